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
normaliser :math:`l` and accumulator. ``out = acc / l`` and :math:`L_i = m + \log l` are
stored; nothing of size ``E`` is. Dropout regenerates the keep mask from the counter-based
RNG of the GAT kernels (``tl.rand(seed, coo_edge_id * H + head) >= p``), so
:func:`fusegnn.kernels.gat_fused.dropout_keep_mask` gives this op's mask too.

**Layout.** A tile is ``[BLOCK_Q, BLOCK_E, BLOCK_H, VEC]``: channel ``q * VEC + v`` of
head ``h`` of the tile's edge ``e``, ``VEC`` channels making 16 bytes. Triton gives a
load its threads along the contiguous axis first; with a ``[E, H, C]`` tile that put
``C / 4`` lanes on one edge's row, so every per-edge value (score, exponential, dropout
draw, gradient coefficients) was computed ``C / 4`` times over and every channel sum
took shuffles. Here the one contiguous axis is ``VEC`` wide, so the lanes go along the
edges (heads): each lane holds whole rows, the channel sums stay inside a lane and the
per-edge work is done once. The lanes also keep their own running softmax state
(maximum, normaliser, accumulator; one exponential per edge: the new edge's weight, or
the rescale of a lane whose maximum it raises) and their own backward sums, merged over
the lanes once per row (or chunk): no cross-lane traffic inside the edge loops. The
LeakyReLU is ``ls z`` with ``ls = LeakyReLU'(z)`` (1 or the slope), which the backward
reuses: :math:`dz = ds\, a \odot ls`.

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

* pass R over ``csr`` (targets): :math:`\partial x^r` (``a`` times the row's sum of
  :math:`ds\, ls`), each target's share of :math:`\partial a` (summed over targets afterwards) and :math:`\partial e` (each edge
  written once, in COO order); with ``"gas"`` also :math:`\partial x^l` by atomics into
  the sources;
