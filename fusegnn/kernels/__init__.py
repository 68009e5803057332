"""Triton kernels, each beside the pure-PyTorch reference it must match.

The references live in :mod:`fusegnn.sparse.reference`. Modules:

* :mod:`fusegnn.kernels.spmm_gas` -- fused gather-apply-scatter SpMM (edge-parallel, atomics);
* :mod:`fusegnn.kernels.spmm_gar` -- fused gather-apply-reduce SpMM (segment-parallel, no atomics);
* :mod:`fusegnn.kernels.partition` -- the load-balanced segment work list of GAR;
* :mod:`fusegnn.kernels.spmm` -- the autograd Functions and entry points;

Importing this package imports no Triton code: the kernel modules are loaded on first
use (Triton is optional, and ``TRITON_INTERPRET=1`` must be set before a kernel module
is imported for the kernels to run on the CPU). The op layer registers the backends
(:mod:`fusegnn.sparse.kernel_backends`) on the first dispatch; kernels never import it.
"""
