r"""Triton edge softmax: softmax of edge scores over each target's incoming edges.

Matches :func:`fusegnn.sparse.reference.edge_softmax`, per head:

.. math::
    \alpha_{ji} = \frac{\exp(s_{ji} - m_i)}{\sum_{k \to i} \exp(s_{ki} - m_i)}, \qquad
    m_i = \max_{k \to i} s_{ki}

Row-parallel over ``graph.csr`` (one program per target and block of heads): pass 1 keeps
an online maximum and normaliser (rescaling the sum when the maximum grows), pass 2 writes
:math:`\alpha` -- two reads and one write of the scores, nothing else of size ``E``.
Scores and coefficients stay in COO edge order (read and written through ``csr.perm``).
``-inf`` masks an edge; a target whose edges are all masked gets zeros, never NaN.

Backward (``g`` the gradient of :math:`\alpha`):

.. math::
    \frac{\partial \mathcal{L}}{\partial s_{ji}} = \alpha_{ji}\Big(g_{ji} - \sum_{k \to i} \alpha_{ki} g_{ki}\Big)

the same two-pass row kernel on the saved output. A target's edges are one program: a
hub with tens of thousands of edges is a long serial loop (the fused GAT kernels of
:mod:`fusegnn.kernels.gat_fused` split such rows instead). The backward is not itself
differentiable (:func:`~fusegnn.kernels._autograd.differentiable_once`: double backward raises).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from fusegnn.kernels._autograd import differentiable_once

from fusegnn.kernels._edge_utils import acc_dtype
from fusegnn.kernels._triton import LazyKernel, next_pow2
from fusegnn.sparse.graph import Graph

__all__ = ["edge_softmax", "edge_softmax_backward", "EdgeSoftmaxFunction"]

_TL_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


def _edge_softmax_fwd_kernel(
    ptr, perm, scores, alpha, H,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, ACC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = hd < H
    start = tl.load(ptr + row)
    end = tl.load(ptr + row + 1)
    offs = tl.arange(0, BLOCK_E)
    m = tl.full([BLOCK_H], float("-inf"), ACC)
    l = tl.zeros([BLOCK_H], ACC)
    for e0 in range(start, end, BLOCK_E):
        pos = e0 + offs
        me = pos < end
        mask = me[:, None] & mh[None, :]
        eid = tl.load(perm + pos, mask=me, other=0).to(tl.int64)
        s = tl.load(scores + eid[:, None] * H + hd[None, :], mask=mask, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[None, :]), axis=0)
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    inv = 1.0 / tl.where(l > 0, l, 1.0)
    for e0 in range(start, end, BLOCK_E):
        pos = e0 + offs
        me = pos < end
        mask = me[:, None] & mh[None, :]
        eid = tl.load(perm + pos, mask=me, other=0).to(tl.int64)
        s = tl.load(scores + eid[:, None] * H + hd[None, :], mask=mask, other=float("-inf")).to(ACC)
        a = tl.exp(s - m_safe[None, :]) * inv[None, :]
        tl.store(alpha + eid[:, None] * H + hd[None, :], a.to(alpha.dtype.element_ty), mask=mask)


def _edge_softmax_bwd_kernel(
    ptr, perm, alpha, grad_alpha, grad_scores, H,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, ACC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    hd = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mh = hd < H
    start = tl.load(ptr + row)
    end = tl.load(ptr + row + 1)
    offs = tl.arange(0, BLOCK_E)
    dot = tl.zeros([BLOCK_H], ACC)
    for e0 in range(start, end, BLOCK_E):
        pos = e0 + offs
        me = pos < end
        mask = me[:, None] & mh[None, :]
        eid = tl.load(perm + pos, mask=me, other=0).to(tl.int64)
        off = eid[:, None] * H + hd[None, :]
        a = tl.load(alpha + off, mask=mask, other=0.0).to(ACC)
        g = tl.load(grad_alpha + off, mask=mask, other=0.0).to(ACC)
        dot += tl.sum(a * g, axis=0)
    for e0 in range(start, end, BLOCK_E):
        pos = e0 + offs
        me = pos < end
        mask = me[:, None] & mh[None, :]
        eid = tl.load(perm + pos, mask=me, other=0).to(tl.int64)
        off = eid[:, None] * H + hd[None, :]
        a = tl.load(alpha + off, mask=mask, other=0.0).to(ACC)
        g = tl.load(grad_alpha + off, mask=mask, other=0.0).to(ACC)
        tl.store(grad_scores + off, (a * (g - dot[None, :])).to(grad_scores.dtype.element_ty), mask=mask)


edge_softmax_fwd_kernel = LazyKernel(_edge_softmax_fwd_kernel)
edge_softmax_bwd_kernel = LazyKernel(_edge_softmax_bwd_kernel)


def _blocks(graph: Graph, heads: int) -> tuple[int, int]:
    block_h = min(next_pow2(heads), 64)
    by_degree = min(max(next_pow2(int(graph.avg_degree + 0.999)), 16), 256)
    return max(1, min(by_degree, 4096 // block_h)), block_h


def _launch(kernel, graph: Graph, heads: int, dtype: torch.dtype, *tensors: Tensor) -> None:
    n = graph.num_dst_nodes
    if n == 0 or graph.num_edges == 0 or heads == 0:
        return
    block_e, block_h = _blocks(graph, heads)
    csr = graph.csr
    kernel[(n, triton.cdiv(heads, block_h))](
        csr.ptr, csr.perm, *tensors, heads,
        BLOCK_E=block_e, BLOCK_H=block_h, ACC=_TL_ACC[acc_dtype(dtype)],
    )


class EdgeSoftmaxFunction(torch.autograd.Function):
    """Autograd for :func:`edge_softmax` (``scores`` contiguous ``[E]`` or ``[E, H]``)."""

    @staticmethod
    def forward(ctx, scores: Tensor, graph: Graph):
        heads = scores.shape[1:].numel() if scores.dim() > 1 else 1  # no row 0 to read without edges
        alpha = torch.zeros_like(scores) if graph.num_edges == 0 else torch.empty_like(scores)
        _launch(edge_softmax_fwd_kernel, graph, heads, scores.dtype, scores, alpha)
        ctx.graph, ctx.heads = graph, heads
        ctx.save_for_backward(alpha)
        return alpha

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_alpha: Tensor):
        (alpha,) = ctx.saved_tensors
        return edge_softmax_backward(ctx.graph, alpha, grad_alpha), None


def edge_softmax_backward(graph: Graph, alpha: Tensor, grad_alpha: Tensor) -> Tensor:
    """Backward of :func:`edge_softmax` as a plain function: the gradient of the scores
    from the forward's output ``alpha`` (contiguous ``[E]`` or ``[E, H]``) and its
    gradient (see the module docstring)."""
    heads = alpha.size(1) if alpha.dim() > 1 else 1
    grad_alpha = grad_alpha.contiguous()
    grad_scores = torch.empty_like(alpha) if graph.num_edges else torch.zeros_like(alpha)
    _launch(edge_softmax_bwd_kernel, graph, heads, alpha.dtype, alpha, grad_alpha, grad_scores)
    return grad_scores


def edge_softmax(graph: Graph, scores: Tensor) -> Tensor:
    """Triton edge softmax with the signature of :func:`fusegnn.sparse.reference.edge_softmax`
    (``scores`` ``[E]`` or ``[E, H]``, assumed validated)."""
    return EdgeSoftmaxFunction.apply(scores.contiguous(), graph)
