r"""Triton SDDMM: one value per edge from its endpoints' rows, with autograd.

Matches :func:`fusegnn.sparse.reference.sddmm`. For edges :math:`j \to i`:

.. math::
    \text{dot:}\ s_{ji} = \langle a_j, b_i \rangle \ \text{(last axis, per head)}, \qquad
    \text{add/sub/mul:}\ s_{ji} = a_j \odot b_i \ \text{(elementwise)}

``a`` is ``[N_src]``, ``[N_src, F]`` or ``[N_src, H, F]``; ``b`` the same with ``N_dst``
rows. The forward is edge-parallel over the COO list (one program per block of edges and
heads, no atomics, no sorted format needed); fp16 / bf16 inputs are computed in fp32 and
rounded once.

Backward, with :math:`g` the gradient of the ``[E, ...]`` output:

* ``dot``: :math:`\partial a_j = \sum_{j \to i} g_{ji} b_i` and
  :math:`\partial b_i = \sum_{j \to i} g_{ji} a_j` -- SpMMs, run through
  the fused SpMM of :mod:`fusegnn.kernels.spmm` (over the reverse graph for ``a``) with the same fused
  ``aggregation`` (``gas`` / ``gar``) as the forward;
* ``add`` / ``sub`` / ``mul``: per-feature edge-to-node sums
  :math:`\partial a_j = \sum_{j \to i} g_{ji} \,(\odot\, b_i)`,
  :math:`\partial b_i = \pm\sum_{j \to i} g_{ji} \,(\odot\, a_j)`, one program per node over
  its CSC / CSR group (reading the edges' gradients in COO order through ``perm``; no
  atomics, deterministic). A node's edges are one program: a hub of tens of thousands of
  edges is a long serial loop there (the fused GAT kernels split such rows instead).

The backward is not itself differentiable (:func:`~fusegnn.kernels._autograd.differentiable_once`: double backward
raises); use ``aggregation="reference"`` for higher-order gradients.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from fusegnn.kernels._autograd import differentiable_once

from fusegnn.kernels._edge_utils import acc_dtype
from fusegnn.kernels._triton import LazyKernel, next_pow2
from fusegnn.sparse.graph import Graph

__all__ = ["sddmm", "gas_sddmm", "gar_sddmm", "sddmm_backward", "edge_to_node_sum", "SddmmFunction"]

_OPS = {"dot": 0, "add": 1, "sub": 2, "mul": 3}
_TL_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


def _sddmm_kernel(
    src, dst, a, b, out,
    E, G, F,
    OP: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_F: tl.constexpr,
    ACC: tl.constexpr,
):
    """Edges ``pid_e * BLOCK_E + ...``, heads ``pid_g * BLOCK_G + ...``, all of F."""
    pid_e = tl.program_id(0)
    pid_g = tl.program_id(1)
    eid = pid_e.to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    me = eid < E
    j = tl.load(src + eid, mask=me, other=0).to(tl.int64)
    i = tl.load(dst + eid, mask=me, other=0).to(tl.int64)
    g = pid_g * BLOCK_G + tl.arange(0, BLOCK_G)
    mg = g < G
    row = G * F
    acc = tl.zeros([BLOCK_E, BLOCK_G], ACC)
    for f0 in range(0, F, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        mask = me[:, None, None] & mg[None, :, None] & (f < F)[None, None, :]
        col = g[None, :, None] * F + f[None, None, :]
        av = tl.load(a + j[:, None, None] * row + col, mask=mask, other=0.0).to(ACC)
        bv = tl.load(b + i[:, None, None] * row + col, mask=mask, other=0.0).to(ACC)
        if OP == 0:
            acc += tl.sum(av * bv, axis=2)
        else:
            if OP == 1:
                r = av + bv
            elif OP == 2:
                r = av - bv
            else:
                r = av * bv
            tl.store(out + eid[:, None, None] * row + col, r.to(out.dtype.element_ty), mask=mask)
    if OP == 0:
        tl.store(out + eid[:, None] * G + g[None, :], acc.to(out.dtype.element_ty), mask=me[:, None] & mg[None, :])


def _edge_to_node_kernel(
    ptr, other_idx, perm, grad, other, out,
    W,
    HAS_OTHER: tl.constexpr, NEGATE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_W: tl.constexpr, ACC: tl.constexpr,
):
    """out[n, w] = (-1)^NEGATE * sum over n's group of grad[e, w] (* other[k_e, w])."""
    n = tl.program_id(0).to(tl.int64)
    pid_w = tl.program_id(1)
    start = tl.load(ptr + n)
    end = tl.load(ptr + n + 1)
    w = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
    mw = w < W
    acc = tl.zeros([BLOCK_W], ACC)
    for e0 in range(start, end, BLOCK_E):
        pos = e0 + tl.arange(0, BLOCK_E)
        me = pos < end
        mask = me[:, None] & mw[None, :]
        eid = tl.load(perm + pos, mask=me, other=0).to(tl.int64)
        v = tl.load(grad + eid[:, None] * W + w[None, :], mask=mask, other=0.0).to(ACC)
        if HAS_OTHER:
            k = tl.load(other_idx + pos, mask=me, other=0).to(tl.int64)
            v = v * tl.load(other + k[:, None] * W + w[None, :], mask=mask, other=0.0).to(ACC)
        acc += tl.sum(v, axis=0)
    if NEGATE:
        acc = -acc
    tl.store(out + n * W + w, acc.to(out.dtype.element_ty), mask=mw)


