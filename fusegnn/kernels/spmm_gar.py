r"""Fused gather-apply-reduce (GAR): segment-parallel SpMM over grouped edges, no atomics.

The edges are grouped by the row they reduce into -- CSR (grouped by target) for the
forward pass, CSC (grouped by source) for the gradient of the features -- and cut into
segments of at most ``K`` edges by :mod:`fusegnn.kernels.partition`. With features
viewed as ``[N, H, F]`` (``C = H F`` columns) and weights ``[E, H]`` already in grouped
order, the program of segment ``s`` (row ``r``, edges ``k0..k1``), head ``h`` and feature
block ``b`` computes

.. math::
    p_s[h, f] = \sum_{k = k_0}^{k_1 - 1} w_{k,h}\; a[\mathrm{index}_k, h, f]

entirely on chip: a ``[BLOCK_E, BLOCK_F]`` register tile accumulates ``BLOCK_E`` edges
per step (fuseGNN's ``T / m`` edges at once for narrow features) and is reduced over the
edge axis once at the end (fuseGNN's group reduce). A segment that is its row's only one
stores :math:`p_s` as the row's result; the segments of a split row store partial sums,
which :func:`_gar_combine_kernel` adds in slot order. No atomics anywhere, and every sum
has a fixed order: results are bitwise reproducible.

Backward (``DOT``): over CSC the row is a *source* ``j``; the same pass that reduces
``grad_x[j] = sum_k w_k grad_out[index_k]`` also forms the weight gradient
:math:`\partial L / \partial w_{k,h} = \langle \mathrm{grad\_out}[\mathrm{index}_k, h],
x[j, h] \rangle`, reusing the gathered ``grad_out`` rows and ``x[j]`` loaded once per
segment (fuseGNN's data reuse), and writes it at the edge's COO position ``perm[k]``.
This needs a head's whole feature vector in one tile (``BLOCK_F >= F``); wider heads use
:func:`fusegnn.kernels.spmm_gas.gas_scatter` with ``scatter=False`` for the dot products.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusegnn.kernels._triton import LazyKernel
from fusegnn.kernels.partition import SegmentPlan

# element offsets at or above this are computed in int64 (tests lower it to exercise that path)
INT64_OFFSETS_FROM = 2**31 - 1

__all__ = ["GarConfig", "gar_config", "gar_reduce", "MAX_DOT_BLOCK_F"]

# Widest head (in features, rounded up to a power of two) the fused weight gradient handles.
MAX_DOT_BLOCK_F = 1024
# Average degree below which gar_config shapes the tile for short rows.
LOW_DEGREE = 32.0


class GarConfig(NamedTuple):
    """Launch parameters of the GAR kernels.

    ``seg_len`` (edges per segment) selects the cached work list; ``block_e`` edges by
    ``block_f`` features is the register tile; ``col_major`` orders the grid so that all
    segments of one feature block run before the next block (the gathered columns then
    stay in L2 for wide features); ``hints`` marks the streamed index / weight loads and
    the stores evict-first and the gathered rows evict-last in L2; ``prefetch`` loads the
    next step's indices and weights before the current gather (software pipelining by
    hand).
    """

    block_e: int
    block_f: int
    num_warps: int = 4
    seg_len: int = 1024
    num_stages: int = 1
    col_major: bool = True
    hints: bool = False
    prefetch: bool = False


@functools.lru_cache(maxsize=512)
def gar_config(
    feat: int,
    elem_size: int,
    *,
    dot: bool = False,
    avg_degree: float | None = None,
    max_row_bytes: int = 256,
) -> GarConfig:
    """Default launch parameters for ``feat`` features per head of ``elem_size`` bytes.

    A feature block spans at most ``max_row_bytes`` of a row, so with ``col_major`` the
    gathered column strip of a Reddit-sized graph stays in L2; the tile holds 1024
    elements (2048 for wider heads and for the fused weight gradient, whose block must
    span the whole head). Narrower strips lose once edge weights, which every strip
    re-reads, are counted (the measurements: ``benchmarks/NOTES-spmm.md``). When the
    graph's ``avg_degree`` is low, short rows would leave most of a tall tile masked:
    the tile is then as tall as the average row and as wide as the whole head.
    """
    full = triton.next_power_of_2(max(feat, 1))
    if dot:
        block_f = full
    elif avg_degree is not None and avg_degree < LOW_DEGREE:
        block_f = min(full, max(1024 // elem_size, 1))
    else:
        block_f = min(full, max(max_row_bytes // elem_size, 1))
    tile = 2048 if (dot or full > 64) else 1024
    block_e = max(tile // block_f, 1)
    if avg_degree is not None and avg_degree < LOW_DEGREE:
        block_e = min(block_e, max(triton.next_power_of_2(math.ceil(avg_degree)), 2))
    # the fused weight gradient prefetches the next indices (it pays there: NOTES-spmm.md)
    return GarConfig(block_e=block_e, block_f=block_f, num_warps=4, prefetch=dot)


def _gar_kernel(
    a_ptr,
    index_ptr,
    w_ptr,
    seg_row_ptr,
    seg_start_ptr,
    seg_end_ptr,
    seg_slot_ptr,
    out_ptr,
    part_ptr,
    xrow_ptr,
    perm_ptr,
    gw_ptr,
    num_segments,
    num_feat,
    row_stride,
    num_fblocks,
    num_heads,
    HAS_W: tl.constexpr,
    DOT: tl.constexpr,
    IDX64: tl.constexpr,
    ACC64: tl.constexpr,
    COL_MAJOR: tl.constexpr,
    PREFETCH: tl.constexpr,
    STREAM: tl.constexpr,
    KEEP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    acc_t = tl.float64 if ACC64 else tl.float32
    pid = tl.program_id(0)
    if COL_MAJOR:
        seg = pid % num_segments
        col = pid // num_segments
    else:
        seg = pid // (num_heads * num_fblocks)
        col = pid % (num_heads * num_fblocks)
    head = col // num_fblocks
    fblock = col % num_fblocks
    row = tl.load(seg_row_ptr + seg)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_end_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg)
    if IDX64:
        row = row.to(tl.int64)
        slot = slot.to(tl.int64)
        start = start.to(tl.int64)
        end = end.to(tl.int64)
    f = fblock * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = f < num_feat
    col0 = head * num_feat
    if DOT:
        xr = tl.load(xrow_ptr + (row * row_stride + col0 + f), mask=fmask, other=0.0).to(acc_t)
    acc = tl.zeros([BLOCK_E, BLOCK_F], dtype=acc_t)
    if PREFETCH:
        k = start + tl.arange(0, BLOCK_E)
        kmask = k < end
        j = tl.load(index_ptr + k, mask=kmask, other=0, eviction_policy=STREAM)
        if HAS_W:
            w = tl.load(w_ptr + k * num_heads + head, mask=kmask, other=0.0, eviction_policy=STREAM)
    for k0 in range(start, end, BLOCK_E):
        if PREFETCH:
            kn = k0 + BLOCK_E + tl.arange(0, BLOCK_E)
            knmask = kn < end
            jn = tl.load(index_ptr + kn, mask=knmask, other=0, eviction_policy=STREAM)
            if HAS_W:
                wn = tl.load(w_ptr + kn * num_heads + head, mask=knmask, other=0.0, eviction_policy=STREAM)
        else:
            k = k0 + tl.arange(0, BLOCK_E)
            kmask = k < end
            j = tl.load(index_ptr + k, mask=kmask, other=0, eviction_policy=STREAM)
            if HAS_W:
                w = tl.load(w_ptr + k * num_heads + head, mask=kmask, other=0.0, eviction_policy=STREAM)
        if IDX64:
            jj = j.to(tl.int64)
        else:
            jj = j
        m = kmask[:, None] & fmask[None, :]
        a = tl.load(a_ptr + (jj[:, None] * row_stride + col0 + f[None, :]), mask=m, other=0.0, eviction_policy=KEEP)
        a = a.to(acc_t)
        if HAS_W:
            acc += a * w.to(acc_t)[:, None]
        else:
            acc += a
        if DOT:
            d = tl.sum(a * xr[None, :], axis=1)
            p = tl.load(perm_ptr + k, mask=kmask, other=0, eviction_policy=STREAM)
            if IDX64:
                p = p.to(tl.int64)
            tl.store(gw_ptr + p * num_heads + head, d.to(gw_ptr.dtype.element_ty), mask=kmask)
        if PREFETCH:
            k = kn
            kmask = knmask
            j = jn
            if HAS_W:
                w = wn
    res = tl.sum(acc, axis=0)
    if slot < 0:
        tl.store(out_ptr + (row * row_stride + col0 + f), res.to(out_ptr.dtype.element_ty), mask=fmask,
                 eviction_policy=STREAM)
    else:
        tl.store(part_ptr + (slot * row_stride + col0 + f), res, mask=fmask)


def _gar_combine_kernel(
    part_ptr,
    split_rows_ptr,
    slot_ptr_ptr,
    out_ptr,
    row_stride,
    IDX64: tl.constexpr,
    ACC64: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    acc_t = tl.float64 if ACC64 else tl.float32
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < row_stride
    row = tl.load(split_rows_ptr + r)
    s0 = tl.load(slot_ptr_ptr + r)
    s1 = tl.load(slot_ptr_ptr + r + 1)
    if IDX64:
        row = row.to(tl.int64)
    else:
        s0 = s0.to(tl.int32)
        s1 = s1.to(tl.int32)
    acc = tl.zeros([BLOCK_C], dtype=acc_t)
    for s in range(s0, s1):
        acc += tl.load(part_ptr + (s * row_stride + c), mask=cmask, other=0.0)
    tl.store(out_ptr + (row * row_stride + c), acc.to(out_ptr.dtype.element_ty), mask=cmask)


# jitted at the first launch; relaunched without Triton's binder (fusegnn.kernels._launch)
_gar = LazyKernel(_gar_kernel)
_gar_combine = LazyKernel(_gar_combine_kernel)


def gar_reduce(
    plan: SegmentPlan,
    a: Tensor,
    weight: Tensor | None,
    num_out_rows: int,
    num_heads: int,
    out_dtype: torch.dtype,
    *,
    dot_with: Tensor | None = None,
    gw_dtype: torch.dtype | None = None,
    config: GarConfig | None = None,
) -> tuple[Tensor, Tensor | None]:
    r"""Run GAR over the segments of ``plan``.

    Args:
        plan: the work list of the grouped edge order (its ``index`` is read).
        a: ``[N_a, C]`` contiguous rows gathered at ``plan.index``.
        weight: ``None`` or ``[E, num_heads]`` contiguous, **in grouped order**.
        num_out_rows: number of groups (rows of the result).
        num_heads: ``H`` (``F = C / H``).
        out_dtype: dtype of the result.
        dot_with: ``[num_out_rows, C]`` rows ``x`` for the fused weight gradient
            ``gw[perm[k], h] = <a[index[k], h], x[row, h]>`` (needs
            ``next_pow2(F) <= MAX_DOT_BLOCK_F``), or ``None``.
        gw_dtype: dtype of the weight gradient.
        config: launch parameters (default :func:`gar_config`); its ``seg_len`` must be
            the plan's.

    Returns:
        ``(out, gw)``: ``[num_out_rows, C]`` in ``out_dtype`` and the ``[E, num_heads]``
        weight gradient in COO order (``None`` without ``dot_with``).
    """
    cols = a.size(1)
    feat = cols // max(num_heads, 1)  # zero heads: zero columns
    num_edges = plan.index.numel()
    dot = dot_with is not None
    acc_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    out = torch.empty(num_out_rows, cols, dtype=out_dtype, device=a.device)
    gw = torch.empty(num_edges, num_heads, dtype=gw_dtype or a.dtype, device=a.device) if dot else None
    if num_out_rows == 0 or cols == 0:
        if gw is not None:
            gw.zero_()
        return out, gw
    cfg = config or gar_config(feat, a.element_size(), dot=dot)
    if cfg.seg_len != plan.seg_len:
        raise ValueError(f"config.seg_len={cfg.seg_len} does not match the plan's {plan.seg_len}")
    if dot and cfg.block_f < feat:
        raise ValueError(f"the fused weight gradient needs block_f >= F={feat}, got {cfg.block_f}")
    num_fblocks = triton.cdiv(feat, cfg.block_f)
    num_segments = plan.num_segments
    part = torch.empty(plan.num_slots, cols, dtype=acc_dtype, device=a.device) if plan.num_slots else out
    big = max(a.size(0), num_out_rows, plan.num_slots) * cols
    idx64 = max(big, (num_edges + cfg.block_e) * num_heads) >= INT64_OFFSETS_FROM
    _gar[(num_segments * num_heads * num_fblocks,)](
        a,
        plan.index,
        weight if weight is not None else a,
        plan.seg_row,
        plan.seg_start,
        plan.seg_end,
        plan.seg_slot,
        out,
        part,
        dot_with if dot else a,
        plan.perm,
        gw if dot else a,
        num_segments,
        feat,
        cols,
        num_fblocks,
        num_heads,
        HAS_W=weight is not None,
        DOT=dot,
        IDX64=idx64,
        ACC64=acc_dtype == torch.float64,
        COL_MAJOR=cfg.col_major,
        PREFETCH=cfg.prefetch,
        STREAM="evict_first" if cfg.hints else "",
        KEEP="evict_last" if cfg.hints else "",
        BLOCK_E=cfg.block_e,
        BLOCK_F=cfg.block_f,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if plan.num_slots:
        block_c = min(triton.next_power_of_2(cols), 1024)
        grid = (plan.split_rows.numel(), triton.cdiv(cols, block_c))
        _gar_combine[grid](
            part,
            plan.split_rows,
            plan.slot_ptr,
            out,
            cols,
            IDX64=idx64,
            ACC64=acc_dtype == torch.float64,
            BLOCK_C=block_c,
            num_warps=4,
        )
    return out, gw
