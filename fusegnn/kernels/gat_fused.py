r"""Fused GAT attention: scores, LeakyReLU, online softmax, dropout and aggregation.

For each head (index dropped), edge :math:`j \to i` and ``p`` the dropout probability:

.. math::
    z_{ji} = s_j + t_i \; (+\, u_{ji}), \quad e_{ji} = \mathrm{LeakyReLU}(z_{ji}), \quad
    \alpha_{ji} = \frac{\exp(e_{ji})}{\sum_{k \to i} \exp(e_{ki})}, \quad
    w_{ji} = \alpha_{ji} \frac{M_{ji}}{1 - p}, \quad
    \mathrm{out}_i = \sum_{j \to i} w_{ji} h_j

with :math:`s` = ``score_src`` ``[N_src, H]``, :math:`t` = ``score_dst`` ``[N_dst, H]``,
:math:`h` ``[N_src, H, C]``, :math:`u` an optional per-edge addend ``score_edge``
``[E, H]`` (COO order; read at each edge's COO id through ``csr.perm`` / ``csc.perm``,
like the dropout counter) and :math:`M_{ji} \in \{0, 1\}` the dropout keep mask.

**Forward** (GAR, one program per target row of ``graph.csr``): a single pass over the
row's edges keeps FlashAttention's running maximum :math:`m`, normaliser :math:`l` and
accumulator :math:`a` per head, rescaling both by :math:`\exp(m_{old} - m_{new})` when the
maximum grows; ``out = a / l`` and the log-sum-exp :math:`L_i = m + \log l` is kept for
the backward. Nothing of size ``E`` is kept. The keep mask is not stored between passes
either: it is defined by a counter-based RNG, one Philox draw (four uniforms) per edge and
group of four heads: head ``h`` keeps where output ``h % 4`` of
``tl.rand4x(seed, coo_edge_id * ceil(H / 4) + h // 4)`` is ``>= p``.
For up to :data:`MAX_BITS_HEADS` heads a pass with small edge tiles
(:data:`BITS_BELOW_EDGES`) first draws it into one byte per edge
in the pass's own (CSR or CSC) order (:meth:`_Config.keep_mask`, ``E`` bytes, freed after
the pass) and reads that contiguously; drawing it inside the pass instead costs a random
draw per edge and head replicated over the lanes of a small edge tile (GATv2 1 x 48 on the
Reddit-sized graph, H100: forward 4.9 ms without dropout, 9.9 ms drawing it).

**Backward.** With :math:`g_i = \partial \mathcal{L} / \partial \mathrm{out}_i` and
:math:`\alpha_{ji} = \exp(e_{ji} - L_i)` recomputed from the stored log-sum-exp:

.. math::
    \frac{\partial \mathcal{L}}{\partial h_j} = \sum_{i} w_{ji} g_i, \qquad
    dP_{ji} = \frac{M_{ji}}{1-p} \, g_i \cdot h_j, \qquad
    dE_{ji} = \alpha_{ji} \big(dP_{ji} - D_i\big), \qquad
    D_i = \sum_{k} \alpha_{ki} dP_{ki} = g_i \cdot \mathrm{out}_i

(FlashAttention-2's identity; it holds with dropout because ``out`` already carries the
mask), then :math:`dZ = dE \cdot (1 \text{ if } z > 0 \text{ else slope})`,
:math:`\partial \mathcal{L} / \partial t_i = \sum_j dZ_{ji}` (row reduction) and
:math:`\partial \mathcal{L} / \partial s_j = \sum_i dZ_{ji}` (column reduction) and, with an
edge addend, :math:`\partial \mathcal{L} / \partial u_{ji} = dZ_{ji}` (written by pass R). When the
attention coefficients :math:`w` are also returned and receive a gradient
:math:`\bar{w}`, :math:`dP` gains :math:`\frac{M}{1-p}\bar{w}` and :math:`D_i` gains
:math:`\sum_k w_{ki} \bar{w}_{ki}`.

Two backwards, by ``aggregation``:

* ``"gar"``: pass R over ``csr`` (targets) computes :math:`\partial t` and :math:`D`;
  pass C over ``csc`` (sources) computes :math:`\partial h` and :math:`\partial s`,
  reading each edge's COO id through ``csc.perm``. No atomics;
* ``"gas"``: pass R alone, scattering :math:`\partial h` and :math:`\partial s` into the
  sources with atomics (no CSC needed).

**Long rows.** Rows longer than ``chunk`` edges (hub nodes) are split into several work
items (:func:`~fusegnn.kernels._edge_utils.chunk_schedule`, cached on the graph), so a
hub does not serialise one program. In the forward each item writes partial
``(m, l, a)`` that a combine kernel merges by the same rescaling; in the backward each
item writes its partial sums and a second kernel adds them in item order. So ``"gar"``
is bitwise reproducible; ``"gas"`` is not (its atomics).

The steps the kernels have in common are device helpers here, shared with the GATv2
kernels (:mod:`fusegnn.kernels.gatv2_fused`): the online softmax (``_softmax_init``,
``_softmax_weights``, ``_softmax_accumulate``, ``_finish_softmax_row``, whose store the
combine kernel uses too), a tile's positions and COO edge ids (``_edge_tile``,
``_coo_ids``) and the backward's keep mask, recomputed coefficients and gradient through
dropout and the softmax (``_tile_keep``, ``_recomputed_alpha``, ``_dropout_softmax_grads``).

Accumulation is in float32 (float64 for float64 inputs); index arithmetic in int64.
The LeakyReLU slope and the dropout scale :math:`1/(1-p)` are passed as float64 kernel
arguments and cast to the accumulation type (Triton passes an unannotated Python float
as float32: for float64 inputs that rounded ``0.2`` to ``0.2000000030`` and cost ~1e-8
relative accuracy on the GPU, while the CPU interpreter kept full precision), so
float64 inputs give float64-accurate results. The dropout threshold ``p`` stays float32:
it is compared with ``tl.rand4x``'s float32 uniforms, which is the mask's definition.
The backward is not itself differentiable (:func:`~fusegnn.kernels._autograd.differentiable_once`: double backward
raises); use the reference composition for higher-order gradients.
"""

from __future__ import annotations

import contextlib
import copy
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from fusegnn.kernels._autograd import differentiable_once

from fusegnn.kernels._edge_utils import ChunkSchedule, acc_dtype, chunk_schedule, padded_channels
from fusegnn.kernels._reductions import column_sum
from fusegnn.kernels._triton import LazyKernel, kernel_helper, next_pow2
from fusegnn.kernels.sddmm import edge_to_node_sum
from fusegnn.sparse.graph import Graph

__all__ = [
    "fused_gat_attention", "attention_config", "attention_forward", "attention_backward", "dropout_keep_mask",
    "padded_channels", "tuning", "GATAttentionFunction", "DEFAULT_CHUNK",
]

#: Longest run of edges one program handles before a row is split into several items.
#: (H200, Reddit-sized graph, forward + backward with single-warp tiles: 512 beat 1024,
#: 2048, 4096 and 8192 by 1-20% at 1 x 16 and 8 x 8, and was within 3% at 1 x 48.)
DEFAULT_CHUNK = 512
_AGGREGATIONS = ("gar", "gas")


# ---------------------------------------------------------------------------- kernels
@kernel_helper
def _work_item(pid, ptr, item_row, item_start, item_slot, CHUNK, HAS_ITEMS: tl.constexpr):
    """``(group, start, end, slot)`` of program ``pid``: a whole CSR row / CSC column
    ``ptr[group]:ptr[group + 1]`` (``slot = -1``: its result is written directly), or,
    with ``HAS_ITEMS``, one chunk of at most ``CHUNK`` edges of a long one, whose partial
    result goes to ``slot`` (see :class:`~fusegnn.kernels._edge_utils.ChunkSchedule`)."""
    if HAS_ITEMS:
        group = tl.load(item_row + pid)
        start = tl.load(item_start + pid)
        slot = tl.load(item_slot + pid)
        end = tl.minimum(start + CHUNK, tl.load(ptr + group + 1))
    else:
        group = pid.to(tl.int64)
        start = tl.load(ptr + group)
        end = tl.load(ptr + group + 1)
        slot = -1
    return group, start, end, slot



@kernel_helper
def _program_start(ptr, item_row, item_start, item_slot, seed_ptr, drop_scale, negative_slope, CHUNK,
                   HAS_ITEMS: tl.constexpr, DROPOUT: tl.constexpr, ACC: tl.constexpr):
    """What each program of a pass over CSR rows / CSC columns starts from: its work item
    ``(group, start, end, slot)`` (:func:`_work_item`), the LeakyReLU slope and the dropout
    scale in ``ACC`` (float64 arguments: exact for float64 inputs), and the dropout seed (one
    int64 read on the device, so that a CUDA graph replays a fresh draw; 0 without dropout)."""
    group, start, end, slot = _work_item(tl.program_id(0), ptr, item_row, item_start, item_slot, CHUNK, HAS_ITEMS)
    seed = tl.full([], 0, tl.int64)
    if DROPOUT:
        seed = tl.load(seed_ptr)
    return group, start, end, slot, tl.full([], negative_slope, ACC), tl.full([], drop_scale, ACC), seed


