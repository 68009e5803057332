r"""Fused GATv2 attention: per-edge scores, LeakyReLU, online softmax, dropout and aggregation.

For each head (index dropped), edge :math:`j \to i` and ``p`` the dropout probability:

.. math::
    z_{ji} = x^l_j + x^r_i \;(+\, e_{ji}), \quad
    s_{ji} = a \cdot \mathrm{LeakyReLU}(z_{ji}), \quad
    \alpha_{ji} = \frac{\exp(s_{ji})}{\sum_{k \to i} \exp(s_{ki})}, \quad
    w_{ji} = \alpha_{ji} \frac{M_{ji}}{1 - p}, \quad
    \mathrm{out}_i = \sum_{j \to i} w_{ji} x^l_j

with :math:`x^l` ``[N_src, H, C]``, :math:`x^r` ``[N_dst, H, C]``, the attention vector
:math:`a` ``[H, C]``, optional per-edge features :math:`e` ``[E, H, C]`` (already
projected, COO edge order) and :math:`M` the dropout keep mask. Unlike GAT, the score is
not a sum of a source and a target term, so it is computed per edge from two (or three)
``[H, C]`` rows: a GATv2 pass reads ``C`` times more per edge for its scores than GAT's.

**Forward** (GAR, one program per target row of ``graph.csr``, as
:mod:`fusegnn.kernels.gat_fused`): :math:`x^r_i` and :math:`a` stay in registers; per
tile of edges the program gathers :math:`x^l_j` (and :math:`e_{ji}` through
``csr.perm``), forms :math:`z`, the LeakyReLU and the per-head dot product with
:math:`a`, and folds the scores into FlashAttention's running maximum :math:`m`,
normaliser :math:`l` and accumulator (the GAT kernels' online-softmax helpers).
``out = acc / l`` and :math:`L_i = m + \log l` are stored; nothing of size ``E`` is.
Dropout regenerates the keep mask from the counter-based RNG of the GAT kernels
(four heads per Philox draw, keyed by the COO edge id), read as one byte per edge in each
pass's order like theirs (:meth:`~fusegnn.kernels.gat_fused._Config.keep_mask`), so
:func:`fusegnn.kernels.gat_fused.dropout_keep_mask` gives this op's mask too.

**Backward** (no ``[E, H, C]`` intermediate stored; the scores are recomputed and
:math:`\alpha_{ji} = \exp(s_{ji} - L_i)`). With :math:`g_i` the output gradient and
:math:`D_i = g_i \cdot \mathrm{out}_i` per head (FlashAttention-2's identity; it holds
with dropout because ``out`` carries the mask):

.. math::
    dP_{ji} = \frac{M_{ji}}{1-p}\, g_i \cdot x^l_j, \quad
    ds_{ji} = \alpha_{ji} (dP_{ji} - D_i), \quad
    dz_{ji} = ds_{ji}\, a \odot \mathrm{LeakyReLU}'(z_{ji})

.. math::
    \partial x^r_i = \sum_{j} dz_{ji}, \quad
    \partial a = \sum_{(j, i)} ds_{ji} \mathrm{LeakyReLU}(z_{ji}), \quad
    \partial e_{ji} = dz_{ji}, \quad
    \partial x^l_j = \sum_i \big(w_{ji} g_i + dz_{ji}\big)

* pass R over ``csr`` (targets): :math:`\partial x^r`, each target's share of
  :math:`\partial a` (summed over targets afterwards) and :math:`\partial e` (each edge
  written once, in COO order); with ``"gas"`` also :math:`\partial x^l` by atomics into
  the sources;
* with ``"gar"``, pass C over ``csc`` (sources): :math:`\partial x^l`, recomputing each
  edge from :math:`x^r_i`, :math:`g_i`, :math:`e_{ji}` and the stored :math:`(L_i, D_i)`.
  No atomics, so ``"gar"`` is bitwise reproducible (the deterministic mode's choice).

Both passes recompute a tile with the GAT kernels' per-tile helpers (edge ids, keep
mask, :math:`\alpha`, the dropout and softmax gradient) around their own scores.

**Long rows** are split into work items of at most ``chunk`` edges with the GAT kernels'
schedule (:func:`~fusegnn.kernels._edge_utils.chunk_schedule`): forward partials
``(m, l, acc)`` merged by the GAT combine kernel, backward partial sums added in item
order. Launch tiles are :data:`GATV2_TILES` (smaller than GAT's: three live
``[edges, H, C]`` tiles per step, not one); the :func:`fusegnn.kernels.gat_fused.tuning`
overrides apply.

Accumulation is in float32 (float64 for float64 inputs); the LeakyReLU slope and the
dropout scale are float64 kernel arguments (see :mod:`fusegnn.kernels.gat_fused`). The
backward is not itself differentiable (:func:`~fusegnn.kernels._autograd.differentiable_once`).
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor
from fusegnn.kernels._autograd import differentiable_once

from fusegnn.kernels import gat_fused
from fusegnn.kernels._reductions import column_sum
from fusegnn.kernels._triton import LazyKernel, kernel_helper, shared_kernel_helper
from fusegnn.kernels.gat_fused import (
    DEFAULT_CHUNK,
    _combine_sums,
    _Config,
    _items,
    _partials,
    _schedule,
    _seed_tensor,
    _TL_ACC,
    _TUNING,
    _tuned,
    gat_combine_kernel,
    tile_launch,
    padded_channels,
)

__all__ = [
    "fused_gatv2_attention", "gatv2_config", "gatv2_forward", "gatv2_backward", "GATv2AttentionFunction",
]

_AGGREGATIONS = ("gar", "gas")

# the GAT kernels' device helpers (work item, online softmax, per-tile backward steps),
# jitted with these kernels
_program_start = shared_kernel_helper(gat_fused.__name__, "_program_start", __name__)
_head_channels = shared_kernel_helper(gat_fused.__name__, "_head_channels", __name__)
_tile_keep = shared_kernel_helper(gat_fused.__name__, "_tile_keep", __name__)
_coo_ids = shared_kernel_helper(gat_fused.__name__, "_coo_ids", __name__)
_recomputed_alpha = shared_kernel_helper(gat_fused.__name__, "_recomputed_alpha", __name__)
_dropout_softmax_grads = shared_kernel_helper(gat_fused.__name__, "_dropout_softmax_grads", __name__)
_edge_tile = shared_kernel_helper(gat_fused.__name__, "_edge_tile", __name__)
_softmax_init = shared_kernel_helper(gat_fused.__name__, "_softmax_init", __name__)
_softmax_weights = shared_kernel_helper(gat_fused.__name__, "_softmax_weights", __name__)
_softmax_accumulate = shared_kernel_helper(gat_fused.__name__, "_softmax_accumulate", __name__)
_finish_softmax_row = shared_kernel_helper(gat_fused.__name__, "_finish_softmax_row", __name__)


@kernel_helper
def _edge_scores(z, a, edge, cid, hc, m3, slope, H, C, HAS_EDGE: tl.constexpr, ACC: tl.constexpr):
    """For a tile of edges with ``z = x_l[j] + x_r[i]`` ``[E, H, C]``: adds the edge features
    (``HAS_EDGE``, rows ``cid``) and returns ``(z, LeakyReLU(z), score [E, H])``."""
    if HAS_EDGE:
        z += tl.load(edge + cid[:, None, None] * (H * C) + hc[None, :, :], mask=m3, other=0.0).to(ACC)
    lr = tl.where(z > 0, z, z * slope)
    return z, lr, tl.sum(lr * a[None, :, :], axis=2)


@kernel_helper
def _target_row_tile(e0, end, offs_e, mask_h, mask_hc, hc, idx, perm, xl, xr_i, a, edge, slope, H, C,
                     HAS_EDGE: tl.constexpr, DRAW: tl.constexpr, ACC: tl.constexpr):
    """The tile of a target row's edges from position ``e0`` (before ``end``): ``(me, meh,
    m3, j, cid, x_l[j], z, LeakyReLU(z), score)`` -- masks of the edges, (edge, head) and
    (edge, head, channel) entries, the sources, the COO edge ids (read only with
    ``HAS_EDGE`` or ``DRAW``: dropout drawn per edge), the gathered source rows and the scores."""
    pos, me, meh = _edge_tile(e0, end, offs_e, mask_h)
    m3 = me[:, None, None] & mask_hc[None, :, :]
    j = tl.load(idx + pos, mask=me, other=0).to(tl.int64)
    xj = tl.load(xl + j[:, None, None] * (H * C) + hc[None, :, :], mask=m3, other=0.0).to(ACC)
    cid = _coo_ids(perm, pos, me, DRAW, False, HAS_EDGE)
    z, lr, s = _edge_scores(xj + xr_i[None, :, :], a, edge, cid, hc, m3, slope, H, C, HAS_EDGE, ACC)
    return me, meh, m3, j, cid, xj, z, lr, s


@kernel_helper
def _edge_grads(alpha, dp, d, z, a, slope, keep, scale, DROPOUT: tl.constexpr):
    """Back through dropout, the softmax and the LeakyReLU for a tile of edges: ``(w, ds,
    dz)`` with ``w`` the applied coefficient, ``ds = alpha (dP - D)`` and
    ``dz = ds a LeakyReLU'(z)``; ``dp`` is ``g_i . x_l[j]`` (before the mask), ``keep``
    read only with ``DROPOUT``."""
    w, ds = _dropout_softmax_grads(alpha, dp, d, keep, scale, DROPOUT)
    return w, ds, ds[:, :, None] * tl.where(z > 0, a[None, :, :], a[None, :, :] * slope)


# ---------------------------------------------------------------------------- kernels
def _gatv2_fwd_kernel(
    ptr, idx, perm,
    item_row, item_start, item_slot,
    xl, xr, att, edge,
    out, lse,
    part_acc, part_m, part_l,
    keep_bits, seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, CHUNK,
    HAS_ITEMS: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr,
    HAS_BITS: tl.constexpr, DRAW: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """One target row (or one chunk of a long row): scores, online softmax, aggregation."""
    row, start, end, slot, slope, scale, seed = _program_start(
        ptr, item_row, item_start, item_slot, seed_ptr, drop_scale, negative_slope, CHUNK, HAS_ITEMS, DROPOUT, ACC)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, mask_hc, hc = _head_channels(H, C, BLOCK_H, BLOCK_C)
    xr_i = tl.load(xr + row * (H * C) + hc, mask=mask_hc, other=0.0).to(ACC)
    a = tl.load(att + hc, mask=mask_hc, other=0.0).to(ACC)
    m, l, acc = _softmax_init(BLOCK_H, BLOCK_C, ACC)
    for e0 in range(start, end, BLOCK_E):
        me, meh, m3, j, cid, xj, z, lr, s = _target_row_tile(
            e0, end, offs_e, mask_h, mask_hc, hc, idx, perm, xl, xr_i, a, edge, slope, H, C,
            HAS_EDGE, DRAW, ACC,
        )
        m, l, rescale, pexp = _softmax_weights(m, l, s, meh, seed, keep_bits, cid, e0 + offs_e, me, offs_h, H, p_drop,
                                               scale, DROPOUT, RNG64, HAS_BITS)
        acc = _softmax_accumulate(acc, rescale, pexp, xj)
    _finish_softmax_row(out, lse, part_acc, part_m, part_l, row, slot, m, l, acc, offs_h, mask_h, mask_hc, hc, H, C)


def _gatv2_bwd_row_kernel(
    ptr, idx, perm,
    item_row, item_start, item_slot,
    xl, xr, att, edge, out, lse, grad_out,
    grad_xr, grad_att, part_xr, part_att, aux, grad_edge, grad_xl,
    keep_bits, seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, CHUNK,
    HAS_ITEMS: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr,
    HAS_BITS: tl.constexpr, DRAW: tl.constexpr,
    SCATTER_SRC: tl.constexpr, STORE_AUX: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """Pass R over a target row: d x_r (row sum of dz), the row's share of d att, d e per
    edge, and (L_i, D_i) for pass C; with SCATTER_SRC also d x_l by atomics ("gas")."""
    row, start, end, slot, slope, scale, seed = _program_start(
        ptr, item_row, item_start, item_slot, seed_ptr, drop_scale, negative_slope, CHUNK, HAS_ITEMS, DROPOUT, ACC)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, mask_hc, hc = _head_channels(H, C, BLOCK_H, BLOCK_C)
    xr_i = tl.load(xr + row * (H * C) + hc, mask=mask_hc, other=0.0).to(ACC)
    a = tl.load(att + hc, mask=mask_hc, other=0.0).to(ACC)
    g = tl.load(grad_out + row * (H * C) + hc, mask=mask_hc, other=0.0).to(ACC)
    o = tl.load(out + row * (H * C) + hc, mask=mask_hc, other=0.0).to(ACC)
    lse_i = tl.load(lse + row * H + offs_h, mask=mask_h, other=0.0).to(ACC)
    d = tl.sum(g * o, axis=1)
    dxr = tl.zeros([BLOCK_H, BLOCK_C], ACC)
    datt = tl.zeros([BLOCK_H, BLOCK_C], ACC)
    for e0 in range(start, end, BLOCK_E):
        me, meh, m3, j, cid, xj, z, lr, s = _target_row_tile(
            e0, end, offs_e, mask_h, mask_hc, hc, idx, perm, xl, xr_i, a, edge, slope, H, C,
            HAS_EDGE, DRAW, ACC,
        )
        alpha = _recomputed_alpha(s, lse_i[None, :], meh)
        keep = _tile_keep(seed, keep_bits, cid, e0 + offs_e, me, meh, offs_h, H, p_drop, DROPOUT, RNG64, HAS_BITS)
        w, ds, dz = _edge_grads(alpha, tl.sum(g[None, :, :] * xj, axis=2), d[None, :], z, a, slope, keep, scale,
                                DROPOUT)
        dxr += tl.sum(dz, axis=0)
        datt += tl.sum(ds[:, :, None] * lr, axis=0)
        if HAS_EDGE:
            tl.store(grad_edge + cid[:, None, None] * (H * C) + hc[None, :, :], dz, mask=m3)
        if SCATTER_SRC:
            tl.atomic_add(
                grad_xl + j[:, None, None] * (H * C) + hc[None, :, :], w[:, :, None] * g[None, :, :] + dz, mask=m3
            )
    if STORE_AUX:  # (L_i, D_i) side by side: one gather per edge in pass C
        tl.store(aux + row * (2 * H) + offs_h, lse_i, mask=mask_h)
        tl.store(aux + row * (2 * H) + H + offs_h, d, mask=mask_h)
    if slot < 0:
        tl.store(grad_xr + row * (H * C) + hc, dxr, mask=mask_hc)
        tl.store(grad_att + row * (H * C) + hc, datt, mask=mask_hc)
    else:
        tl.store(part_xr + slot * (H * C) + hc, dxr, mask=mask_hc)
        tl.store(part_att + slot * (H * C) + hc, datt, mask=mask_hc)


def _gatv2_bwd_col_kernel(
    ptr, idx, perm,
    item_row, item_start, item_slot,
    xl, xr, att, edge, aux, grad_out,
    grad_xl, part_xl,
    keep_bits, seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, CHUNK,
    HAS_ITEMS: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr,
    HAS_BITS: tl.constexpr, DRAW: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """Pass C over a source row of the CSC: d x_l_j = sum_i (w_ji g_i + dz_ji)."""
    col, start, end, slot, slope, scale, seed = _program_start(
        ptr, item_row, item_start, item_slot, seed_ptr, drop_scale, negative_slope, CHUNK, HAS_ITEMS, DROPOUT, ACC)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, mask_hc, hc = _head_channels(H, C, BLOCK_H, BLOCK_C)
    xj = tl.load(xl + col * (H * C) + hc, mask=mask_hc, other=0.0).to(ACC)
    a = tl.load(att + hc, mask=mask_hc, other=0.0).to(ACC)
    acc = tl.zeros([BLOCK_H, BLOCK_C], ACC)
    for e0 in range(start, end, BLOCK_E):
        pos, me, meh = _edge_tile(e0, end, offs_e, mask_h)
        m3 = me[:, None, None] & mask_hc[None, :, :]
        i = tl.load(idx + pos, mask=me, other=0).to(tl.int64)
        rows = i[:, None, None] * (H * C) + hc[None, :, :]
        cid = _coo_ids(perm, pos, me, DRAW, False, HAS_EDGE)
        z = xj[None, :, :] + tl.load(xr + rows, mask=m3, other=0.0).to(ACC)
        z, lr, s = _edge_scores(z, a, edge, cid, hc, m3, slope, H, C, HAS_EDGE, ACC)
        gi = tl.load(grad_out + rows, mask=m3, other=0.0).to(ACC)
        lse_i = tl.load(aux + i[:, None] * (2 * H) + offs_h[None, :], mask=meh, other=0.0)
        d = tl.load(aux + i[:, None] * (2 * H) + H + offs_h[None, :], mask=meh, other=0.0)
        alpha = _recomputed_alpha(s, lse_i, meh)
        keep = _tile_keep(seed, keep_bits, cid, pos, me, meh, offs_h, H, p_drop, DROPOUT, RNG64, HAS_BITS)
        w, ds, dz = _edge_grads(alpha, tl.sum(gi * xj[None, :, :], axis=2), d, z, a, slope, keep, scale, DROPOUT)
        acc += tl.sum(w[:, :, None] * gi + dz, axis=0)
    if slot < 0:
        tl.store(grad_xl + col * (H * C) + hc, acc, mask=mask_hc)
    else:
        tl.store(part_xl + slot * (H * C) + hc, acc, mask=mask_hc)


gatv2_fwd_kernel = LazyKernel(_gatv2_fwd_kernel)
gatv2_bwd_row_kernel = LazyKernel(_gatv2_bwd_row_kernel)
gatv2_bwd_col_kernel = LazyKernel(_gatv2_bwd_col_kernel)


# ---------------------------------------------------------------------------- launch
def _forward(cfg: _Config, xl: Tensor, xr: Tensor, att: Tensor, edge: Tensor | None) -> tuple[Tensor, Tensor]:
    graph = cfg.graph
    n_dst, H, C = graph.num_dst_nodes, cfg.heads, cfg.channels
    out = torch.empty((n_dst, H, C), dtype=xl.dtype, device=xl.device)
    lse = torch.empty((n_dst, H), dtype=cfg.acc, device=xl.device)
    csr = graph.csr
    sched = _schedule(graph, "csr", cfg.chunk)
    grid, item_row, item_start, item_slot = _items(sched, csr.ptr, n_dst)
    part_acc = _partials(sched, (H, C), cfg.acc, xl.device, lse)
    part_m = _partials(sched, (H,), cfg.acc, xl.device, lse)
    part_l = _partials(sched, (H,), cfg.acc, xl.device, lse)
    bits, keep_flags = cfg.keep_mask("csr", cfg.fwd, lse)
    gatv2_fwd_kernel[(grid,)](
        csr.ptr, csr.index, csr.perm,
        item_row, item_start, item_slot,
        xl, xr, att, edge if edge is not None else xl,
        out, lse, part_acc, part_m, part_l,
        bits, *cfg.rng_args(),
        H, C, cfg.chunk,
        HAS_ITEMS=sched is not None, HAS_EDGE=edge is not None, DROPOUT=cfg.dropout, RNG64=cfg.rng64, **keep_flags,
        BLOCK_E=cfg.fwd.block_e, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ACC=_TL_ACC[cfg.acc],
        num_warps=cfg.fwd.num_warps,
    )
    if sched is not None and sched.split_groups.numel() > 0:
        gat_combine_kernel[(sched.split_groups.numel(),)](
            sched.split_groups, sched.slot_ptr, part_acc, part_m, part_l, out, lse,
            H, C, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ACC=_TL_ACC[cfg.acc],
        )
    return out, lse


def _backward(cfg: _Config, xl, xr, att, edge, out, lse, grad_out):
    graph = cfg.graph
    dev = xl.device
    H, C = cfg.heads, cfg.channels
    n_src, n_dst = graph.num_src_nodes, graph.num_dst_nodes
    acc_tl = _TL_ACC[cfg.acc]
    scatter = cfg.aggregation == "gas"
    has_edge = edge is not None
    csr = graph.csr
    sched_r = _schedule(graph, "csr", cfg.chunk)
    grid, item_row, item_start, item_slot = _items(sched_r, csr.ptr, n_dst)
    grad_xr = torch.empty((n_dst, H, C), dtype=cfg.acc, device=dev)
    att_rows = torch.empty((n_dst, H, C), dtype=cfg.acc, device=dev)  # each target's share of d att
    part_xr = _partials(sched_r, (H, C), cfg.acc, dev, lse)
    part_att = _partials(sched_r, (H, C), cfg.acc, dev, lse)
    aux = torch.empty((n_dst, 2 * H), dtype=cfg.acc, device=dev) if not scatter else lse
    grad_edge = torch.empty((graph.num_edges, H, C), dtype=cfg.acc, device=dev) if has_edge else lse
    grad_xl = torch.zeros((n_src, H, C), dtype=cfg.acc, device=dev) if scatter else lse
    bits, keep_flags = cfg.keep_mask("csr", cfg.row, lse)
    gatv2_bwd_row_kernel[(grid,)](
        csr.ptr, csr.index, csr.perm,
        item_row, item_start, item_slot,
        xl, xr, att, edge if has_edge else xl, out, lse, grad_out,
        grad_xr, att_rows, part_xr, part_att, aux, grad_edge, grad_xl,
        bits, *cfg.rng_args(), H, C, cfg.chunk,
        HAS_ITEMS=sched_r is not None, HAS_EDGE=has_edge, DROPOUT=cfg.dropout, RNG64=cfg.rng64, **keep_flags,
        SCATTER_SRC=scatter, STORE_AUX=not scatter,
        BLOCK_E=cfg.row.block_e, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ACC=acc_tl,
        num_warps=cfg.row.num_warps,
    )
    _combine_sums(sched_r, part_xr, grad_xr, part_att, att_rows)
    if not scatter:
        csc = graph.csc
        sched_c = _schedule(graph, "csc", cfg.chunk)
        grid, item_row, item_start, item_slot = _items(sched_c, csc.ptr, n_src)
        grad_xl = torch.empty((n_src, H, C), dtype=cfg.acc, device=dev)
        part_xl = _partials(sched_c, (H, C), cfg.acc, dev, lse)
        if n_src > 0:
            del bits  # the CSR mask: freed before the CSC one is drawn
            bits, keep_flags = cfg.keep_mask("csc", cfg.col, lse)
            gatv2_bwd_col_kernel[(grid,)](
                csc.ptr, csc.index, csc.perm,
                item_row, item_start, item_slot,
                xl, xr, att, edge if has_edge else xl, aux, grad_out,
                grad_xl, part_xl,
                bits, *cfg.rng_args(), H, C, cfg.chunk,
                HAS_ITEMS=sched_c is not None, HAS_EDGE=has_edge, DROPOUT=cfg.dropout, RNG64=cfg.rng64, **keep_flags,
                BLOCK_E=cfg.col.block_e, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ACC=acc_tl,
                num_warps=cfg.col.num_warps,
            )
        _combine_sums(sched_c, part_xl, grad_xl)
    # the targets' shares of d att, summed over the rows (a deterministic column sum)
    grad_att = column_sum(att_rows.reshape(n_dst, H * C)).view(1, H, C)
    return grad_xl, grad_xr, grad_att, (grad_edge if has_edge else None)


def gatv2_forward(cfg: _Config, x_l: Tensor, x_r: Tensor, att: Tensor, edge: Tensor | None) -> tuple[Tensor, Tensor]:
    """The fused forward as a plain function (what :class:`GATv2AttentionFunction` and the
    ``torch.library`` op run): ``(out [N_dst, H, C], lse [N_dst, H])`` for contiguous
    inputs (``att`` ``[H, C]`` or ``[1, H, C]``); ``lse`` is what the backward reads."""
    graph = cfg.graph
    if graph.num_edges == 0 or graph.num_dst_nodes == 0:  # no edges: every output row is zero
        out = x_l.new_zeros((graph.num_dst_nodes, cfg.heads, cfg.channels))
        return out, torch.zeros((graph.num_dst_nodes, cfg.heads), dtype=cfg.acc, device=x_l.device)
    return _forward(cfg, x_l, x_r, att, edge)


def gatv2_backward(cfg: _Config, x_l: Tensor, x_r: Tensor, att: Tensor, edge: Tensor | None, out: Tensor,
                   lse: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The fused backward as a plain function: ``(grad_x_l, grad_x_r, grad_att [1, H, C],
    grad_edge [E, H, C] or None)`` in the inputs' dtypes, from the forward's ``out`` and
    ``lse``."""
    graph = cfg.graph
    if graph.num_edges == 0 or graph.num_dst_nodes == 0:
        grad_edge = torch.zeros_like(edge) if edge is not None else None
        return (torch.zeros_like(x_l), torch.zeros_like(x_r), att.new_zeros((1, cfg.heads, cfg.channels)),
                grad_edge)
    gl, gr, ga, ge = _backward(cfg, x_l, x_r, att, edge, out, lse, grad_out.contiguous())
    return gl.to(x_l.dtype), gr.to(x_r.dtype), ga.to(att.dtype), (ge.to(edge.dtype) if ge is not None else None)


