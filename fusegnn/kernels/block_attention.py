r"""Fused block-sparse attention (FlashAttention-2 style), forward and backward.

For every batch ``b``, head ``h``, query ``i`` and key ``j``, with the boolean mask
:math:`M^{(h)}` of a :class:`~fusegnn.attention.block_layout.BlockLayout` (per head, or one
shared by all heads) and :math:`s` = ``scale`` (default :math:`1/\sqrt{D}`):

.. math::
    S_{ij} = s \, q_i \cdot k_j, \qquad
    P_{ij} = \frac{M_{ij} \exp(S_{ij})}{\sum_{j'} M_{ij'} \exp(S_{ij'})}, \qquad
    \mathrm{out}_i = \sum_j P_{ij} v_j

and :math:`\mathrm{out}_i = 0` for a row with no allowed key (never NaN).

**Forward** (one program per query block row and ``(b, h)``): the program walks the
non-empty key blocks of its row from the block-CSR index (``row_ptr``/``col_idx``) and
keeps FlashAttention's running maximum :math:`m`, normaliser :math:`l` and accumulator
:math:`a` in float32, rescaling them by :math:`2^{m_{old} - m_{new}}` when the maximum
grows (logits are kept in base 2: :math:`S \log_2 e`; for ``scale > 0`` the running maximum
is taken over the unscaled products and scaled once per row, so each score costs one fused
multiply-add before :math:`2^x`). As in FlexAttention, each row's
blocks are visited in two loops: first its partial blocks, which load their element
pattern (stored once per distinct pattern in ``patterns``; when every pattern of the
layout is a diagonal band ``lo <= i - j <= hi`` -- windows, causal, Longformer and BigBird
-- the kernels test ``i - j`` against the pattern's ``(lo, hi)`` instead of loading it),
then its full blocks
(``pattern_id == -1``), which use no element mask at all (the kernels' copy of the index
lists each row's partial blocks first and records where its full blocks start). Keys ``>= L_k`` are always masked (last
block column of a length that is not a multiple of ``BN``); rows ``>= L_q`` are computed
but never stored. The base-2 log-sum-exp :math:`\mathrm{lse}_i = m_i + \log_2 l_i`
(``+inf`` for empty rows) is stored for the backward.

**Backward** (FlashAttention-2, deterministic, no atomics). With
:math:`dO = \partial\mathcal{L}/\partial\mathrm{out}` and :math:`P` recomputed from the
stored log-sum-exp, :math:`P_{ij} = M_{ij} 2^{S_{ij}\log_2 e - \mathrm{lse}_i}`:

.. math::
    \Delta_i = dO_i \cdot \mathrm{out}_i, \quad
    dV_j = \sum_i P_{ij} \, dO_i, \quad
    dS_{ij} = P_{ij} \big(dO_i \cdot v_j - \Delta_i\big), \quad
    dQ_i = s \sum_j dS_{ij} k_j, \quad
    dK_j = s \sum_i dS_{ij} q_i.

Two kernels, launched in this order: ``_bwd_dq`` (one program per query block row over
the forward index; it first computes :math:`\Delta` of its rows from ``dO`` and ``out``
and stores it) and ``_bwd_dkdv`` (one program per key block column, walking the query
blocks of the transposed index ``col_ptr``/``row_idx`` with ``t_block`` pointing back to
each block's forward id, hence its pattern; it reads :math:`\Delta`, and takes each
``BM``-row block in sub-tiles of ``SUB_M`` rows, :attr:`LaunchConfig.dkdv_sub_m`;
``_bwd_dq`` likewise takes each ``BN``-key block in sub-tiles of ``SUB_N`` keys,
:attr:`LaunchConfig.dq_sub_n`). When
only ``k`` / ``v`` need a gradient, ``_bwd_preprocess`` computes :math:`\Delta` instead of
``_bwd_dq``. Masked elements and empty rows (:math:`\mathrm{lse} = +\infty`) give
:math:`P = 0`, so they contribute no gradient.

**Dilation** (``dilation=d > 1``): the sequences are ``d`` interleaved sub-sequences
(token ``t`` is position ``t // d`` of sub-sequence ``r = t % d``), each attending within
itself by the layout (then over ``ceil(L / d)`` positions). Every kernel row is one
``(b, h, r)``; its tiles are read and written at token addresses ``r + d * position``
(strided rows: nothing is copied), its statistics stored per token. With ``d = 1`` the
compiler folds all of this away.

**Scheduling.** A row whose block count exceeds twice the mean (a global token's row in
BigBird / Longformer masks, which visits every key block) would otherwise start late in
the grid and finish alone. Programs are numbered so that the heavy rows of every
``(b, h)`` run first (heaviest first), then the light rows ``(b, h)``-major with the block
row fastest (neighbouring rows of one head share key blocks in L2). The order is
computed on the device once per layout (:func:`prepare_layout`, with the partial-first
copy of the index; the layout keeps it, ``layout.prepared(device)``); the same is done for
key block columns in ``_bwd_dkdv``.

**Host work per call.** The launch arguments that do not change between calls (the
layout's arrays, strides, sizes, constexprs, the launch configuration) are computed once
per call signature -- shapes, strides, dtype, 16-byte alignment, scale -- and kept with the
layout's prepared arrays (:attr:`PreparedLayout.plans`); a repeated call allocates its
outputs and relaunches the compiled kernels through :mod:`fusegnn.kernels._launch`,
without Triton's per-call binder (short calls are bound by host time:
``benchmarks/NOTES-attention.md``).

**The layout** is a :class:`~fusegnn.attention.block_layout.BlockLayout` (or any object
with its fields) whose ``prepared(device)`` returns :func:`prepare_layout` of it on
``device``, built once and kept by the layout: this module never imports the layout's
package.

**N:M sparsity** (``nm=(N, M)``, DFSS; :mod:`fusegnn.kernels.nm_sparsity`): of every
``M`` consecutive keys of a row (groups aligned to multiples of ``M``), only the ``N``
largest allowed scores take part in the softmax (ties to the lower key index; masked
scores and padding keys ``>= L_k`` are never kept; a group with fewer than ``N`` allowed
scores keeps them all). The kernels load each key tile (``BN`` keys, or a sub-tile;
multiples of ``M``) in the *N:M order*: tile column ``r * (BN / M) + g`` holds key
``g * M + r``, so column chunk ``r`` is every group's ``r``-th member. Splitting the
score tile into its ``M`` chunks moves no data (the chunks differ in the tile's highest
column bits, which the MMA accumulator layout keeps in each thread's registers), and
every score's rank in its group -- the others greater, plus the others equal at a lower
index -- is a few elementwise comparisons of chunks; scores of rank ``>= N`` get
probability 0. (A ``[rows, groups, M]`` reshape with an ``M x M`` broadcast instead
moved every tile through shared memory and spilled: 3-20x the time of the kernel
without N:M on an H100, issue 19.) Each kernel selects on a tile of its own shape --
the forward on ``BM x BN``, ``_bwd_dq`` on ``BM x SUB_N``, ``_bwd_dkdv`` on ``SUB_M x BN``
-- and takes the N:M order and the chunks only where that tile has at least
``NM_MIN_ROWS`` (64) rows and chunks of at least ``NM_MIN_CHUNK`` (8) columns
(:func:`nm_chunk_path`, decided on the host and passed as the constexpr ``NM_CHUNKS``,
which picks both the key order and the selection); other tiles keep the key order and
that reshape (16-bit inputs gave grossly wrong outputs on an H100 through the chunk
path on 16-row tiles, even with 8-column chunks). The N:M order changes
nothing else: ``K``, ``V``, ``dK`` and ``dV`` rows are read and written at their own
addresses, and the products with ``V`` sum over the same keys. The forward's online
softmax runs over the kept scores (its log-sum-exp is theirs), and both backward kernels
recompute the same selection from the same float32 products (``q . k``, queries x keys
as in the forward -- ``_bwd_dkdv`` too, transposing its probabilities for the products
with ``dO`` and ``q`` -- scaled first when ``scale <= 0``), so dropped scores get no
gradient; nothing is stored. Not with ``dilation > 1`` (the groups are in absolute key
index, which a dilated tile interleaves).

dtypes: float16, bfloat16, float32 (float32 accumulation; float32 inputs use TF32 tensor
cores when ``torch.get_float32_matmul_precision() != "highest"``, IEEE otherwise, or as
chosen by ``allow_tf32``). Any head dim (padded to a power of two >= 16 inside; 32, 64
and 128 are the tuned ones). The layout's ``BM``/``BN`` are the kernel's tile sizes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import Tensor

from fusegnn.kernels._env import env_flag
from fusegnn.kernels._triton import BLOCK_ATTENTION_DTYPES, LazyKernel, interpreter_enabled, kernel_helper, next_pow2
from fusegnn.kernels._launch import launch as fast_launch
from fusegnn.kernels.attention_inputs import check_qkv, check_scale
from fusegnn.kernels.nm_sparsity import check_nm

__all__ = [
    "BlockSparseAttentionFunction",
    "LaunchConfig",
    "PreparedLayout",
    "block_sparse_attention",
    "block_sparse_attention_lse",
    "block_sparse_attention_prechecked",
    "launch_config",
    "nm_chunk_path",
    "nm_paths",
    "nm_selection_tiles",
    "prepare_layout",
    "SUPPORTED_DTYPES",
]

SUPPORTED_DTYPES = BLOCK_ATTENTION_DTYPES
_LOG2E = 1.4426950408889634

try:  # triton is an optional dependency; the kernels below need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None


# --------------------------------------------------------------------------------------
# Device helpers (jitted with the kernels, see kernel_helper)
# --------------------------------------------------------------------------------------


@kernel_helper
def _scheduled_block(sched, BH, NB):
    """``(bh, block)`` of this program: the ``n_heavy = sched[0]`` heavy blocks (rows or
    columns) of every ``(b, h)`` first, ``bh`` fastest; then the other blocks,
    ``bh``-major, in the order ``sched[1 + n_heavy:]`` (module doc, *Scheduling*)."""
    pid_flat = tl.program_id(0)
    n_heavy = tl.load(sched)
    heavy_work = n_heavy * BH
    is_heavy = pid_flat < heavy_work
    n_light = tl.maximum(NB - n_heavy, 1)
    rest = tl.maximum(pid_flat - heavy_work, 0)
    bh = tl.where(is_heavy, pid_flat % BH, rest // n_light)
    block = tl.load(sched + 1 + tl.where(is_heavy, pid_flat // BH, n_heavy + rest % n_light))
    return bh, block


@kernel_helper
def _program_heads(bh, H, NHL, R: tl.constexpr):
    """``(bhh, b, h, h_l, r)`` of kernel row ``bh = (b * H + h) * R + r``: the
    ``(b, h)`` pair ``bhh``, its batch and head (int64), the layout's head ``h_l`` (``h``,
    or 0 for a shared layout) and the residue ``r`` of a dilated call (0 when ``R == 1``:
    the compiler folds it away)."""
    r = bh % R
    bhh = bh // R
    b = (bhh // H).to(tl.int64)
    h = (bhh % H).to(tl.int64)
    h_l = bhh % H % NHL
    return bhh, b, h, h_l, r


@kernel_helper
def _residue_tokens(offs, r, L, R: tl.constexpr):
    """``(tokens, valid)``: the positions ``offs`` of residue ``r``'s sub-sequence as
    token indices ``r + R * offs`` (int32), and whether they lie in it (``< ceil((L - r) / R)``,
    i.e. the token ``< L``)."""
    tokens = r + offs * R
    return tokens, tokens < L


@kernel_helper
def _block_span(ptr, split_ptr, h_l, NB, block):
    """``(start, split, end)`` of a block row (column) of layout head ``h_l``: its partial
    blocks are ``start:split``, its full blocks ``split:end``."""
    start = tl.load(ptr + h_l * (NB + 1) + block)
    split = tl.load(split_ptr + h_l * NB + block)
    end = tl.load(ptr + h_l * (NB + 1) + block + 1)
    return start, split, end


@kernel_helper
def _phase_blocks(PHASE: tl.constexpr, start, split, end):
    """``(lo, hi)``: the block positions of phase 0 (partial blocks, ``start:split``) or
    phase 1 (full blocks, ``split:end``) of a block row (column)."""
    if PHASE == 0:
        lo = start
        hi = split
    else:
        lo = split
        hi = end
    return lo, hi


@kernel_helper
def _mask_block(x, pattern_ptrs, band_ptr, rows, cols, key_valid, fill: tl.constexpr, PARTIAL: tl.constexpr,
                EVEN_K: tl.constexpr, BANDS: tl.constexpr):
    """``x`` (scores or probabilities of one block or sub-tile) where the block allows it,
    else ``fill``: for a partial block its element pattern and the key bound
    ``key_valid``; for a full block only the key bound, and only for a ragged last block
    column (``not EVEN_K``). The pattern is read at ``pattern_ptrs`` (the shape of ``x``),
    or, when every pattern of the layout is a diagonal band (``BANDS``), it is
    ``lo <= i - j <= hi`` with ``(lo, hi)`` at ``band_ptr``, tested as
    ``i - hi <= j <= i - lo`` on the tile's in-block rows ``i`` and columns ``j``
    (broadcastable vectors ``rows``, ``cols``: no element load, and no tile-sized
    index kept live across the loop)."""
    if PARTIAL:
        if BANDS:
            lo = tl.load(band_ptr)
            hi = tl.load(band_ptr + 1)
            keep = (cols >= rows - hi) & (cols <= rows - lo)
        else:
            keep = tl.load(pattern_ptrs) != 0
        x = tl.where(keep & key_valid, x, fill)
    else:
        if not EVEN_K:
            x = tl.where(key_valid, x, fill)
    return x


@kernel_helper
def _nm_key_order(COLS: tl.constexpr, NM_M: tl.constexpr, NM_CHUNKS: tl.constexpr):
    """``[COLS]`` int32: the key (offset in an ``M``-aligned run of ``COLS`` keys) held by
    each position of a tile in the *N:M order*: position ``c = r * (COLS / M) + g`` holds
    key ``g * M + r``, member ``r`` of group ``g``. Chunk ``r`` of the tile (positions
    ``r * COLS / M`` onwards) is then every group's ``r``-th member: a group's scores sit
    at the same place of ``M`` equally shaped chunks. The identity for ``NM_M = 0`` and
    for kernels whose selection tile takes the key-order path (``NM_CHUNKS`` false, see
    :func:`nm_chunk_path`; the same flag picks :func:`_nm_keep`'s path)."""
    c = tl.arange(0, COLS)
    if NM_M > 0:
        if NM_CHUNKS:
            c = (c % (COLS // NM_M)) * NM_M + c // (COLS // NM_M)
    return c


@kernel_helper
def _halves(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``(x[:, :COLS/2], x[:, COLS/2:])`` of a ``[ROWS, COLS]`` tile. The split is on the
    highest column bit, which the MMA accumulator layout keeps in each thread's own
    registers (for ``COLS / 2 >= 8``): no data moves between threads."""
    return tl.split(tl.permute(tl.reshape(x, (ROWS, 2, COLS // 2)), (0, 2, 1)))


@kernel_helper
def _joined(a, b, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The ``[ROWS, COLS]`` tile whose halves are ``a`` and ``b`` (inverse of :func:`_halves`)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (ROWS, COLS))


@kernel_helper
def _first(a, b):
    """int32 1 where ``a`` outranks ``b``, ``a``'s key being the lower index: ``a >= b``."""
    return (a >= b).to(tl.int32)


@kernel_helper
def _ranks4(c0, c1, c2, c3):
    """The ranks of 4 same-shaped score tiles ``c0..c3`` (members ``r = 0..3`` of the same
    groups) among the 4: the others greater, or equal at a lower index."""
    f01 = _first(c0, c1)
    f02 = _first(c0, c2)
    f03 = _first(c0, c3)
    f12 = _first(c1, c2)
    f13 = _first(c1, c3)
    f23 = _first(c2, c3)
    return 3 - f01 - f02 - f03, 2 + f01 - f12 - f13, 1 + f02 + f12 - f23, f03 + f13 + f23


@kernel_helper
def _majority(a, b, c):
    """Where at least 2 of the booleans ``a, b, c`` hold."""
    return (a & b) | (c & (a | b))


@kernel_helper
def _outranking(x, a, b, c, d):
    """How many of ``a, b, c, d`` are ``<= x``: with ``x`` at the lower key index, the
    ones ``x`` outranks."""
    return _first(x, a) + _first(x, b) + _first(x, c) + _first(x, d)


@kernel_helper
def _outranked(x, a, b, c, d):
    """How many of ``a, b, c, d`` (keys at lower indices than ``x``'s) outrank ``x``."""
    return _first(a, x) + _first(b, x) + _first(c, x) + _first(d, x)


@kernel_helper
def _nm_keep(s, NM_N: tl.constexpr, NM_M: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
             NM_CHUNKS: tl.constexpr):
    """bool ``[ROWS, COLS]``: whether each score of the tile ``s`` (columns in the order
    of :func:`_nm_key_order` with the same ``NM_CHUNKS``) is among the ``NM_N`` largest
    of its group of ``NM_M`` keys: :func:`_nm_keep_chunks` where the tile is in the N:M
    order (``NM_CHUNKS``), else :func:`_nm_keep_grouped` (key order)."""
    if NM_CHUNKS:
        keep = _nm_keep_chunks(s, NM_N, NM_M, ROWS, COLS)
    else:
        keep = _nm_keep_grouped(s, NM_N, NM_M, ROWS, COLS)
    return keep


@kernel_helper
def _nm_keep_grouped(s, NM_N: tl.constexpr, NM_M: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """bool ``[ROWS, COLS]``: whether each score of the tile ``s``, whose columns are in
    key order, is among the ``NM_N`` largest of its group of ``NM_M`` consecutive keys.
    The tile is reshaped to ``[ROWS, groups, M]`` and a score's rank (the others in its
    group that are greater, or equal at a lower key index) counted through an
    ``[ROWS, groups, M, M]`` broadcast: slow (shared memory, spills), but the selection
    that ran correctly on sm_90 with tiles of any shape; for the tiles
    :func:`nm_chunk_path` refuses (fewer than ``NM_MIN_ROWS`` rows, or chunks narrower
    than ``NM_MIN_CHUNK`` columns: 16-bit inputs gave wrong outputs on an H100 with the
    chunk path on 16-row tiles)."""
    idx = tl.arange(0, NM_M)
    g = tl.reshape(s, (ROWS, COLS // NM_M, NM_M))
    me = g[:, :, :, None]
    other = g[:, :, None, :]
    lower = (idx[None, :] < idx[:, None])[None, None, :, :]  # [me, other]: other comes first
    rank = tl.sum(((other > me) | ((other == me) & lower)).to(tl.int32), 3)
    return tl.reshape(rank < NM_N, (ROWS, COLS))


@kernel_helper
def _nm_keep_chunks(s, NM_N: tl.constexpr, NM_M: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """bool ``[ROWS, COLS]``: whether each score of the tile ``s``, whose columns are in
    the N:M order (:func:`_nm_key_order`), is among the ``NM_N`` largest of its group of
    ``NM_M`` keys. A score's rank is the number of others in its group that are greater,
    or equal at a lower key index; masked scores are ``-inf``, so they never outrank an
    allowed one (a kept ``-inf`` has probability 0). A group's members are the same
    element of the tile's ``M`` column chunks, so the ranks are ``M (M - 1) / 2``
    elementwise comparisons of chunk tiles, each in its thread's registers."""
    if NM_M == 2:
        c0, c1 = _halves(s, ROWS, COLS)
        f01 = _first(c0, c1)
        keep = _joined(1 - f01 < NM_N, f01 < NM_N, ROWS, COLS)
    elif NM_M == 4:  # 2:4 (check_nm's only N for M = 4)
        tl.static_assert(NM_N == 2)
        lo, hi = _halves(s, ROWS, COLS)
        c0, c1 = _halves(lo, ROWS, COLS // 2)
        c2, c3 = _halves(hi, ROWS, COLS // 2)
        # a key is kept when it outranks at least 2 of the other 3: a majority of 3
        # pairwise outcomes (predicate logic, no counting)
        f01 = c0 >= c1
        f02 = c0 >= c2
        f03 = c0 >= c3
        f12 = c1 >= c2
        f13 = c1 >= c3
        f23 = c2 >= c3
        k0 = _majority(f01, f02, f03)
        k1 = _majority(f01 == 0, f12, f13)
        k2 = _majority(f02 == 0, f12 == 0, f23)
        k3 = _majority(f03 == 0, f13 == 0, f23 == 0)
        keep = _joined(_joined(k0, k1, ROWS, COLS // 2), _joined(k2, k3, ROWS, COLS // 2), ROWS, COLS)
    else:  # NM_M == 8: the ranks within each half of 4, plus the other half's members that outrank
        lo, hi = _halves(s, ROWS, COLS)
        l0, l1 = _halves(lo, ROWS, COLS // 2)
        h0, h1 = _halves(hi, ROWS, COLS // 2)
        c0, c1 = _halves(l0, ROWS, COLS // 4)
        c2, c3 = _halves(l1, ROWS, COLS // 4)
        c4, c5 = _halves(h0, ROWS, COLS // 4)
        c6, c7 = _halves(h1, ROWS, COLS // 4)
        r0, r1, r2, r3 = _ranks4(c0, c1, c2, c3)
        r4, r5, r6, r7 = _ranks4(c4, c5, c6, c7)
        r0 += 4 - _outranking(c0, c4, c5, c6, c7)  # an upper member outranks unless it is <= this one
        r1 += 4 - _outranking(c1, c4, c5, c6, c7)
        r2 += 4 - _outranking(c2, c4, c5, c6, c7)
        r3 += 4 - _outranking(c3, c4, c5, c6, c7)
        r4 += _outranked(c4, c0, c1, c2, c3)
        r5 += _outranked(c5, c0, c1, c2, c3)
        r6 += _outranked(c6, c0, c1, c2, c3)
        r7 += _outranked(c7, c0, c1, c2, c3)
        keep = _joined(
            _joined(_joined(r0 < NM_N, r1 < NM_N, ROWS, COLS // 4), _joined(r2 < NM_N, r3 < NM_N, ROWS, COLS // 4), ROWS, COLS // 2),
            _joined(_joined(r4 < NM_N, r5 < NM_N, ROWS, COLS // 4), _joined(r6 < NM_N, r7 < NM_N, ROWS, COLS // 4), ROWS, COLS // 2),
            ROWS, COLS)
    return keep


@kernel_helper
def _nm_probabilities(p, qk, sm_scale_log2, pattern_ptrs, band_ptr, rows, cols, key_valid, PARTIAL: tl.constexpr,
                      EVEN_K: tl.constexpr, BANDS: tl.constexpr, SCALE_POSITIVE: tl.constexpr, NM_N: tl.constexpr,
                      NM_M: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, NM_CHUNKS: tl.constexpr):
    """The backward's probabilities ``p`` of a ``[ROWS, COLS]`` tile (queries x keys in
    the order of :func:`_nm_key_order`) with the forward's N:M selection: the selection is recomputed from the
    products ``qk`` exactly as the forward made it (on ``qk`` for ``scale > 0``, else on
    ``qk * scale * log2(e)``, masked scores ``-inf``); dropped and masked scores get 0."""
    key = qk
    if not SCALE_POSITIVE:
        key = qk * sm_scale_log2
    key = _mask_block(key, pattern_ptrs, band_ptr, rows, cols, key_valid, float("-inf"), PARTIAL, EVEN_K, BANDS)
    keep = _nm_keep(key, NM_N, NM_M, ROWS, COLS, NM_CHUNKS) & (key > float("-inf"))
    return tl.where(keep, p, 0.0)


@kernel_helper
def _load_kv(k_base, v_base, cols, stride_kn, stride_vn, n_valid, d_valid,
             EVEN_K: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr):
    """The key and value rows ``cols`` (``[N, 1]``); rows ``>= L_k`` (``~n_valid``) and
    padded head-dim columns (``~d_valid``) read as zeros."""
    if EVEN_K and EVEN_D:
        k = tl.load(k_base + cols * stride_kn)
        v = tl.load(v_base + cols * stride_vn)
    else:
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + cols * stride_kn, mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols * stride_vn, mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


# --------------------------------------------------------------------------------------
# Kernels (jitted at first launch, see LazyKernel)
# --------------------------------------------------------------------------------------


def _fwd_kernel(
    Q, K, V, Out, Lse,
    row_ptr, row_split, col_idx, pattern_id, patterns, bands, sched,
    sm_scale_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    H, NHL, L_q, L_k, NRB, BH, D,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SCALE_POSITIVE: tl.constexpr, DILATION: tl.constexpr, BANDS: tl.constexpr,
    NM_N: tl.constexpr, NM_M: tl.constexpr, NM_CHUNKS: tl.constexpr,
):
    bh, pid_m = _scheduled_block(sched, BH, NRB)  # heavy rows of every bh first
    bhh, b, h, h_l, r = _program_heads(bh, H, NHL, DILATION)
    start, split, end = _block_span(row_ptr, row_split, h_l, NRB, pid_m)  # partial blocks first

    tok_m, m_valid = _residue_tokens(pid_m * BM + tl.arange(0, BM), r, L_q, DILATION)
    offs_bn = _nm_key_order(BN, NM_M, NM_CHUNKS)  # the block's keys (in the N:M order with nm)
    offs_d = tl.arange(0, BD)
    d_valid = offs_d < D
    rows = tok_m[:, None].to(tl.int64)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows * stride_qm + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * stride_kb + h * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + h * stride_vh + offs_d[None, :]
    pat_offs = tl.arange(0, BM)[:, None] * BN + offs_bn[None, :]

    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    # phase 0: partial blocks (element pattern), phase 1: full blocks (no element mask)
    for phase in tl.static_range(2):
        lo, hi = _phase_blocks(phase, start, split, end)
        for idx in range(lo, hi):
            cb = tl.load(col_idx + idx)
            tok_n, n_valid = _residue_tokens(cb * BN + offs_bn, r, L_k, DILATION)
            cols = tok_n[:, None].to(tl.int64)
            k, v = _load_kv(k_base, v_base, cols, stride_kn, stride_vn, n_valid, d_valid, EVEN_K, EVEN_D, UPCAST)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            if not SCALE_POSITIVE:  # scale <= 0: scale first (the row maximum is of scaled scores)
                s = s * sm_scale_log2
            pid = 0  # the partial block's element pattern (phase 0 only)
            if phase == 0:
                pid = tl.load(pattern_id + idx)
            s = _mask_block(s, patterns + pid * (BM * BN) + pat_offs, bands + 2 * pid, tl.arange(0, BM)[:, None],
                            offs_bn[None, :], n_valid[None, :], float("-inf"), phase == 0, EVEN_K, BANDS)
            if NM_M > 0:  # N:M: only the N largest of every M keys enter the softmax
                s = tl.where(_nm_keep(s, NM_N, NM_M, BM, BN, NM_CHUNKS), s, float("-inf"))
            if SCALE_POSITIVE:
                # max(scale * s) = scale * max(s): one fused multiply-add per score below
                m_new = tl.maximum(m_i, tl.max(s, 1) * sm_scale_log2)
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN
            alpha = tl.exp2(m_i - m_safe)
            if SCALE_POSITIVE:
                p = tl.exp2(s * sm_scale_log2 - m_safe[:, None])
            else:
                p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(Lse + bhh.to(tl.int64) * L_q + tok_m, lse, mask=m_valid)
    tl.store(Out + b * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


def _bwd_preprocess_kernel(
    Out, DO, Delta,
    stride_ob, stride_oh, stride_om,
    stride_db, stride_dh, stride_dm,
    H, L_q, D,
    BM: tl.constexpr, BD: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, BD)
    mask = (offs_m < L_q)[:, None] & (offs_d < D)[None, :]
    rows = offs_m[:, None].to(tl.int64)
    o = tl.load(Out + b * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + rows * stride_dm + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh.to(tl.int64) * L_q + offs_m, delta, mask=offs_m < L_q)


def _bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV,
    col_ptr, col_split, row_idx, t_pattern, patterns, bands, sched,
    sm_scale, sm_scale_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    H, NHL, L_q, L_k, NCB, BH, D,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SUB_M: tl.constexpr,
    DILATION: tl.constexpr, BANDS: tl.constexpr,
    SCALE_POSITIVE: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr, NM_CHUNKS: tl.constexpr,
):
    bh, pid_n = _scheduled_block(sched, BH, NCB)  # heavy columns of every bh first
    bhh, b, h, h_l, r = _program_heads(bh, H, NHL, DILATION)
    start, split, end = _block_span(col_ptr, col_split, h_l, NCB, pid_n)  # partial blocks first

    offs_bn = _nm_key_order(BN, NM_M, NM_CHUNKS)  # the block's keys (in the N:M order with nm)
    tok_n, n_valid = _residue_tokens(pid_n * BN + offs_bn, r, L_k, DILATION)
    offs_bm = tl.arange(0, SUB_M)
    offs_d = tl.arange(0, BD)
    d_valid = offs_d < D
    kv_mask = n_valid[:, None] & d_valid[None, :]
    cols = tok_n[:, None].to(tl.int64)
    k_base = K + b * stride_kb + h * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + h * stride_vh + offs_d[None, :]
    k, v = _load_kv(k_base, v_base, cols, stride_kn, stride_vn, n_valid, d_valid, False, False, UPCAST)
    q_base = Q + b * stride_qb + h * stride_qh + offs_d[None, :]
    do_base = DO + b * stride_db + h * stride_dh + offs_d[None, :]
    stat_base = bhh.to(tl.int64) * L_q
    # element (i, j) of a [BM, BN] pattern, read as [SUB_M, BN] (nm) or transposed per sub-tile
    pat_offs = offs_bm[:, None] * BN + offs_bn[None, :]
    patT_offs = offs_bm[None, :] * BN + offs_bn[:, None]

    dk = tl.zeros([BN, BD], dtype=tl.float32)
    dv = tl.zeros([BN, BD], dtype=tl.float32)
    # phase 0: partial blocks (element pattern), phase 1: full blocks (no element mask)
    for phase in tl.static_range(2):
        lo, hi = _phase_blocks(phase, start, split, end)
        for t in range(lo, hi):
            rb = tl.load(row_idx + t)
            pid = 0  # the partial block's element pattern (phase 0 only)
            if phase == 0:
                pid = tl.load(t_pattern + t)
            # the block's BM query rows in sub-tiles of SUB_M (smaller live tiles)
            for sub in tl.static_range(BM // SUB_M):
                tok_m, m_valid = _residue_tokens(rb * BM + sub * SUB_M + offs_bm, r, L_q, DILATION)
                rows = tok_m[:, None].to(tl.int64)
                qd_mask = m_valid[:, None] & d_valid[None, :]
                q = tl.load(q_base + rows * stride_qm, mask=qd_mask, other=0.0)
                do = tl.load(do_base + rows * stride_dm, mask=qd_mask, other=0.0)
                if UPCAST:
                    q = q.to(tl.float32)
                    do = do.to(tl.float32)
                # rows >= L_q and empty rows have lse = +inf: P = 0, no gradient
                lse = tl.load(Lse + stat_base + tok_m, mask=m_valid, other=float("inf"))
                delta = tl.load(Delta + stat_base + tok_m, mask=m_valid, other=0.0)
                pat_base = patterns + pid * (BM * BN) + sub * (SUB_M * BN)
                if NM_M > 0:
                    # the forward's N:M selection, recomputed on the forward's orientation
                    # (queries x keys, the groups along a thread's registers), then transposed
                    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
                    p = tl.exp2(qk * sm_scale_log2 - lse[:, None])
                    p = _nm_probabilities(p, qk, sm_scale_log2, pat_base + pat_offs, bands + 2 * pid,
                                          (sub * SUB_M + offs_bm)[:, None], offs_bn[None, :], n_valid[None, :],
                                          phase == 0, EVEN_K, BANDS, SCALE_POSITIVE, NM_N, NM_M, SUB_M, BN,
                                          NM_CHUNKS)
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
                    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                    ds = p * (dp - delta[:, None])
                    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
                else:
                    qkT = tl.dot(k, tl.trans(q), input_precision=PRECISION)
                    pT = tl.exp2(qkT * sm_scale_log2 - lse[None, :])
                    pT = _mask_block(pT, pat_base + patT_offs, bands + 2 * pid, (sub * SUB_M + offs_bm)[None, :],
                                     offs_bn[:, None], n_valid[:, None], 0.0, phase == 0, EVEN_K, BANDS)
                    dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
                    dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
                    dsT = pT * (dpT - delta[None, :])
                    dk += tl.dot(dsT.to(q.dtype), q, input_precision=PRECISION)

    dk = dk * sm_scale
    tl.store(DK + b * stride_dkb + h * stride_dkh + cols * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * stride_dvb + h * stride_dvh + cols * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


def _bwd_dq_kernel(
    Q, K, V, DO, Out, Lse, Delta, DQ,
    row_ptr, row_split, col_idx, pattern_id, patterns, bands, sched,
    sm_scale, sm_scale_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dm,
    stride_ob, stride_oh, stride_om,
    stride_dqb, stride_dqh, stride_dqm,
    H, NHL, L_q, L_k, NRB, BH, D,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    SUB_N: tl.constexpr, DILATION: tl.constexpr, BANDS: tl.constexpr,
    SCALE_POSITIVE: tl.constexpr, NM_N: tl.constexpr, NM_M: tl.constexpr, NM_CHUNKS: tl.constexpr,
):
    bh, pid_m = _scheduled_block(sched, BH, NRB)
    bhh, b, h, h_l, r = _program_heads(bh, H, NHL, DILATION)
    start, split, end = _block_span(row_ptr, row_split, h_l, NRB, pid_m)  # partial blocks first

    tok_m, m_valid = _residue_tokens(pid_m * BM + tl.arange(0, BM), r, L_q, DILATION)
    offs_bn = _nm_key_order(SUB_N, NM_M, NM_CHUNKS)  # a sub-tile's keys (in the N:M order with nm)
    offs_d = tl.arange(0, BD)
    d_valid = offs_d < D
    qd_mask = m_valid[:, None] & d_valid[None, :]
    rows = tok_m[:, None].to(tl.int64)
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows * stride_qm + offs_d[None, :], mask=qd_mask, other=0.0)
    do = tl.load(DO + b * stride_db + h * stride_dh + rows * stride_dm + offs_d[None, :], mask=qd_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    stat_base = bhh.to(tl.int64) * L_q
    lse = tl.load(Lse + stat_base + tok_m, mask=m_valid, other=float("inf"))
    # Delta_i = dO_i . out_i of this program's rows, stored for _bwd_dkdv (launched next)
    o = tl.load(Out + b * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :], mask=qd_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + stat_base + tok_m, delta, mask=m_valid)
    k_base = K + b * stride_kb + h * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + h * stride_vh + offs_d[None, :]
    pat_offs = tl.arange(0, BM)[:, None] * BN + offs_bn[None, :]

    dq = tl.zeros([BM, BD], dtype=tl.float32)
    # phase 0: partial blocks (element pattern), phase 1: full blocks (no element mask)
    for phase in tl.static_range(2):
        lo, hi = _phase_blocks(phase, start, split, end)
        for idx in range(lo, hi):
            cb = tl.load(col_idx + idx)
            pid = 0  # the partial block's element pattern (phase 0 only)
            if phase == 0:
                pid = tl.load(pattern_id + idx)
            # the block's BN keys in sub-tiles of SUB_N (smaller live tiles)
            for sub in tl.static_range(BN // SUB_N):
                tok_n, n_valid = _residue_tokens(cb * BN + sub * SUB_N + offs_bn, r, L_k, DILATION)
                cols = tok_n[:, None].to(tl.int64)
                k, v = _load_kv(k_base, v_base, cols, stride_kn, stride_vn, n_valid, d_valid,
                                EVEN_K, EVEN_D, UPCAST)
                qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
                p = tl.exp2(qk * sm_scale_log2 - lse[:, None])
                pat_ptrs = patterns + pid * (BM * BN) + sub * SUB_N + pat_offs
                if NM_M > 0:  # the forward's N:M selection, recomputed
                    p = _nm_probabilities(p, qk, sm_scale_log2, pat_ptrs, bands + 2 * pid, tl.arange(0, BM)[:, None],
                                          (sub * SUB_N + offs_bn)[None, :], n_valid[None, :], phase == 0, EVEN_K,
                                          BANDS, SCALE_POSITIVE, NM_N, NM_M, BM, SUB_N, NM_CHUNKS)
                else:
                    p = _mask_block(p, pat_ptrs, bands + 2 * pid, tl.arange(0, BM)[:, None],
                                    (sub * SUB_N + offs_bn)[None, :], n_valid[None, :], 0.0, phase == 0, EVEN_K, BANDS)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                ds = p * (dp - delta[:, None])
                dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)

    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=qd_mask)


_fwd = LazyKernel(_fwd_kernel)
_bwd_preprocess = LazyKernel(_bwd_preprocess_kernel)
_bwd_dkdv = LazyKernel(_bwd_dkdv_kernel)
_bwd_dq = LazyKernel(_bwd_dq_kernel)


# --------------------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    """``num_warps`` / ``num_stages`` of the forward and the two backward kernels.

    ``bwd_warps`` / ``bwd_stages`` launch ``_bwd_dkdv``, and ``_bwd_dq`` too unless
    ``dq_warps`` / ``dq_stages`` are given; ``dkdv_sub_m`` is the number of query rows
    ``_bwd_dkdv`` processes at a time within a ``BM``-row block, ``dq_sub_n`` the number
    of keys ``_bwd_dq`` processes at a time within a ``BN``-column block (powers of two
    >= 16; ``None``: the whole block). ``*_maxnreg`` cap a kernel's registers per thread
    (Triton's ``maxnreg``: more programs per multiprocessor, at the price of spills;
    ``None``: no cap; ignored by the interpreter)."""

    fwd_warps: int
    fwd_stages: int
    bwd_warps: int
    bwd_stages: int
    dq_warps: int | None = None
    dq_stages: int | None = None
    dkdv_sub_m: int | None = None
    dq_sub_n: int | None = None
    fwd_maxnreg: int | None = None
    dq_maxnreg: int | None = None
    dkdv_maxnreg: int | None = None

    @property
    def dq(self) -> tuple[int, int]:
        """``(num_warps, num_stages)`` of ``_bwd_dq``."""
        return (self.dq_warps or self.bwd_warps, self.dq_stages or self.bwd_stages)

    def sub_m(self, BM: int) -> int:
        """Query rows per ``_bwd_dkdv`` step for ``BM``-row blocks."""
        return BM if self.dkdv_sub_m is None else min(BM, self.dkdv_sub_m)

    def sub_n(self, BN: int) -> int:
        """Keys per ``_bwd_dq`` step for ``BN``-column blocks."""
        return BN if self.dq_sub_n is None else min(BN, self.dq_sub_n)


# The best launch per block size at head dim <= 64, from the launch sweeps on an H200
# (bf16; what was measured and why each entry won: benchmarks/NOTES-attention.md, "Launch
# table"). At 64 x 64 the backward takes sub-tiles and register caps so that more programs
# fit per multiprocessor; the caps are for 16-bit inputs only (launch_config drops them
# for float32).
_MEASURED_D64: dict[tuple[int, int], LaunchConfig] = {
    (64, 64): LaunchConfig(
        4, 2, 4, 4, dq_warps=4, dq_stages=4, dkdv_sub_m=32, dq_sub_n=32,
        fwd_maxnreg=96, dq_maxnreg=None, dkdv_maxnreg=128,
    ),
    (128, 64): LaunchConfig(8, 2, 4, 2),
    (64, 128): LaunchConfig(4, 2, 4, 2),
    (128, 128): LaunchConfig(4, 3, 8, 1),
}


#: ``_bwd_dkdv``'s register cap with N:M (16-bit inputs, where the table caps it): its
#: whole-block step holds one more ``[BM, BN]`` tile than the table's sub-tiles; 168
#: registers still fit 3 programs of 4 warps per multiprocessor, with few spills in the
#: loop (sm_90 compile: ``benchmarks/NOTES-attention.md``, "N:M selection"; 152-192 and
#: 3 stages were slower on an H100, session 13)
_NM_DKDV_MAXNREG = 168
#: The forward's and ``_bwd_dq``'s register caps with N:M (16-bit inputs), and
#: ``_bwd_dq``'s pipeline stages: the selection's compares and predicates need registers
#: the table's 96-register forward spills. H100 sweep (session 13, bf16, D = 64, 64 x 64
#: blocks, BigBird / Longformer L = 16384 and dense L = 4096, per-kernel device times):
#: forward 96 -> 128 registers 0.975 -> 0.948, 0.641 -> 0.624, 0.822 -> 0.776 ms
#: (104-144 and 3 stages slower); ``_bwd_dq`` at 32-key sub-tiles, no cap and 4 stages ->
#: 128 registers and 3 stages 1.256 -> 1.118, 0.813 -> 0.713, 1.206 -> 0.958 ms
#: (64-key sub-tiles and 112 / 144 registers slower: ``benchmarks/NOTES-attention.md``).
_NM_FWD_MAXNREG = 128
_NM_DQ_MAXNREG = 128
_NM_DQ_STAGES = 3


@functools.lru_cache(maxsize=256)
def launch_config(BM: int, BN: int, head_dim: int, dtype: torch.dtype = torch.bfloat16,
                  nm: tuple[int, int] | None = None) -> LaunchConfig:
    """The launch table: measured on an H200 for head dims <= 64 at 64x64, 128x64,
    64x128 and 128x128 (for float32 inputs without the register caps, which were
    measured on bfloat16); otherwise 4 warps per 64-row tile (8 for 128-row tiles, 2 for
    16-row tiles), 3 pipeline stages for D <= 64, 2 above (shared memory), the backward
    one step leaner (it holds more tiles: k, v, dk, dv and the streamed q, dO).

    With ``nm = (N, M)``: ``_bwd_dkdv`` takes whole ``BM``-row blocks (it recomputes the
    selection on ``[rows, keys]`` tiles, whose products need >= 64 rows for Hopper's
    warpgroup MMA) and ``_bwd_dq`` sub-tiles of at least ``8 M`` keys (so that the N:M
    order's ``M`` chunks are whole 8-column groups of the MMA layout, each thread's own);
    where the table caps registers (16-bit inputs) and ``M <= 4``, the forward and
    ``_bwd_dq`` take N:M's caps and ``_bwd_dq`` 3 stages (``_NM_FWD_MAXNREG``: the
    selection's predicates need registers)."""
    cfg = _table_config(BM, BN, head_dim, dtype)
    if nm is None:
        return cfg
    m = nm[1]
    dkdv_cap = None if cfg.dkdv_maxnreg is None else max(cfg.dkdv_maxnreg, _NM_DKDV_MAXNREG)
    dq_sub_n = None if cfg.dq_sub_n is None else max(cfg.dq_sub_n, 8 * m)
    cfg = replace(cfg, dkdv_sub_m=None, dkdv_maxnreg=dkdv_cap, dq_sub_n=dq_sub_n)
    if cfg.fwd_maxnreg is not None and m <= 4:  # capped (16-bit) entries, M as swept: N:M's own caps
        cfg = replace(cfg, fwd_maxnreg=max(cfg.fwd_maxnreg, _NM_FWD_MAXNREG), dq_maxnreg=_NM_DQ_MAXNREG,
                      dq_stages=_NM_DQ_STAGES)
    return cfg


def _table_config(BM: int, BN: int, head_dim: int, dtype: torch.dtype) -> LaunchConfig:
    """:func:`launch_config` without N:M."""
    if head_dim <= 64 and (BM, BN) in _MEASURED_D64:
        cfg = _MEASURED_D64[(BM, BN)]
        if dtype == torch.float32:
            cfg = replace(cfg, fwd_maxnreg=None, dq_maxnreg=None, dkdv_maxnreg=None)
        return cfg
    rows = max(BM, BN)
    warps = 8 if rows >= 128 else (4 if rows >= 32 else 2)
    if BM * BN <= 32 * 32:
        warps = min(warps, 2)
    stages = 3 if head_dim <= 64 else 2
    bwd_warps = 8 if BM * BN >= 128 * 64 else (4 if BM * BN >= 32 * 32 else 2)
    bwd_stages = 2 if head_dim <= 64 or BM * BN <= 64 * 64 else 1
    return LaunchConfig(warps, stages, bwd_warps, bwd_stages)


def _upcast(dtype: torch.dtype) -> bool:
    """Work around the Triton interpreter's ``tl.dot`` on bfloat16 (it multiplies the raw
    uint16 bit patterns): under the interpreter, bfloat16 tiles are converted to float32
    right after loading. Never on a GPU."""
    return dtype == torch.bfloat16 and interpreter_enabled()


def _precision(dtype: torch.dtype, allow_tf32: bool | None) -> str:
    if dtype != torch.float32:
        return "tf32"  # Triton's default; it only changes float32 products (fp16/bf16: tensor cores)
    if allow_tf32 is None:
        allow_tf32 = torch.get_float32_matmul_precision() != "highest"
    return "tf32" if allow_tf32 else "ieee"


# --------------------------------------------------------------------------------------
# Layout preparation (kept by the layout: BlockLayout.prepared)
# --------------------------------------------------------------------------------------


def _heavy_first_order(ptr: Tensor, num_blocks: int) -> Tensor:
    """``[1 + num_blocks]`` int32: the number of heavy blocks, then the block order.

    ``ptr`` is ``[num_heads, num_blocks + 1]``; a block (row or column) is heavy when its
    count of non-empty blocks, summed over the layout's heads, exceeds twice the mean.
    Heavy blocks come first, heaviest first; then the others in index order. Computed
    on ``ptr``'s device without a host synchronisation.
    """
    lens = (ptr[:, 1:] - ptr[:, :-1]).to(torch.int64).sum(0)
    heavy = lens * num_blocks > 2 * lens.sum()
    key = torch.where(heavy, -lens, torch.zeros_like(lens))
    order = torch.sort(key, stable=True).indices
    sched = torch.empty(num_blocks + 1, dtype=torch.int32, device=ptr.device)
    sched[0] = heavy.sum().to(torch.int32)
    sched[1:] = order.to(torch.int32)
    return sched


def _partial_first(ptr: Tensor, is_partial: Tensor, *arrays: Tensor) -> tuple[Tensor, ...]:
    """Reorder each group ``ptr[h, g] : ptr[h, g + 1]`` of the flat block arrays so that
    its partial blocks come first (stable: the original order within both kinds).

    Returns ``(split, *reordered)`` with ``split [num_heads, num_groups]`` int32 the flat
    position of each group's first full block (its end when it has none)."""
    H, G = ptr.size(0), ptr.size(1) - 1
    counts = (ptr[:, 1:] - ptr[:, :-1]).reshape(-1).to(torch.int64)
    group = torch.repeat_interleave(torch.arange(H * G, device=ptr.device), counts, output_size=is_partial.numel())
    order = torch.sort(group * 2 + (~is_partial).to(torch.int64), stable=True).indices
    n_partial = torch.zeros(H * G, dtype=torch.int64, device=ptr.device)
    n_partial.index_add_(0, group, is_partial.to(torch.int64))
    split = (ptr[:, :-1].to(torch.int64) + n_partial.view(H, G)).to(torch.int32).contiguous()
    return (split, *(_int32(a[order]) for a in arrays))


def _band_table(patterns: Tensor) -> tuple[Tensor, bool]:
    """``(bands, all_bands)``: ``bands [max(P, 1), 2]`` int32 the ``(lo, hi)`` range of
    ``i - j`` over each ``[P, BM, BN]`` pattern's allowed elements, and whether every
    pattern is exactly its band ``lo <= i - j <= hi`` -- true of sliding-window, causal
    and Longformer / BigBird window blocks, false of a dilated window's or a dense mask's.
    One host synchronisation (once per layout)."""
    P, BM, BN = patterns.shape
    if P == 0:
        return torch.zeros(1, 2, dtype=torch.int32, device=patterns.device), False
    diff = (torch.arange(BM, device=patterns.device).view(-1, 1)
            - torch.arange(BN, device=patterns.device).view(1, -1))
    far = BM + BN
    lo = torch.where(patterns, diff, far).amin(dim=(1, 2))
    hi = torch.where(patterns, diff, -far).amax(dim=(1, 2))
    band = (diff >= lo.view(-1, 1, 1)) & (diff <= hi.view(-1, 1, 1))
    return torch.stack([lo, hi], 1).to(torch.int32).contiguous(), bool((band == patterns).all())


def _bands_enabled() -> bool:
    """``FUSEGNN_BAND_PATTERNS=0`` (or ``false``, ``no``, ``off``) makes the kernels always
    load element patterns (for comparing the two on a GPU); another value than an on / off
    switch raises (:func:`~fusegnn.kernels._env.env_flag`)."""
    return env_flag("FUSEGNN_BAND_PATTERNS", True)


@dataclass
class PreparedLayout:
    """The kernels' view of a layout on ``device``: each block row (column) lists its
    partial blocks first, then its full blocks, split at ``row_split`` (``col_split``);
    plus the launch plans of the calls seen so far."""

    device: torch.device
    row_ptr: Tensor
    row_split: Tensor
    col_idx: Tensor
    pattern_id: Tensor
    patterns: Tensor
    col_ptr: Tensor
    col_split: Tensor
    row_idx: Tensor
    t_pattern: Tensor
    row_sched: Tensor
    col_sched: Tensor
    #: (lo, hi) of each pattern's diagonal band, and whether the kernels use them instead
    #: of the patterns (every pattern is its band, see _band_table)
    bands: Tensor
    all_bands: bool
    nnzb: int
    #: every array above starts on a 16-byte boundary (set by prepare_layout)
    aligned: bool = True
    #: launch plans of the calls seen so far (see _forward_plan)
    plans: dict = field(default_factory=dict)


def _int32(t: Tensor) -> Tensor:
    return t.to(torch.int32).contiguous()


def prepare_layout(layout, device: torch.device) -> PreparedLayout:
    """Kernel-ready int32 / uint8 arrays of ``layout``, computed on ``device`` (one host
    synchronisation: whether its patterns are bands). The kernels read them through
    ``layout.prepared(device)``, which builds them once per layout with this function."""
    patterns = layout.patterns
    bands, all_bands = _band_table(patterns.to(device=device, dtype=torch.bool))
    if patterns.numel() == 0:  # no partial block: a 1-element dummy the kernels never read
        patterns = torch.zeros(1, dtype=torch.uint8, device=device)
    else:
        patterns = patterns.to(torch.uint8).contiguous()
    pattern_id = layout.pattern_id.to(torch.int64)
    t_pattern = pattern_id[layout.t_block.to(torch.int64)]
    row_split, col_idx, pattern_id_r = _partial_first(layout.row_ptr, pattern_id >= 0, layout.col_idx, pattern_id)
    col_split, row_idx, t_pattern_r = _partial_first(layout.col_ptr, t_pattern >= 0, layout.row_idx, t_pattern)
    prepared = PreparedLayout(
        device=device,
        row_ptr=_int32(layout.row_ptr),
        row_split=row_split,
        col_idx=col_idx,
        pattern_id=pattern_id_r,
        patterns=patterns,
        col_ptr=_int32(layout.col_ptr),
        col_split=col_split,
        row_idx=row_idx,
        t_pattern=t_pattern_r,
        row_sched=_heavy_first_order(layout.row_ptr, layout.nrb),
        col_sched=_heavy_first_order(layout.col_ptr, layout.ncb),
        bands=bands,
        all_bands=all_bands and _bands_enabled(),
        nnzb=int(layout.col_idx.numel()),
    )
    prepared.aligned = _layout_aligned(prepared)
    return prepared


# --------------------------------------------------------------------------------------
# Validation and entry points
# --------------------------------------------------------------------------------------

_LAYOUT_FIELDS = (
    "L_q", "L_k", "BM", "BN", "num_heads", "nrb", "ncb", "row_ptr", "col_idx",
    "pattern_id", "patterns", "col_ptr", "row_idx", "t_block", "prepared",
)


def _check_dilation(dilation: object) -> int:
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1:
        raise ValueError(f"dilation must be an int >= 1, got {dilation!r}")
    return dilation


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, layout, dilation: int = 1) -> None:
    check_qkv(q, k, v, SUPPORTED_DTYPES)
    B, H, L_q, D = q.shape
    if v.shape[3] != D:
        raise ValueError(f"v must be [B, H, L_k, {D}] like k {tuple(k.shape)}, got {tuple(v.shape)}")
    missing = [f for f in _LAYOUT_FIELDS if not hasattr(layout, f)]
    if missing:
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__} (missing {missing})")
    if dilation == 1 and (layout.L_q, layout.L_k) != (L_q, k.shape[2]):
        raise ValueError(
            f"layout is for L_q x L_k = {layout.L_q} x {layout.L_k}, but q, k have {L_q} and {k.shape[2]}"
        )
    sub = (-(-L_q // dilation), -(-k.shape[2] // dilation))
    if dilation > 1 and (layout.L_q, layout.L_k) != sub:
        raise ValueError(
            f"with dilation={dilation} the layout must be for the sub-sequences, ceil(L / {dilation}): "
            f"{sub[0]} x {sub[1]} for q, k of {L_q} and {k.shape[2]}; got {layout.L_q} x {layout.L_k}"
        )
    if layout.num_heads not in (1, H):
        raise ValueError(f"layout has {layout.num_heads} heads; need 1 (shared) or H = {H}")
    for bs_name in ("BM", "BN"):
        bs = getattr(layout, bs_name)
        if bs < 16 or bs & (bs - 1):
            raise ValueError(f"layout.{bs_name} must be a power of two >= 16, got {bs}")
    if layout.row_ptr.device != q.device:
        raise ValueError(
            f"layout is on {layout.row_ptr.device} but q is on {q.device}: "
            f"build it on q's device or call layout.to(q.device)"
        )
    if triton is None or not (q.device.type == "cuda" or (q.device.type == "cpu" and interpreter_enabled())):
        raise RuntimeError(
            "block_sparse_attention needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU) and triton"
        )


def _check_launch(launch) -> None:
    if launch is not None and not isinstance(launch, LaunchConfig):
        raise TypeError(f"launch must be a LaunchConfig or None, got {type(launch).__name__}")
    if launch is not None:
        for name in ("fwd_warps", "bwd_warps", "dq_warps"):
            w = getattr(launch, name)
            if name == "dq_warps" and w is None:
                continue
            if not isinstance(w, int) or w < 1 or w & (w - 1):
                raise ValueError(f"launch.{name} must be a power of two >= 1, got {w!r}")
        for name in ("fwd_stages", "bwd_stages", "dq_stages"):
            st = getattr(launch, name)
            if name == "dq_stages" and st is None:
                continue
            if not isinstance(st, int) or st < 1:
                raise ValueError(f"launch.{name} must be an int >= 1, got {st!r}")
        for name in ("fwd_maxnreg", "dq_maxnreg", "dkdv_maxnreg"):
            cap = getattr(launch, name)
            if cap is not None and (not isinstance(cap, int) or not 24 <= cap <= 255):
                raise ValueError(f"launch.{name} must be an int in [24, 255] or None, got {cap!r}")
        for name in ("dkdv_sub_m", "dq_sub_n"):
            sub = getattr(launch, name)
            if sub is not None and (not isinstance(sub, int) or sub < 16 or sub & (sub - 1)):
                raise ValueError(f"launch.{name} must be a power of two >= 16 or None, got {sub!r}")


# (kernel, constexprs, dtype, num_warps, num_stages of the table) -> the fewer stages that
# fit in shared memory, for table configurations that did not (see _launch)
_STAGES_THAT_FIT: dict[tuple, int] = {}


def _launch(
    kernel, grid, args: tuple, meta: dict, warps: int, stages: int, *, fallback: bool, dtype,
    spec_key=None, device: torch.device | None = None,
):
    """``kernel[grid](*args, **meta, num_warps=warps, num_stages=stages)``. With
    ``fallback`` (a configuration of :func:`launch_config`'s table, not one asked for),
    a kernel that does not fit in shared memory at ``stages`` (Triton's
    ``OutOfResources``, e.g. float32 tiles at head dim 128) is retried with one stage
    fewer, down to 1, and the stages that fitted are remembered for that specialisation.
    With ``spec_key`` (see :mod:`fusegnn.kernels._launch`), a repeated call relaunches the
    compiled kernel without Triton's binder. Returns Triton's compiled kernel."""
    key = None
    if fallback and _STAGES_THAT_FIT:
        key = (kernel.__name__, tuple(sorted(meta.items())), dtype, warps, stages)
    run_stages = _STAGES_THAT_FIT.get(key, stages) if key is not None else stages
    while True:
        try:
            compiled = fast_launch(kernel, grid, args, meta, warps, run_stages, spec_key, device)
            break
        except Exception as exc:  # noqa: BLE001 - only Triton's OutOfResources is retried
            if not fallback or run_stages <= 1 or type(exc).__name__ != "OutOfResources":
                raise
            run_stages -= 1
    if run_stages != stages:
        _STAGES_THAT_FIT[(kernel.__name__, tuple(sorted(meta.items())), dtype, warps, stages)] = run_stages
    return compiled  # Triton's compiled kernel (register / spill counts for the sweeps)


def _with_cap(meta: dict, maxnreg: int | None) -> dict:
    return meta if maxnreg is None else dict(meta, maxnreg=maxnreg)


def _last_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _alignment(*tensors: Tensor) -> tuple[int, ...]:
    """Each tensor's address modulo 16 (Triton specialises pointers on 16-byte alignment)."""
    return tuple(t.data_ptr() & 15 for t in tensors)


def _layout_aligned(prep: PreparedLayout) -> bool:
    return all(
        t.data_ptr() % 16 == 0
        for t in (prep.row_ptr, prep.row_split, prep.col_idx, prep.pattern_id, prep.patterns, prep.col_ptr,
                  prep.col_split, prep.row_idx, prep.t_pattern, prep.row_sched, prep.col_sched, prep.bands)
    )


_MAX_PLANS = 64


def _bound(plans: dict) -> None:
    """Keep a layout's plan cache small (a caller varying ``scale`` per call, say)."""
    if len(plans) >= _MAX_PLANS:
        plans.clear()


class _Launch(NamedTuple):
    """One kernel launch of a plan: everything but the call's own tensors, which
    ``args`` follow (``kernel[grid](*tensors, *args, **meta)``)."""

    grid: tuple[int, ...]
    args: tuple
    meta: dict
    warps: int
    stages: int


# A plan is the launches of one call, computed once per (layout, shapes, strides, dtype,
# alignment, scale, precision, launch configuration) and cached on the layout's kernel
# arrays (PreparedLayout.plans): a repeated call only allocates its outputs and launches. Its
# key is also the kernels' specialisation key for fusegnn.kernels._launch: it determines
# every integer argument and every tensor's dtype and alignment (the outputs are fresh
# allocations, aligned; the layout's arrays are checked once, _layout_aligned).


#: The fewest rows and the narrowest N:M chunk (``cols / M`` columns of a ``cols``-key
#: tile) of a selection tile for which a kernel loads its keys in the N:M order and
#: selects elementwise on the chunks (:func:`nm_chunk_path`); other tiles select in key
#: order (:func:`_nm_keep_grouped`). On an H100 (Triton 3.6) 16-bit inputs gave grossly
#: wrong outputs through the chunk path on 16-row tiles (mma.sync accumulators) with
#: chunks of 2, 4 and 8 columns, while 64 x 64 blocks (warpgroup MMA; chunks of 8 and
#: 16 columns) matched the reference; float32 passed on every tile. The gate holds for
#: every dtype (one rule; float32 N:M on small tiles is not a case worth a second one).
NM_MIN_ROWS = 64
NM_MIN_CHUNK = 8


def nm_chunk_path(rows: int, cols: int, m: int) -> bool:
    """Whether a kernel whose N:M selection tile is ``[rows, cols]`` (queries x keys)
    with groups of ``m`` keys loads its keys in the N:M order and selects on the chunks
    (``rows >= NM_MIN_ROWS`` and ``cols / m >= NM_MIN_CHUNK``), rather than in key order.
    The kernels' constexpr ``NM_CHUNKS`` is this value for their tile
    (:func:`nm_selection_tiles`)."""
    return rows >= NM_MIN_ROWS and cols // m >= NM_MIN_CHUNK


def nm_selection_tiles(BM: int, BN: int, cfg: LaunchConfig) -> dict[str, tuple[int, int]]:
    """``{kernel: (rows, cols)}``: the shape of the tile each kernel selects on with
    ``BM x BN`` blocks and the launch ``cfg`` -- the forward's whole block, ``_bwd_dq``'s
    ``BM x SUB_N`` sub-tiles, ``_bwd_dkdv``'s ``SUB_M x BN`` sub-tiles (it recomputes the
    forward's queries x keys orientation)."""
    return {"fwd": (BM, BN), "dq": (BM, cfg.sub_n(BN)), "dkdv": (cfg.sub_m(BM), BN)}


def nm_paths(BM: int, BN: int, cfg: LaunchConfig, nm: tuple[int, int]) -> dict[str, str]:
    """``{kernel: "chunks" | "grouped"}``: the selection each kernel makes with N:M
    pattern ``nm`` (for probes and reports)."""
    return {name: "chunks" if nm_chunk_path(rows, cols, nm[1]) else "grouped"
            for name, (rows, cols) in nm_selection_tiles(BM, BN, cfg).items()}


def _nm_meta(nm: tuple[int, int] | None, rows: int, cols: int) -> dict:
    """The N:M constexprs of a kernel whose selection tile is ``[rows, cols]``
    (``NM_M = 0``: no selection, compiled out)."""
    if nm is None:
        return dict(NM_N=0, NM_M=0, NM_CHUNKS=False)
    return dict(NM_N=nm[0], NM_M=nm[1], NM_CHUNKS=nm_chunk_path(rows, cols, nm[1]))


def _forward_plan(q: Tensor, k: Tensor, v: Tensor, layout, prep: PreparedLayout, scale: float, precision: str,
                  launch: LaunchConfig | None, dilation: int, nm: tuple[int, int] | None = None) -> _Launch:
    B, H, L_q, D = q.shape
    L_k = k.shape[2]
    BM, BN = int(layout.BM), int(layout.BN)
    BD = max(16, next_pow2(D))
    cfg = launch if launch is not None else launch_config(BM, BN, D, q.dtype, nm)
    tiles = nm_selection_tiles(BM, BN, cfg)
    out_strides = (H * L_q * D, L_q * D, D)  # out is allocated contiguous
    rows = B * H * dilation  # kernel rows: one per (b, h) and residue
    return _Launch(
        (layout.nrb * rows,),
        (prep.row_ptr, prep.row_split, prep.col_idx, prep.pattern_id, prep.patterns, prep.bands, prep.row_sched,
         scale * _LOG2E,
         *_strides(q), *_strides(k), *_strides(v), *out_strides,
         H, int(layout.num_heads), L_q, L_k, int(layout.nrb), rows, D),
        _with_cap(dict(BM=BM, BN=BN, BD=BD, EVEN_K=L_k % (BN * dilation) == 0, EVEN_D=BD == D,
                       PRECISION=precision, UPCAST=_upcast(q.dtype), SCALE_POSITIVE=scale > 0,
                       DILATION=dilation, BANDS=prep.all_bands, **_nm_meta(nm, *tiles["fwd"])), cfg.fwd_maxnreg),
        cfg.fwd_warps, cfg.fwd_stages,
    )


def _off_current_device(t: Tensor) -> bool:
    """``t`` is on a CUDA device other than the current one, where Triton launches."""
    return t.is_cuda and t.device.index != torch.cuda.current_device()


def _forward(
    q: Tensor, k: Tensor, v: Tensor, layout, scale: float, precision: str, launch: LaunchConfig | None = None,
    dilation: int = 1, nm: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    if _off_current_device(q):  # Triton launches on the current device: make it q's
        with torch.cuda.device(q.device):
            return _forward(q, k, v, layout, scale, precision, launch, dilation, nm)
    B, H, L_q, D = q.shape
    out = torch.empty(B, H, L_q, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, L_q, dtype=torch.float32, device=q.device)
    prep = layout.prepared(q.device)
    if prep.nnzb == 0 or B * H == 0 or L_q == 0:
        out.zero_()
        lse.fill_(float("inf"))
        return out, lse
    spec = ("fwd", q.shape, q.stride(), k.shape, k.stride(), v.stride(), q.dtype, _alignment(q, k, v),
            prep.aligned, int(layout.num_heads), dilation)
    key = (spec, scale, precision, launch, nm)
    plan = prep.plans.get(key)
    if plan is None:
        _bound(prep.plans)
        plan = prep.plans[key] = _forward_plan(q, k, v, layout, prep, scale, precision, launch, dilation, nm)
    _launch(_fwd, plan.grid, (q, k, v, out, lse, *plan.args), plan.meta, plan.warps, plan.stages,
            fallback=launch is None, dtype=q.dtype, spec_key=spec, device=q.device)
    return out, lse


def _backward_plan(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, layout, prep: PreparedLayout,
                   scale: float, precision: str, need_dq: bool, need_dkdv: bool,
                   launch: LaunchConfig | None, dilation: int,
                   nm: tuple[int, int] | None = None) -> tuple[_Launch | None, _Launch | None, _Launch | None]:
    """``(dq launch, preprocess launch, dK/dV launch)``, ``None`` for those not run."""
    B, H, L_q, D = q.shape
    L_k = k.shape[2]
    BM, BN = int(layout.BM), int(layout.BN)
    BD = max(16, next_pow2(D))
    cfg = launch if launch is not None else launch_config(BM, BN, D, q.dtype, nm)
    tiles = nm_selection_tiles(BM, BN, cfg)
    scale_log2 = scale * _LOG2E
    nhl = int(layout.num_heads)
    even_k = L_k % (BN * dilation) == 0
    upcast = _upcast(q.dtype)
    rows = B * H * dilation  # kernel rows: one per (b, h) and residue
    q_contig = (H * L_q * D, L_q * D, D)  # dq, dk, dv are allocated contiguous
    k_contig = (H * L_k * D, L_k * D, D)
    dq_launch = pre_launch = dkdv_launch = None
    if need_dq:  # also computes delta = rowsum(dO * out), which _bwd_dkdv reads
        dq_warps, dq_stages = cfg.dq
        dq_launch = _Launch(
            (layout.nrb * rows,),
            (prep.row_ptr, prep.row_split, prep.col_idx, prep.pattern_id, prep.patterns, prep.bands, prep.row_sched,
             scale, scale_log2,
             *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(out), *q_contig,
             H, nhl, L_q, L_k, int(layout.nrb), rows, D),
            _with_cap(dict(BM=BM, BN=BN, BD=BD, EVEN_K=even_k, EVEN_D=BD == D, PRECISION=precision,
                           UPCAST=upcast, SUB_N=cfg.sub_n(BN), DILATION=dilation, BANDS=prep.all_bands,
                           SCALE_POSITIVE=scale > 0, **_nm_meta(nm, *tiles["dq"])),
                      cfg.dq_maxnreg),
            dq_warps, dq_stages,
        )
    elif need_dkdv:
        pre_launch = _Launch(
            ((L_q + 63) // 64, B * H), (*_strides(out), *_strides(do), H, L_q, D), dict(BM=64, BD=BD), 4, 1,
        )
    if need_dkdv:
        dkdv_launch = _Launch(
            (layout.ncb * rows,),
            (prep.col_ptr, prep.col_split, prep.row_idx, prep.t_pattern, prep.patterns, prep.bands, prep.col_sched,
             scale, scale_log2,
             *_strides(q), *_strides(k), *_strides(v), *_strides(do), *k_contig, *k_contig,
             H, nhl, L_q, L_k, int(layout.ncb), rows, D),
            _with_cap(dict(BM=BM, BN=BN, BD=BD, EVEN_K=even_k, PRECISION=precision, UPCAST=upcast,
                           SUB_M=cfg.sub_m(BM), DILATION=dilation, BANDS=prep.all_bands,
                           SCALE_POSITIVE=scale > 0, **_nm_meta(nm, *tiles["dkdv"])), cfg.dkdv_maxnreg),
            cfg.bwd_warps, cfg.bwd_stages,
        )
    return dq_launch, pre_launch, dkdv_launch


def _backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, layout, scale: float,
    precision: str, need_dq: bool, need_dkdv: bool, launch: LaunchConfig | None = None, dilation: int = 1,
    nm: tuple[int, int] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    if _off_current_device(q):
        with torch.cuda.device(q.device):
            return _backward(do, q, k, v, out, lse, layout, scale, precision, need_dq, need_dkdv, launch, dilation,
                             nm)
    B, H, L_q, D = q.shape
    L_k = k.shape[2]
    prep = layout.prepared(q.device)
    if prep.nnzb == 0 or B * H == 0 or L_q == 0 or L_k == 0:
        zeros = lambda t, need: torch.zeros_like(t, memory_format=torch.contiguous_format) if need else None  # noqa: E731
        return zeros(q, need_dq), zeros(k, need_dkdv), zeros(v, need_dkdv)
    do = _last_contiguous(do)
    spec = ("bwd", q.shape, q.stride(), k.shape, k.stride(), v.stride(), do.stride(), out.stride(), q.dtype,
            _alignment(q, k, v, do, out), prep.aligned, int(layout.num_heads), dilation)
    key = (spec, scale, precision, need_dq, need_dkdv, launch, nm)
    plan = prep.plans.get(key)
    if plan is None:
        _bound(prep.plans)
        plan = prep.plans[key] = _backward_plan(
            do, q, k, v, out, layout, prep, scale, precision, need_dq, need_dkdv, launch, dilation, nm)
    dq_launch, pre_launch, dkdv_launch = plan
    # every element is written by the kernels (blocks with no work store zeros): no memset
    dq = torch.empty(B, H, L_q, D, dtype=q.dtype, device=q.device) if need_dq else None
    dk = torch.empty(B, H, L_k, D, dtype=k.dtype, device=k.device) if need_dkdv else None
    dv = torch.empty(B, H, L_k, D, dtype=v.dtype, device=v.device) if need_dkdv else None
    delta = torch.empty(B, H, L_q, dtype=torch.float32, device=q.device)
    fallback = launch is None
    if dq_launch is not None:
        _launch(_bwd_dq, dq_launch.grid, (q, k, v, do, out, lse, delta, dq, *dq_launch.args), dq_launch.meta,
                dq_launch.warps, dq_launch.stages, fallback=fallback, dtype=q.dtype, spec_key=spec, device=q.device)
    if pre_launch is not None:
        _launch(_bwd_preprocess, pre_launch.grid, (out, do, delta, *pre_launch.args), pre_launch.meta,
                pre_launch.warps, pre_launch.stages, fallback=False, dtype=q.dtype, spec_key=spec, device=q.device)
    if dkdv_launch is not None:
        _launch(_bwd_dkdv, dkdv_launch.grid, (q, k, v, do, lse, delta, dk, dv, *dkdv_launch.args),
                dkdv_launch.meta, dkdv_launch.warps, dkdv_launch.stages, fallback=fallback, dtype=q.dtype,
                spec_key=spec, device=q.device)
    return dq, dk, dv


class BlockSparseAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: ``apply(q, k, v, layout, scale, precision, launch, dilation, nm) ->
    (out, lse)`` (``lse`` base 2, not differentiable; ``launch`` a :class:`LaunchConfig`
    or ``None`` for :func:`launch_config`; ``dilation`` and ``nm`` (a checked ``(N, M)``
    or ``None``) see :func:`block_sparse_attention`)."""

    @staticmethod
    def forward(ctx, q, k, v, layout, scale, precision, launch=None, dilation=1, nm=None):  # type: ignore[override]
        q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
        out, lse = _forward(q, k, v, layout, scale, precision, launch, dilation, nm)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout = layout
        ctx.scale = scale
        ctx.precision = precision
        ctx.launch = launch
        ctx.dilation = dilation
        ctx.nm = nm
        ctx.mark_non_differentiable(lse)
        # lse never has a gradient: do not let autograd build a zero tensor for it
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        if grad_out is None:  # out was not used by the loss
            return None, None, None, None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        need_dq, need_dk, need_dv = ctx.needs_input_grad[:3]
        dq, dk, dv = _backward(
            grad_out, q, k, v, out, lse, ctx.layout, ctx.scale, ctx.precision,
            need_dq, need_dk or need_dv, ctx.launch, ctx.dilation, ctx.nm,
        )
        return dq, (dk if need_dk else None), (dv if need_dv else None), None, None, None, None, None, None


def _checked_apply(q, k, v, layout, scale, allow_tf32, launch, dilation, nm=None) -> tuple[Tensor, Tensor]:
    """Validate the public entry points' arguments, then run the autograd function:
    ``(out, base-2 lse)``."""
    dilation = _check_dilation(dilation)
    nm = check_nm(nm)
    if nm is not None and dilation > 1:
        raise ValueError(
            f"nm={nm} needs dilation=1 (N:M groups are consecutive keys, which a dilated call interleaves); "
            f"got dilation={dilation}"
        )
    _check_inputs(q, k, v, layout, dilation)
    _check_launch(launch)
    scale = check_scale(scale, q.shape[-1])
    return BlockSparseAttentionFunction.apply(
        q, k, v, layout, scale, _precision(q.dtype, allow_tf32), launch, dilation, nm)


def block_sparse_attention_lse(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout,
    scale: float | None = None,
    *,
    allow_tf32: bool | None = None,
    launch: LaunchConfig | None = None,
    dilation: int = 1,
    nm: tuple[int, int] | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Like :func:`block_sparse_attention`, also returning the natural-log log-sum-exp
    ``[B, H, L_q]`` float32 of each row's allowed scores (with ``nm``, its kept scores;
    ``+inf`` for empty rows; not differentiable)."""
    out, lse2 = _checked_apply(q, k, v, layout, scale, allow_tf32, launch, dilation, nm)
    return out, lse2 / _LOG2E


def block_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layout,
    scale: float | None = None,
    *,
    allow_tf32: bool | None = None,
    launch: LaunchConfig | None = None,
    dilation: int = 1,
    nm: tuple[int, int] | str | None = None,
) -> Tensor:
    r"""Masked softmax attention over the non-empty blocks of ``layout``, fused.

    Args:
        q: ``[B, H, L_q, D]`` queries (float16, bfloat16 or float32; last dim contiguous
            or it is copied).
        k, v: ``[B, H, L_k, D]`` keys and values, same dtype and device.
        layout: a :class:`~fusegnn.attention.block_layout.BlockLayout` for ``L_q x L_k`` on
            ``q``'s device, shared (``num_heads == 1``) or per head (``num_heads == H``).
            Its ``BM``/``BN`` are the kernel's tile sizes.
        scale: multiplies :math:`q \cdot k` (default :math:`1/\sqrt{D}`).
        allow_tf32: float32 inputs only: use TF32 tensor cores (default: when
            ``torch.get_float32_matmul_precision() != "highest"``).
        launch: ``num_warps`` / ``num_stages`` of the forward and backward kernels
            (``None``: :func:`launch_config`'s table; for tuning sweeps).
        dilation: ``d >= 1``. With ``d > 1`` the sequences are taken as ``d``
            interleaved sub-sequences -- token ``t`` is position ``t // d`` of
            sub-sequence ``t % d`` -- and each sub-sequence attends only within itself
            by ``layout``, which is then for ``ceil(L_q / d) x ceil(L_k / d)`` (the
            shorter sub-sequences ``r`` use its first ``ceil((L - r) / d)`` positions):

            .. math:: M_{ij} = [\, i \equiv j \pmod d \,] \cdot
                M^{\mathrm{layout}}_{\lfloor i/d \rfloor,\, \lfloor j/d \rfloor}

            A dilated window (:func:`~fusegnn.attention.masks.dilated`) is then a plain
            sliding window over each sub-sequence: mostly full blocks instead of every
            block partial and half empty. No data moves: the kernels read the
            sub-sequences through strided addresses.
        nm: ``(N, M)`` in ``(1, 2)``, ``(2, 4)``, ``(4, 8)`` (or ``"N:M"``): dynamic N:M
            sparsity -- of every ``M`` consecutive keys of a row only the ``N`` largest
            allowed scores enter the softmax (:mod:`fusegnn.kernels.nm_sparsity`; ties to
            the lower key index). ``None``: all allowed scores. Needs ``dilation=1``.

    Returns:
        ``[B, H, L_q, D]`` in ``q``'s dtype; rows with no allowed key are zero.
        Differentiable in ``q``, ``k``, ``v`` (deterministic backward, no atomics).
    """
    out, _ = _checked_apply(q, k, v, layout, scale, allow_tf32, launch, dilation, nm)
    return out


def block_sparse_attention_prechecked(q: Tensor, k: Tensor, v: Tensor, layout, scale: float,
                                      dilation: int = 1, nm: tuple[int, int] | None = None) -> Tensor:
    """:func:`block_sparse_attention` without its input checks, for callers that have
    already validated ``q``, ``k``, ``v`` (a supported dtype, one device, matching
    shapes), the layout (on ``q``'s device, for ``L_q x L_k`` and ``H`` or 1 heads) and
    the float ``scale``, and ``nm`` (a checked ``(N, M)`` or ``None``, with ``dilation=1``)
    -- :func:`fusegnn.attention.sparse_attention.sparse_attention`'s automatic path, where
    the checks are a measurable part of a short call."""
    out, _ = BlockSparseAttentionFunction.apply(q, k, v, layout, scale, _precision(q.dtype, None), None, dilation,
                                                nm)
    return out