sddmm_kernel = LazyKernel(_sddmm_kernel)
edge_to_node_kernel = LazyKernel(_edge_to_node_kernel)


def _geometry(a: Tensor, op: str) -> tuple[int, int]:
    """(G, F): ``a`` viewed as ``[N, G, F]``; elementwise ops flatten everything into F."""
    if op != "dot":
        return 1, math.prod(a.shape[1:])
    if a.dim() == 2:
        return 1, a.size(1)
    return a.size(1), a.size(2)


def _launch_sddmm(graph: Graph, a: Tensor, b: Tensor, op: str) -> Tensor:
    E = graph.num_edges
    if op == "dot":
        out_shape = (E,) + tuple(a.shape[1:-1])
    else:
        out_shape = (E,) + tuple(a.shape[1:])
    out = torch.empty(out_shape, dtype=a.dtype, device=a.device)
    G, F = _geometry(a, op)
    if E == 0 or G == 0 or F == 0:
        return out.zero_()
    block_f = min(next_pow2(F), 128)
    block_g = min(next_pow2(G), max(1, 512 // block_f))
    block_e = max(1, min(128, 4096 // (block_g * block_f)))
    grid = (triton.cdiv(E, block_e), triton.cdiv(G, block_g))
    sddmm_kernel[grid](
        graph.src, graph.dst, a, b, out, E, G, F,
        OP=_OPS[op], BLOCK_E=block_e, BLOCK_G=block_g, BLOCK_F=block_f,
        ACC=_TL_ACC[acc_dtype(a.dtype)],
    )
    return out


def edge_to_node_sum(
    graph: Graph,
    grad: Tensor,
    side: str,
    other: Tensor | None = None,
    negate: bool = False,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    r"""Sum per-edge rows into nodes: ``side="src"`` gives
    :math:`\mathrm{out}_j = \sum_{j \to i} g_{ji} \odot o_i` (over ``graph.csc``),
    ``side="dst"`` gives :math:`\mathrm{out}_i = \sum_{j \to i} g_{ji} \odot o_j` (over
    ``graph.csr``), with :math:`o` = ``other`` (``[N_other, *S]``) or 1 when ``None``.

    ``grad`` is ``[E, *S]`` in COO edge order; the result is ``[N_side, *S]``.
    """
    comp, n = (graph.csc, graph.num_src_nodes) if side == "src" else (graph.csr, graph.num_dst_nodes)
    grad = grad.contiguous()
    width = math.prod(grad.shape[1:])
    out = torch.empty((n,) + tuple(grad.shape[1:]), dtype=out_dtype or grad.dtype, device=grad.device)
    if n == 0 or width == 0:
        return out
    if other is not None:
        other = other.contiguous()
    block_w = min(next_pow2(width), 256)
    block_e = max(1, min(128, 4096 // block_w))
    edge_to_node_kernel[(n, triton.cdiv(width, block_w))](
        comp.ptr, comp.index, comp.perm, grad, other if other is not None else grad, out,
        width,
        HAS_OTHER=other is not None, NEGATE=negate,
        BLOCK_E=block_e, BLOCK_W=block_w, ACC=_TL_ACC[acc_dtype(grad.dtype)],
    )
    return out


def _spmm(aggregation: str, graph: Graph, x: Tensor, weight: Tensor) -> Tensor:
    """The fused SpMM of ``aggregation`` (``"gas"`` / ``"gar"``): the ``dot`` backward."""
    from fusegnn.kernels.spmm import gar_spmm, gas_spmm

    return (gas_spmm if aggregation == "gas" else gar_spmm)(graph, x, weight)


class SddmmFunction(torch.autograd.Function):
    """Autograd for :func:`sddmm` (inputs validated and contiguous)."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor, graph: Graph, op: str, aggregation: str):
        ctx.graph, ctx.op, ctx.aggregation = graph, op, aggregation
        ctx.save_for_backward(a, b)
        return _launch_sddmm(graph, a, b, op)

    @staticmethod
    @differentiable_once
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad_a, grad_b = sddmm_backward(
            ctx.graph, a, b, grad, ctx.op, ctx.aggregation, ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        )
        return grad_a, grad_b, None, None, None


def sddmm_backward(
    graph: Graph, a: Tensor, b: Tensor, grad: Tensor, op: str, aggregation: str, need_a: bool, need_b: bool
) -> tuple[Tensor | None, Tensor | None]:
    """Backward of :func:`sddmm` as a plain function (see the module docstring):
    ``(grad_a, grad_b)``, each ``None`` unless needed. ``aggregation`` (``"gas"`` / ``"gar"``)
    picks the fused SpMM of the ``dot`` backward."""
    grad_a = grad_b = None
    grad = grad.contiguous()
    if op == "dot":
        weight = grad.to(a.dtype)
        if need_a:
            grad_a = _spmm(aggregation, graph.reversed(), b, weight)
        if need_b:
            grad_b = _spmm(aggregation, graph, a, weight)
    else:
        if need_a:
            grad_a = edge_to_node_sum(graph, grad, "src", b if op == "mul" else None, out_dtype=a.dtype)
        if need_b:
            grad_b = edge_to_node_sum(
                graph, grad, "dst", a if op == "mul" else None, negate=op == "sub", out_dtype=b.dtype
            )
    return grad_a, grad_b


def sddmm(graph: Graph, a: Tensor, b: Tensor, op: str = "dot", *, aggregation: str = "gar") -> Tensor:
    """Triton SDDMM with the signature of :func:`fusegnn.sparse.reference.sddmm`.

    ``aggregation`` (``"gas"`` / ``"gar"``) picks the fused SpMM that the ``dot`` backward runs.
    Inputs are assumed validated (see :func:`fusegnn.sparse.sddmm`).
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {tuple(_OPS)}, got {op!r}")
    return SddmmFunction.apply(a.contiguous(), b.contiguous(), graph, op, aggregation)


def gas_sddmm(graph: Graph, a: Tensor, b: Tensor, op: str = "dot") -> Tensor:
    """:func:`sddmm` whose ``dot`` backward uses the GAS SpMM (the ``gas`` backend's)."""
    return sddmm(graph, a, b, op, aggregation="gas")


def gar_sddmm(graph: Graph, a: Tensor, b: Tensor, op: str = "dot") -> Tensor:
    """:func:`sddmm` whose ``dot`` backward uses the GAR SpMM (the ``gar`` backend's)."""
    return sddmm(graph, a, b, op, aggregation="gar")