class GATv2AttentionFunction(torch.autograd.Function):
    """Autograd for :func:`fused_gatv2_attention` (inputs validated and contiguous):
    :func:`gatv2_forward` and :func:`gatv2_backward`."""

    @staticmethod
    def forward(ctx, x_l, x_r, att, edge, cfg: _Config):  # type: ignore[override]
        out, lse = gatv2_forward(cfg, x_l, x_r, att, edge)
        ctx.cfg = cfg
        ctx.att_shape = att.shape
        ctx.save_for_backward(x_l, x_r, att, edge, out, lse)
        return out

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_out):  # type: ignore[override]
        x_l, x_r, att, edge, out, lse = ctx.saved_tensors
        gl, gr, ga, ge = gatv2_backward(ctx.cfg, x_l, x_r, att, edge, out, lse, grad_out)
        return gl, gr, ga.reshape(ctx.att_shape), ge, None


#: values of a GATv2 tile (edges x heads x padded channels) per kernel, one warp, by
#: heads: ``(one head, several heads)``; ``None`` keeps GAT's launch. A GATv2 step keeps
#: three ``[edges, H, C]`` tiles live (the gathered rows, ``z`` and its LeakyReLU) where a
#: GAT step keeps one, so GAT's 2,048-value forward tile spills. H100, Reddit-sized graph
#: (115M edges), fp32, forward + backward of the op, no dropout: 1 x 48 channels
#: 27.1 -> 22.3 ms (forward 6.8 -> 4.9 ms), 1 x 16 7.4 -> 6.8 ms (forward 1.9 -> 1.4 ms),
#: 8 x 16 forward 29 -> 15 ms at 2 edges a step and row pass 87 -> 79 ms at 1 edge (the
#: column pass keeps GAT's 4-warp tile: within 1 %);
#: ``results/agg/raw/gatv2-tiles-nvidia-h100-80gb-hbm3.log``.
GATV2_TILES = {"fwd": (512, 256), "row": (512, 128), "col": (256, None)}