* with ``"gar"``, pass C over ``csc`` (sources): :math:`\partial x^l`, recomputing each
  edge from :math:`x^r_i`, :math:`g_i`, :math:`e_{ji}` and the stored :math:`(L_i, D_i)`.
  No atomics, so ``"gar"`` is bitwise reproducible (the deterministic mode's choice).

**Long rows** are split into work items of at most ``chunk`` edges with the GAT kernels'
schedule (:func:`~fusegnn.kernels._edge_utils.chunk_schedule`): forward partials
``(m, l, acc)`` merged by the GAT combine kernel, backward partial sums added in item
order. Launch tiles: :class:`_GATv2Config`; the :func:`fusegnn.kernels.gat_fused.tuning`
overrides apply.

Accumulation is in float32 (float64 for float64 inputs); the LeakyReLU slope and the
dropout scale are float64 kernel arguments (see :mod:`fusegnn.kernels.gat_fused`). The
backward is not itself differentiable (``once_differentiable``).
"""

from __future__ import annotations

import math

import torch
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

from fusegnn.kernels import gat_fused
from fusegnn.kernels._triton import LazyKernel, kernel_helper, next_pow2, shared_kernel_helper
from fusegnn.kernels.gat_fused import (
    DEFAULT_CHUNK,
    _combine_sums,
    _Config,
    Launch,
    _items,
    _partials,
    _schedule,
    _seed_tensor,
    _TL_ACC,
    _TUNING,
    _tuned,
    gat_combine_kernel,
    padded_channels,
)

__all__ = [
    "fused_gatv2_attention", "gatv2_config", "gatv2_forward", "gatv2_backward", "GATv2AttentionFunction",
]

_AGGREGATIONS = ("gar", "gas")

# the GAT kernels' work-item and dropout-mask device helpers, jitted with these kernels
_work_item = shared_kernel_helper(gat_fused.__name__, "_work_item", __name__)
_dropout_keep = shared_kernel_helper(gat_fused.__name__, "_dropout_keep", __name__)


@kernel_helper
def _row_tile(H, C, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, VEC: tl.constexpr):
    """``(offs_h, mask_h, hq, mask_hq)``: head offsets and mask, and the offsets and mask
    of an ``[H, C]`` row laid out as ``[BLOCK_Q, BLOCK_H, VEC]`` (channel ``q * VEC + v``
    of head ``h`` at ``[q, h, v]``)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_q = tl.arange(0, BLOCK_Q)
    offs_v = tl.arange(0, VEC)
    ch = offs_q[:, None, None] * VEC + offs_v[None, None, :]
    mask_h = offs_h < H
    mask_hq = mask_h[None, :, None] & (ch < C)
    return offs_h, mask_h, offs_h[None, :, None] * C + ch, mask_hq


@kernel_helper
def _channel_sum(x):
    """``[BLOCK_Q, BLOCK_E, BLOCK_H, VEC] -> [BLOCK_E, BLOCK_H]``: the sum over a head's
    channels (inside one thread: see the module docstring)."""
    return tl.sum(tl.sum(x, axis=3), axis=0)


@kernel_helper
def _gather_rows(base, rows, hq, m4, HC):
    """The ``[H, C]`` rows ``rows`` ``[BLOCK_E]`` (int64) of ``base`` as a
    ``[BLOCK_Q, BLOCK_E, BLOCK_H, VEC]`` tile (zero where ``m4`` is false)."""
    return tl.load(base + rows[None, :, None, None] * HC + hq[:, None, :, :], mask=m4, other=0.0)


@kernel_helper
def _edge_scores(z, a, edge, cid, hq, m4, slope, H, C, HAS_EDGE: tl.constexpr, ACC: tl.constexpr):
    """For a tile of edges with ``z = x_l[j] + x_r[i]``: adds the edge features
    (``HAS_EDGE``, COO rows ``cid``) and returns ``(z, ls, ls z, score [E, H])`` with
    ``ls = LeakyReLU'(z)`` (1 or the slope), so ``LeakyReLU(z) = ls z``."""
    if HAS_EDGE:
        z += _gather_rows(edge, cid, hq, m4, H * C).to(ACC)
    ls = tl.where(z > 0, 1.0, slope)
    lz = ls * z
    return z, ls, lz, _channel_sum(lz * a[:, None, :, :])


@kernel_helper
def _target_row_tile(e0, end, offs_e, mask_h, hq, mask_hq, idx, perm, xl, xr_i, a, edge, slope, H, C,
                     HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr):
    """The tile of a target row's edges from position ``e0`` (before ``end``): ``(meh, m4,
    j, cid, x_l[j], ls, ls z, score)`` -- masks of the (edge, head) and (channel, edge,
    head, lane) entries, the sources, the COO edge ids (read only with ``HAS_EDGE`` or
    ``DROPOUT``), the gathered source rows, LeakyReLU' and LeakyReLU of ``z`` and the
    scores."""
    pos = e0 + offs_e
    me = pos < end
    meh = me[:, None] & mask_h[None, :]
    m4 = me[None, :, None, None] & mask_hq[:, None, :, :]
    j = tl.load(idx + pos, mask=me, other=0).to(tl.int64)
    xj = _gather_rows(xl, j, hq, m4, H * C).to(ACC)
    cid = pos
    if HAS_EDGE or DROPOUT:
        cid = tl.load(perm + pos, mask=me, other=0).to(tl.int64)
    z, ls, lz, s = _edge_scores(xj + xr_i[:, None, :, :], a, edge, cid, hq, m4, slope, H, C, HAS_EDGE, ACC)
    return meh, m4, j, cid, xj, ls, lz, s


@kernel_helper
def _edge_grads(alpha, dp, d, keep, scale, DROPOUT: tl.constexpr):
    """Back through dropout and the softmax for a tile of edges: ``(w, ds)`` with ``w``
    the applied coefficient and ``ds = alpha (dP - D)``; ``dp`` is ``g_i . x_l[j]``
    (before the mask), ``keep`` read only with ``DROPOUT``."""
    w = alpha
    if DROPOUT:
        dp = tl.where(keep, dp * scale, 0.0)
        w = tl.where(keep, alpha * scale, 0.0)
    return w, alpha * (dp - d)


# ---------------------------------------------------------------------------- kernels
def _gatv2_fwd_kernel(
    ptr, idx, perm,
    item_row, item_start, item_slot,
    xl, xr, att, edge,
    out, lse,
    part_acc, part_m, part_l,
    seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, CHUNK,
    HAS_ITEMS: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, VEC: tl.constexpr,
    ACC: tl.constexpr,
):
    """One target row (or one chunk of a long row): scores, online softmax, aggregation.
    Each lane keeps its own running maximum, normaliser and accumulator; they are merged
    once, after the row."""
    pid = tl.program_id(0)
    slope = tl.full([], negative_slope, ACC)  # fp64 argument: exact for fp64 inputs
    scale = tl.full([], drop_scale, ACC)
    if DROPOUT:
        seed = tl.load(seed_ptr)
    row, start, end, slot = _work_item(pid, ptr, item_row, item_start, item_slot, CHUNK, HAS_ITEMS)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, hq, mask_hq = _row_tile(H, C, BLOCK_H, BLOCK_Q, VEC)
    xr_i = tl.load(xr + row * (H * C) + hq, mask=mask_hq, other=0.0).to(ACC)
    a = tl.load(att + hq, mask=mask_hq, other=0.0).to(ACC)
    m = tl.full([BLOCK_E, BLOCK_H], float("-inf"), ACC)
    l = tl.zeros([BLOCK_E, BLOCK_H], ACC)
    acc = tl.zeros([BLOCK_Q, BLOCK_E, BLOCK_H, VEC], ACC)
    for e0 in range(start, end, BLOCK_E):
        meh, m4, j, cid, xj, ls, lz, s = _target_row_tile(
            e0, end, offs_e, mask_h, hq, mask_hq, idx, perm, xl, xr_i, a, edge, slope, H, C,
            HAS_EDGE, DROPOUT, ACC,
        )
        # one exponential per edge: exp(m - s) rescales a lane whose maximum grows to s,
        # otherwise exp(s - m) weighs the edge (masked edges: weight 0, no rescale)
        up = meh & (s > m)
        ex = tl.exp(tl.where(meh, tl.where(up, m - s, s - m), float("-inf")))
        rescale = tl.where(up, ex, 1.0)
        pexp = tl.where(up, 1.0, ex)
        m = tl.where(up, s, m)
        l = l * rescale + pexp
        if DROPOUT:
            keep = _dropout_keep(seed, cid, offs_h, H, p_drop, RNG64)
            pexp = tl.where(keep, pexp * scale, 0.0)
        acc = acc * rescale[None, :, :, None] + pexp[None, :, :, None] * xj
    # merge the lanes: m_row = max over lanes, each lane's sums rescaled to it
    m_row = tl.max(m, axis=0)
    f = tl.exp(m - tl.where(m_row == float("-inf"), 0.0, m_row)[None, :])
    l_row = tl.sum(l * f, axis=0)
    acc_row = tl.sum(acc * f[None, :, :, None], axis=1)
    if slot < 0:
        inv = tl.where(l_row > 0, 1.0 / tl.where(l_row > 0, l_row, 1.0), 0.0)
        tl.store(out + row * (H * C) + hq, (acc_row * inv[None, :, None]).to(out.dtype.element_ty), mask=mask_hq)
        lse_row = tl.where(l_row > 0, m_row + tl.log(tl.where(l_row > 0, l_row, 1.0)), 0.0)
        tl.store(lse + row * H + offs_h, lse_row, mask=mask_h)
    else:
        tl.store(part_acc + slot * (H * C) + hq, acc_row, mask=mask_hq)
        tl.store(part_m + slot * H + offs_h, m_row, mask=mask_h)
        tl.store(part_l + slot * H + offs_h, l_row, mask=mask_h)


def _gatv2_bwd_row_kernel(
    ptr, idx, perm,
    item_row, item_start, item_slot,
    xl, xr, att, edge, out, lse, grad_out,
    grad_xr, grad_att, part_xr, part_att, aux, grad_edge, grad_xl,
    seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, CHUNK,
    HAS_ITEMS: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr,
    SCATTER_SRC: tl.constexpr, STORE_AUX: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, VEC: tl.constexpr,
    ACC: tl.constexpr,
):
    """Pass R over a target row: d x_r (row sum of dz), the row's share of d att, d e per
    edge, and (L_i, D_i) for pass C; with SCATTER_SRC also d x_l by atomics ("gas").
    Per-lane sums of ``ds ls`` (d x_r is ``a`` times their total) and ``ds ls z``
    (d att), added over the lanes after the row."""
    pid = tl.program_id(0)
    slope = tl.full([], negative_slope, ACC)
    scale = tl.full([], drop_scale, ACC)
    if DROPOUT:
        seed = tl.load(seed_ptr)
    row, start, end, slot = _work_item(pid, ptr, item_row, item_start, item_slot, CHUNK, HAS_ITEMS)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, hq, mask_hq = _row_tile(H, C, BLOCK_H, BLOCK_Q, VEC)
    xr_i = tl.load(xr + row * (H * C) + hq, mask=mask_hq, other=0.0).to(ACC)
    a = tl.load(att + hq, mask=mask_hq, other=0.0).to(ACC)
    g = tl.load(grad_out + row * (H * C) + hq, mask=mask_hq, other=0.0).to(ACC)
    o = tl.load(out + row * (H * C) + hq, mask=mask_hq, other=0.0).to(ACC)
    lse_i = tl.load(lse + row * H + offs_h, mask=mask_h, other=0.0).to(ACC)
    d = tl.sum(tl.sum(g * o, axis=2), axis=0)
    sum_u = tl.zeros([BLOCK_Q, BLOCK_E, BLOCK_H, VEC], ACC)
    sum_ulz = tl.zeros([BLOCK_Q, BLOCK_E, BLOCK_H, VEC], ACC)
    for e0 in range(start, end, BLOCK_E):
        meh, m4, j, cid, xj, ls, lz, s = _target_row_tile(
            e0, end, offs_e, mask_h, hq, mask_hq, idx, perm, xl, xr_i, a, edge, slope, H, C,
            HAS_EDGE, DROPOUT, ACC,
        )
        alpha = tl.where(meh, tl.exp(s - lse_i[None, :]), 0.0)
        keep = meh  # read only with DROPOUT
        if DROPOUT:
            keep = _dropout_keep(seed, cid, offs_h, H, p_drop, RNG64)
        w, ds = _edge_grads(alpha, _channel_sum(g[:, None, :, :] * xj), d[None, :], keep, scale, DROPOUT)
        ds4 = ds[None, :, :, None]
        u = ds4 * ls  # dz = a u
        sum_u += u
        sum_ulz += ds4 * lz
        if HAS_EDGE:
            tl.store(grad_edge + cid[None, :, None, None] * (H * C) + hq[:, None, :, :], u * a[:, None, :, :],
                     mask=m4)
        if SCATTER_SRC:
            tl.atomic_add(grad_xl + j[None, :, None, None] * (H * C) + hq[:, None, :, :],
                          w[None, :, :, None] * g[:, None, :, :] + u * a[:, None, :, :], mask=m4)
    if STORE_AUX:  # (L_i, D_i) side by side: one gather per edge in pass C
        tl.store(aux + row * (2 * H) + offs_h, lse_i, mask=mask_h)
        tl.store(aux + row * (2 * H) + H + offs_h, d, mask=mask_h)
    dxr = a * tl.sum(sum_u, axis=1)
    datt = tl.sum(sum_ulz, axis=1)
    if slot < 0:
        tl.store(grad_xr + row * (H * C) + hq, dxr, mask=mask_hq)
        tl.store(grad_att + row * (H * C) + hq, datt, mask=mask_hq)
    else:
        tl.store(part_xr + slot * (H * C) + hq, dxr, mask=mask_hq)
        tl.store(part_att + slot * (H * C) + hq, datt, mask=mask_hq)


def _gatv2_bwd_col_kernel(
    ptr, idx, perm,
    item_row, item_start, item_slot,
    xl, xr, att, edge, aux, grad_out,
    grad_xl, part_xl,
    seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, CHUNK,
    HAS_ITEMS: tl.constexpr, HAS_EDGE: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, VEC: tl.constexpr,
    ACC: tl.constexpr,
):
    """Pass C over a source row of the CSC: d x_l_j = sum_i w_ji g_i + a sum_i ds_ji ls_ji
    (per-lane sums, added over the lanes after the row)."""
    pid = tl.program_id(0)
    slope = tl.full([], negative_slope, ACC)
    scale = tl.full([], drop_scale, ACC)
    if DROPOUT:
        seed = tl.load(seed_ptr)
    col, start, end, slot = _work_item(pid, ptr, item_row, item_start, item_slot, CHUNK, HAS_ITEMS)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, hq, mask_hq = _row_tile(H, C, BLOCK_H, BLOCK_Q, VEC)
    xj = tl.load(xl + col * (H * C) + hq, mask=mask_hq, other=0.0).to(ACC)
    a = tl.load(att + hq, mask=mask_hq, other=0.0).to(ACC)
    sum_wg = tl.zeros([BLOCK_Q, BLOCK_E, BLOCK_H, VEC], ACC)
    sum_u = tl.zeros([BLOCK_Q, BLOCK_E, BLOCK_H, VEC], ACC)
    for e0 in range(start, end, BLOCK_E):
        pos = e0 + offs_e
        me = pos < end
        meh = me[:, None] & mask_h[None, :]
        m4 = me[None, :, None, None] & mask_hq[:, None, :, :]
        i = tl.load(idx + pos, mask=me, other=0).to(tl.int64)
        cid = pos  # read only with HAS_EDGE or DROPOUT
        if HAS_EDGE or DROPOUT:
            cid = tl.load(perm + pos, mask=me, other=0).to(tl.int64)
        z = xj[:, None, :, :] + _gather_rows(xr, i, hq, m4, H * C).to(ACC)
        z, ls, lz, s = _edge_scores(z, a, edge, cid, hq, m4, slope, H, C, HAS_EDGE, ACC)
        gi = _gather_rows(grad_out, i, hq, m4, H * C).to(ACC)
        lse_i = tl.load(aux + i[:, None] * (2 * H) + offs_h[None, :], mask=meh, other=0.0)
        d = tl.load(aux + i[:, None] * (2 * H) + H + offs_h[None, :], mask=meh, other=0.0)
        alpha = tl.where(meh, tl.exp(s - lse_i), 0.0)
        keep = meh  # read only with DROPOUT
        if DROPOUT:
            keep = _dropout_keep(seed, cid, offs_h, H, p_drop, RNG64)
        w, ds = _edge_grads(alpha, _channel_sum(gi * xj[:, None, :, :]), d, keep, scale, DROPOUT)
        sum_wg += w[None, :, :, None] * gi
        sum_u += ds[None, :, :, None] * ls
    acc = tl.sum(sum_wg, axis=1) + a * tl.sum(sum_u, axis=1)
    if slot < 0:
        tl.store(grad_xl + col * (H * C) + hq, acc, mask=mask_hq)
    else:
        tl.store(part_xl + slot * (H * C) + hq, acc, mask=mask_hq)


gatv2_fwd_kernel = LazyKernel(_gatv2_fwd_kernel)
gatv2_bwd_row_kernel = LazyKernel(_gatv2_bwd_row_kernel)
gatv2_bwd_col_kernel = LazyKernel(_gatv2_bwd_col_kernel)


# ---------------------------------------------------------------------------- launch
#: Values (edges x heads x channels) in one program's tile: forward, backward (both passes).
FWD_TILE = 1024
BWD_TILE = 512


class _GATv2Config(_Config):
    """The GAT kernels' launch configuration with this module's tiles: one warp, each
    lane holding whole ``[H, C]`` rows as ``BLOCK_Q`` vectors of ``vec`` channels (16
    bytes of the input dtype), ``BLOCK_E`` edges per step: ``FWD_TILE`` /
    ``BWD_TILE`` values, never more edges than a typical row has (at least 16). The
    :func:`~fusegnn.kernels.gat_fused.tuning` overrides apply as to the GAT kernels."""

    def __init__(self, graph, x: Tensor, *args) -> None:
        super().__init__(graph, x, *args)
        self.vec = min(self.block_c, max(16 // x.element_size(), 1))
        self.block_q = self.block_c // self.vec
        width = self.block_h * self.block_c
        by_degree = min(max(next_pow2(math.ceil(graph.avg_degree)), 16), 128)
        self.fwd = _tuned("fwd", Launch(min(by_degree, max(FWD_TILE // width, 2)), 1))
        bwd = Launch(min(by_degree, max(BWD_TILE // width, 2)), 1)
        self.row = _tuned("row", bwd)
        self.col = _tuned("col", bwd)


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
    gatv2_fwd_kernel[(grid,)](
        csr.ptr, csr.index, csr.perm,
        item_row, item_start, item_slot,
        xl, xr, att, edge if edge is not None else xl,
        out, lse, part_acc, part_m, part_l,
        *cfg.rng_args(),
        H, C, cfg.chunk,
        HAS_ITEMS=sched is not None, HAS_EDGE=edge is not None, DROPOUT=cfg.dropout, RNG64=cfg.rng64,
        BLOCK_E=cfg.fwd.block_e, BLOCK_H=cfg.block_h, BLOCK_Q=cfg.block_q, VEC=cfg.vec, ACC=_TL_ACC[cfg.acc],
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
    gatv2_bwd_row_kernel[(grid,)](
        csr.ptr, csr.index, csr.perm,
        item_row, item_start, item_slot,
        xl, xr, att, edge if has_edge else xl, out, lse, grad_out,
        grad_xr, att_rows, part_xr, part_att, aux, grad_edge, grad_xl,
        *cfg.rng_args(), H, C, cfg.chunk,
        HAS_ITEMS=sched_r is not None, HAS_EDGE=has_edge, DROPOUT=cfg.dropout, RNG64=cfg.rng64,
        SCATTER_SRC=scatter, STORE_AUX=not scatter,
        BLOCK_E=cfg.row.block_e, BLOCK_H=cfg.block_h, BLOCK_Q=cfg.block_q, VEC=cfg.vec, ACC=acc_tl,
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
            gatv2_bwd_col_kernel[(grid,)](
                csc.ptr, csc.index, csc.perm,
                item_row, item_start, item_slot,
                xl, xr, att, edge if has_edge else xl, aux, grad_out,
                grad_xl, part_xl,
                *cfg.rng_args(), H, C, cfg.chunk,
                HAS_ITEMS=sched_c is not None, HAS_EDGE=has_edge, DROPOUT=cfg.dropout, RNG64=cfg.rng64,
                BLOCK_E=cfg.col.block_e, BLOCK_H=cfg.block_h, BLOCK_Q=cfg.block_q, VEC=cfg.vec, ACC=acc_tl,
                num_warps=cfg.col.num_warps,
            )
        _combine_sums(sched_c, part_xl, grad_xl)
    # the targets' shares of d att, summed in row order (deterministic)
    grad_att = att_rows.sum(dim=0, keepdim=True)
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
    @once_differentiable
    def backward(ctx, grad_out):  # type: ignore[override]
        x_l, x_r, att, edge, out, lse = ctx.saved_tensors
        gl, gr, ga, ge = gatv2_backward(ctx.cfg, x_l, x_r, att, edge, out, lse, grad_out)
        return gl, gr, ga.reshape(ctx.att_shape), ge, None


def gatv2_config(graph, x_l: Tensor, att: Tensor, negative_slope: float, dropout: float,
                 seed: int | Tensor | None, aggregation: str, chunk: int | None = None) -> _Config:
    """The launch configuration of :func:`gatv2_forward` / :func:`gatv2_backward` (the GAT
    kernels' :class:`~fusegnn.kernels.gat_fused._Config`: tiles by heads, channels and
    average degree, dropout seed as a ``[1]`` tensor; ``seed`` read only with dropout)."""
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {aggregation!r}")
    if chunk is None:
        chunk = _TUNING.get("chunk", DEFAULT_CHUNK)
    seed_t = _seed_tensor(seed, x_l.device) if dropout > 0.0 else None
    return _GATv2Config(graph, x_l, att.dtype, negative_slope, dropout, seed_t, aggregation, chunk)


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
