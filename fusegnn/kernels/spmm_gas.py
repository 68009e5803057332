r"""Fused gather-apply-scatter (GAS): edge-parallel SpMM over unsorted COO, with atomics.

One kernel serves the forward pass, the backward pass for the features and the
edge-weight gradient (fuseGNN, Algorithms 1 and 2). With features viewed as
``[N, H, F]`` (``H`` heads of ``F`` features, ``C = H F`` columns per row) and weights
``w`` of shape ``[E, H]`` (``H = 1`` when a weight is shared by all columns), a program
owns ``BLOCK_E`` edges and one head and walks that head's features in chunks of
``BLOCK_F``:

.. math::
    \text{SCATTER:}\quad \mathrm{out}[s_e, h, f] \mathrel{+}= w_{e,h}\, a[g_e, h, f]
    \qquad
    \text{DOT:}\quad \mathrm{gw}[e, h] = \sum_f a[g_e, h, f]\, b[s_e, h, f]

* forward: ``a = x``, gather at the source ``g = src``, scatter into the target ``s = dst``;
* backward: the roles swap, ``a = grad_out`` gathered at ``dst`` and scattered into
  ``grad_x`` at ``src``; with ``DOT`` the same program also forms the weight gradient
  :math:`\partial L / \partial w_{e,h} = \langle \mathrm{grad\_out}_{dst}, x_{src} \rangle_h`
  from the rows it already holds. Each edge owns its weight, so ``gw`` needs no atomics;
  ``DOT`` without ``SCATTER`` is a deterministic edge-parallel dot product.

When ``F`` is narrow, ``BLOCK_E = TILE / BLOCK_F`` edges share a program, so the tile
stays full (fuseGNN's ``T / m`` packing). The scatter uses relaxed fp32 (fp64 for fp64
inputs) atomics into an accumulation buffer; the caller casts to the input dtype. The
order of the atomic additions is not fixed, so results may differ in the last bits from
run to run: deterministic mode never routes here (see :mod:`fusegnn.sparse.dispatch`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from fusegnn.kernels._triton import LazyKernel, kernel_helper

# element offsets at or above this are computed in int64 (tests lower it to exercise that path)
INT64_OFFSETS_FROM = 2**31 - 1

__all__ = ["GasConfig", "gas_config", "gas_scatter"]


class GasConfig(NamedTuple):
    """Launch parameters of the GAS kernel.

    ``runs``: add up the contributions of consecutive edges with the same scatter row
    inside the program (a segmented scan) before the atomics, so that one atomic per
    run and column reaches memory. Pays off when the scatter index comes in runs (the
    backward of a COO sorted by source, as datasets usually are); costs a scan otherwise.
    """

    block_e: int
    block_f: int
    num_warps: int = 4
    runs: bool = False


@functools.lru_cache(maxsize=256)
def gas_config(feat: int, elem_size: int, tile: int = 2048, max_block_f: int = 128) -> GasConfig:
    """Default launch parameters for ``feat`` features per head of ``elem_size`` bytes."""
    block_f = min(triton.next_power_of_2(max(feat, 1)), max_block_f)
    block_e = max(tile // block_f, 1)
    return GasConfig(block_e=block_e, block_f=block_f, num_warps=4)


@kernel_helper
def _segmented_add(flag_a, val_a, flag_b, val_b):
    """Combine of a segmented inclusive scan: a set flag starts a new run."""
    return flag_a | flag_b, tl.where(flag_b != 0, val_b, val_a + val_b)


def _gas_kernel(
    a_ptr,
    gidx_ptr,
    sidx_ptr,
    w_ptr,
    out_ptr,
    b_ptr,
    gw_ptr,
    num_edges,
    num_feat,
    row_stride,
    HAS_W: tl.constexpr,
    SCATTER: tl.constexpr,
    DOT: tl.constexpr,
    IDX64: tl.constexpr,
    ACC64: tl.constexpr,
    RUNS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    acc_t = tl.float64 if ACC64 else tl.float32
    pid = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    if IDX64:
        e = pid.to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    else:
        e = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = e < num_edges
    gi = tl.load(gidx_ptr + e, mask=emask, other=0)
    si = tl.load(sidx_ptr + e, mask=emask, other=0)
    if RUNS:
        lane = tl.arange(0, BLOCK_E)
        prev = tl.load(sidx_ptr + e - 1, mask=emask & (lane > 0), other=-1)
        nxt = tl.load(sidx_ptr + e + 1, mask=(e + 1 < num_edges) & (lane < BLOCK_E - 1), other=-1)
        run_start = ((si != prev) | (lane == 0)).to(tl.int32)
        run_end = (si != nxt) | (lane == BLOCK_E - 1)
    if IDX64:
        gi = gi.to(tl.int64)
        si = si.to(tl.int64)
    g_row = gi * row_stride + head * num_feat
    s_row = si * row_stride + head * num_feat
    if HAS_W:
        w = tl.load(w_ptr + e * num_heads + head, mask=emask, other=0.0).to(acc_t)
    dot = tl.zeros([BLOCK_E], dtype=acc_t)
    for f0 in range(0, num_feat, BLOCK_F):
        f = f0 + tl.arange(0, BLOCK_F)
        m = emask[:, None] & (f < num_feat)[None, :]
        a = tl.load(a_ptr + (g_row[:, None] + f[None, :]), mask=m, other=0.0).to(acc_t)
        if SCATTER:
            val = a
            if HAS_W:
                val = a * w[:, None]
            am = m
            if RUNS:
                flags = tl.broadcast_to(run_start[:, None], [BLOCK_E, BLOCK_F])
                _, val = tl.associative_scan((flags, val), 0, _segmented_add)
                am = m & run_end[:, None]
            tl.atomic_add(out_ptr + (s_row[:, None] + f[None, :]), val, mask=am, sem="relaxed")
        if DOT:
            b = tl.load(b_ptr + (s_row[:, None] + f[None, :]), mask=m, other=0.0).to(acc_t)
            dot += tl.sum(a * b, axis=1)
    if DOT:
        tl.store(gw_ptr + e * num_heads + head, dot.to(gw_ptr.dtype.element_ty), mask=emask)


# jitted at the first launch; relaunched without Triton's binder (fusegnn.kernels._launch)
_gas = LazyKernel(_gas_kernel)


def gas_scatter(
    a: Tensor,
    gather_index: Tensor,
    scatter_index: Tensor,
    weight: Tensor | None,
    num_out_rows: int,
    num_heads: int,
    *,
    dot_with: Tensor | None = None,
    scatter: bool = True,
    config: GasConfig | None = None,
    initial: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    r"""Run the GAS kernel.

    Args:
        a: ``[N_a, C]`` contiguous rows gathered at ``gather_index``.
        gather_index, scatter_index: ``[E]`` int32/int64 row ids (COO order).
        weight: ``None`` (all ones) or ``[E, num_heads]`` contiguous.
        num_out_rows: rows of the scatter target.
        num_heads: ``H``; ``C`` must be a multiple of it (``F = C / H``).
        dot_with: ``[num_out_rows, C]`` rows read at ``scatter_index`` for the per-edge
            dot product (the weight gradient), or ``None``.
        scatter: whether to scatter at all (``False`` with ``dot_with``: dot only).
        config: launch parameters (default :func:`gas_config`).
        initial: ``[C]`` starting value of every accumulator row (a bias), else zeros.

    Returns:
        ``(acc, gw)``: the ``[num_out_rows, C]`` accumulation buffer (fp32, fp64 for
        fp64 input; ``None`` without ``scatter``) and the ``[E, num_heads]`` dot products
        in ``weight``'s dtype (``a``'s without weight; ``None`` without ``dot_with``).
    """
    num_edges = gather_index.numel()
    cols = a.size(1)
    feat = cols // max(num_heads, 1)  # zero heads: zero columns
    acc_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    if not scatter:
        acc = None
    elif initial is None:
        acc = torch.zeros(num_out_rows, cols, dtype=acc_dtype, device=a.device)
    else:
        # a copy always: with one target row, expand(...).contiguous() would be the caller's
        # bias itself, which the atomics would then overwrite
        acc = initial.to(acc_dtype).expand(num_out_rows, cols).clone(memory_format=torch.contiguous_format)
    gw = None
    if dot_with is not None:
        gw_dtype = weight.dtype if weight is not None else a.dtype
        gw = torch.empty(num_edges, num_heads, dtype=gw_dtype, device=a.device)
    if num_edges == 0 or feat == 0 or (acc is None and gw is None):
        if gw is not None:
            gw.zero_()
        return acc, gw
    cfg = config or gas_config(feat, a.element_size())
    big = max(a.size(0), num_out_rows) * cols
    idx64 = max(big, (num_edges + cfg.block_e) * num_heads) >= INT64_OFFSETS_FROM
    grid = (triton.cdiv(num_edges, cfg.block_e), num_heads)
    _gas[grid](
        a,
        gather_index,
        scatter_index,
        weight if weight is not None else a,
        acc if acc is not None else a,
        dot_with if dot_with is not None else a,
        gw if gw is not None else a,
        num_edges,
        feat,
        cols,
        HAS_W=weight is not None,
        SCATTER=acc is not None,
        DOT=gw is not None,
        IDX64=idx64,
        ACC64=acc_dtype == torch.float64,
        RUNS=cfg.runs and acc is not None,
        BLOCK_E=cfg.block_e,
        BLOCK_F=cfg.block_f,
        num_warps=cfg.num_warps,
    )
    return acc, gw
