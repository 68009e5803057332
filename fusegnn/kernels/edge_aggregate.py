r"""Fused edge-message aggregation (GAR): ``spmm``'s gather-apply-reduce with a per-edge message.

For edges ``j -> i`` grouped by target (CSR, cut into the segments of
:mod:`fusegnn.kernels.partition`), features viewed as ``[N, H, F]`` (``C = H F`` columns),
optional source rows ``x``, optional edge rows ``e`` (``[E, C]``, COO order), optional
weights ``w`` (``[E, H]``, COO order) and an optional ReLU, one program per segment, head
and feature block computes, on chip,

.. math::
    m_{ji} = w_{ji}\,\mathrm{act}(x_j + e_{ji}), \qquad
    \mathrm{out}_i = \sum_{j \to i} m_{ji} \quad\text{or}\quad \max_{j \to i} m_{ji}

(a missing ``x`` or ``e`` is a zero term; ``"mean"`` is the sum divided by the in-degree,
done by the caller). Neither ``x[src]`` nor the messages are ever materialised.

**Max** keeps, per tile lane, a running maximum and the grouped position of the edge that
gave it (updated on a strictly larger value, so the earliest edge of the lane wins), then
reduces the tile: the largest value, and among the lanes that hold it the lowest position.
Within a target, grouped (CSR) positions follow COO positions (the CSR is a stable sort),
so the **tie rule is the lowest COO edge id** -- the reference's
(:func:`fusegnn.sparse.reference.max_and_argmax`). The result also stores that edge's COO
id per output element (``argmax``, int32 ``[N_dst, C]``, ``-1`` for a target without
edges, whose output is 0). A split row's segments write partial maxima and positions to
slots that :func:`_max_combine_kernel` folds in slot (= edge) order with the same rule.
NaN messages give unspecified results.

**Backward** (:func:`edge_aggregate_backward`): one GAR pass over the CSC segments (rows
are sources ``j``; every edge is visited exactly once, by its source's program), with
``g`` the output gradient (for max: kept only where ``argmax[i, c]`` is this edge):

.. math::
    \delta_{ji} = w_{ji}\, g_i \odot \mathrm{act}'(x_j + e_{ji}), \qquad
    \frac{\partial L}{\partial x_j} = \sum_{j \to i} \delta_{ji}, \qquad
    \frac{\partial L}{\partial e_{ji}} = \delta_{ji}, \qquad
    \frac{\partial L}{\partial w_{ji,h}} = \langle \mathrm{act}(x_j + e_{ji}), g_i \rangle_h .

The feature gradient is reduced on chip (split rows through
:func:`fusegnn.kernels.spmm_gar` 's combine pass, in slot order); the edge-row gradient is
stored per edge; the weight gradient is stored per edge and feature block and the blocks'
partial dot products are added afterwards (one block for heads up to the tile width). No
atomics anywhere: bitwise reproducible.

Without edge rows (``spmm(reduce="max")``, weighted or not), a head wider than 16
columns and not a multiple of 16 runs zero-padded to the next multiple
(:func:`~fusegnn.kernels._edge_utils.padded_channels`, the rule of GAR's
:mod:`fusegnn.kernels.spmm`): ``x``, the output gradient and the argmax (node-sized) are
copied padded for the kernels only, and the outputs and gradients sliced back; the zero
columns add nothing to the weight gradient. There is no GAS form of this op, so every
such path pads (GAS hands it to GAR). With edge rows ``[E, C]`` (GINE's messages) nothing
is padded: they share the row stride, and padding them copies every edge row, which cost
more than the aligned loads saved (H100, session 18: GINE messages at 41 columns 9.9 ms
as they come, 22.6 ms padded; spmm max 21.7 -> 13.9 ms; ``benchmarks/NOTES-spmm.md``).

``spmm(reduce="max")`` is this op with ``x`` only and no activation.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from fusegnn.kernels._autograd import differentiable_once

from fusegnn.kernels._edge_utils import pad_heads, padded_channels, unpad_heads
from fusegnn.kernels._triton import LazyKernel, kernel_helper
from fusegnn.kernels.partition import SegmentPlan, plan_for
from fusegnn.kernels.spmm import gar_cfg
from fusegnn.kernels.spmm_gar import _gar_combine
from fusegnn.sparse.graph import Graph

__all__ = ["EdgeAggregate", "edge_aggregate", "edge_aggregate_forward", "edge_aggregate_backward"]

# element offsets at or above this are computed in int64 (tests lower it to exercise that path)
INT64_OFFSETS_FROM = 2**31 - 1
_INT32_MAX = 2**31 - 1


@kernel_helper
def _program_segment(seg_row_ptr, seg_start_ptr, seg_end_ptr, seg_slot_ptr, num_segments, num_fblocks, num_feat,
                     IDX64: tl.constexpr, BLOCK_F: tl.constexpr):
    """This program's segment (its row, edge range and slot), head and feature block, the
    block's features ``f`` (and mask) and the head's first column; segments vary fastest
    (a feature block's segments run together)."""
    pos_t = tl.int64 if IDX64 else tl.int32
    pid = tl.program_id(0)
    seg = pid % num_segments
    col = pid // num_segments
    row = tl.load(seg_row_ptr + seg).to(pos_t)
    start = tl.load(seg_start_ptr + seg).to(pos_t)
    end = tl.load(seg_end_ptr + seg).to(pos_t)
    slot = tl.load(seg_slot_ptr + seg).to(pos_t)
    head = col // num_fblocks
    fblock = col % num_fblocks
    f = fblock * BLOCK_F + tl.arange(0, BLOCK_F)
    return row, start, end, slot, head, fblock, f, f < num_feat, head * num_feat


def _ea_forward_kernel(
    x_ptr, e_ptr, w_ptr, index_ptr, perm_ptr,
    seg_row_ptr, seg_start_ptr, seg_end_ptr, seg_slot_ptr,
    out_ptr, arg_ptr, part_ptr, part_arg_ptr,
    num_segments, num_feat, row_stride, num_fblocks, num_heads,
    HAS_X: tl.constexpr, HAS_E: tl.constexpr, HAS_W: tl.constexpr, RELU: tl.constexpr, MAX: tl.constexpr,
    IDX64: tl.constexpr, ACC64: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr,
):
    acc_t = tl.float64 if ACC64 else tl.float32
    pos_t = tl.int64 if IDX64 else tl.int32
    row, start, end, slot, head, fblock, f, fmask, col0 = _program_segment(
        seg_row_ptr, seg_start_ptr, seg_end_ptr, seg_slot_ptr, num_segments, num_fblocks, num_feat, IDX64, BLOCK_F
    )
    if MAX:
        best = tl.full([BLOCK_E, BLOCK_F], float("-inf"), acc_t)
        best_k = tl.full([BLOCK_E, BLOCK_F], -1, pos_t)
    else:
        acc = tl.zeros([BLOCK_E, BLOCK_F], dtype=acc_t)
    for k0 in range(start, end, BLOCK_E):
        k = k0 + tl.arange(0, BLOCK_E)
        kmask = k < end
        m = kmask[:, None] & fmask[None, :]
        if HAS_E or HAS_W:
            p = tl.load(perm_ptr + k, mask=kmask, other=0).to(pos_t)
        if HAS_X:
            j = tl.load(index_ptr + k, mask=kmask, other=0).to(pos_t)
            z = tl.load(x_ptr + (j[:, None] * row_stride + col0 + f[None, :]), mask=m, other=0.0).to(acc_t)
            if HAS_E:
                z += tl.load(e_ptr + (p[:, None] * row_stride + col0 + f[None, :]), mask=m, other=0.0).to(acc_t)
        else:
            z = tl.load(e_ptr + (p[:, None] * row_stride + col0 + f[None, :]), mask=m, other=0.0).to(acc_t)
        if RELU:
            z = tl.maximum(z, 0.0)
        if HAS_W:
            w = tl.load(w_ptr + p * num_heads + head, mask=kmask, other=0.0).to(acc_t)
            z = z * w[:, None]
        if MAX:
            take = m & ((z > best) | (best_k < 0))
            best = tl.where(take, z, best)
            best_k = tl.where(take, k[:, None], best_k)
        else:
            acc += z
    if MAX:
        top = tl.max(best, axis=0)
        none = tl.full([BLOCK_E, BLOCK_F], 2147483647, pos_t)  # no edge (a literal: kernels read no globals)
        cand = tl.where((best == top[None, :]) & (best_k >= 0), best_k, none)
        top_k = tl.min(cand, axis=0)
        has = top_k < 2147483647
        if slot < 0:
            edge = tl.load(perm_ptr + top_k, mask=has & fmask, other=-1)
            res = tl.where(has, top, 0.0)
            tl.store(out_ptr + (row * row_stride + col0 + f), res.to(out_ptr.dtype.element_ty), mask=fmask)
            tl.store(arg_ptr + (row * row_stride + col0 + f), edge.to(arg_ptr.dtype.element_ty), mask=fmask)
        else:
            tl.store(part_ptr + (slot * row_stride + col0 + f), top, mask=fmask)
            tl.store(part_arg_ptr + (slot * row_stride + col0 + f), tl.where(has, top_k, -1), mask=fmask)
    else:
        res = tl.sum(acc, axis=0)
        if slot < 0:
            tl.store(out_ptr + (row * row_stride + col0 + f), res.to(out_ptr.dtype.element_ty), mask=fmask)
        else:
            tl.store(part_ptr + (slot * row_stride + col0 + f), res, mask=fmask)


def _max_combine_kernel(
    part_ptr, part_arg_ptr, split_rows_ptr, slot_ptr_ptr, perm_ptr, out_ptr, arg_ptr, row_stride,
    IDX64: tl.constexpr, ACC64: tl.constexpr, BLOCK_C: tl.constexpr,
):
    acc_t = tl.float64 if ACC64 else tl.float32
    pos_t = tl.int64 if IDX64 else tl.int32
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < row_stride
    row = tl.load(split_rows_ptr + r).to(pos_t)
    s0 = tl.load(slot_ptr_ptr + r).to(pos_t)
    s1 = tl.load(slot_ptr_ptr + r + 1).to(pos_t)
    best = tl.full([BLOCK_C], float("-inf"), acc_t)
    best_k = tl.full([BLOCK_C], -1, pos_t)
    for s in range(s0, s1):  # slots in edge order: a strictly larger value replaces
        v = tl.load(part_ptr + (s * row_stride + c), mask=cmask, other=float("-inf"))
        k = tl.load(part_arg_ptr + (s * row_stride + c), mask=cmask, other=-1).to(pos_t)
        take = (k >= 0) & ((v > best) | (best_k < 0))
        best = tl.where(take, v, best)
        best_k = tl.where(take, k, best_k)
    has = best_k >= 0
    edge = tl.load(perm_ptr + best_k, mask=has & cmask, other=-1)
    tl.store(out_ptr + (row * row_stride + c), tl.where(has, best, 0.0).to(out_ptr.dtype.element_ty), mask=cmask)
    tl.store(arg_ptr + (row * row_stride + c), edge.to(arg_ptr.dtype.element_ty), mask=cmask)


def _ea_backward_kernel(
    g_ptr, x_ptr, e_ptr, w_ptr, arg_ptr, index_ptr, perm_ptr,
    seg_row_ptr, seg_start_ptr, seg_end_ptr, seg_slot_ptr,
    gx_ptr, part_ptr, ge_ptr, gw_ptr,
    num_segments, num_feat, row_stride, num_fblocks, num_heads,
    HAS_X: tl.constexpr, HAS_E: tl.constexpr, HAS_W: tl.constexpr, RELU: tl.constexpr, MASK: tl.constexpr,
    NEED_X: tl.constexpr, NEED_E: tl.constexpr, NEED_W: tl.constexpr, NEED_Z: tl.constexpr,
    IDX64: tl.constexpr, ACC64: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr,
):
    acc_t = tl.float64 if ACC64 else tl.float32
    pos_t = tl.int64 if IDX64 else tl.int32
    row, start, end, slot, head, fblock, f, fmask, col0 = _program_segment(
        seg_row_ptr, seg_start_ptr, seg_end_ptr, seg_slot_ptr, num_segments, num_fblocks, num_feat, IDX64, BLOCK_F
    )
    if HAS_X and NEED_Z:
        xr = tl.load(x_ptr + (row * row_stride + col0 + f), mask=fmask, other=0.0).to(acc_t)
    if NEED_X:
        acc = tl.zeros([BLOCK_E, BLOCK_F], dtype=acc_t)
    for k0 in range(start, end, BLOCK_E):
        k = k0 + tl.arange(0, BLOCK_E)
        kmask = k < end
        m = kmask[:, None] & fmask[None, :]
        i = tl.load(index_ptr + k, mask=kmask, other=0).to(pos_t)
        p = tl.load(perm_ptr + k, mask=kmask, other=0).to(pos_t)
        at = i[:, None] * row_stride + col0 + f[None, :]
        g = tl.load(g_ptr + at, mask=m, other=0.0).to(acc_t)
        if MASK:  # max: only where this edge gave the target's maximum
            winner = tl.load(arg_ptr + at, mask=m, other=-1).to(pos_t)
            g = tl.where(winner == p[:, None], g, 0.0)
        d = g
        if HAS_W:
            w = tl.load(w_ptr + p * num_heads + head, mask=kmask, other=0.0).to(acc_t)
            d = g * w[:, None]
        if NEED_Z:
            if HAS_E:
                z = tl.load(e_ptr + (p[:, None] * row_stride + col0 + f[None, :]), mask=m, other=0.0).to(acc_t)
                if HAS_X:
                    z += xr[None, :]
            else:
                z = tl.zeros([BLOCK_E, BLOCK_F], dtype=acc_t) + xr[None, :]
            if RELU:
                d = tl.where(z > 0.0, d, 0.0)
                z = tl.maximum(z, 0.0)
        if NEED_X:
            acc += d
        if NEED_E:
            tl.store(ge_ptr + (p[:, None] * row_stride + col0 + f[None, :]), d.to(ge_ptr.dtype.element_ty), mask=m)
        if NEED_W:
            dot = tl.sum(tl.where(m, z * g, 0.0), axis=1)
            tl.store(gw_ptr + ((p * num_heads + head) * num_fblocks + fblock), dot, mask=kmask)
    if NEED_X:
        res = tl.sum(acc, axis=0)
        if slot < 0:
            tl.store(gx_ptr + (row * row_stride + col0 + f), res.to(gx_ptr.dtype.element_ty), mask=fmask)
        else:
            tl.store(part_ptr + (slot * row_stride + col0 + f), res, mask=fmask)


# jitted at the first launch; relaunched without Triton's binder (fusegnn.kernels._launch)
_ea_forward = LazyKernel(_ea_forward_kernel)
_ea_backward = LazyKernel(_ea_backward_kernel)
_max_combine = LazyKernel(_max_combine_kernel)


# --------------------------------------------------------------------------- host side
def _flat(t: Tensor | None) -> Tensor | None:
    """``[N, (H,) F]`` rows as contiguous ``[N, C]``."""
    return None if t is None else t.reshape(t.size(0), math.prod(t.shape[1:])).contiguous()


def _run_width(feat: int, edge_attr: Tensor | None) -> int:
    """The head width the kernels run at: aligned (:func:`padded_channels`) without edge
    rows, ``feat`` itself with them (see the module docstring)."""
    return padded_channels(feat) if edge_attr is None else feat


def _padded(t: Tensor | None, heads: int, channels: int) -> Tensor | None:
    """``t``'s rows flat (:func:`_flat`) with each of the ``heads`` heads zero-padded to
    ``channels`` columns (:func:`~fusegnn.kernels._edge_utils.pad_heads`; ``t``'s flat
    rows when nothing is padded)."""
    return None if t is None else pad_heads(_flat(t), heads, channels)


def _flat_weight(w: Tensor | None) -> tuple[Tensor | None, int]:
    """Weights as contiguous ``[E, heads]`` and ``heads`` (1 for ``[E]`` or none)."""
    if w is None:
        return None, 1
    if w.dim() == 1:
        return w.reshape(-1, 1).contiguous(), 1
    return w.contiguous(), w.size(1)


def _mean_count(graph: Graph, like: Tensor) -> Tensor:
    """The in-degrees (clamped to 1) shaped to divide ``like`` (``[N_dst, ...]``) row-wise."""
    count = graph.in_degree.clamp(min=1).to(like.dtype)
    return count.reshape((-1,) + (1,) * (like.dim() - 1))


def _idx64(plan: SegmentPlan, rows: int, cols: int, num_edges: int, block_e: int) -> bool:
    """Whether element offsets (rows of ``x`` / the output / the slots, edge rows of
    ``edge_attr``, per-edge weights) can reach int32's range."""
    return max(rows, num_edges + block_e, plan.num_slots) * max(cols, 1) >= INT64_OFFSETS_FROM


def _argmax_dtype(num_edges: int) -> torch.dtype:
    return torch.int32 if num_edges <= _INT32_MAX else torch.int64


def _run_forward(
    graph: Graph, x2: Tensor | None, e2: Tensor | None, w2: Tensor | None, heads: int, feat: int,
    like: Tensor, activation: str | None, is_max: bool,
) -> tuple[Tensor, Tensor | None]:
    """The forward kernels on flat rows of ``heads * feat`` columns (``x2`` ``[N_src, C]``,
    ``e2`` ``[E, C]``, contiguous, at the width the kernels run at): ``(out, argmax)`` as
    ``[N_dst, C]`` (``argmax`` only for the max), before the mean's division."""
    cols = heads * feat
    num_dst = graph.num_dst_nodes
    acc_dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    out = torch.empty(num_dst, cols, dtype=like.dtype, device=like.device)
    arg = torch.empty(num_dst, cols, dtype=_argmax_dtype(graph.num_edges), device=like.device) if is_max else None
    if num_dst == 0 or cols == 0:
        return out, arg
    cfg = gar_cfg(feat, like.element_size(), False, graph.avg_degree)
    plan = plan_for(graph, "csr", cfg.seg_len)
    num_fblocks = triton.cdiv(feat, cfg.block_f)
    part = torch.empty(plan.num_slots, cols, dtype=acc_dtype, device=like.device) if plan.num_slots else out
    part_arg = (torch.empty(plan.num_slots, cols, dtype=plan.seg_start.dtype, device=like.device)
                if plan.num_slots and is_max else part)
    idx64 = _idx64(plan, max(num_dst, graph.num_src_nodes), cols, graph.num_edges, cfg.block_e)
    _ea_forward[(plan.num_segments * heads * num_fblocks,)](
        x2 if x2 is not None else e2, e2 if e2 is not None else x2, w2 if w2 is not None else like,
        plan.index, plan.perm, plan.seg_row, plan.seg_start, plan.seg_end, plan.seg_slot,
        out, arg if is_max else out, part, part_arg,
        plan.num_segments, feat, cols, num_fblocks, heads,
        HAS_X=x2 is not None, HAS_E=e2 is not None, HAS_W=w2 is not None,
        RELU=activation == "relu", MAX=is_max, IDX64=idx64, ACC64=acc_dtype == torch.float64,
        BLOCK_E=cfg.block_e, BLOCK_F=cfg.block_f, num_warps=cfg.num_warps,
    )
    if plan.num_slots:
        block_c = min(triton.next_power_of_2(cols), 1024)
        grid = (plan.split_rows.numel(), triton.cdiv(cols, block_c))
        if is_max:
            _max_combine[grid](
                part, part_arg, plan.split_rows, plan.slot_ptr, plan.perm, out, arg, cols,
                IDX64=idx64, ACC64=acc_dtype == torch.float64, BLOCK_C=block_c, num_warps=4,
            )
        else:
            _gar_combine[grid](
                part, plan.split_rows, plan.slot_ptr, out, cols,
                IDX64=idx64, ACC64=acc_dtype == torch.float64, BLOCK_C=block_c, num_warps=4,
            )
    return out, arg


def edge_aggregate_forward(
    graph: Graph, x: Tensor | None, edge_attr: Tensor | None, weight: Tensor | None,
    activation: str | None, reduce: str,
) -> tuple[Tensor, Tensor | None]:
    """``(out, argmax)`` of :func:`fusegnn.sparse.reference.edge_aggregate` through the
    fused GAR kernels (no autograd). ``argmax`` (``[N_dst, C]`` COO edge ids, ``-1`` for
    none; int32 unless there are ``2**31`` edges) only for ``reduce="max"``, else ``None``.
    Inputs as the op takes them (checked by the op layer)."""
    like = x if x is not None else edge_attr
    w2, heads = _flat_weight(weight)
    feat = math.prod(like.shape[1:]) // max(heads, 1)  # zero heads: zero columns
    run_feat = _run_width(feat, edge_attr)
    # the padded copy of x lives for the kernels only (edge rows are never padded: _run_width)
    out, arg = _run_forward(
        graph, _padded(x, heads, run_feat), _flat(edge_attr), w2, heads, run_feat,
        like, activation, reduce == "max",
    )
    out_shape = (graph.num_dst_nodes,) + tuple(like.shape[1:])
    out = unpad_heads(out, heads, feat).view(out_shape)
    if reduce == "mean":
        out = out / _mean_count(graph, out)
    return out, (unpad_heads(arg, heads, feat).view(out_shape) if arg is not None else None)


def edge_aggregate_backward(
    graph: Graph, grad: Tensor, x: Tensor | None, edge_attr: Tensor | None, weight: Tensor | None,
    activation: str | None, reduce: str, argmax: Tensor | None,
    need_x: bool, need_e: bool, need_w: bool,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(grad_x, grad_edge_attr, grad_weight)`` of :func:`edge_aggregate_forward` (each
    ``None`` unless needed) from one GAR pass over the CSC segments (see the module
    docstring). For ``reduce="max"``, ``argmax`` is the forward's; ``None`` recomputes it
    (a forward pass: what the compiled op's backward, which cannot keep it, does)."""
    like = x if x is not None else edge_attr
    if reduce == "mean":
        grad = grad / _mean_count(graph, grad)
    w2, heads = _flat_weight(weight)
    cols = math.prod(grad.shape[1:])
    feat = cols // max(heads, 1)  # zero heads: zero columns
    need_x, need_e = need_x and x is not None, need_e and edge_attr is not None
    need_w = need_w and weight is not None
    acc_dtype = torch.float64 if grad.dtype == torch.float64 else torch.float32
    num_src, num_edges = graph.num_src_nodes, graph.num_edges
    gx = ge = gw = None
    if (need_x or need_e or need_w) and num_src and cols:
        run_feat = _run_width(feat, edge_attr)  # the forward's
        run_cols = heads * run_feat
        need_z = activation == "relu" or need_w
        recompute = reduce == "max" and argmax is None
        # the padded copies live for this pass only (x: read for z; edge rows are never padded)
        g2 = _padded(grad, heads, run_feat)
        x2 = _padded(x, heads, run_feat) if need_z or recompute else None
        e2 = _flat(edge_attr) if need_z or recompute else None
        if recompute:  # the forward's, at the same width
            _, arg2 = _run_forward(graph, x2, e2, w2, heads, run_feat, like, activation, True)
        else:
            arg2 = _padded(argmax, heads, run_feat)
        gx = torch.empty(num_src, run_cols, dtype=x.dtype, device=grad.device) if need_x else None
        ge = torch.empty(num_edges, run_cols, dtype=edge_attr.dtype, device=grad.device) if need_e else None
        cfg = gar_cfg(run_feat, like.element_size(), False, num_edges / max(num_src, 1))
        plan = plan_for(graph, "csc", cfg.seg_len)
        num_fblocks = triton.cdiv(run_feat, cfg.block_f)
        gw_part = torch.empty(num_edges, heads, num_fblocks, dtype=acc_dtype, device=grad.device) if need_w else None
        part = (torch.empty(plan.num_slots, run_cols, dtype=acc_dtype, device=grad.device)
                if plan.num_slots and need_x else g2)
        idx64 = _idx64(plan, max(num_src, graph.num_dst_nodes), run_cols, num_edges, cfg.block_e)
        _ea_backward[(plan.num_segments * heads * num_fblocks,)](
            g2, x2 if x2 is not None else g2, e2 if e2 is not None else g2, w2 if w2 is not None else g2,
            arg2 if arg2 is not None else g2,
            plan.index, plan.perm, plan.seg_row, plan.seg_start, plan.seg_end, plan.seg_slot,
            gx if need_x else g2, part, ge if need_e else g2, gw_part if need_w else g2,
            plan.num_segments, run_feat, run_cols, num_fblocks, heads,
            HAS_X=x is not None, HAS_E=edge_attr is not None, HAS_W=weight is not None,
            RELU=activation == "relu", MASK=reduce == "max",
            NEED_X=need_x, NEED_E=need_e, NEED_W=need_w, NEED_Z=need_z,
            IDX64=idx64, ACC64=acc_dtype == torch.float64,
            BLOCK_E=cfg.block_e, BLOCK_F=cfg.block_f, num_warps=cfg.num_warps,
        )
        if need_x and plan.num_slots:
            block_c = min(triton.next_power_of_2(run_cols), 1024)
            _gar_combine[(plan.split_rows.numel(), triton.cdiv(run_cols, block_c))](
                part, plan.split_rows, plan.slot_ptr, gx, run_cols,
                IDX64=idx64, ACC64=acc_dtype == torch.float64, BLOCK_C=block_c, num_warps=4,
            )
        gx = unpad_heads(gx, heads, feat) if need_x else None
        if need_w:  # the zero columns added nothing to the dot products
            gw = gw_part.sum(-1) if num_fblocks > 1 else gw_part.squeeze(-1)
    else:
        gx = torch.zeros(num_src, cols, dtype=x.dtype, device=grad.device) if need_x else None
        ge = torch.zeros(num_edges, cols, dtype=edge_attr.dtype, device=grad.device) if need_e else None
        if need_w:
            gw = torch.zeros(num_edges, heads, dtype=acc_dtype, device=grad.device)
    return (
        gx.view(x.shape) if need_x else None,
        ge.view(edge_attr.shape) if need_e else None,
        gw.to(weight.dtype).reshape(weight.shape) if need_w else None,
    )


class EdgeAggregate(torch.autograd.Function):
    """``apply(x, edge_attr, weight, graph, activation, reduce)``: the fused op,
    differentiable (once) in ``x``, ``edge_attr`` and ``weight``; the max's argmax is
    kept for the backward."""

    @staticmethod
    def forward(ctx, x, edge_attr, weight, graph, activation, reduce):  # type: ignore[override]
        out, argmax = edge_aggregate_forward(graph, x, edge_attr, weight, activation, reduce)
        ctx.graph, ctx.activation, ctx.reduce = graph, activation, reduce
        ctx.save_for_backward(x, edge_attr, weight, argmax)
        return out

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_out):  # type: ignore[override]
        x, edge_attr, weight, argmax = ctx.saved_tensors
        need_x, need_e, need_w = ctx.needs_input_grad[:3]
        gx, ge, gw = edge_aggregate_backward(
            ctx.graph, grad_out, x, edge_attr, weight, ctx.activation, ctx.reduce, argmax, need_x, need_e, need_w
        )
        return gx, ge, gw, None, None, None


def edge_aggregate(graph: Graph, x: Tensor | None, edge_attr: Tensor | None, weight: Tensor | None = None,
                   activation: str | None = None, reduce: str = "sum") -> Tensor:
    """:func:`fusegnn.sparse.reference.edge_aggregate` through the fused GAR kernels (differentiable)."""
    return EdgeAggregate.apply(x, edge_attr, weight, graph, activation, reduce)
