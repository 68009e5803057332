r"""Fused GCN normalisation: two launches from edge weights to normalised weights.

:func:`fusegnn.sparse.processing.gcn_norm` computes, on the graph with self-loops
added to the nodes that have none (weight ``fill``; a node's existing self-loop keeps
its weight),

.. math::
    d_i = \sum_{(j \to i)} w_{ji}, \qquad
    \hat{w}_{ji} = d_j^{-1/2} \, w_{ji} \, d_i^{-1/2} \quad (d^{-1/2} := 0 \text{ where } d = 0).

Composed from PyTorch ops that is about fifteen launches (the loop weights, a
concatenation, a scatter-add, the power, the zero fix, two gathers, two products).
Here it is two, neither with atomics (bitwise reproducible):

1. ``_inv_sqrt_degree_kernel``, one program per target row of the result's CSR:
   reads each incoming edge's weight straight from the *input* weights through
   ``source_edge`` (the input edge each result edge comes from, ``-1`` for an added
   loop), sums them in a fixed order and stores :math:`d_i^{-1/2}`;
2. ``_normalise_kernel``, edge-parallel over the result's COO: gathers the same
   weight and both endpoints' :math:`d^{-1/2}`.

The result's structure (which input edge lands where, its CSR) depends on the edges only
and is cached on the graph, so re-normalising with other weights reruns only these two
kernels. Not differentiable: :func:`~fusegnn.sparse.processing.gcn_norm` takes its
composed (autograd) path when the weights require grad.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusegnn.kernels._edge_utils import acc_dtype
from fusegnn.kernels._triton import LazyKernel
from fusegnn.sparse.graph import Graph

__all__ = ["fused_gcn_norm_weights"]

_TL = {torch.float32: tl.float32, torch.float64: tl.float64}


def _inv_sqrt_degree_kernel(
    ptr, perm, w_ptr, source_ptr, dis_ptr, fill: tl.float64,
    HAS_W: tl.constexpr, HAS_SOURCE: tl.constexpr, BLOCK_E: tl.constexpr, ACC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    start = tl.load(ptr + row).to(tl.int64)
    end = tl.load(ptr + row + 1).to(tl.int64)
    acc = tl.zeros([BLOCK_E], ACC)
    for k in range(start, end, BLOCK_E):
        offs = k + tl.arange(0, BLOCK_E)
        mask = offs < end
        e = tl.load(perm + offs, mask=mask, other=0).to(tl.int64)
        # (the weight lookup is written out in both kernels; _triton.kernel_helper
        # could now share it, not done yet: the change needs a GPU check)
        if HAS_SOURCE:  # input edge of each result edge, -1 for an added loop (weight fill)
            src_edge = tl.load(source_ptr + e, mask=mask, other=-1).to(tl.int64)
            present = mask & (src_edge >= 0)
            if HAS_W:
                w = tl.load(w_ptr + src_edge, mask=present, other=0).to(ACC)
            else:
                w = tl.full([BLOCK_E], 1.0, ACC)
            w = tl.where(present, w, tl.full([BLOCK_E], fill, ACC))
        else:
            if HAS_W:
                w = tl.load(w_ptr + e, mask=mask, other=0).to(ACC)
            else:
                w = tl.full([BLOCK_E], 1.0, ACC)
        acc += tl.where(mask, w, 0.0)
    deg = tl.sum(acc, axis=0)
    # deg ** -0.5 with 0 where deg == 0 (a negative degree gives NaN, like the pow)
    dis = tl.where(deg == 0.0, 0.0, 1.0 / tl.sqrt(tl.where(deg == 0.0, 1.0, deg)))
    tl.store(dis_ptr + row, dis)


def _normalise_kernel(
    src_ptr, dst_ptr, w_ptr, source_ptr, dis_ptr, out_ptr, num_edges, fill: tl.float64,
    HAS_W: tl.constexpr, HAS_SOURCE: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < num_edges
    if HAS_SOURCE:
        src_edge = tl.load(source_ptr + e, mask=mask, other=-1).to(tl.int64)
        present = mask & (src_edge >= 0)
        if HAS_W:
            w = tl.load(w_ptr + src_edge, mask=present, other=0).to(ACC)
        else:
            w = tl.full([BLOCK], 1.0, ACC)
        w = tl.where(present, w, tl.full([BLOCK], fill, ACC))
    else:
        if HAS_W:
            w = tl.load(w_ptr + e, mask=mask, other=0).to(ACC)
        else:
            w = tl.full([BLOCK], 1.0, ACC)
    j = tl.load(src_ptr + e, mask=mask, other=0).to(tl.int64)
    i = tl.load(dst_ptr + e, mask=mask, other=0).to(tl.int64)
    dj = tl.load(dis_ptr + j, mask=mask, other=0.0)
    di = tl.load(dis_ptr + i, mask=mask, other=0.0)
    tl.store(out_ptr + e, (dj * w * di).to(out_ptr.dtype.element_ty), mask=mask)


inv_sqrt_degree_kernel = LazyKernel(_inv_sqrt_degree_kernel)
normalise_kernel = LazyKernel(_normalise_kernel)


def fused_gcn_norm_weights(
    graph: Graph,
    weight: Tensor | None,
    source_edge: Tensor | None,
    fill: float,
    dtype: torch.dtype,
) -> Tensor:
    r"""Normalised weights :math:`\hat{w}` of ``graph`` (the result graph, self-loops
    already in its structure), in its COO edge order.

    Args:
        graph: the result graph (its CSR is built once and cached).
        weight: the *input* graph's ``[E_in]`` weights, or ``None`` for all ones.
        source_edge: ``[E]`` int64: for each edge of ``graph`` the input edge it comes
            from, ``-1`` for an added self-loop (weight ``fill``); ``None`` when
            ``graph`` is the input graph itself (no loops added).
        fill: weight of the added self-loops.
        dtype: floating dtype of the result (fp16 / bf16 / fp32 / fp64; accumulation in
            fp32, fp64 for fp64).
    """
    device = graph.device
    acc = acc_dtype(dtype)
    n, num_edges = graph.num_dst_nodes, graph.num_edges
    out = torch.empty(num_edges, dtype=dtype, device=device)
    dis = torch.empty(n, dtype=acc, device=device)
    if weight is not None:
        weight = weight.contiguous()
    dummy = dis  # never read: HAS_W / HAS_SOURCE are off
    w_arg = weight if weight is not None else dummy
    s_arg = source_edge if source_edge is not None else dummy
    if n:
        csr = graph.csr
        inv_sqrt_degree_kernel[(n,)](
            csr.ptr, csr.perm, w_arg, s_arg, dis, float(fill),
            HAS_W=weight is not None, HAS_SOURCE=source_edge is not None,
            BLOCK_E=256, ACC=_TL[acc], num_warps=2,
        )
    if num_edges:
        block = 1024
        normalise_kernel[(triton.cdiv(num_edges, block),)](
            graph.src, graph.dst, w_arg, s_arg, dis, out, num_edges, float(fill),
            HAS_W=weight is not None, HAS_SOURCE=source_edge is not None,
            BLOCK=block, ACC=_TL[acc], num_warps=4,
        )
    return out