#: below this many target rows, the several-head forward and row pass run 4 warps on
#: :data:`GATV2_FEW_ROWS_TILES` values: one warp per row leaves most of an H100's 8,448
#: warp slots empty. Cora (2,708 rows, 13,264 edges with self-loops), 8 x 16, fp32,
#: dropout 0.6, GPU time of the op's kernels (H100): forward 55 -> 24 us, row pass
#: 167 -> 55 us; PubMed (19,717 rows) is above it (one warp within 15 % of the best there);
#: ``benchmarks/results/agg/raw/gatv2-small-tiles-nvidia-h100-80gb-hbm3.json``.
GATV2_FEW_ROWS = 4096
GATV2_FEW_ROWS_TILES = {"fwd": 1024, "row": 1024}


def _gatv2_launches(cfg: _Config) -> None:
    """Replace ``cfg``'s GAT tiles by :data:`GATV2_TILES` (one warp, at least 1 edge a step:
    :func:`~fusegnn.kernels.gat_fused.tile_launch`), or for several heads on a graph of few
    target rows :data:`GATV2_FEW_ROWS_TILES` on 4 warps; :func:`fusegnn.kernels.gat_fused.tuning`
    overrides still win."""
    width = cfg.block_h * cfg.block_c
    few_rows = cfg.block_h > 1 and cfg.graph.num_dst_nodes < GATV2_FEW_ROWS
    for kernel, tiles in GATV2_TILES.items():
        tile, warps = (tiles[0] if cfg.block_h == 1 else tiles[1]), 1
        if few_rows and kernel in GATV2_FEW_ROWS_TILES:
            tile, warps = GATV2_FEW_ROWS_TILES[kernel], 4
        if tile is not None:
            setattr(cfg, kernel, _tuned(kernel, tile_launch(tile, width, cfg.graph.avg_degree, warps=warps, least=1)))


