r"""Vector-sparse (row-window) attention for element-irregular masks, forward and backward.

For masks too scattered for ``64 x 64`` blocks (random 1-5 % element density: nearly
every block is non-empty and almost all of it masked out), the rows are cut into
**query windows** of ``W`` consecutive queries (``W`` in :data:`WINDOW_SIZES`; Jigsaw's
row windows, :class:`fusegnn.sparse.vector_sparse.RowWindows`) and each window keeps the
sorted list of the key columns that *any* of its rows attends (its compacted columns),
with a ``W``-bit word per compacted column: bit ``r`` says whether query
``window * W + r`` attends that key. With :math:`M` the mask and :math:`s` = ``scale``:

.. math::
    S_{ij} = s\, q_i \cdot k_j, \qquad
    P_{ij} = \frac{M_{ij} \exp S_{ij}}{\sum_{j'} M_{ij'} \exp S_{ij'}}, \qquad
    \mathrm{out}_i = \sum_j P_{ij} v_j,

and :math:`\mathrm{out}_i = 0` for a row with no allowed key (never NaN).

**Forward** (``_fwd``, one program per (query window, batch, head)): the window's ``[W, D]``
query tile stays in registers; the compacted column list is streamed in tiles of
``BLOCK_N`` entries, whose key and value rows are gathered (``[BLOCK_N, D]``); the
``[W, BLOCK_N]`` score tile is one ``tl.dot``, masked per element by the columns' bit
words, then FlashAttention's online softmax in float32 (base 2: scores are multiplied by
``scale * log2(e)`` once) and ``P @ V`` with ``tl.dot``. It stores the base-2 log-sum-exp
:math:`\mathrm{lse}_i = m_i + \log_2 l_i` (``+inf`` for an empty row), the convention of
:mod:`fusegnn.kernels.block_attention`.

**Backward** (deterministic, no atomics; :math:`P` recomputed from the stored
log-sum-exp, nothing of size ``nnz`` stored):

.. math::
    \Delta_i = dO_i \cdot \mathrm{out}_i, \quad
    dS_{ij} = P_{ij}\big(dO_i \cdot v_j - \Delta_i\big), \quad
    dQ_i = s \sum_j dS_{ij} k_j, \quad
    dK_j = s \sum_i dS_{ij} q_i, \quad
    dV_j = \sum_i P_{ij}\, dO_i.

``_bwd_dq`` walks the query windows exactly as the forward does (and stores
:math:`\Delta` of its rows). ``_bwd_dkdv`` walks the **transposed structure**: key windows
of ``W`` keys, each with the sorted list of the queries that attend any of its keys and a
``W``-bit word per query (bit ``r``: the query attends key ``window * W + r``), gathering
``BLOCK_N`` query rows (``q``, ``dO``, lse, :math:`\Delta`) per step into ``[W, BLOCK_N]``
tiles. Every ``dK`` / ``dV`` row is written by the one program that owns its key window:
no atomics, so the result does not depend on scheduling (atomics into ``dK`` / ``dV``
from the query windows would avoid the second structure but make float32 sums
order-dependent and, for fp16/bf16, need a float32 scratch copy of ``dK`` and ``dV``).

**The structure** (:class:`VectorAttentionStructure`, :func:`build_structure`) is built
on the device with torch ops from the allowed ``(head, query, key)`` triples -- one sort,
no Python loop over rows -- once per mask (the op layer caches it on the mask). The bit
words are int32 for ``W <= 32`` and int64 for ``W = 64``. :func:`vector_attention_reference`
is the dense PyTorch definition the kernels must match (it reads the mask back from the
structure).

**Cost.** A window computes ``W`` scores for each compacted column. For a mask of
uniform random density :math:`d`, a window has :math:`L_k (1 - (1 - d)^W)` compacted
columns, so a smaller ``W`` wastes fewer scores (``W = 16`` at ``d = 1 %``: 15 % of the
keys, 7 % of them allowed; ``W = 64``: 47 % of the keys, 2 %) but reuses each gathered
key row for fewer queries: :data:`DEFAULT_WINDOW` is 16.

dtypes: float16, bfloat16 (float32 accumulation) and float32 (TF32 tensor cores when
``torch.get_float32_matmul_precision() != "highest"``, IEEE otherwise). Any head dims
(``D`` for ``q`` / ``k``, ``D_v`` for ``v``, padded to powers of two >= 16 inside).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from fusegnn.kernels._triton import BLOCK_ATTENTION_DTYPES, LazyKernel, interpreter_enabled, kernel_helper, next_pow2
from fusegnn.kernels.attention_inputs import check_qkv, check_scale
from fusegnn.kernels.block_attention import _last_contiguous, _off_current_device, _precision, _upcast

try:  # triton is an optional dependency; the kernels below need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

__all__ = [
    "DEFAULT_BLOCK_N",
    "DEFAULT_WINDOW",
    "VectorAttentionFunction",
    "VectorAttentionStructure",
    "WINDOW_SIZES",
    "WindowIndex",
    "build_structure",
    "check_vector_sizes",
    "structure_dense",
    "vector_attention_reference",
    "vector_sparse_attention",
]

#: query (and key) window sizes: ``tl.dot`` needs >= 16 rows; a bit word holds <= 64
WINDOW_SIZES = (16, 32, 64)
DEFAULT_WINDOW = 16
#: compacted columns streamed per step (a power of two in [16, 128])
DEFAULT_BLOCK_N = 64
_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------
# The structure
# --------------------------------------------------------------------------------------


class WindowIndex(NamedTuple):
    """One direction of the structure: group ``g`` (a window of one layout head, ``g =
    head * num_windows + window``) owns entries ``ptr[g] .. ptr[g + 1] - 1``; entry ``e``
    is index ``idx[e]`` (sorted within the group) with bit word ``bits[e]`` (bit ``r``:
    element ``window * W + r`` of the window pairs with ``idx[e]``)."""

    ptr: Tensor  # int32 [groups + 1]
    idx: Tensor  # int32 [entries]
    bits: Tensor  # int32 (W <= 32) or int64 (W = 64) [entries]


class VectorAttentionStructure(NamedTuple):
    """The kernels' view of a mask: ``rows`` (query windows, compacted key columns) for
    the forward and ``dQ``, ``cols`` (key windows, compacted query rows) for ``dK`` /
    ``dV``; ``num_heads`` is 1 (shared by every head) or the number of heads; ``nnz`` the
    distinct allowed elements (all heads; a repeated element counts once)."""

    W: int
    L_q: int
    L_k: int
    num_heads: int
    rows: WindowIndex
    cols: WindowIndex
    nnz: int

    @property
    def device(self) -> torch.device:
        return self.rows.ptr.device

    @property
    def num_entries(self) -> int:
        """Compacted (window, column) entries of the forward structure."""
        return self.rows.idx.numel()


def check_vector_sizes(W: object, BLOCK_N: object) -> tuple[int, int]:
    """``(W, BLOCK_N)`` as ints: ``W`` in :data:`WINDOW_SIZES`, ``BLOCK_N`` a power of two
    in ``[16, 128]`` (``ValueError`` naming ``block_size`` otherwise)."""
    for name, value in (("W", W), ("BLOCK_N", BLOCK_N)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"block_size: the vector path's {name} must be an int, got {type(value).__name__}")
    if W not in WINDOW_SIZES:
        raise ValueError(f"block_size: the vector path's window W must be one of {WINDOW_SIZES}, got {W}")
    if BLOCK_N < 16 or BLOCK_N > 128 or BLOCK_N & (BLOCK_N - 1):
        raise ValueError(f"block_size: the vector path's BLOCK_N must be a power of two in [16, 128], got {BLOCK_N}")
    return W, BLOCK_N


def _window_index(group: Tensor, member: Tensor, offset: Tensor, num_groups: int, num_members: int,
                  W: int) -> tuple[WindowIndex, int]:
    """Entries ``(group, member)`` with the bits ``offset`` of their elements set
    (duplicate elements count once), and the number of distinct elements."""
    device = group.device
    key = torch.unique((group * num_members + member) * W + offset)  # sorted by group, member, offset
    entry = torch.div(key, W, rounding_mode="floor")
    entries, inverse = torch.unique_consecutive(entry, return_inverse=True)
    bits = torch.zeros(entries.numel(), dtype=torch.int64, device=device)
    # distinct bits of one entry: their sum is their OR (two's complement wrap for bit 63)
    bits.index_add_(0, inverse, torch.ones_like(key) << (key % W))
    if W <= 32:  # the same 32 bits as an int32 word
        bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    groups = torch.div(entries, num_members, rounding_mode="floor")
    ptr = torch.zeros(num_groups + 1, dtype=torch.int64, device=device)
    ptr[1:] = torch.cumsum(torch.bincount(groups, minlength=num_groups), 0)
    index = WindowIndex(ptr.to(torch.int32), (entries % num_members).to(torch.int32), bits.contiguous())
    return index, key.numel()


def _check_extent(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_elements(head: object, query: object, key: object, extents: tuple[int, int, int]) -> tuple[Tensor, ...]:
    """``head``, ``query``, ``key`` as flat int64 tensors after checking that they are
    integer tensors on one device with one entry per element, each within its extent (an
    index out of range would land in another window and read outside ``k`` / ``v``)."""
    named = (("head", head), ("query", query), ("key", key))
    for name, t in named:
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if not (head.device == query.device == key.device):
        raise ValueError(f"head, query and key must be on one device, got {head.device}, {query.device}, {key.device}")
    if not head.numel() == query.numel() == key.numel():
        raise ValueError("head, query and key must hold one entry per allowed element, got "
                         f"{head.numel()}, {query.numel()}, {key.numel()}")
    out = []
    for (name, t), extent in zip(named, extents):
        t = t.to(torch.int64).reshape(-1)
        if t.numel():
            lo, hi = (int(m) for m in torch.aminmax(t))
            if lo < 0 or hi >= extent:
                raise ValueError(f"{name} must lie in [0, {extent}), got values in [{lo}, {hi}]")
        out.append(t)
    return tuple(out)


def build_structure(head: Tensor, query: Tensor, key: Tensor, L_q: int, L_k: int, num_heads: int,
                    W: int = DEFAULT_WINDOW) -> VectorAttentionStructure:
    """The structure of the mask whose allowed elements are ``(head[e], query[e],
    key[e])`` (integer tensors on one device; ``head`` all 0 for a shared mask,
    ``num_heads = 1``), on their device, with windows of ``W`` rows / keys. Torch ops
    only; two sorts of the elements."""
    W, _ = check_vector_sizes(W, DEFAULT_BLOCK_N)
    L_q, L_k = _check_extent(L_q, "L_q", 0), _check_extent(L_k, "L_k", 0)
    num_heads = _check_extent(num_heads, "num_heads", 1)
    head, query, key = _check_elements(head, query, key, (num_heads, L_q, L_k))
    if L_q * L_k * num_heads >= 2**62 // W:
        raise ValueError("the mask is too large for the structure's int64 keys")
    nqw, nkw = -(-L_q // W), -(-L_k // W)
    rows, nnz = _window_index(head * nqw + query // W, key, query % W, num_heads * nqw, L_k, W)
    cols, _ = _window_index(head * nkw + key // W, query, key % W, num_heads * nkw, L_q, W)
    if max(rows.idx.numel(), cols.idx.numel()) >= 2**31:
        raise ValueError("too many compacted entries for int32 indices")
    return VectorAttentionStructure(W, L_q, L_k, num_heads, rows, cols, nnz)



def _dense_of(index: WindowIndex, W: int, num_heads: int, L_rows: int, L_idx: int) -> Tensor:
    """Bool ``[num_heads, L_rows, L_idx]``: element ``(g * W + r, idx[e])`` set for every
    entry ``e`` of group ``g`` whose bit ``r`` is set."""
    device = index.ptr.device
    nw = -(-L_rows // W)
    counts = (index.ptr[1:] - index.ptr[:-1]).to(torch.int64)
    group = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts)
    r = torch.arange(W, device=device)
    bit = ((index.bits.to(torch.int64).view(-1, 1) >> r) & 1) != 0  # [entries, W]
    dense = torch.zeros(num_heads, nw * W, L_idx, dtype=torch.bool, device=device)
    e, rr = bit.nonzero(as_tuple=True)
    g = group[e]
    dense[g // nw, (g % nw) * W + rr, index.idx[e].to(torch.int64)] = True
    return dense[:, :L_rows]


def structure_dense(structure: VectorAttentionStructure, transposed: bool = False) -> Tensor:
    """The mask the structure encodes, bool ``[num_heads, L_q, L_k]``, read from its query
    windows (or, ``transposed``, from its key windows: the two must agree)."""
    s = structure
    if transposed:
        return _dense_of(s.cols, s.W, s.num_heads, s.L_k, s.L_q).transpose(1, 2)
    return _dense_of(s.rows, s.W, s.num_heads, s.L_q, s.L_k)


def vector_attention_reference(q: Tensor, k: Tensor, v: Tensor, structure: VectorAttentionStructure,
                               scale: float | None = None) -> Tensor:
    """The kernels' definition in PyTorch: masked softmax attention over the mask the
    structure encodes (rows with no allowed key give zeros), in the inputs' dtype,
    differentiable."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    allowed = structure_dense(structure).to(q.device)  # [NH, L_q, L_k], broadcast over the batch
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    return torch.matmul(p / torch.where(denom > 0, denom, torch.ones_like(denom)), v)


