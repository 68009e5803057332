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

**Projected rows** (``PROJECT``; :func:`fused_gatv2_projected_attention`). With
:math:`x^l = x_{src} W_l^\top + b_l` and a narrow input (``K`` features, ``K < H C``),
the forward and pass R gather the ``K``-wide rows :math:`x_{src,j}` instead of
:math:`x^l_j` and form the tile ``[edges, H * C] = [edges, K] @ W_l^T`` with ``tl.dot``
against the weight held in registers (``K`` padded to at least 16, at most
:data:`MAX_PROJECTED_INPUTS`), plus :math:`b_l`; pass C does the same for
:math:`x^r_i` from :math:`x_{dst,i}` and :math:`W_r`. Per edge a pass then reads ``K``
floats for those rows instead of ``H * C``: on GATv2's Reddit output layer (16 inputs, 41
classes padded to 48) forward 16 instead of 48, pass R 16 instead of 48, pass C 16 + 48
instead of 96. The rows read once per program (:math:`x^r_i` of a target row,
:math:`x^l_j` of a source column) and the gradients stay node-sized: the backward still
returns :math:`\partial x^l` and :math:`\partial x^r`, and the ordinary GEMMs of the
projections' autograd carry them on to :math:`W`, :math:`b` and the inputs. The same
kernels, one ``constexpr`` apart; a projected pass takes at least 16 edges a step and 16
padded heads x channels (``tl.dot``'s smallest sizes).

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

from typing import NamedTuple

import torch
import triton.language as tl
from torch import Tensor
from fusegnn.kernels._autograd import differentiable_once

from fusegnn.kernels import gat_fused
from fusegnn.kernels._reductions import column_sum
from fusegnn.kernels._triton import LazyKernel, kernel_helper, next_pow2, shared_kernel_helper
from fusegnn.kernels.gat_fused import (
    DEFAULT_CHUNK,
    Launch,
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
    "fused_gatv2_attention", "fused_gatv2_projected_attention", "gatv2_config", "gatv2_forward", "gatv2_backward",
    "GATv2AttentionFunction", "Projection", "projectable_inputs",
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
def _weight_tile(w, b, hc, mask_hc, K, PROJECT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """With ``PROJECT``, the projection held in registers: ``(W^T [BLOCK_K, BLOCK_H *
    BLOCK_C], b [BLOCK_H, BLOCK_C])`` of a weight ``w`` ``[H * C, K]`` (rows in ``hc``'s
    order) and bias ``b`` ``[H * C]``, zero outside the ``K`` inputs and valid entries;
    without, two unused zeros."""
    if PROJECT:
        offs_k = tl.arange(0, BLOCK_K)
        mask = mask_hc[None, :, :] & (offs_k[:, None, None] < K)
        w_t = tl.load(w + hc[None, :, :] * K + offs_k[:, None, None], mask=mask, other=0.0).to(ACC)
        w_t = tl.reshape(w_t, (BLOCK_K, BLOCK_H * BLOCK_C))
        bias = tl.load(b + hc, mask=mask_hc, other=0.0).to(ACC)
    else:
        w_t = 0.0
        bias = 0.0
    return w_t, bias


@kernel_helper
def _gathered_rows(x, rows, me, m3, hc, H, C, x_in, w_t, bias, K, PROJECT: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                   ACC: tl.constexpr):
    """The rows ``x[rows]`` ``[BLOCK_E, H, C]`` of a tile of edges (``me``: valid edges,
    ``m3``: valid entries; zero elsewhere): gathered from ``x`` ``[N, H, C]``, or with
    ``PROJECT`` computed from the ``K``-wide input rows ``x_in[rows]`` as
    ``x_in[rows] @ W^T + b`` against :func:`_weight_tile`'s ``(w_t, bias)``."""
    if PROJECT:
        offs_k = tl.arange(0, BLOCK_K)
        x_k = tl.load(x_in + rows[:, None] * K + offs_k[None, :], mask=me[:, None] & (offs_k[None, :] < K),
                      other=0.0).to(ACC)
        flat = tl.dot(x_k, w_t, input_precision=PRECISION)
        rows_hc = tl.where(m3, tl.reshape(flat, (BLOCK_E, BLOCK_H, BLOCK_C)) + bias[None, :, :], 0.0)
    else:
        rows_hc = tl.load(x + rows[:, None, None] * (H * C) + hc[None, :, :], mask=m3, other=0.0).to(ACC)
    return rows_hc


@kernel_helper
def _target_row_tile(e0, end, offs_e, mask_h, mask_hc, hc, idx, perm, xl, xr_i, a, edge, slope, H, C,
                     x_in, w_t, bias, K,
                     HAS_EDGE: tl.constexpr, DRAW: tl.constexpr, PROJECT: tl.constexpr, BLOCK_E: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                     ACC: tl.constexpr):
    """The tile of a target row's edges from position ``e0`` (before ``end``): ``(me, meh,
    m3, j, cid, x_l[j], z, LeakyReLU(z), score)`` -- masks of the edges, (edge, head) and
    (edge, head, channel) entries, the sources, the COO edge ids (read only with
    ``HAS_EDGE`` or ``DRAW``: dropout drawn per edge), the source rows (gathered, or with
    ``PROJECT`` projected from ``x_in``: :func:`_gathered_rows`) and the scores."""
    pos, me, meh = _edge_tile(e0, end, offs_e, mask_h)
    m3 = me[:, None, None] & mask_hc[None, :, :]
    j = tl.load(idx + pos, mask=me, other=0).to(tl.int64)
    xj = _gathered_rows(xl, j, me, m3, hc, H, C, x_in, w_t, bias, K, PROJECT, BLOCK_E, BLOCK_H, BLOCK_C, BLOCK_K,
                        PRECISION, ACC)
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
    x_in, w, b,
    out, lse,
    part_acc, part_m, part_l,
    keep_bits, seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, K, CHUNK,
    HAS_ITEMS: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr,
    HAS_BITS: tl.constexpr, DRAW: tl.constexpr,
    PROJECT: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """One target row (or one chunk of a long row): scores, online softmax, aggregation;
    with PROJECT the sources' rows x_l[j] are x_in[j] @ w^T + b (x_l unread)."""
    row, start, end, slot, slope, scale, seed = _program_start(
        ptr, item_row, item_start, item_slot, seed_ptr, drop_scale, negative_slope, CHUNK, HAS_ITEMS, DROPOUT, ACC)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, mask_hc, hc = _head_channels(H, C, BLOCK_H, BLOCK_C)
    w_t, bias = _weight_tile(w, b, hc, mask_hc, K, PROJECT, BLOCK_K, BLOCK_H, BLOCK_C, ACC)
    xr_i = tl.load(xr + row * (H * C) + hc, mask=mask_hc, other=0.0).to(ACC)
    a = tl.load(att + hc, mask=mask_hc, other=0.0).to(ACC)
    m, l, acc = _softmax_init(BLOCK_H, BLOCK_C, ACC)
    for e0 in range(start, end, BLOCK_E):
        me, meh, m3, j, cid, xj, z, lr, s = _target_row_tile(
            e0, end, offs_e, mask_h, mask_hc, hc, idx, perm, xl, xr_i, a, edge, slope, H, C, x_in, w_t, bias, K,
            HAS_EDGE, DRAW, PROJECT, BLOCK_E, BLOCK_H, BLOCK_C, BLOCK_K, PRECISION, ACC,
        )
        m, l, rescale, pexp = _softmax_weights(m, l, s, meh, seed, keep_bits, cid, e0 + offs_e, me, offs_h, H, p_drop,
                                               scale, DROPOUT, RNG64, HAS_BITS)
        acc = _softmax_accumulate(acc, rescale, pexp, xj)
    _finish_softmax_row(out, lse, part_acc, part_m, part_l, row, slot, m, l, acc, offs_h, mask_h, mask_hc, hc, H, C)


def _gatv2_bwd_row_kernel(
    ptr, idx, perm,
    item_row, item_start, item_slot,
    xl, xr, att, edge, out, lse, grad_out,
    x_in, w, b,
    grad_xr, grad_att, part_xr, part_att, aux, grad_edge, grad_xl,
    keep_bits, seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, K, CHUNK,
    HAS_ITEMS: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr,
    HAS_BITS: tl.constexpr, DRAW: tl.constexpr,
    SCATTER_SRC: tl.constexpr, STORE_AUX: tl.constexpr,
    PROJECT: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """Pass R over a target row: d x_r (row sum of dz), the row's share of d att, d e per
    edge, and (L_i, D_i) for pass C; with SCATTER_SRC also d x_l by atomics ("gas"); with
    PROJECT the sources' rows x_l[j] are x_in[j] @ w^T + b."""
    row, start, end, slot, slope, scale, seed = _program_start(
        ptr, item_row, item_start, item_slot, seed_ptr, drop_scale, negative_slope, CHUNK, HAS_ITEMS, DROPOUT, ACC)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, mask_hc, hc = _head_channels(H, C, BLOCK_H, BLOCK_C)
    w_t, bias = _weight_tile(w, b, hc, mask_hc, K, PROJECT, BLOCK_K, BLOCK_H, BLOCK_C, ACC)
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
            e0, end, offs_e, mask_h, mask_hc, hc, idx, perm, xl, xr_i, a, edge, slope, H, C, x_in, w_t, bias, K,
            HAS_EDGE, DRAW, PROJECT, BLOCK_E, BLOCK_H, BLOCK_C, BLOCK_K, PRECISION, ACC,
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
    x_in, w, b,
    grad_xl, part_xl,
    keep_bits, seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, K, CHUNK,
    HAS_ITEMS: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr,
    HAS_BITS: tl.constexpr, DRAW: tl.constexpr,
    PROJECT: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """Pass C over a source row of the CSC: d x_l_j = sum_i (w_ji g_i + dz_ji); with
    PROJECT the targets' rows x_r[i] are x_in[i] @ w^T + b."""
    col, start, end, slot, slope, scale, seed = _program_start(
        ptr, item_row, item_start, item_slot, seed_ptr, drop_scale, negative_slope, CHUNK, HAS_ITEMS, DROPOUT, ACC)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, mask_hc, hc = _head_channels(H, C, BLOCK_H, BLOCK_C)
    w_t, bias = _weight_tile(w, b, hc, mask_hc, K, PROJECT, BLOCK_K, BLOCK_H, BLOCK_C, ACC)
    xj = tl.load(xl + col * (H * C) + hc, mask=mask_hc, other=0.0).to(ACC)
    a = tl.load(att + hc, mask=mask_hc, other=0.0).to(ACC)
    acc = tl.zeros([BLOCK_H, BLOCK_C], ACC)
    for e0 in range(start, end, BLOCK_E):
        pos, me, meh = _edge_tile(e0, end, offs_e, mask_h)
        m3 = me[:, None, None] & mask_hc[None, :, :]
        i = tl.load(idx + pos, mask=me, other=0).to(tl.int64)
        rows = i[:, None, None] * (H * C) + hc[None, :, :]
        cid = _coo_ids(perm, pos, me, DRAW, False, HAS_EDGE)
        xr_i = _gathered_rows(xr, i, me, m3, hc, H, C, x_in, w_t, bias, K, PROJECT, BLOCK_E, BLOCK_H, BLOCK_C,
                              BLOCK_K, PRECISION, ACC)
        z = xj[None, :, :] + xr_i
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
#: ``tl.dot`` precision of the in-kernel projections. ``"ieee"`` keeps the op within float32
#: rounding of the unprojected one (the 1e-5 parity target); ``"tf32x3"`` (tensor cores,
#: about 1e-6 relative) is the alternative to measure.
PROJECTION_PRECISION = "ieee"
#: widest input (``K``) a projection takes: its ``[K, H * C]`` weight tile stays in registers
MAX_PROJECTED_INPUTS = 64


class Projection(NamedTuple):
    """One side's rows computed in the kernels instead of gathered: ``x = inputs @ weight^T
    + bias`` with ``inputs`` ``[N, K]``, ``weight`` ``[H * C, K]`` and ``bias`` ``[H * C]``
    (contiguous, the kernels' padded channels; read only, no gradient)."""

    inputs: Tensor
    weight: Tensor
    bias: Tensor

    @property
    def block_k(self) -> int:
        return max(16, next_pow2(self.inputs.size(1)))  # tl.dot takes no dimension below 16


def _projection_args(proj: Projection | None, dummy: Tensor) -> tuple[tuple, int, dict]:
    """``((x_in, w, b), K, constexprs)`` of a kernel launch with or without ``proj``."""
    if proj is None:
        return (dummy, dummy, dummy), 1, dict(PROJECT=False, BLOCK_K=16, PRECISION=PROJECTION_PRECISION)
    flags = dict(PROJECT=True, BLOCK_K=proj.block_k, PRECISION=PROJECTION_PRECISION)
    return (proj.inputs, proj.weight, proj.bias), proj.inputs.size(1), flags


def _forward(cfg: _Config, xl: Tensor, xr: Tensor, att: Tensor, edge: Tensor | None,
             proj_l: Projection | None = None) -> tuple[Tensor, Tensor]:
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
    proj_ptrs, K, proj_flags = _projection_args(proj_l, xl)
    gatv2_fwd_kernel[(grid,)](
        csr.ptr, csr.index, csr.perm,
        item_row, item_start, item_slot,
        xl, xr, att, edge if edge is not None else xl, *proj_ptrs,
        out, lse, part_acc, part_m, part_l,
        bits, *cfg.rng_args(),
        H, C, K, cfg.chunk,
        HAS_ITEMS=sched is not None, HAS_EDGE=edge is not None, DROPOUT=cfg.dropout, RNG64=cfg.rng64, **keep_flags,
        **proj_flags,
        BLOCK_E=cfg.fwd.block_e, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ACC=_TL_ACC[cfg.acc],
        num_warps=cfg.fwd.num_warps,
    )
    if sched is not None and sched.split_groups.numel() > 0:
        gat_combine_kernel[(sched.split_groups.numel(),)](
            sched.split_groups, sched.slot_ptr, part_acc, part_m, part_l, out, lse,
            H, C, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ACC=_TL_ACC[cfg.acc],
        )
    return out, lse


def _backward(cfg: _Config, xl, xr, att, edge, out, lse, grad_out, proj_l: Projection | None = None,
              proj_r: Projection | None = None):
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
    proj_ptrs, K, proj_flags = _projection_args(proj_l, xl)
    gatv2_bwd_row_kernel[(grid,)](
        csr.ptr, csr.index, csr.perm,
        item_row, item_start, item_slot,
        xl, xr, att, edge if has_edge else xl, out, lse, grad_out, *proj_ptrs,
        grad_xr, att_rows, part_xr, part_att, aux, grad_edge, grad_xl,
        bits, *cfg.rng_args(), H, C, K, cfg.chunk,
        HAS_ITEMS=sched_r is not None, HAS_EDGE=has_edge, DROPOUT=cfg.dropout, RNG64=cfg.rng64, **keep_flags,
        SCATTER_SRC=scatter, STORE_AUX=not scatter, **proj_flags,
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
            proj_ptrs, K, proj_flags = _projection_args(proj_r, xl)
            gatv2_bwd_col_kernel[(grid,)](
                csc.ptr, csc.index, csc.perm,
                item_row, item_start, item_slot,
                xl, xr, att, edge if has_edge else xl, aux, grad_out, *proj_ptrs,
                grad_xl, part_xl,
                bits, *cfg.rng_args(), H, C, K, cfg.chunk,
                HAS_ITEMS=sched_c is not None, HAS_EDGE=has_edge, DROPOUT=cfg.dropout, RNG64=cfg.rng64, **keep_flags,
                **proj_flags,
                BLOCK_E=cfg.col.block_e, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ACC=acc_tl,
                num_warps=cfg.col.num_warps,
            )
        _combine_sums(sched_c, part_xl, grad_xl)
    # the targets' shares of d att, summed over the rows (a deterministic column sum)
    grad_att = column_sum(att_rows.reshape(n_dst, H * C)).view(1, H, C)
    return grad_xl, grad_xr, grad_att, (grad_edge if has_edge else None)


def gatv2_forward(cfg: _Config, x_l: Tensor, x_r: Tensor, att: Tensor, edge: Tensor | None,
                  proj_l: Projection | None = None) -> tuple[Tensor, Tensor]:
    """The fused forward as a plain function (what :class:`GATv2AttentionFunction` and the
    ``torch.library`` op run): ``(out [N_dst, H, C], lse [N_dst, H])`` for contiguous
    inputs (``att`` ``[H, C]`` or ``[1, H, C]``); ``lse`` is what the backward reads. With
    ``proj_l`` the sources' rows are projected in the kernel (``x_l`` is not read)."""
    graph = cfg.graph
    if graph.num_edges == 0 or graph.num_dst_nodes == 0:  # no edges: every output row is zero
        out = x_l.new_zeros((graph.num_dst_nodes, cfg.heads, cfg.channels))
        return out, torch.zeros((graph.num_dst_nodes, cfg.heads), dtype=cfg.acc, device=x_l.device)
    return _forward(cfg, x_l, x_r, att, edge, proj_l)


def gatv2_backward(cfg: _Config, x_l: Tensor, x_r: Tensor, att: Tensor, edge: Tensor | None, out: Tensor,
                   lse: Tensor, grad_out: Tensor, proj_l: Projection | None = None,
                   proj_r: Projection | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The fused backward as a plain function: ``(grad_x_l, grad_x_r, grad_att [1, H, C],
    grad_edge [E, H, C] or None)`` in the inputs' dtypes, from the forward's ``out`` and
    ``lse``. ``proj_l`` projects the sources' rows in pass R, ``proj_r`` the targets' rows
    in pass C (``"gar"``); the gradients are still those of ``x_l`` and ``x_r``."""
    graph = cfg.graph
    if graph.num_edges == 0 or graph.num_dst_nodes == 0:
        grad_edge = torch.zeros_like(edge) if edge is not None else None
        return (torch.zeros_like(x_l), torch.zeros_like(x_r), att.new_zeros((1, cfg.heads, cfg.channels)),
                grad_edge)
    gl, gr, ga, ge = _backward(cfg, x_l, x_r, att, edge, out, lse, grad_out.contiguous(), proj_l, proj_r)
    return gl.to(x_l.dtype), gr.to(x_r.dtype), ga.to(att.dtype), (ge.to(edge.dtype) if ge is not None else None)


class GATv2AttentionFunction(torch.autograd.Function):
    """Autograd for :func:`fused_gatv2_attention` (inputs validated and contiguous):
    :func:`gatv2_forward` and :func:`gatv2_backward`. ``projections`` ``(proj_l, proj_r)``
    (either ``None``) are another read of ``x_l`` / ``x_r``'s values, not inputs of the
    op: the gradients go to ``x_l`` and ``x_r``, whose own autograd carries them on to a
    projection's weight, bias and inputs."""

    @staticmethod
    def forward(ctx, x_l, x_r, att, edge, cfg: _Config, projections: tuple):  # type: ignore[override]
        out, lse = gatv2_forward(cfg, x_l, x_r, att, edge, projections[0])
        ctx.cfg = cfg
        ctx.att_shape = att.shape
        ctx.projections = projections
        ctx.save_for_backward(x_l, x_r, att, edge, out, lse)
        return out

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_out):  # type: ignore[override]
        x_l, x_r, att, edge, out, lse = ctx.saved_tensors
        gl, gr, ga, ge = gatv2_backward(ctx.cfg, x_l, x_r, att, edge, out, lse, grad_out, *ctx.projections)
        return gl, gr, ga.reshape(ctx.att_shape), ge, None, None


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


#: values of a projected pass's ``[edges, H, C]`` tile per warp. A projected pass needs at
#: least 16 edges a step (``tl.dot``'s smallest dimension): GATv2 1 x 41 (padded to 64
#: in registers) takes one warp at 16 edges, a several-head tile adds warps (up to 4).
GATV2_PROJECTED_VALUES = 1024


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


def _projected_launches(cfg: _Config, kernels: tuple[str, ...]) -> None:
    """Launch ``kernels`` (``"fwd"``, ``"row"``, ``"col"``) of ``cfg`` as projected passes:
    at least 16 edges a step and 16 padded heads x channels (``tl.dot``'s smallest sizes;
    the extra channels are masked), :data:`GATV2_PROJECTED_VALUES` values a warp, up to 4
    warps; :func:`fusegnn.kernels.gat_fused.tuning` overrides win but for those minimums."""
    if not kernels:
        return
    cfg.block_c = max(cfg.block_c, 16 // cfg.block_h)
    width = cfg.block_h * cfg.block_c
    warps = min(4, max(1, 16 * width // GATV2_PROJECTED_VALUES))
    for kernel in kernels:
        launch = _tuned(kernel, tile_launch(GATV2_PROJECTED_VALUES * warps, width, cfg.graph.avg_degree,
                                            warps=warps, least=16))
        setattr(cfg, kernel, Launch(max(launch.block_e, 16), launch.num_warps))


def gatv2_config(graph, x_l: Tensor, att: Tensor, negative_slope: float, dropout: float,
                 seed: int | Tensor | None, aggregation: str, chunk: int | None = None, *,
                 project_l: bool = False, project_r: bool = False) -> _Config:
    """The launch configuration of :func:`gatv2_forward` / :func:`gatv2_backward` (the GAT
    kernels' :class:`~fusegnn.kernels.gat_fused._Config`: tiles by heads, channels and
    average degree, :data:`GATV2_TILES`, dropout seed as a ``[1]`` tensor;
    ``seed`` read only with dropout). ``project_l`` launches the forward and pass R,
    ``project_r`` pass C, as projected passes (:func:`_projected_launches`)."""
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {aggregation!r}")
    if chunk is None:
        chunk = _TUNING.get("chunk", DEFAULT_CHUNK)
    seed_t = _seed_tensor(seed, x_l.device) if dropout > 0.0 else None
    cfg = _Config(graph, x_l, att.dtype, negative_slope, dropout, seed_t, aggregation, chunk)
    _gatv2_launches(cfg)
    _projected_launches(cfg, ("fwd", "row") * project_l + ("col",) * project_r)
    return cfg


def _check_options(dropout: float, chunk: int | None) -> None:
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")


def _pad_channels(t: Tensor | None, padded: int) -> Tensor | None:
    """``t`` ``[..., C]`` zero-padded to ``padded`` channels (as given when it has them).
    A padded channel has ``z = 0`` and ``att = 0``, so it adds nothing to a score, and its
    output column is sliced off."""
    if t is None or t.size(-1) == padded:
        return t
    return torch.nn.functional.pad(t, (0, padded - t.size(-1)))


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
    _check_options(dropout, chunk)
    channels = x_l.size(-1)
    padded = padded_channels(channels)
    x_l, x_r, att, edge_attr = (_pad_channels(t, padded) for t in (x_l, x_r, att, edge_attr))
    cfg = gatv2_config(graph, x_l, att, negative_slope, dropout, seed, aggregation, chunk)
    edge = edge_attr.contiguous() if edge_attr is not None else None
    out = GATv2AttentionFunction.apply(x_l.contiguous(), x_r.contiguous(), att.contiguous(), edge, cfg, (None, None))
    return out[..., :channels] if padded != channels else out


def _padded_linear(weight: Tensor, bias: Tensor | None, heads: int, channels: int,
                   padded: int) -> tuple[Tensor, Tensor]:
    """``(weight [H * padded, K], bias [H * padded])`` of a projection to ``heads x
    channels``, each head's rows zero-padded to ``padded`` channels (a zero bias for
    ``None``); differentiable, so the projection's gradients reach ``weight`` and ``bias``."""
    k = weight.size(1)
    w = torch.nn.functional.pad(weight.view(heads, channels, k), (0, 0, 0, padded - channels))
    if bias is None:
        b = weight.new_zeros((heads, padded))
    else:
        b = torch.nn.functional.pad(bias.view(heads, channels), (0, padded - channels))
    return w.reshape(heads * padded, k), b.reshape(heads * padded)


def projectable_inputs(in_channels: int) -> bool:
    """Whether a projection from ``in_channels`` inputs fits the kernels' register tile
    (:data:`MAX_PROJECTED_INPUTS`)."""
    return 1 <= in_channels <= MAX_PROJECTED_INPUTS


def fused_gatv2_projected_attention(
    graph,
    x_src: Tensor,
    weight_l: Tensor,
    bias_l: Tensor | None,
    x_dst: Tensor,
    weight_r: Tensor,
    bias_r: Tensor | None,
    att: Tensor,
    edge_attr: Tensor | None = None,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    *,
    seed: int | Tensor | None = None,
    aggregation: str = "gar",
    chunk: int | None = None,
    project_l: bool = True,
    project_r: bool = True,
) -> Tensor:
    r""":func:`fused_gatv2_attention` of ``x_l = x_src W_l^T + b_l`` and ``x_r = x_dst W_r^T
    + b_r``, with the per-edge rows projected in the kernels: with ``project_l`` the forward
    and pass R gather ``x_src[j]`` (``K`` wide) and multiply it by ``W_l`` held in registers
    instead of gathering ``x_l[j]`` (``H * C`` wide); with ``project_r`` pass C
    (``"gar"``) does so for ``x_r[i]`` from ``x_dst[i]``.

    ``x_l`` and ``x_r`` are still formed once per node (one GEMM each: the rows a program
    reads once, and the carriers of the gradients): the backward returns ``d x_l`` and
    ``d x_r``, and torch's autograd of those GEMMs gives ``d W = dx^T x``, ``d b`` the
    column sum and ``d x_{src} = dx W``. With ``x_dst is x_src`` and the same weight and bias
    (shared weights on one node set) ``x_r`` is ``x_l``.

    Args:
        x_src: ``[N_src, K_l]``, ``weight_l``: ``[H * C, K_l]``, ``bias_l``: ``[H * C]`` or ``None``.
        x_dst: ``[N_dst, K_r]``, ``weight_r``: ``[H * C, K_r]``, ``bias_r``: ``[H * C]`` or ``None``.
        att: ``[1, H, C]`` (or ``[H, C]``); the heads and channels are read from it.
        edge_attr: ``[E, H, C]`` projected edge features (gathered as in the plain op).
        project_l, project_r: which side is projected in the kernels; a side's ``K`` must be
            at most :data:`MAX_PROJECTED_INPUTS`. The result is the same either way.

    Other arguments and the result as :func:`fused_gatv2_attention`'s (``out`` ``[N_dst, H,
    C]``; differentiable with respect to every tensor argument). Inputs are assumed
    checked. The projections' ``tl.dot`` runs at :data:`PROJECTION_PRECISION`.
    """
    _check_options(dropout, chunk)
    heads, channels = att.shape[-2], att.shape[-1]
    for flag, x, side in ((project_l, x_src, "x_src"), (project_r, x_dst, "x_dst")):
        if flag and not projectable_inputs(x.size(1)):
            raise ValueError(f"{side} has {x.size(1)} features; a projection takes 1..{MAX_PROJECTED_INPUTS}")
    project_r = project_r and aggregation == "gar"  # "gas" has no pass C
    padded = padded_channels(channels)
    w_l, b_l = _padded_linear(weight_l, bias_l, heads, channels, padded)
    x_l = torch.nn.functional.linear(x_src, w_l, b_l).view(-1, heads, padded)
    shared = x_dst is x_src and weight_r is weight_l and bias_r is bias_l
    if shared:
        w_r, b_r, x_r = w_l, b_l, x_l
    else:
        w_r, b_r = _padded_linear(weight_r, bias_r, heads, channels, padded)
        x_r = torch.nn.functional.linear(x_dst, w_r, b_r).view(-1, heads, padded)

    def projection(flag: bool, x: Tensor, w: Tensor, b: Tensor) -> Projection | None:
        return Projection(x.detach().contiguous(), w.detach().contiguous(), b.detach().contiguous()) if flag else None

    att, edge_attr = _pad_channels(att, padded), _pad_channels(edge_attr, padded)
    cfg = gatv2_config(graph, x_l, att, negative_slope, dropout, seed, aggregation, chunk,
                       project_l=project_l, project_r=project_r)
    projections = (projection(project_l, x_src, w_l, b_l), projection(project_r, x_dst, w_r, b_r))
    edge = edge_attr.contiguous() if edge_attr is not None else None
    out = GATv2AttentionFunction.apply(x_l, x_r, att.contiguous(), edge, cfg, projections)
    return out[..., :channels] if padded != channels else out