@kernel_helper
def _head_channels(H, C, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """``(offs_h, mask_h, mask_hc, hc)``: head offsets, the valid heads and (head, channel)
    entries, and the offsets ``hc`` of an ``[H, C]`` row."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    mask_h = offs_h < H
    return offs_h, mask_h, mask_h[:, None] & (offs_c[None, :] < C), offs_h[:, None] * C + offs_c[None, :]

@kernel_helper
def _uniform_of_lane(u0, u1, u2, u3, lane):
    """Output ``lane`` (0-3, elementwise) of a four-output Philox draw."""
    return tl.where(lane == 0, u0, tl.where(lane == 1, u1, tl.where(lane == 2, u2, u3)))


@kernel_helper
def _philox_draw(seed, edge_id, group, H, RNG64: tl.constexpr):
    """The four uniforms (``tl.rand4x``) of the draw that serves heads ``4 group`` to
    ``4 group + 3`` of the edges ``edge_id`` (broadcast against each other): counter
    ``edge_id * ceil(H / 4) + group``, in 32 bits unless ``RNG64``. The one place the
    dropout mask's counter is written: every consumer draws through it."""
    rng = edge_id * ((H + 3) // 4) + group
    if not RNG64:
        rng = rng.to(tl.int32)
    return tl.rand4x(seed, rng)


@kernel_helper
def _dropout_keep(seed, edge_id, offs_h, H, p_drop, RNG64: tl.constexpr):
    """``[E, H]`` whether each (edge, head) survives dropout. One Philox draw
    (:func:`_philox_draw`) gives four uniforms: head ``h`` of the edge with id ``edge_id``
    (its id in the input order) takes output ``h % 4`` of the draw at counter
    ``edge_id * ceil(H / 4) + h // 4``, so the forward, both backward passes,
    :meth:`_Config.keep_mask` and :func:`dropout_keep_mask` regenerate the same mask (with
    one head it is ``tl.rand(seed, edge_id)``)."""
    u0, u1, u2, u3 = _philox_draw(seed, edge_id[:, None], offs_h[None, :] // 4, H, RNG64)
    return _uniform_of_lane(u0, u1, u2, u3, offs_h[None, :] % 4) >= p_drop


@kernel_helper
def _keep(seed, keep_bits, cid, pos, me, offs_h, H, p_drop, RNG64: tl.constexpr, HAS_BITS: tl.constexpr):
    """``[E, H]`` dropout keep mask of a tile of edges at positions ``pos`` of the pass's
    order: read from ``keep_bits`` (one byte per edge in that order, bit ``h`` for head
    ``h``: :meth:`_Config.keep_mask`) with ``HAS_BITS``, else drawn (:func:`_dropout_keep`). Both
    give the same mask; reading it avoids a random draw per edge and head in every pass,
    which small edge tiles make costly (their ``[E, H]`` values are replicated over the
    lanes of the channel axis)."""
    if HAS_BITS:
        b = tl.load(keep_bits + pos, mask=me, other=0).to(tl.int32)
        return ((b[:, None] >> offs_h[None, :]) & 1) != 0
    else:
        return _dropout_keep(seed, cid, offs_h, H, p_drop, RNG64)


@kernel_helper
def _tile_keep(seed, keep_bits, cid, pos, me, meh, offs_h, H, p_drop,
               DROPOUT: tl.constexpr, RNG64: tl.constexpr, HAS_BITS: tl.constexpr):
    """A backward tile's ``[E, H]`` dropout keep mask (:func:`_keep`) with ``DROPOUT``;
    without, ``meh`` (which :func:`_dropout_softmax_grads` then does not read)."""
    keep = meh
    if DROPOUT:
        keep = _keep(seed, keep_bits, cid, pos, me, offs_h, H, p_drop, RNG64, HAS_BITS)
    return keep


@kernel_helper
def _edge_tile(e0, end, offs_e, mask_h):
    """``(pos, me, meh)`` of the tile of edges from position ``e0`` of a row / column that
    ends before ``end``: the positions, which of them are edges, and the valid
    (edge, head) entries."""
    pos = e0 + offs_e
    me = pos < end
    return pos, me, me[:, None] & mask_h[None, :]


@kernel_helper
def _coo_ids(perm, pos, me, DRAW: tl.constexpr, HAS_GALPHA: tl.constexpr, HAS_EDGE: tl.constexpr):
    """The COO edge ids ``perm[pos]`` of the edges at positions ``pos`` of a pass's (CSR /
    CSC) order, read only where something uses them: a dropout mask drawn per edge
    (``DRAW``), the coefficients' gradient (``HAS_GALPHA``) or a per-edge input
    (``HAS_EDGE``); else ``pos``, which is then not read."""
    cid = pos
    if DRAW or HAS_GALPHA or HAS_EDGE:
        cid = tl.load(perm + pos, mask=me, other=0).to(tl.int64)
    return cid


@kernel_helper
def _gat_scores(z, s_edge, cid, meh, offs_h, H, slope, HAS_EDGE: tl.constexpr, ACC: tl.constexpr):
    """For a tile of edges with ``z = s_j + t_i`` ``[E, H]``: adds the edge addend
    ``u[cid]`` (``HAS_EDGE``) and returns ``(z, LeakyReLU(z))``."""
    if HAS_EDGE:
        z += tl.load(s_edge + cid[:, None] * H + offs_h[None, :], mask=meh, other=0.0).to(ACC)
    return z, tl.where(z > 0, z, z * slope)


@kernel_helper
def _gat_target_row_tile(e0, end, offs_e, offs_h, mask_h, idx, perm, s_src, s_edge, t, slope, H,
                         DRAW: tl.constexpr, HAS_GALPHA: tl.constexpr, HAS_EDGE: tl.constexpr, ACC: tl.constexpr):
    """The tile of a target row's edges from position ``e0`` (before ``end``) with the row's
    score ``t`` ``[H]``: ``(pos, me, meh, j, cid, z, LeakyReLU(z))`` -- positions, masks of
    the edges and (edge, head) entries (:func:`_edge_tile`), the sources, the COO edge ids
    (:func:`_coo_ids`) and the scores (:func:`_gat_scores`)."""
    pos, me, meh = _edge_tile(e0, end, offs_e, mask_h)
    j = tl.load(idx + pos, mask=me, other=0).to(tl.int64)
    s = tl.load(s_src + j[:, None] * H + offs_h[None, :], mask=meh, other=0.0).to(ACC)
    z = s + t[None, :]
    cid = _coo_ids(perm, pos, me, DRAW, HAS_GALPHA, HAS_EDGE)
    z, e = _gat_scores(z, s_edge, cid, meh, offs_h, H, slope, HAS_EDGE, ACC)
    return pos, me, meh, j, cid, z, e


@kernel_helper
def _gather_rows(base, j, me, mask_hc, hc, H, C, ACC: tl.constexpr):
    """``[E, H, C]`` rows ``j`` of an ``[N, H, C]`` tensor for a tile of edges (zero outside
    ``me`` and ``mask_hc``), in ``ACC``."""
    return tl.load(
        base + j[:, None, None] * (H * C) + hc[None, :, :],
        mask=me[:, None, None] & mask_hc[None, :, :],
        other=0.0,
    ).to(ACC)


@kernel_helper
def _recomputed_alpha(scores, lse_i, meh):
    """The softmax coefficients ``exp(score - L_i)`` of a tile, recomputed from the stored
    log-sum-exp ``lse_i`` (broadcast to ``[E, H]``); 0 outside ``meh``."""
    return tl.where(meh, tl.exp(scores - lse_i), 0.0)


@kernel_helper
def _dropout_softmax_grads(alpha, dp, d, keep, scale, DROPOUT: tl.constexpr):
    """Back through dropout and the softmax for a tile of edges: ``(w, ds)`` with ``w`` the
    coefficient applied to the messages (alpha, or alpha * keep / (1 - p)) and
    ``ds = alpha (dP - D)``, where ``dp`` is ``dL/d(applied coefficient)``, ``dP`` it
    through the mask and ``d`` the row's ``D``; ``keep`` is read only with ``DROPOUT``."""
    w = alpha
    if DROPOUT:
        dp = tl.where(keep, dp * scale, 0.0)
        w = tl.where(keep, alpha * scale, 0.0)
    return w, alpha * (dp - d)


@kernel_helper
def _score_grads(alpha, dp, d, z, meh, slope, keep, scale, DROPOUT: tl.constexpr):
    """Back through dropout, the softmax and the LeakyReLU for a block of edges:
    ``w`` and ``ds`` of :func:`_dropout_softmax_grads`, and ``dZ = LeakyReLU'(z) ds``,
    zero outside ``meh``."""
    w, ds = _dropout_softmax_grads(alpha, dp, d, keep, scale, DROPOUT)
    dz = tl.where(meh, tl.where(z > 0, ds, ds * slope), 0.0)
    return w, dz


@kernel_helper
def _softmax_init(BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """The online softmax's empty state ``(m, l, acc)``: running maximum ``-inf`` and
    normaliser 0 per head, accumulator ``[H, C]`` of zeros."""
    m = tl.full([BLOCK_H], float("-inf"), ACC)
    l = tl.zeros([BLOCK_H], ACC)
    acc = tl.zeros([BLOCK_H, BLOCK_C], ACC)
    return m, l, acc


@kernel_helper
def _softmax_weights(m, l, scores, meh, seed, keep_bits, cid, pos, me, offs_h, H, p_drop, scale,
                     DROPOUT: tl.constexpr, RNG64: tl.constexpr, HAS_BITS: tl.constexpr):
    """One tile of edges folded into the online softmax of a target row: ``(m, l, rescale,
    p)`` -- the running maximum and normaliser after the tile, the factor
    ``exp(m_old - m_new)`` that rescales what was accumulated before it and the tile's
    unnormalised weights ``exp(score - m_new)`` ``[E, H]`` (``scores`` outside ``meh`` do
    not count), with ``DROPOUT`` masked by the keep mask (:func:`_keep`) and scaled by
    ``scale`` after they were added to ``l``."""
    scores = tl.where(meh, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    rescale = tl.exp(m - m_safe)
    pexp = tl.exp(scores - m_safe[None, :])
    l = l * rescale + tl.sum(pexp, axis=0)
    if DROPOUT:
        keep = _keep(seed, keep_bits, cid, pos, me, offs_h, H, p_drop, RNG64, HAS_BITS)
        pexp = tl.where(keep, pexp * scale, 0.0)
    return m_new, l, rescale, pexp


@kernel_helper
def _softmax_accumulate(acc, rescale, p, rows):
    """The online softmax's accumulator ``[H, C]`` after a tile: the old one rescaled by
    ``rescale`` plus the tile's rows ``[E, H, C]`` weighted by ``p`` ``[E, H]``
    (:func:`_softmax_weights`)."""
    return acc * rescale[:, None] + tl.sum(p[:, :, None] * rows, axis=0)


@kernel_helper
def _store_softmax_row(out, lse, row, m, l, acc, offs_h, mask_h, mask_hc, hc, H, C):
    """Stores a target row's result from its online-softmax state: ``out = acc / l`` and the
    log-sum-exp ``m + log l`` (both 0 for a head without edges, ``l = 0``)."""
    inv = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0)
    tl.store(out + row * (H * C) + hc, (acc * inv[:, None]).to(out.dtype.element_ty), mask=mask_hc)
    lse_row = tl.where(l > 0, m + tl.log(tl.where(l > 0, l, 1.0)), 0.0)
    tl.store(lse + row * H + offs_h, lse_row, mask=mask_h)


@kernel_helper
def _finish_softmax_row(out, lse, part_acc, part_m, part_l, row, slot, m, l, acc, offs_h, mask_h, mask_hc, hc,
                        H, C):
    """The end of a forward program: a whole row's result (``slot < 0``:
    :func:`_store_softmax_row`), or a chunk's partial ``(acc, m, l)`` at ``slot`` for the
    combine kernel."""
    if slot < 0:
        _store_softmax_row(out, lse, row, m, l, acc, offs_h, mask_h, mask_hc, hc, H, C)
    else:
        tl.store(part_acc + slot * (H * C) + hc, acc, mask=mask_hc)
        tl.store(part_m + slot * H + offs_h, m, mask=mask_h)
        tl.store(part_l + slot * H + offs_h, l, mask=mask_h)


def _gat_fwd_kernel(
    ptr, idx, perm,
    item_row, item_start, item_slot,
    h, s_src, s_dst, s_edge,
    out, lse,
    part_acc, part_m, part_l,
    keep_bits, seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, CHUNK,
    HAS_ITEMS: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr, HAS_EDGE: tl.constexpr,
    HAS_BITS: tl.constexpr, DRAW: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """One target row (or one chunk of a long row): online softmax + aggregation."""
    row, start, end, slot, slope, scale, seed = _program_start(
        ptr, item_row, item_start, item_slot, seed_ptr, drop_scale, negative_slope, CHUNK, HAS_ITEMS, DROPOUT, ACC)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, mask_hc, hc = _head_channels(H, C, BLOCK_H, BLOCK_C)
    t = tl.load(s_dst + row * H + offs_h, mask=mask_h, other=0.0).to(ACC)
    m, l, acc = _softmax_init(BLOCK_H, BLOCK_C, ACC)
    for e0 in range(start, end, BLOCK_E):
        pos, me, meh, j, cid, z, e = _gat_target_row_tile(
            e0, end, offs_e, offs_h, mask_h, idx, perm, s_src, s_edge, t, slope, H, DRAW, False, HAS_EDGE, ACC)
        m, l, rescale, pexp = _softmax_weights(m, l, e, meh, seed, keep_bits, cid, pos, me, offs_h, H, p_drop, scale,
                                               DROPOUT, RNG64, HAS_BITS)
        acc = _softmax_accumulate(acc, rescale, pexp, _gather_rows(h, j, me, mask_hc, hc, H, C, ACC))
    _finish_softmax_row(out, lse, part_acc, part_m, part_l, row, slot, m, l, acc, offs_h, mask_h, mask_hc, hc, H, C)


def _gat_combine_kernel(
    split_rows, slot_ptr,
    part_acc, part_m, part_l,
    out, lse,
    H, C,
    BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr,
):
    """Merge the partial (m, l, acc) of the chunks of one long row."""
    pid = tl.program_id(0)
    row = tl.load(split_rows + pid)
    first = tl.load(slot_ptr + pid)
    last = tl.load(slot_ptr + pid + 1)
    offs_h, mask_h, mask_hc, hc = _head_channels(H, C, BLOCK_H, BLOCK_C)
    m, l, acc = _softmax_init(BLOCK_H, BLOCK_C, ACC)
    for slot in range(first, last):
        pm = tl.load(part_m + slot * H + offs_h, mask=mask_h, other=float("-inf"))
        pl = tl.load(part_l + slot * H + offs_h, mask=mask_h, other=0.0)
        pa = tl.load(part_acc + slot * (H * C) + hc, mask=mask_hc, other=0.0)
        m_new = tl.maximum(m, pm)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        r_old = tl.exp(m - m_safe)
        r_new = tl.exp(pm - m_safe)
        l = l * r_old + pl * r_new
        acc = acc * r_old[:, None] + pa * r_new[:, None]
        m = m_new
    _store_softmax_row(out, lse, row, m, l, acc, offs_h, mask_h, mask_hc, hc, H, C)


def _gat_bwd_row_kernel(
    ptr, idx, perm,
    item_row, item_start, item_slot,
    h, s_src, s_dst, s_edge, out, lse, grad_out, d_extra, grad_alpha,
    grad_dst, part_dst, aux_buf, grad_h, grad_src, grad_edge,
    keep_bits, seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, CHUNK, AUX_STRIDE,
    HAS_ITEMS: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr, HAS_EDGE: tl.constexpr,
    HAS_BITS: tl.constexpr, DRAW: tl.constexpr,
    HAS_GALPHA: tl.constexpr, SCATTER_SRC: tl.constexpr, STORE_AUX: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """Pass R over a target row: d score_dst (row sum of dZ) and D (stored with t and lse
    for pass C); with SCATTER_SRC also d h and d score_src by atomics into the sources
    (the "gas" backward); with HAS_EDGE, dZ itself (the gradient of the per-edge score
    addend) at each edge's COO position (every edge lies in exactly one row: no atomics)."""
    row, start, end, slot, slope, scale, seed = _program_start(
        ptr, item_row, item_start, item_slot, seed_ptr, drop_scale, negative_slope, CHUNK, HAS_ITEMS, DROPOUT, ACC)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, mask_hc, hc = _head_channels(H, C, BLOCK_H, BLOCK_C)
    t = tl.load(s_dst + row * H + offs_h, mask=mask_h, other=0.0).to(ACC)
    lse_i = tl.load(lse + row * H + offs_h, mask=mask_h, other=0.0).to(ACC)
    g = tl.load(grad_out + row * (H * C) + hc, mask=mask_hc, other=0.0).to(ACC)
    o = tl.load(out + row * (H * C) + hc, mask=mask_hc, other=0.0).to(ACC)
    d = tl.sum(g * o, axis=1)
    if HAS_GALPHA:
        d += tl.load(d_extra + row * H + offs_h, mask=mask_h, other=0.0).to(ACC)
    dt = tl.zeros([BLOCK_H], ACC)
    for e0 in range(start, end, BLOCK_E):
        pos, me, meh, j, cid, z, e = _gat_target_row_tile(
            e0, end, offs_e, offs_h, mask_h, idx, perm, s_src, s_edge, t, slope, H, DRAW, HAS_GALPHA, HAS_EDGE, ACC)
        alpha = _recomputed_alpha(e, lse_i[None, :], meh)
        hj = _gather_rows(h, j, me, mask_hc, hc, H, C, ACC)
        dp = tl.sum(g[None, :, :] * hj, axis=2)
        if HAS_GALPHA:
            dp += tl.load(grad_alpha + cid[:, None] * H + offs_h[None, :], mask=meh, other=0.0).to(ACC)
        keep = _tile_keep(seed, keep_bits, cid, pos, me, meh, offs_h, H, p_drop, DROPOUT, RNG64, HAS_BITS)
        w, dz = _score_grads(alpha, dp, d[None, :], z, meh, slope, keep, scale, DROPOUT)
        dt += tl.sum(dz, axis=0)
        if HAS_EDGE:
            tl.store(grad_edge + cid[:, None] * H + offs_h[None, :], dz, mask=meh)
        if SCATTER_SRC:
            tl.atomic_add(grad_src + j[:, None] * H + offs_h[None, :], dz, mask=meh)
            tl.atomic_add(
                grad_h + j[:, None, None] * (H * C) + hc[None, :, :],
                w[:, :, None] * g[None, :, :],
                mask=me[:, None, None] & mask_hc[None, :, :],
            )
    if STORE_AUX:  # (t_i, lse_i, D_i) side by side: one gather per edge in pass C
        aux = aux_buf + row * AUX_STRIDE + offs_h
        tl.store(aux, t, mask=mask_h)
        tl.store(aux + H, lse_i, mask=mask_h)
        tl.store(aux + 2 * H, d, mask=mask_h)
    if slot < 0:
        tl.store(grad_dst + row * H + offs_h, dt, mask=mask_h)
    else:
        tl.store(part_dst + slot * H + offs_h, dt, mask=mask_h)


def _gat_bwd_col_kernel(
    ptr, idx, perm,
    item_row, item_start, item_slot,
    h, s_src, s_edge, aux, grad_out, grad_alpha,
    grad_h, grad_src, part_h, part_src,
    keep_bits, seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    H, C, CHUNK, AUX_STRIDE,
    HAS_ITEMS: tl.constexpr, DROPOUT: tl.constexpr, RNG64: tl.constexpr, HAS_EDGE: tl.constexpr,
    HAS_BITS: tl.constexpr, DRAW: tl.constexpr,
    HAS_GALPHA: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    ACC: tl.constexpr,
):
    """Pass C over a source row of the CSC: d h_j = sum_i w_ji g_i, d s_j = sum_i dZ_ji."""
    col, start, end, slot, slope, scale, seed = _program_start(
        ptr, item_row, item_start, item_slot, seed_ptr, drop_scale, negative_slope, CHUNK, HAS_ITEMS, DROPOUT, ACC)
    offs_e = tl.arange(0, BLOCK_E)
    offs_h, mask_h, mask_hc, hc = _head_channels(H, C, BLOCK_H, BLOCK_C)
    s = tl.load(s_src + col * H + offs_h, mask=mask_h, other=0.0).to(ACC)
    hj = tl.load(h + col * (H * C) + hc, mask=mask_hc, other=0.0).to(ACC)
    acc_h = tl.zeros([BLOCK_H, BLOCK_C], ACC)
    acc_s = tl.zeros([BLOCK_H], ACC)
    for e0 in range(start, end, BLOCK_E):
        pos, me, meh = _edge_tile(e0, end, offs_e, mask_h)
        i = tl.load(idx + pos, mask=me, other=0).to(tl.int64)
        ih = aux + i[:, None] * AUX_STRIDE + offs_h[None, :]
        t = tl.load(ih, mask=meh, other=0.0)
        lse_i = tl.load(ih + H, mask=meh, other=0.0)
        d = tl.load(ih + 2 * H, mask=meh, other=0.0)
        z = s[None, :] + t
        cid = _coo_ids(perm, pos, me, DRAW, HAS_GALPHA, HAS_EDGE)
        z, e = _gat_scores(z, s_edge, cid, meh, offs_h, H, slope, HAS_EDGE, ACC)
        alpha = _recomputed_alpha(e, lse_i, meh)
        gi = _gather_rows(grad_out, i, me, mask_hc, hc, H, C, ACC)
        dp = tl.sum(gi * hj[None, :, :], axis=2)
        if HAS_GALPHA:
            dp += tl.load(grad_alpha + cid[:, None] * H + offs_h[None, :], mask=meh, other=0.0).to(ACC)
        keep = _tile_keep(seed, keep_bits, cid, pos, me, meh, offs_h, H, p_drop, DROPOUT, RNG64, HAS_BITS)
        w, dz = _score_grads(alpha, dp, d, z, meh, slope, keep, scale, DROPOUT)
        acc_s += tl.sum(dz, axis=0)
        acc_h += tl.sum(w[:, :, None] * gi, axis=0)
    if slot < 0:
        tl.store(grad_src + col * H + offs_h, acc_s, mask=mask_h)
        tl.store(grad_h + col * (H * C) + hc, acc_h, mask=mask_hc)
    else:
        tl.store(part_src + slot * H + offs_h, acc_s, mask=mask_h)
        tl.store(part_h + slot * (H * C) + hc, acc_h, mask=mask_hc)


def _sum_partials_kernel(
    split_groups, slot_ptr,
    part_a, out_a, WA, part_b, out_b, WB,
    HAS_B: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[group] = sum of the partial rows of a split group's items, in item order
    (deterministic, unlike atomics). Two (partials, output, width) pairs per launch."""
    pid = tl.program_id(0)
    group = tl.load(split_groups + pid)
    first = tl.load(slot_ptr + pid)
    last = tl.load(slot_ptr + pid + 1)
    offs = tl.arange(0, BLOCK)
    for w0 in range(0, WA, BLOCK):
        mw = w0 + offs < WA
        acc = tl.zeros([BLOCK], out_a.dtype.element_ty)
        for slot in range(first, last):
            acc += tl.load(part_a + slot * WA + w0 + offs, mask=mw, other=0.0)
        tl.store(out_a + group * WA + w0 + offs, acc, mask=mw)
    if HAS_B:
        for w0 in range(0, WB, BLOCK):
            mw = w0 + offs < WB
            acc = tl.zeros([BLOCK], out_b.dtype.element_ty)
            for slot in range(first, last):
                acc += tl.load(part_b + slot * WB + w0 + offs, mask=mw, other=0.0)
            tl.store(out_b + group * WB + w0 + offs, acc, mask=mw)


def _gat_alpha_kernel(
    src, dst, s_src, s_dst, s_edge, lse, alpha,
    seed_ptr, p_drop, drop_scale: tl.float64, negative_slope: tl.float64,
    E, H,
    DROPOUT: tl.constexpr, RNG64: tl.constexpr, HAS_EDGE: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, ACC: tl.constexpr,
):
    """Edge-parallel (COO order): the coefficients actually applied, w = alpha * M / (1-p)."""
    pid = tl.program_id(0)
    slope = tl.full([], negative_slope, ACC)  # fp64 argument: exact for fp64 inputs
    scale = tl.full([], drop_scale, ACC)
    if DROPOUT:  # one int64 on the device: a CUDA graph replays a fresh draw
        seed = tl.load(seed_ptr)
    eid = pid.to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H)
    me = eid < E
    meh = me[:, None] & (offs_h[None, :] < H)
    j = tl.load(src + eid, mask=me, other=0).to(tl.int64)
    i = tl.load(dst + eid, mask=me, other=0).to(tl.int64)
    s = tl.load(s_src + j[:, None] * H + offs_h[None, :], mask=meh, other=0.0).to(ACC)
    t = tl.load(s_dst + i[:, None] * H + offs_h[None, :], mask=meh, other=0.0).to(ACC)
    lse_i = tl.load(lse + i[:, None] * H + offs_h[None, :], mask=meh, other=0.0).to(ACC)
    z = s + t
    if HAS_EDGE:
        z += tl.load(s_edge + eid[:, None] * H + offs_h[None, :], mask=meh, other=0.0).to(ACC)
    e = tl.where(z > 0, z, z * slope)
    a = tl.exp(e - lse_i)
    if DROPOUT:
        a = tl.where(_dropout_keep(seed, eid, offs_h, H, p_drop, RNG64), a * scale, 0.0)
    tl.store(alpha + eid[:, None] * H + offs_h[None, :], a.to(alpha.dtype.element_ty), mask=meh)


def _keep_mask_kernel(keep, seed_ptr, p_drop, E, H, RNG64: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_H: tl.constexpr):
    """The dropout keep mask the fused kernels regenerate (:func:`_dropout_keep`),
    materialised (for tests): rows ``[BLOCK_E]`` of the ``[E, H]`` mask, COO edge order."""
    pid = tl.program_id(0)
    seed = tl.load(seed_ptr)
    edges = pid.to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, BLOCK_H)
    k = _dropout_keep(seed, edges, offs_h, H, p_drop, RNG64)
    m = (edges < E)[:, None] & (offs_h < H)[None, :]
    tl.store(keep + edges[:, None] * H + offs_h[None, :], k.to(tl.int8), mask=m)


def _keep_bits_kernel(perm, bits, seed_ptr, p_drop, E, H, RNG64: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_G: tl.constexpr):
    """``bits[pos]``: bit ``h`` set where (edge ``perm[pos]``, head ``h``) survives dropout
    (:func:`_dropout_keep`'s mask), for the edges of one CSR / CSC order in that order. Each
    Philox draw here serves four heads (``BLOCK_G`` draws per edge, ``ceil(H / 4)`` used)."""
    pid = tl.program_id(0)
    seed = tl.load(seed_ptr)
    pos = pid.to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    me = pos < E
    cid = tl.load(perm + pos, mask=me, other=0).to(tl.int64)
    group = tl.arange(0, BLOCK_G)[None, :]
    first = group * 4  # the first head of each draw
    u0, u1, u2, u3 = _philox_draw(seed, cid[:, None], group, H, RNG64)
    b = ((u0 >= p_drop) & (first < H)).to(tl.int32) << first
    b |= ((u1 >= p_drop) & (first + 1 < H)).to(tl.int32) << (first + 1)
    b |= ((u2 >= p_drop) & (first + 2 < H)).to(tl.int32) << (first + 2)
    b |= ((u3 >= p_drop) & (first + 3 < H)).to(tl.int32) << (first + 3)
    tl.store(bits + pos, tl.sum(b, axis=1).to(tl.uint8), mask=me)


def _node_scores_kernel(h, att_src, att_dst, scores, N, H, C,
                        BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr):
    """``scores[0, n, k] = <h[n, k], att_src[k]>``, ``scores[1, n, k] = <h[n, k], att_dst[k]>``
    for a block of ``BLOCK_N`` nodes: one read of ``h``, sums over the channels in ``ACC``."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h, mask_h, mask_hc, hc = _head_channels(H, C, BLOCK_H, BLOCK_C)
    a_s = tl.load(att_src + hc, mask=mask_hc, other=0.0).to(ACC)
    a_t = tl.load(att_dst + hc, mask=mask_hc, other=0.0).to(ACC)
    m3 = (rows < N)[:, None, None] & mask_hc[None, :, :]
    x = tl.load(h + rows[:, None, None] * (H * C) + hc[None, :, :], mask=m3, other=0.0).to(ACC)
    out = rows[:, None] * H + offs_h[None, :]
    m2 = (rows < N)[:, None] & mask_h[None, :]
    tl.store(scores + out, tl.sum(x * a_s[None, :, :], axis=2).to(scores.dtype.element_ty), mask=m2)
    tl.store(scores + N * H + out, tl.sum(x * a_t[None, :, :], axis=2).to(scores.dtype.element_ty), mask=m2)


gat_fwd_kernel = LazyKernel(_gat_fwd_kernel)
node_scores_kernel = LazyKernel(_node_scores_kernel)
gat_combine_kernel = LazyKernel(_gat_combine_kernel)
gat_bwd_row_kernel = LazyKernel(_gat_bwd_row_kernel)
gat_bwd_col_kernel = LazyKernel(_gat_bwd_col_kernel)
gat_alpha_kernel = LazyKernel(_gat_alpha_kernel)
keep_mask_kernel = LazyKernel(_keep_mask_kernel)
keep_bits_kernel = LazyKernel(_keep_bits_kernel)
sum_partials_kernel = LazyKernel(_sum_partials_kernel)


# ---------------------------------------------------------------------------- launch
_TL_ACC = {torch.float32: tl.float32, torch.float64: tl.float64}


class Launch(NamedTuple):
    """Edges per step ``block_e`` and ``num_warps`` of one kernel's launch."""

    block_e: int
    num_warps: int


class BlockSizes(NamedTuple):
    """Register tiles of the three edge-streaming kernels: the forward (pass over
    ``csr``), backward pass R (``csr``) and backward pass C (``csc``)."""

    block_h: int
    block_c: int
    fwd: Launch
    row: Launch
    col: Launch


#: Values (edges x heads x channels) in one program's tile: forward, backward with one
#: head, backward with several heads.
FWD_TILE = 2048
BWD_TILE = 512
BWD_TILE_MULTIHEAD = 256


def _block_sizes(heads: int, channels: int, avg_degree: float) -> BlockSizes:
    """The tiles and warps of each kernel for ``heads`` x ``channels`` and a graph of
    average degree ``avg_degree``.

    Each program holds a full head x channel tile of ``block_e`` edges, never more
    edges than a typical row has (at least 16, so short rows are not all padding):

    * forward: ``FWD_TILE`` values, **one warp**;
    * backward, one head: ``BWD_TILE`` values, one warp (the backward keeps four such
      tiles live: h, grad_out and two products);
    * backward, several heads: ``BWD_TILE_MULTIHEAD`` values over four warps (its
      per-head reductions over few channels spread thin).

    These gathers are latency bound: many small single-warp programs per SM keep more
    row loads in flight than few wide ones. Measured on an H200 on a Reddit-sized graph
    (115M edges, dropout 0.6), forward + backward of the op, against the former
    128-edge (2048-value) tiles of 4-8 warps: 1 head x 16 channels 13.8 -> 6.9 ms,
    1 x 48 60 -> 25 ms, 8 x 8 222 -> ~83 ms; a GAT training step of 1 x 16 heads
    29.9 -> 16.1 ms (logs of the retired tile sweeps:
    ``benchmarks/results/agg/raw/tiles-nvidia-h200.log`` and ``tiles2-nvidia-h200.log``).
    """
    block_h, block_c = next_pow2(heads), next_pow2(channels)
    width = block_h * block_c
    fwd = tile_launch(FWD_TILE, width, avg_degree)
    if block_h == 1:
        bwd = tile_launch(BWD_TILE, width, avg_degree)
    else:
        bwd = tile_launch(BWD_TILE_MULTIHEAD, width, avg_degree, warps=4)
    return BlockSizes(block_h, block_c, fwd, bwd, bwd)


def tile_launch(values: int, width: int, avg_degree: float, warps: int = 1, least: int = 2) -> Launch:
    """The launch of a pass whose tiles hold about ``values`` values of ``width`` (padded
    heads x channels) per edge: ``values / width`` edges a step, at least ``least``, and
    never more than a typical row has (the average degree's power of two, kept within
    16..128, so short rows are not all padding)."""
    by_degree = min(max(next_pow2(math.ceil(avg_degree)), 16), 128)
    return Launch(min(by_degree, max(values // width, least)), warps)


#: most heads whose dropout keep mask the passes read as bits of one byte per edge
#: (:meth:`_Config.keep_mask`); more heads draw it in every pass
MAX_BITS_HEADS = 8
#: a pass reads the keep mask as bits only when its tiles have fewer edges than this. With
#: 32 edges or more a tile's ``[E, H]`` draw already spans a warp's lanes: GAT 1 x 16 on
#: the Reddit-sized graph (tiles of 128 / 32 / 32 edges, H100, dropout 0.6) took 7.1 ms
#: forward + backward drawing it and 7.2 ms reading bits (and 73 MiB more peak memory in a
#: training step), where GAT 1 x 48 (tiles of 8 edges in the backward) went from 25.9 to
#: 18.4 ms and GATv2 1 x 48 (8 / 8 / 4) from 37.1 to 28.2 ms.
BITS_BELOW_EDGES = 32
#: Philox draws per program of the keep-mask draw (edges per program: this over the draws
#: per edge, ceil(H / 4), within 128-1,024). With one draw per (edge, head) and 1,024
#: edges per program a mask of 8 heads took 9.8 us on PubMed's 108k edges (106 programs,
#: fewer than an H100 has SMs) and 4.0 ms on the Reddit-sized graph; 256 edges per program
#: took 5.0 us and 2.9 ms; with one head 1,024 edges stayed best (Reddit-sized: 0.40 ms
#: against 0.54 at 256). With four heads per draw (512 edges per program at 8 heads) the
#: 8-head mask takes 2.8 us and 1.09 ms. H100, session 16 (``benchmarks/NOTES-overhead.md``).
KEEP_BITS_DRAWS = 1024

_TUNING: dict = {}
_KERNELS = ("fwd", "row", "col")


@contextlib.contextmanager
def tuning(
    *,
    block_e: int | None = None,
    num_warps: int | None = None,
    chunk: int | None = None,
    fwd: tuple[int, int] | None = None,
    row: tuple[int, int] | None = None,
    col: tuple[int, int] | None = None,
):
    """Override the launch parameters of the fused GAT kernels inside the block (for
    benchmark sweeps): edges per step ``block_e`` (a power of two) and ``num_warps`` of
    every kernel, or ``(block_e, num_warps)`` of one kernel (``fwd``, backward pass
    ``row`` or ``col``; these win over the shared values), and the default ``chunk``
    (longest run of edges per work item)."""

    def check(key: str, value: int, pow2: bool) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
        if pow2 and value & (value - 1):
            raise ValueError(f"{key} must be a power of two, got {value}")
        return value

    previous = dict(_TUNING)
    try:
        for key, value in (("block_e", block_e), ("num_warps", num_warps), ("chunk", chunk)):
            if value is not None:
                _TUNING[key] = check(key, value, key != "chunk")
        for key, value in (("fwd", fwd), ("row", row), ("col", col)):
            if value is not None:
                if not isinstance(value, (tuple, list)) or len(value) != 2:
                    raise ValueError(f"{key} must be a pair (block_e, num_warps), got {value!r}")
                _TUNING[key] = Launch(check(f"{key}[0]", value[0], True), check(f"{key}[1]", value[1], True))
    except Exception:
        _TUNING.clear()
        _TUNING.update(previous)
        raise
    try:
        yield
    finally:
        _TUNING.clear()
        _TUNING.update(previous)


def _tuned(kernel: str, default: Launch) -> Launch:
    if kernel in _TUNING:
        return _TUNING[kernel]
    return Launch(_TUNING.get("block_e", default.block_e), _TUNING.get("num_warps", default.num_warps))


def _rng64(num_edges: int, heads: int) -> bool:
    """Philox counters (``edge * ceil(H / 4) + head // 4``, below ``E * H``) take 64 bits
    once ``E * H`` reaches 2**31 (a different but equally valid random stream; forward and
    backward always agree)."""
    return num_edges * heads >= 2**31


def _schedule(graph: Graph, which: str, chunk: int) -> ChunkSchedule | None:
    comp = graph.csr if which == "csr" else graph.csc
    return graph.cached(f"fusegnn.gat.schedule.{which}.{chunk}", lambda: chunk_schedule(comp.ptr, chunk), structural=True)


def _items(schedule: ChunkSchedule | None, ptr: Tensor, num_groups: int):
    """(grid, item_row, item_start, item_slot) for a launch over groups or items."""
    if schedule is None:
        return num_groups, ptr, ptr, ptr
    return schedule.item_group.numel(), schedule.item_group, schedule.item_start, schedule.item_slot


def _partials(schedule: ChunkSchedule | None, shape: tuple[int, ...], dtype, device, dummy: Tensor) -> Tensor:
    """Buffer for the partial results of split groups' items (``dummy`` when none)."""
    if schedule is None or schedule.num_slots == 0:
        return dummy
    return torch.empty((schedule.num_slots,) + shape, dtype=dtype, device=device)


def _combine_sums(schedule: ChunkSchedule | None, part_a: Tensor, out_a: Tensor,
                  part_b: Tensor | None = None, out_b: Tensor | None = None) -> None:
    """Sum the partials of every split group into its output row(s)."""
    if schedule is None or schedule.split_groups.numel() == 0:
        return
    wa = out_a[0].numel()
    wb = out_b[0].numel() if out_b is not None else 0
    block = min(next_pow2(max(wa, wb)), 1024)
    sum_partials_kernel[(schedule.split_groups.numel(),)](
        schedule.split_groups, schedule.slot_ptr,
        part_a, out_a, wa,
        part_b if part_b is not None else part_a, out_b if out_b is not None else out_a, wb,
        HAS_B=out_b is not None, BLOCK=block,
    )


class _Config:
    """Everything a launch needs besides the tensors (shared by forward and backward)."""

    def __init__(self, graph: Graph, h: Tensor, scores_dtype: torch.dtype, negative_slope: float,
                 p: float, seed: Tensor | None, aggregation: str, chunk: int) -> None:
        self.graph = graph
        self.heads, self.channels = h.size(1), h.size(2)
        self.negative_slope = float(negative_slope)
        self.p = float(p)
        self.dropout = self.p > 0.0
        self.drop_scale = 1.0 / (1.0 - self.p) if self.dropout else 1.0
        self.seed = seed  # [1] int64 on the device (None without dropout)
        self.aggregation = aggregation
        self.chunk = int(chunk)
        self.rng64 = _rng64(graph.num_edges, self.heads)
        self.acc = acc_dtype(torch.promote_types(h.dtype, scores_dtype))
        sizes = _block_sizes(self.heads, self.channels, graph.avg_degree)
        self.block_h, self.block_c = sizes.block_h, sizes.block_c
        self.fwd = _tuned("fwd", sizes.fwd)
        self.row = _tuned("row", sizes.row)
        self.col = _tuned("col", sizes.col)

    def keep_mask(self, order: str, launch: Launch, dummy: Tensor) -> tuple[Tensor, dict]:
        """``(keep_bits argument, constexprs HAS_BITS / DRAW)`` of the pass over ``graph.csr``
        (``order="csr"``) or ``graph.csc`` launched with ``launch``. With dropout, up to
        :data:`MAX_BITS_HEADS` heads and tiles of fewer than :data:`BITS_BELOW_EDGES` edges,
        the keep mask of the order's edges, drawn here into one byte per edge in that order
        (bit ``h``: head ``h``), for the pass to read (:func:`_keep`); else ``dummy`` and the
        pass draws the mask itself (or has no dropout). Drawn afresh per call from the device
        seed, so a CUDA graph replay gets a fresh mask too."""
        if (not self.dropout or self.heads > MAX_BITS_HEADS or launch.block_e >= BITS_BELOW_EDGES
                or self.graph.num_edges == 0):
            return dummy, {"HAS_BITS": False, "DRAW": self.dropout}
        comp = self.graph.csr if order == "csr" else self.graph.csc
        num_edges = self.graph.num_edges
        bits = torch.empty(num_edges, dtype=torch.uint8, device=comp.perm.device)
        draws = max(1, self.block_h // 4)  # Philox draws per edge (four heads each)
        block = max(128, min(1024, KEEP_BITS_DRAWS // draws))
        keep_bits_kernel[(triton.cdiv(num_edges, block),)](
            comp.perm, bits, self.seed, self.p, num_edges, self.heads,
            RNG64=self.rng64, BLOCK_E=block, BLOCK_G=draws,
        )
        return bits, {"HAS_BITS": True, "DRAW": False}

    def rng_args(self):
        seed = self.seed if self.seed is not None else self.graph.edge_index  # not read
        return seed, self.p, self.drop_scale, self.negative_slope


def _forward(cfg: _Config, h: Tensor, s_src: Tensor, s_dst: Tensor, s_edge: Tensor | None = None) -> tuple[Tensor, Tensor]:
    graph = cfg.graph
    n_dst, H, C = graph.num_dst_nodes, cfg.heads, cfg.channels
    out = torch.empty((n_dst, H, C), dtype=h.dtype, device=h.device)
    lse = torch.empty((n_dst, H), dtype=cfg.acc, device=h.device)
    csr = graph.csr
    sched = _schedule(graph, "csr", cfg.chunk)
    grid, item_row, item_start, item_slot = _items(sched, csr.ptr, n_dst)
    if sched is not None and sched.num_slots > 0:
        part_acc = torch.empty((sched.num_slots, H, C), dtype=cfg.acc, device=h.device)
        part_m = torch.empty((sched.num_slots, H), dtype=cfg.acc, device=h.device)
        part_l = torch.empty((sched.num_slots, H), dtype=cfg.acc, device=h.device)
    else:
        part_acc = part_m = part_l = lse
    bits, keep_flags = cfg.keep_mask("csr", cfg.fwd, lse)
    gat_fwd_kernel[(grid,)](
        csr.ptr, csr.index, csr.perm,
        item_row, item_start, item_slot,
        h, s_src, s_dst, s_edge if s_edge is not None else s_src, out, lse,
        part_acc, part_m, part_l,
        bits, *cfg.rng_args(),
        H, C, cfg.chunk,
        HAS_ITEMS=sched is not None, DROPOUT=cfg.dropout, RNG64=cfg.rng64, HAS_EDGE=s_edge is not None, **keep_flags,
        BLOCK_E=cfg.fwd.block_e, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ACC=_TL_ACC[cfg.acc],
        num_warps=cfg.fwd.num_warps,
    )
    if sched is not None and sched.split_groups.numel() > 0:
        gat_combine_kernel[(sched.split_groups.numel(),)](
            sched.split_groups, sched.slot_ptr, part_acc, part_m, part_l, out, lse,
            H, C, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ACC=_TL_ACC[cfg.acc],
        )
    return out, lse


def _alpha(cfg: _Config, s_src: Tensor, s_dst: Tensor, lse: Tensor, s_edge: Tensor | None = None) -> Tensor:
    graph = cfg.graph
    E, H = graph.num_edges, cfg.heads
    alpha = torch.empty((E, H), dtype=s_src.dtype, device=s_src.device)
    block_e = max(16, min(256, 2048 // cfg.block_h))
    gat_alpha_kernel[(triton.cdiv(E, block_e),)](
        graph.src, graph.dst, s_src, s_dst, s_edge if s_edge is not None else s_src, lse, alpha,
        *cfg.rng_args(), E, H,
        DROPOUT=cfg.dropout, RNG64=cfg.rng64, HAS_EDGE=s_edge is not None, BLOCK_E=block_e, BLOCK_H=cfg.block_h,
        ACC=_TL_ACC[cfg.acc],
    )
    return alpha


def _backward(cfg: _Config, h, s_src, s_dst, out, lse, grad_out, alpha, grad_alpha, s_edge=None):
    """``(grad_h, grad_src, grad_dst, grad_edge or None)`` in the accumulation dtype;
    ``grad_edge`` ``[E, H]`` (COO order) is dZ, the gradient of the per-edge addend
    ``s_edge`` (given only with it)."""
    graph = cfg.graph
    dev = h.device
    H, C = cfg.heads, cfg.channels
    n_src, n_dst = graph.num_src_nodes, graph.num_dst_nodes
    acc_tl = _TL_ACC[cfg.acc]
    has_galpha = grad_alpha is not None
    if has_galpha:
        grad_alpha = grad_alpha.contiguous()
        # D_i gains sum_k w_ki * grad_w_ki (w: the returned, post-dropout coefficients).
        # (a row sum over the CSR: deterministic, no atomics)
        d_extra = edge_to_node_sum(graph, alpha.to(cfg.acc) * grad_alpha.to(cfg.acc), "dst")
    else:
        d_extra = grad_alpha = lse
    scatter = cfg.aggregation == "gas"
    csr = graph.csr
    sched_r = _schedule(graph, "csr", cfg.chunk)
    grid, item_row, item_start, item_slot = _items(sched_r, csr.ptr, n_dst)
    grad_dst = torch.empty((n_dst, H), dtype=cfg.acc, device=dev)
    part_dst = _partials(sched_r, (H,), cfg.acc, dev, lse)
    # pass C gathers (t_i, lse_i, D_i) per edge: one row of 3H values, padded to 16 bytes
    aux_stride = -(-3 * H // 4) * 4
    aux = torch.empty((n_dst, aux_stride), dtype=cfg.acc, device=dev) if not scatter else lse
    if scatter:
        grad_h = torch.zeros((n_src, H, C), dtype=cfg.acc, device=dev)
        grad_src = torch.zeros((n_src, H), dtype=cfg.acc, device=dev)
    else:
        grad_h = grad_src = lse
    has_edge = s_edge is not None
    # every edge lies in one CSR row, so pass R writes each dZ once (no zero fill needed)
    grad_edge = torch.empty((graph.num_edges, H), dtype=cfg.acc, device=dev) if has_edge else None
    bits, keep_flags = cfg.keep_mask("csr", cfg.row, lse)
    gat_bwd_row_kernel[(grid,)](
        csr.ptr, csr.index, csr.perm,
        item_row, item_start, item_slot,
        h, s_src, s_dst, s_edge if has_edge else s_src, out, lse, grad_out, d_extra, grad_alpha,
        grad_dst, part_dst, aux, grad_h, grad_src, grad_edge if has_edge else lse,
        bits, *cfg.rng_args(), H, C, cfg.chunk, aux_stride,
        HAS_ITEMS=sched_r is not None, DROPOUT=cfg.dropout, RNG64=cfg.rng64, HAS_EDGE=has_edge, **keep_flags,
        HAS_GALPHA=has_galpha, SCATTER_SRC=scatter, STORE_AUX=not scatter,
        BLOCK_E=cfg.row.block_e, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ACC=acc_tl,
        num_warps=cfg.row.num_warps,
    )
    _combine_sums(sched_r, part_dst, grad_dst)
    if not scatter:
        csc = graph.csc
        sched_c = _schedule(graph, "csc", cfg.chunk)
        grid, item_row, item_start, item_slot = _items(sched_c, csc.ptr, n_src)
        grad_h = torch.empty((n_src, H, C), dtype=cfg.acc, device=dev)
        grad_src = torch.empty((n_src, H), dtype=cfg.acc, device=dev)
        part_h = _partials(sched_c, (H, C), cfg.acc, dev, lse)
        part_src = _partials(sched_c, (H,), cfg.acc, dev, lse)
        if n_src > 0:
            del bits  # the CSR mask: freed before the CSC one is drawn
            bits, keep_flags = cfg.keep_mask("csc", cfg.col, lse)
            gat_bwd_col_kernel[(grid,)](
                csc.ptr, csc.index, csc.perm,
                item_row, item_start, item_slot,
                h, s_src, s_edge if has_edge else s_src, aux, grad_out, grad_alpha,
                grad_h, grad_src, part_h, part_src,
                bits, *cfg.rng_args(), H, C, cfg.chunk, aux_stride,
                HAS_ITEMS=sched_c is not None, DROPOUT=cfg.dropout, RNG64=cfg.rng64, HAS_EDGE=has_edge, **keep_flags,
                HAS_GALPHA=has_galpha,
                BLOCK_E=cfg.col.block_e, BLOCK_H=cfg.block_h, BLOCK_C=cfg.block_c, ACC=acc_tl,
                num_warps=cfg.col.num_warps,
            )
        _combine_sums(sched_c, part_h, grad_h, part_src, grad_src)
    return grad_h, grad_src, grad_dst, grad_edge


def attention_forward(cfg: _Config, h: Tensor, s_src: Tensor, s_dst: Tensor, return_alpha: bool,
                      s_edge: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The fused attention's forward as a plain function (what :class:`GATAttentionFunction`
    and the ``torch.library`` op run): ``(out, lse, alpha or None)`` for contiguous inputs,
    ``h`` at the padded width of ``cfg`` (:func:`attention_config`), ``s_edge`` the optional
    ``[E, H]`` per-edge score addend (COO order). ``out`` keeps that width; ``lse`` is the
    per-target log-sum-exp the backward reads."""
    graph = cfg.graph
    if graph.num_edges == 0 or graph.num_dst_nodes == 0:  # no edges: every output row is zero
        out = h.new_zeros((graph.num_dst_nodes, cfg.heads, cfg.channels))
        lse = torch.zeros((graph.num_dst_nodes, cfg.heads), dtype=cfg.acc, device=h.device)
        return out, lse, (s_src.new_zeros((graph.num_edges, cfg.heads)) if return_alpha else None)
    out, lse = _forward(cfg, h, s_src, s_dst, s_edge)
    return out, lse, (_alpha(cfg, s_src, s_dst, lse, s_edge) if return_alpha else None)


def attention_backward(cfg: _Config, h: Tensor, s_src: Tensor, s_dst: Tensor, out: Tensor, lse: Tensor,
                       grad_out: Tensor, alpha: Tensor | None, grad_alpha: Tensor | None,
                       s_edge: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The fused attention's backward as a plain function: ``(grad_h, grad_score_src,
    grad_score_dst, grad_score_edge)`` in the inputs' dtypes (the last ``None`` without
    ``s_edge``), from the forward's ``out`` and ``lse`` (``alpha`` and its gradient
    ``grad_alpha`` when the coefficients were returned and received one). Arguments as
    :func:`attention_forward` gave and took them."""
    graph = cfg.graph
    if graph.num_edges == 0 or graph.num_dst_nodes == 0:
        grad_edge = torch.zeros_like(s_edge) if s_edge is not None else None
        return torch.zeros_like(h), torch.zeros_like(s_src), torch.zeros_like(s_dst), grad_edge
    grad_h, grad_src, grad_dst, grad_edge = _backward(
        cfg, h, s_src, s_dst, out, lse, grad_out.contiguous(), alpha, grad_alpha, s_edge
    )
    if grad_edge is not None:
        grad_edge = grad_edge.to(s_edge.dtype)
    return grad_h.to(h.dtype), grad_src.to(s_src.dtype), grad_dst.to(s_dst.dtype), grad_edge


class GATAttentionFunction(torch.autograd.Function):
    """Autograd for :func:`fused_gat_attention` (inputs already validated/contiguous):
    :func:`attention_forward` and :func:`attention_backward`. ``s_edge`` may be ``None``."""

    @staticmethod
    def forward(ctx, h, s_src, s_dst, s_edge, cfg: _Config, return_alpha: bool):
        ctx.set_materialize_grads(False)  # an unused output (e.g. alpha) gets no gradient
        out, lse, alpha = attention_forward(cfg, h, s_src, s_dst, return_alpha, s_edge)
        ctx.cfg = cfg
        ctx.save_for_backward(h, s_src, s_dst, s_edge, out, lse, alpha)
        if return_alpha:
            return out, alpha
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_out, grad_second):
        h, s_src, s_dst, s_edge, out, lse, alpha = ctx.saved_tensors
        grad_alpha = grad_second if alpha is not None else None
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        grads = attention_backward(ctx.cfg, h, s_src, s_dst, out, lse, grad_out, alpha, grad_alpha, s_edge)
        return (*grads, None, None)


def _seed_tensor(seed: int | Tensor | None, device: torch.device) -> Tensor:
    """The dropout seed as a ``[1]`` int64 tensor on ``device``, which the kernels read.

    ``None`` draws it there from torch's generator of that device (``torch.manual_seed``
    fixes it; on CUDA the draw is a kernel, so a captured CUDA graph draws a new seed at
    every replay instead of baking one in). An int is written with a fill kernel (no
    host-to-device copy, so it is capture-safe too)."""
    if seed is None:
        return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device)
    if isinstance(seed, Tensor):
        if seed.numel() != 1 or seed.dtype.is_floating_point or seed.dtype == torch.bool:
            raise ValueError(f"seed tensor must hold one integer, got {seed.dtype} of shape {tuple(seed.shape)}")
        return seed.reshape(1).to(device=device, dtype=torch.int64)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
        raise ValueError(f"seed must be an int in [0, 2**31), got {seed!r}")
    return torch.full((1,), seed, dtype=torch.int64, device=device)


def fused_gat_attention(
    graph: Graph,
    h: Tensor,
    score_src: Tensor,
    score_dst: Tensor,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    *,
    seed: int | Tensor | None = None,
    return_alpha: bool = False,
    aggregation: str = "gar",
    chunk: int | None = None,
    score_edge: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    r"""Fused GAT attention ``out_i = sum_j w_ji h_j`` (see the module docstring).

    Args:
        graph: the graph (edges ``j -> i``); bipartite graphs are fine.
        h: ``[N_src, H, C]`` source features.
        score_src: ``[N_src, H]`` per-source scores :math:`a_s \cdot h_j`.
        score_dst: ``[N_dst, H]`` per-target scores :math:`a_t \cdot h_i`.
        negative_slope: LeakyReLU slope.
        dropout: probability ``p`` of dropping a coefficient (0 disables dropout); kept
            coefficients are scaled by ``1 / (1 - p)``.
        seed: the dropout RNG seed (an int in ``[0, 2**31)`` or a one-element integer
            tensor); drawn on ``h``'s device from torch's generator when ``None`` (a
            kernel on CUDA: capture-safe, a new seed at every CUDA-graph replay). The
            keep mask of a given seed is :func:`dropout_keep_mask`.
        return_alpha: also return the ``[E, H]`` coefficients actually applied
            (post-dropout), in COO edge order; they are differentiable.
        aggregation: ``"gar"`` (two-pass backward over CSR and CSC) or ``"gas"`` (one-pass
            backward with atomics into the sources).
        chunk: longest run of edges one program handles; longer rows are split
            (default :data:`DEFAULT_CHUNK`, or the value set by :func:`tuning`).
        score_edge: optional ``[E, H]`` per-edge score addend :math:`u_{ji}` in COO edge
            order (``z_ji = s_j + t_i + u_ji``; e.g. GAT's edge-feature term
            :math:`a_e \cdot W_e e_{ji}`), read at each edge's COO position through the
            CSR / CSC permutations. Its gradient is :math:`dZ`.

    Returns:
        ``(out [N_dst, H, C], alpha [E, H] or None)``. Inputs must be contiguous, on the
        same device, floating (fp16/bf16/fp32/fp64).
    """
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {aggregation!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    score_src, score_dst = score_src.contiguous(), score_dst.contiguous()
    if score_edge is not None:
        score_edge = score_edge.contiguous()
    cfg, h, channels = attention_config(graph, h, score_src, negative_slope, dropout, seed, aggregation, chunk)
    out, second = GATAttentionFunction.apply(h, score_src, score_dst, score_edge, cfg, return_alpha)
    if h.size(-1) != channels:
        out = out[..., :channels]
    return out, (second if return_alpha else None)


def attention_config(graph: Graph, h: Tensor, score_src: Tensor, negative_slope: float, dropout: float,
                     seed: int | Tensor | None, aggregation: str,
                     chunk: int | None = None) -> tuple[_Config, Tensor, int]:
    """``(launch configuration, h contiguous at the kernels' padded width, h's own width)``
    for :func:`attention_forward` / :func:`attention_backward` (arguments as for
    :func:`fused_gat_attention`, assumed valid; ``seed`` is read only with dropout)."""
    if chunk is None:
        chunk = _TUNING.get("chunk", DEFAULT_CHUNK)
    h = h.contiguous()
    channels = h.size(2) if h.dim() == 3 else 0
    padded = padded_channels(channels)
    if padded != channels:  # aligned rows: see padded_channels
        h = torch.nn.functional.pad(h, (0, padded - channels))
    seed_t = _seed_tensor(seed, h.device) if dropout > 0.0 else None
    cfg = _Config(graph, h, score_src.dtype, negative_slope, dropout, seed_t, aggregation, chunk)
    return cfg, h, channels


# ---------------------------------------------------------------------------- layer
def _layer_config(graph: Graph, h: Tensor, negative_slope: float, p: float, aggregation: str, chunk: int) -> _Config:
    """The launch configuration of a GAT layer's attention, built once per graph and
    (heads, channels, dtype, slope, dropout, aggregation, chunk) and cached on the graph;
    each call copies it to attach its dropout seed."""
    key = (h.size(1), h.size(2), h.dtype, negative_slope, p, aggregation, chunk, tuple(_TUNING.items()))
    memo = graph.cached("fusegnn.gat.layer_configs", dict, structural=True)
    cfg = memo.get(key)
    if cfg is None:
        shape = h.new_empty((0, h.size(1), padded_channels(h.size(2))))  # the kernels' padded width
        cfg = memo[key] = _Config(graph, shape, h.dtype, negative_slope, p, None, aggregation, chunk)
    return cfg


#: ``h`` values (nodes x padded heads x padded channels) per program of the node-scores kernel
NODE_SCORES_TILE = 2048


def node_scores(h: Tensor, att_src: Tensor, att_dst: Tensor, acc: torch.dtype) -> Tensor:
    r"""``[2, N, H]`` in ``h``'s dtype: :math:`s_{nk} = \langle h_{nk}, a^{(k)}_s \rangle` and
    :math:`t_{nk} = \langle h_{nk}, a^{(k)}_t \rangle` for contiguous ``h`` ``[N, H, C]`` and
    ``att_src`` / ``att_dst`` ``[1, H, C]``, summed in ``acc`` by one kernel that reads ``h``
    once -- what ``(h * att).sum(-1)`` for both vectors computes with four passes over a
    ``[2, N, H, C]`` product (PubMed 8 x 8 on an H100: 25 us; ``benchmarks/NOTES-overhead.md``,
    session 16), and without a GEMM (which TF32 matmul precision would round)."""
    n, heads, channels = h.shape
    scores = torch.empty((2, n, heads), dtype=h.dtype, device=h.device)
    if n == 0 or heads == 0:
        return scores
    block_h, block_c = next_pow2(heads), next_pow2(channels)
    block_n = max(1, NODE_SCORES_TILE // (block_h * block_c))
    node_scores_kernel[(triton.cdiv(n, block_n),)](
        h, att_src.contiguous(), att_dst.contiguous(), scores, n, heads, channels,
        BLOCK_N=block_n, BLOCK_H=block_h, BLOCK_C=block_c, ACC=_TL_ACC[acc],
    )
    return scores


def _attention_vector_grads(grad_src: Tensor, grad_dst: Tensor, h: Tensor) -> Tensor:
    r"""``[2, H, C]``: :math:`\partial \mathcal{L} / \partial a_{hc} = \sum_n
    \partial_{s_{nh}} h_{nhc}` for the source and target score vectors (``grad_src``,
    ``grad_dst`` ``[N, H]``, ``h`` ``[N, H, C]``, one dtype). One product over the nodes,
    :math:`[2H, N] \times [N, HC]`, whose head-diagonal blocks are the sums: H times the
    needed multiply-adds, but one cuBLAS call (split over ``N``) where a broadcast
    product and a reduction over the node dimension wrote ``[2, N, H, C]`` first (H100,
    PubMed, 8 x 8: 16 against 31 us; 8 x 16: 18 against 40; ``benchmarks/NOTES-overhead.md``,
    session 16). Under TF32 matmul precision this product runs in TF32, as the layer's
    linear map does; under ``torch.use_deterministic_algorithms(True)`` the broadcast form
    runs (cuBLAS would need ``CUBLAS_WORKSPACE_CONFIG``)."""
    n, heads, channels = h.shape
    if torch.are_deterministic_algorithms_enabled():  # cuBLAS would need CUBLAS_WORKSPACE_CONFIG
        return (torch.stack((grad_src, grad_dst)).unsqueeze(-1) * h.unsqueeze(0)).sum(1)
    full = torch.cat((grad_src, grad_dst), dim=1).t() @ h.reshape(n, heads * channels)  # [2H, HC]
    return full.view(2, heads, heads, channels).diagonal(dim1=1, dim2=2).permute(0, 2, 1)


class GATLayerFunction(torch.autograd.Function):
    r"""The sparse part of a GAT layer as one autograd node: scores from the attention
    vectors, the fused attention, the head epilogue and the bias.

    .. math::
        s_j = \langle h_j, a_s \rangle_c, \quad t_i = \langle h_i, a_t \rangle_c, \quad
        o_i = \sum_{j \to i} \alpha_{ji} h_j, \quad
        y_i = \big\Vert_k o^{(k)}_i + b \;\text{ or }\; \tfrac1H \sum_k o^{(k)}_i + b

    ``apply(h [N, H, C], att_src [1, H, C], att_dst [1, H, C], bias or None,
    score_edge [E, H] or None, cfg, concat)`` -> ``[N, H C]`` (``concat``) or ``[N, C]``;
    ``score_edge`` is the per-edge score addend (its gradient is the kernels' dZ).
    Backward: the fused kernels give
    :math:`\partial L / \partial h` through the aggregation and :math:`\partial L / \partial s`,
    :math:`\partial L / \partial t`; then
    :math:`\partial L / \partial h_j \mathrel{+}= \partial_{s_j} a_s + \partial_{t_j} a_t` and
    :math:`\partial L / \partial a_s = \sum_j \partial_{s_j} h_j` (likewise :math:`a_t`).
    """

    @staticmethod
    def forward(ctx, h, att_src, att_dst, bias, score_edge, cfg: _Config, concat: bool):  # type: ignore[override]
        graph = cfg.graph
        n_dst, H, C = graph.num_dst_nodes, h.size(1), h.size(2)
        scores = node_scores(h, att_src, att_dst, cfg.acc)  # [2, N, H]
        s_src, s_dst = scores[0], scores[1]
        padded = padded_channels(C)
        hp = torch.nn.functional.pad(h, (0, padded - C)) if padded != C else h
        if graph.num_edges == 0 or n_dst == 0:
            out = hp.new_zeros((n_dst, H, padded))
            lse = torch.zeros((n_dst, H), dtype=cfg.acc, device=h.device)
        else:
            out, lse = _forward(cfg, hp, s_src, s_dst, score_edge)
        res = out[..., :C] if padded != C else out
        res = res.reshape(n_dst, H * C) if concat else res.mean(dim=1)
        if bias is not None:
            res = res + bias
        ctx.cfg, ctx.concat, ctx.padded = cfg, concat, padded
        ctx.save_for_backward(h, hp, att_src, att_dst, s_src, s_dst, score_edge, out, lse)
        return res

    @staticmethod
    @differentiable_once
    def backward(ctx, grad_res):  # type: ignore[override]
        h, hp, att_src, att_dst, s_src, s_dst, score_edge, out, lse = ctx.saved_tensors
        cfg: _Config = ctx.cfg
        n, H, C = h.shape
        grad_bias = column_sum(grad_res) if ctx.needs_input_grad[3] else None
        g = grad_res.view(-1, H, C) if ctx.concat else (grad_res / H).unsqueeze(1).expand(-1, H, C)
        if ctx.padded != C:
            g = torch.nn.functional.pad(g, (0, ctx.padded - C))
        g = g.contiguous()
        if cfg.graph.num_edges == 0 or cfg.graph.num_dst_nodes == 0:
            grad_h = torch.zeros(hp.shape, dtype=cfg.acc, device=h.device)
            grad_src = grad_dst = torch.zeros((n, H), dtype=cfg.acc, device=h.device)
            grad_edge = torch.zeros_like(score_edge) if score_edge is not None else None
        else:
            grad_h, grad_src, grad_dst, grad_edge = _backward(cfg, hp, s_src, s_dst, out, lse, g, None, None, score_edge)
        if ctx.padded != C:
            grad_h = grad_h[..., :C]
        # dL/dh_j += dL/ds_j a_s + dL/dt_j a_t, in place on the kernels' fresh gradient
        grad_h = grad_h.addcmul_(grad_src.unsqueeze(-1), att_src).addcmul_(grad_dst.unsqueeze(-1), att_dst)
        grad_att_src = grad_att_dst = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_att = _attention_vector_grads(grad_src, grad_dst, h.to(cfg.acc))  # [2, H, C]
            grad_att_src = grad_att[0].unsqueeze(0).to(att_src.dtype)
            grad_att_dst = grad_att[1].unsqueeze(0).to(att_dst.dtype)
        if grad_edge is not None:
            grad_edge = grad_edge.to(score_edge.dtype)
        return grad_h.to(h.dtype), grad_att_src, grad_att_dst, grad_bias, grad_edge, None, None


def fused_gat_layer(
    graph: Graph,
    h: Tensor,
    att_src: Tensor,
    att_dst: Tensor,
    bias: Tensor | None,
    *,
    concat: bool,
    negative_slope: float,
    dropout: float,
    aggregation: str = "gar",
    score_edge: Tensor | None = None,
) -> Tensor:
    """A GAT layer's sparse part through the fused kernels (:class:`GATLayerFunction`):
    ``h`` ``[N, H, C]``, attention vectors ``[1, H, C]``, ``bias`` ``[H C]`` (``concat``)
    or ``[C]``, ``score_edge`` ``[E, H]`` (COO order) or ``None``; inputs checked by the
    caller."""
    if aggregation not in _AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {_AGGREGATIONS}, got {aggregation!r}")
    cfg = _layer_config(graph, h, float(negative_slope), float(dropout), aggregation, _TUNING.get("chunk", DEFAULT_CHUNK))
    if cfg.dropout:
        cfg = copy.copy(cfg)
        cfg.seed = _seed_tensor(None, h.device)
    if score_edge is not None:
        score_edge = score_edge.contiguous()
    return GATLayerFunction.apply(h.contiguous(), att_src, att_dst, bias, score_edge, cfg, concat)


def dropout_keep_mask(num_edges: int, heads: int, p: float, seed: int | Tensor,
                      device: torch.device | str) -> Tensor:
    """The ``[E, H]`` boolean keep mask (COO edge order) that the fused kernels use for
    dropout probability ``p`` and ``seed`` -- the same counter-based stream, materialised.

    Lets tests compare against the unfused reference with exactly the same mask.
    """
    keep = torch.empty((num_edges, heads), dtype=torch.int8, device=device)
    if num_edges * heads:
        block_h = next_pow2(heads)
        block_e = max(1, 1024 // block_h)
        keep_mask_kernel[(triton.cdiv(num_edges, block_e),)](
            keep, _seed_tensor(seed, keep.device), float(p), num_edges, heads, RNG64=_rng64(num_edges, heads),
            BLOCK_E=block_e, BLOCK_H=block_h,
        )
    return keep.bool()