# --------------------------------------------------------------------------------------
# Kernels (jitted at first launch, see LazyKernel)
# --------------------------------------------------------------------------------------


@kernel_helper
def _window_program(ptr, H, NHL, NW, L, D, DVAL, W: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr):
    """This program's window and its ranges: ``(bh, b, h, start, end, offs_w, tok, valid,
    offs_d, d_valid, offs_dv, dv_valid)`` -- window ``w`` (fastest, so that the programs
    of one ``(b, h)`` share its rows in L2) of kernel row ``bh = b * H + h``; the span
    ``start:end`` of its entries (layout head ``h``, or 0 when shared); its positions
    ``tok = w * W + offs_w`` (``valid``: ``< L``); the head-dim ranges of ``q`` / ``k``
    (``D`` padded to ``BD``) and of ``v`` (``DVAL`` padded to ``BDV``)."""
    pid = tl.program_id(0)
    w = pid % NW
    bh = pid // NW
    g = (bh % H % NHL) * NW + w
    offs_w = tl.arange(0, W)
    tok = w * W + offs_w
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    return (bh, (bh // H).to(tl.int64), (bh % H).to(tl.int64), tl.load(ptr + g), tl.load(ptr + g + 1),
            offs_w, tok, tok < L, offs_d, offs_d < D, offs_dv, offs_dv < DVAL)


@kernel_helper
def _load_rows(base, rows, stride, row_valid, col_valid, UPCAST: tl.constexpr):
    """Rows ``rows`` (``[N, 1]`` int64) of a ``[.., BD]`` tile at ``base``; invalid rows and
    padded columns read as zeros (float32 when ``UPCAST``)."""
    x = tl.load(base + rows * stride, mask=row_valid[:, None] & col_valid[None, :], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@kernel_helper
def _entries(idx, bits, s0, end, offs_w, BLOCK_N: tl.constexpr):
    """``(index, valid, keep)`` of entries ``s0 .. s0 + BLOCK_N - 1`` (those ``< end``
    valid): their compacted indices (0 past the list), and the ``[W, BLOCK_N]`` element
    mask of their bit words (bit ``r`` of entry ``e`` is ``keep[r, e]``; all ``False``
    past the list)."""
    e = s0 + tl.arange(0, BLOCK_N)
    valid = e < end
    index = tl.load(idx + e, mask=valid, other=0)
    word = tl.load(bits + e, mask=valid, other=0)
    keep = ((word[None, :] >> offs_w[:, None]) & 1) != 0
    return index, valid, keep


def _fwd_kernel(
    Q, K, V, Out, Lse, ptr, idx, bits,
    sm_scale_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    H, NHL, L_q, NW, D, DVAL,
    W: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    bh, b, h, start, end, offs_w, tok_m, m_valid, offs_d, d_valid, offs_dv, dv_valid = _window_program(
        ptr, H, NHL, NW, L_q, D, DVAL, W, BD, BDV)
    rows = tok_m[:, None].to(tl.int64)
    q = _load_rows(Q + b * stride_qb + h * stride_qh + offs_d[None, :], rows, stride_qm, m_valid, d_valid, UPCAST)
    k_base = K + b * stride_kb + h * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + h * stride_vh + offs_dv[None, :]

    m_i = tl.full([W], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([W], dtype=tl.float32)
    acc = tl.zeros([W, BDV], dtype=tl.float32)
    for s0 in range(start, end, BLOCK_N):
        col, valid, keep = _entries(idx, bits, s0, end, offs_w, BLOCK_N)
        cols = col.to(tl.int64)[:, None]
        k = _load_rows(k_base, cols, stride_kn, valid, d_valid, UPCAST)
        v = _load_rows(v_base, cols, stride_vn, valid, dv_valid, UPCAST)
        # base-2 logits, scaled once (any sign of scale), masked per element
        s = tl.where(keep, tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    has_key = l_i > 0.0
    l_safe = tl.where(has_key, l_i, 1.0)
    tl.store(Lse + bh.to(tl.int64) * L_q + tok_m, tl.where(has_key, m_i + tl.log2(l_safe), float("inf")),
             mask=m_valid)
    tl.store(Out + b * stride_ob + h * stride_oh + rows * stride_om + offs_dv[None, :],
             (acc / l_safe[:, None]).to(Out.dtype.element_ty), mask=m_valid[:, None] & dv_valid[None, :])


def _bwd_dq_kernel(
    Q, K, V, DO, Out, Lse, Delta, DQ, ptr, idx, bits,
    sm_scale, sm_scale_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dm,
    stride_ob, stride_oh, stride_om,
    stride_dqb, stride_dqh, stride_dqm,
    H, NHL, L_q, NW, D, DVAL,
    W: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    bh, b, h, start, end, offs_w, tok_m, m_valid, offs_d, d_valid, offs_dv, dv_valid = _window_program(
        ptr, H, NHL, NW, L_q, D, DVAL, W, BD, BDV)
    rows = tok_m[:, None].to(tl.int64)
    q = _load_rows(Q + b * stride_qb + h * stride_qh + offs_d[None, :], rows, stride_qm, m_valid, d_valid, UPCAST)
    do = _load_rows(DO + b * stride_db + h * stride_dh + offs_dv[None, :], rows, stride_dm, m_valid, dv_valid,
                    UPCAST)
    o = _load_rows(Out + b * stride_ob + h * stride_oh + offs_dv[None, :], rows, stride_om, m_valid, dv_valid,
                   False)
    stat_base = bh.to(tl.int64) * L_q
    lse = tl.load(Lse + stat_base + tok_m, mask=m_valid, other=float("inf"))
    # Delta_i = dO_i . out_i of this window's rows, stored for _bwd_dkdv (launched next)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + stat_base + tok_m, delta, mask=m_valid)
    k_base = K + b * stride_kb + h * stride_kh + offs_d[None, :]
    v_base = V + b * stride_vb + h * stride_vh + offs_dv[None, :]

    dq = tl.zeros([W, BD], dtype=tl.float32)
    for s0 in range(start, end, BLOCK_N):
        col, valid, keep = _entries(idx, bits, s0, end, offs_w, BLOCK_N)
        cols = col.to(tl.int64)[:, None]
        k = _load_rows(k_base, cols, stride_kn, valid, d_valid, UPCAST)
        v = _load_rows(v_base, cols, stride_vn, valid, dv_valid, UPCAST)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        # empty rows have lse = +inf: P = 0, no gradient
        p = tl.where(keep, tl.exp2(qk * sm_scale_log2 - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)

    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows * stride_dqm + offs_d[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])


def _bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV, ptr, idx, bits,
    sm_scale, sm_scale_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_db, stride_dh, stride_dm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    H, NHL, L_q, L_k, NW, D, DVAL,
    W: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    # a key window and its compacted query rows
    bh, b, h, start, end, offs_w, tok_n, n_valid, offs_d, d_valid, offs_dv, dv_valid = _window_program(
        ptr, H, NHL, NW, L_k, D, DVAL, W, BD, BDV)
    keys = tok_n[:, None].to(tl.int64)
    k = _load_rows(K + b * stride_kb + h * stride_kh + offs_d[None, :], keys, stride_kn, n_valid, d_valid, UPCAST)
    v = _load_rows(V + b * stride_vb + h * stride_vh + offs_dv[None, :], keys, stride_vn, n_valid, dv_valid,
                   UPCAST)
    q_base = Q + b * stride_qb + h * stride_qh + offs_d[None, :]
    do_base = DO + b * stride_db + h * stride_dh + offs_dv[None, :]
    stat_base = bh.to(tl.int64) * L_q

    dk = tl.zeros([W, BD], dtype=tl.float32)
    dv = tl.zeros([W, BDV], dtype=tl.float32)
    for s0 in range(start, end, BLOCK_N):
        qrow, valid, keep = _entries(idx, bits, s0, end, offs_w, BLOCK_N)  # keep: [W keys, BLOCK_N queries]
        qrows = qrow.to(tl.int64)[:, None]
        q = _load_rows(q_base, qrows, stride_qm, valid, d_valid, UPCAST)
        do = _load_rows(do_base, qrows, stride_dm, valid, dv_valid, UPCAST)
        lse = tl.load(Lse + stat_base + qrow, mask=valid, other=float("inf"))
        delta = tl.load(Delta + stat_base + qrow, mask=valid, other=0.0)
        qkT = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        pT = tl.where(keep, tl.exp2(qkT * sm_scale_log2 - lse[None, :]), 0.0)
        dv += tl.dot(pT.to(do.dtype), do, input_precision=PRECISION)
        dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(q.dtype), q, input_precision=PRECISION)

    tl.store(DK + b * stride_dkb + h * stride_dkh + keys * stride_dkn + offs_d[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=n_valid[:, None] & d_valid[None, :])
    tl.store(DV + b * stride_dvb + h * stride_dvh + keys * stride_dvn + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=n_valid[:, None] & dv_valid[None, :])


_fwd = LazyKernel(_fwd_kernel)
_bwd_dq = LazyKernel(_bwd_dq_kernel)
_bwd_dkdv = LazyKernel(_bwd_dkdv_kernel)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _num_warps(W: int) -> int:
    return 4 if W <= 32 else 8


def _forward(q: Tensor, k: Tensor, v: Tensor, st: VectorAttentionStructure, scale: float, precision: str,
             BLOCK_N: int) -> tuple[Tensor, Tensor]:
    if _off_current_device(q):  # Triton launches on the current device: make it q's
        with torch.cuda.device(q.device):
            return _forward(q, k, v, st, scale, precision, BLOCK_N)
    B, H, L_q, D = q.shape
    DV = v.size(-1)
    out = torch.empty(B, H, L_q, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, L_q, dtype=torch.float32, device=q.device)
    NW = -(-L_q // st.W)
    if B * H == 0:
        return out, lse
    _fwd[(NW * B * H,)](
        q, k, v, out, lse, st.rows.ptr, st.rows.idx, st.rows.bits,
        scale * _LOG2E, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
        H, st.num_heads, L_q, NW, D, DV,
        W=st.W, BLOCK_N=BLOCK_N, BD=max(16, next_pow2(D)), BDV=max(16, next_pow2(DV)),
        PRECISION=precision, UPCAST=_upcast(q.dtype), num_warps=_num_warps(st.W), num_stages=2,
    )
    return out, lse


def _backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, st: VectorAttentionStructure,
              scale: float, precision: str, BLOCK_N: int, need_dq: bool,
              need_dkdv: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    if _off_current_device(q):
        with torch.cuda.device(q.device):
            return _backward(do, q, k, v, out, lse, st, scale, precision, BLOCK_N, need_dq, need_dkdv)
    B, H, L_q, D = q.shape
    L_k, DV = v.size(2), v.size(3)
    do = _last_contiguous(do)
    dq = torch.empty_like(q, memory_format=torch.contiguous_format) if need_dq else None
    dk = torch.empty_like(k, memory_format=torch.contiguous_format) if need_dkdv else None
    dv = torch.empty_like(v, memory_format=torch.contiguous_format) if need_dkdv else None
    if B * H == 0:
        return dq, dk, dv
    meta = dict(W=st.W, BLOCK_N=BLOCK_N, BD=max(16, next_pow2(D)), BDV=max(16, next_pow2(DV)),
                PRECISION=precision, UPCAST=_upcast(q.dtype), num_warps=_num_warps(st.W), num_stages=2)
    if need_dq:  # also stores delta = rowsum(dO * out), which _bwd_dkdv reads
        delta = torch.empty(B, H, L_q, dtype=torch.float32, device=q.device)
        NW = -(-L_q // st.W)
        _bwd_dq[(NW * B * H,)](
            q, k, v, do, out, lse, delta, dq, st.rows.ptr, st.rows.idx, st.rows.bits,
            scale, scale * _LOG2E, *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(out),
            *_strides(dq), H, st.num_heads, L_q, NW, D, DV, **meta,
        )
    else:
        delta = (out.float() * do.float()).sum(-1)
    if need_dkdv:
        NKW = -(-L_k // st.W)
        _bwd_dkdv[(NKW * B * H,)](
            q, k, v, do, lse, delta, dk, dv, st.cols.ptr, st.cols.idx, st.cols.bits,
            scale, scale * _LOG2E, *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk),
            *_strides(dv), H, st.num_heads, L_q, L_k, NKW, D, DV, **meta,
        )
    return dq, dk, dv


class VectorAttentionFunction(torch.autograd.Function):
    """Autograd wrapper: ``apply(q, k, v, structure, scale, precision, BLOCK_N) -> (out,
    lse)`` (``lse`` base 2, ``+inf`` for empty rows, not differentiable)."""

    @staticmethod
    def forward(ctx, q, k, v, structure, scale, precision, BLOCK_N):  # type: ignore[override]
        q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
        out, lse = _forward(q, k, v, structure, scale, precision, BLOCK_N)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (structure, scale, precision, BLOCK_N)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):  # type: ignore[override]
        if grad_out is None:
            return None, None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        need_dq, need_dk, need_dv = ctx.needs_input_grad[:3]
        dq, dk, dv = _backward(grad_out, q, k, v, out, lse, *ctx.args, need_dq, need_dk or need_dv)
        return dq, (dk if need_dk else None), (dv if need_dv else None), None, None, None, None


def _check_structure(q: Tensor, k: Tensor, structure: object) -> VectorAttentionStructure:
    if not isinstance(structure, VectorAttentionStructure):
        raise TypeError(f"structure must be a VectorAttentionStructure, got {type(structure).__name__}")
    B, H, L_q, _ = q.shape
    if (structure.L_q, structure.L_k) != (L_q, k.size(2)):
        raise ValueError(
            f"structure is for L_q x L_k = {structure.L_q} x {structure.L_k}, but q, k have {L_q} and {k.size(2)}"
        )
    if structure.num_heads not in (1, H):
        raise ValueError(f"structure has {structure.num_heads} heads; need 1 (shared) or H = {H}")
    if structure.device != q.device:
        raise ValueError(f"structure is on {structure.device} but q is on {q.device}: build it on q's device")
    return structure


def vector_sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    structure: VectorAttentionStructure,
    scale: float | None = None,
    *,
    block_n: int = DEFAULT_BLOCK_N,
    allow_tf32: bool | None = None,
) -> Tensor:
    r"""Masked softmax attention over the structure's query windows, fused (module doc).

    Args:
        q: ``[B, H, L_q, D]`` queries (float16, bfloat16 or float32).
        k: ``[B, H, L_k, D]`` keys; v: ``[B, H, L_k, D_v]`` values (same dtype, device).
        structure: :func:`build_structure` of the mask on ``q``'s device, shared
            (``num_heads == 1``) or per head (``num_heads == H``).
        scale: multiplies :math:`q \cdot k` (default :math:`1/\sqrt{D}`).
        block_n: compacted columns (rows, in the ``dK`` / ``dV`` kernel) per step, a power
            of two in ``[16, 128]``.
        allow_tf32: float32 inputs only: TF32 tensor cores (default: when
            ``torch.get_float32_matmul_precision() != "highest"``).

    Returns:
        ``[B, H, L_q, D_v]`` in ``q``'s dtype; rows with no allowed key are zero.
        Differentiable in ``q``, ``k``, ``v`` (deterministic backward, no atomics).
    """
    check_qkv(q, k, v, BLOCK_ATTENTION_DTYPES)
    structure = _check_structure(q, k, structure)
    _, block_n = check_vector_sizes(structure.W, block_n)
    if triton is None or not (q.device.type == "cuda" or (q.device.type == "cpu" and interpreter_enabled())):
        raise RuntimeError("vector_sparse_attention needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU) and triton")
    scale = check_scale(scale, q.size(-1))
    out, _ = VectorAttentionFunction.apply(q, k, v, structure, scale, _precision(q.dtype, allow_tf32), block_n)
    return out