def gatv2_config(graph, x_l: Tensor, att: Tensor, negative_slope: float, dropout: float,
                 seed: int | Tensor | None, aggregation: str, chunk: int | None = None) -> _Config:
    """The launch configuration of :func:`gatv2_forward` / :func:`gatv2_backward` (the GAT
    kernels' :class:`~fusegnn.kernels.gat_fused._Config`: tiles by heads, channels and
    average degree, :data:`GATV2_TILES`, dropout seed as a ``[1]`` tensor;
    ``seed`` read only with dropout)."""
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {aggregation!r}")
    if chunk is None:
        chunk = _TUNING.get("chunk", DEFAULT_CHUNK)
    seed_t = _seed_tensor(seed, x_l.device) if dropout > 0.0 else None
    cfg = _Config(graph, x_l, att.dtype, negative_slope, dropout, seed_t, aggregation, chunk)
    _gatv2_launches(cfg)
    return cfg


def fused_gatv2_attention(
    graph,
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    edge_attr: Tensor | None = None,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    *,
    seed: int | Tensor | None = None,
    aggregation: str = "gar",
    chunk: int | None = None,
) -> Tensor:
    r"""Fused GATv2 attention ``out_i = sum_j w_ji x_l[j]`` (see the module docstring).

    Args:
        graph: the graph (a :class:`~fusegnn.sparse.Graph`; edges ``j -> i``; bipartite is fine).
        x_l: ``[N_src, H, C]`` source features (also the messages).
        x_r: ``[N_dst, H, C]`` target features.
        att: ``[1, H, C]`` (or ``[H, C]``) attention vector.
        edge_attr: ``[E, H, C]`` projected edge features in the graph's (COO) edge order, or ``None``.
        negative_slope: LeakyReLU slope.
        dropout: probability of dropping a coefficient (kept ones scaled by ``1 / (1 - p)``).
        seed: dropout seed (as :func:`fusegnn.kernels.gat_fused.fused_gat_attention`'s; its
            mask is :func:`~fusegnn.kernels.gat_fused.dropout_keep_mask`).
        aggregation: ``"gar"`` (atomic-free two-pass backward) or ``"gas"`` (atomics).
        chunk: longest run of edges one program handles (default as the GAT kernels').

    Returns ``out`` ``[N_dst, H, C]`` in ``x_l``'s dtype, differentiable with respect to
    ``x_l``, ``x_r``, ``att`` and ``edge_attr``. Inputs are assumed checked (same dtype
    and device, shapes as above). A width ``C`` above 16 that is not a multiple of 16 runs
    zero-padded to :func:`~fusegnn.kernels.gat_fused.padded_channels` (unaligned rows made
    GAT's kernels 3x slower; GATv2's 15x at 41 channels on an H100).
    """
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    channels = x_l.size(-1)
    padded = padded_channels(channels)
    if padded != channels:
        # aligned rows, as GAT's kernels (padded_channels): a padded channel has z = 0 and
        # att = 0, so it adds nothing to a score, and its output column is sliced off
        def pad(t: Tensor | None) -> Tensor | None:
            return None if t is None else torch.nn.functional.pad(t, (0, padded - channels))

        x_l, x_r, att, edge_attr = pad(x_l), pad(x_r), pad(att), pad(edge_attr)
    cfg = gatv2_config(graph, x_l, att, negative_slope, dropout, seed, aggregation, chunk)
    edge = edge_attr.contiguous() if edge_attr is not None else None
    out = GATv2AttentionFunction.apply(x_l.contiguous(), x_r.contiguous(), att.contiguous(), edge, cfg)
    return out[..., :channels] if padded != channels else out
