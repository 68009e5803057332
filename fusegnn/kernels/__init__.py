"""Triton kernels, each beside the pure-PyTorch reference it must match.

The references live in :mod:`fusegnn.sparse.reference`; kernel backends register with
:func:`fusegnn.sparse.register_backend`.
"""
