r"""Linear + cross-entropy without the ``[M, C]`` logits: chunked GEMMs and one fused row kernel.

For rows :math:`h_i` (``[K]``), a classifier :math:`W` (``[C, K]``), bias :math:`b` and
targets :math:`y_i`, with label smoothing :math:`\varepsilon`:

.. math::
    z_i = W h_i + b, \qquad \ell_i = \operatorname{lse}(z_i) - (1-\varepsilon)\, z_{i y_i}
          - \frac{\varepsilon}{C} \sum_c z_{ic},

and (loss elimination, thesis ch. 6, Eq. 6.1: the gradient needs no loss value)

.. math::
    \frac{\partial L}{\partial z_{ic}} = s_i \Big(\operatorname{softmax}(z_i)_c
        - (1-\varepsilon)[c = y_i] - \frac{\varepsilon}{C}\Big),

with :math:`s_i` = ``1 / n_valid`` (mean), ``1`` (sum) or the incoming per-row gradient
(``reduction="none"``), and :math:`s_i = 0` on rows whose target is ``ignore_index``. Then
:math:`\partial h_i = \sum_c \partial z_{ic} W_c`, :math:`\partial W = \partial z^\top h`,
:math:`\partial b = \sum_i \partial z_i`.

The rows are processed in chunks of ``R`` rows, so the only logits ever in memory are one
``[R, C']`` buffer in the input dtype (its size is a budget: :data:`CHUNK_BYTES`, or
:data:`HEAD_CHUNK_BYTES` for heads of up to :data:`SMALL_HEAD_CLASSES` classes); ``C'`` is
``C`` padded to a multiple of :data:`CLASS_ALIGN` with zero rows of ``W`` and ``b`` when
that copy is at most :data:`PAD_MAX_WEIGHT_BYTES` (:func:`_padded_classes`: aligned rows
for cuBLAS and vectorised loads), else ``C``:

1. ``logits = h_chunk @ W^T + b`` (cuBLAS, fp32 accumulation, one rounding to the dtype --
   as ``F.linear`` does);
2. :data:`rows_kernel` (Triton), one pass per row block: an online log-sum-exp in the
   accumulation dtype over class tiles, the target logit, the sum of logits (label
   smoothing) -> the per-row loss, then :math:`\partial z` written **over the logits buffer
   in place** (no second buffer) -- from the registers when a row fits one tile, else by a
   second sweep; padded columns get ``dz = 0``;
3. ``dh_chunk = dz @ W`` and ``dW += dz^T @ h_chunk`` (cuBLAS; ``dW`` from the ``C`` real
   columns only), ``db += dz.sum(0)``.

Heads of up to :data:`HEAD_MAX_CLASSES` classes (GNN heads) take :data:`head_kernel`
instead: one Triton kernel per block of rows computes the logits with ``tl.dot``, the
log-sum-exp, the loss, ``dz`` and ``dh = dz W`` on chip and stores only ``dz`` (for the
``dW`` GEMM), in chunks of :data:`HEAD_CHUNK_BYTES`.

**Precision of dh in half precision.** ``dz`` is stored in the input dtype for the
tensor-core products, and a row's target entry :math:`s (p_y - 1 + \dots)` -- its largest,
of order :math:`s` -- loses ``2^-9`` of itself to that rounding (bfloat16): in ``dh`` that
is more error than the output's own rounding (bfloat16 GNN heads, norm-wise against
float32: 2.6e-3 on a product of the rounded ``dz``, as eager's, against 1.7e-3 for the
rounding of ``dh`` alone). :data:`head_kernel` therefore multiplies ``W`` by ``dz`` in two
half parts (``hi + lo``): a second ``tl.dot`` in a memory-bound kernel. The GEMM path keeps
the product of the rounded ``dz`` (2.1e-3 on ogbn-mag's 349-class head, 1.7e-3 on a
language model's): carrying the remainder there needs the correction inside the ``dh``
GEMM, and a Triton GEMM with that epilogue ran at 0.6x cuBLAS on these shapes (H100,
benchmarks/NOTES-loss.md, session 17).

With ``index`` the rows that count are ``h[index]`` (repeats count each time); a chunk's
rows are gathered into an ``[R, K]`` workspace for the GEMM (never an ``[len(index), K]``
copy), the kernel reads targets through ``index``, and ``dh`` receives the rows with
``index_add_`` (repeats add up). ``dW`` is accumulated in float32 when ``C x K`` float32 fits
the chunk budget (GNN heads: exact to one final rounding); otherwise (language-model heads)
in the weight's dtype, one rounding per chunk.

:func:`linear_cross_entropy_reference` is the pure-PyTorch definition the fused path must
match (``F.cross_entropy(F.linear(h[index], W, b), target[index], ...)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fusegnn.kernels._edge_utils import acc_dtype
from fusegnn.kernels._triton import LazyKernel, interpreter_enabled, kernel_helper, next_pow2

__all__ = [
    "CHUNK_BYTES",
    "HEAD_CHUNK_BYTES",
    "HEAD_MAX_CLASSES",
    "LossAndGrads",
    "chunk_rows_for",
    "fused_linear_cross_entropy",
    "head_kernel",
    "linear_cross_entropy_reference",
    "rows_kernel",
    "scale_all_unless_one",
]

#: byte budget of the one ``[R, C']`` logits buffer (and of a float32 ``dW`` accumulator)
CHUNK_BYTES = 128 * 2**20
#: classes up to which :data:`head_kernel` keeps a row block's logits on chip (GNN heads);
#: more classes take the GEMM path, which was faster from 349 classes on (H100:
#: benchmarks/NOTES-loss.md, session 13)
HEAD_MAX_CLASSES = 128
#: byte budget of the head path's per-chunk buffers (``dz`` rows; ``dh`` rows with
#: ``index``), and of the GEMM path's (logits; gathered rows and their ``dh`` with
#: ``index``) for heads of up to :data:`SMALL_HEAD_CLASSES` classes
HEAD_CHUNK_BYTES = 32 * 2**20
#: classes up to which the GEMM path chunks by :data:`HEAD_CHUNK_BYTES`: a GNN head has
#: many rows, so its ``dh`` is most of the peak and the chunk stays small
SMALL_HEAD_CLASSES = 512
#: the GEMM path pads the classes to a multiple of ``CLASS_ALIGN``: 16-byte rows for
#: cuBLAS's aligned kernels and 16-column rows for the row kernel's vectorised loads
#: (both several times faster than unaligned rows: benchmarks/NOTES-loss.md) ...
CLASS_ALIGN = 16
#: ... through a zero-padded copy of ``W`` of at most this many bytes (larger unaligned
#: vocabularies run unpadded)
PAD_MAX_WEIGHT_BYTES = 16 * 2**20
#: elements of one row-kernel tile (``BLOCK_R x BLOCK_C``)
_TILE = 4096
#: input dtypes whose ``dz`` :data:`head_kernel` carries in two parts for ``dh``
_HALF = (torch.float16, torch.bfloat16)
#: a row that fits one tile of up to ``_ROW_PER_WARP`` columns is held by one warp, two rows
#: a warp, two warps a program (its reductions stay within the warp); wider one-tile rows
#: get a warp per ``_ROW_PER_WARP`` columns, one row a program (the fastest launches on an
#: H100: 30.7 against 46.1 us for a 47,616 x 352 bf16 chunk; benchmarks/NOTES-loss.md,
#: sessions 13-14)
_ROW_PER_WARP = 512


@kernel_helper
def _block_rows(index_ptr, target_ptr, row0, n_rows, ignore_index, smoothing,
                HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """This program's rows of the chunk: ``(local, in_rows, src, y, valid, eps)`` -- chunk
    rows, which are real, rows of ``h`` (through ``index``), targets, which count, and the
    smoothing per row (passed as float64 so that float64 inputs get it exactly)."""
    local = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_rows = local < n_rows
    if HAS_INDEX:
        src = tl.load(index_ptr + row0 + local, mask=in_rows, other=0).to(tl.int64)
    else:
        src = row0 + local
    y = tl.load(target_ptr + src, mask=in_rows, other=ignore_index).to(tl.int64)
    valid = in_rows & (y != ignore_index)
    eps = (tl.zeros([BLOCK], ACC) + smoothing).to(ACC)
    return local, in_rows, src, y, valid, eps


@kernel_helper
def _store_row_loss(loss_ptr, row0, local, in_rows, valid, lse, z_y, z_sum, eps, num_classes):
    """``loss = lse - (1 - eps) z_y - eps / C * sum(z)`` (0 on ignored rows)."""
    loss = lse - (1.0 - eps) * z_y - (eps / num_classes) * z_sum
    tl.store(loss_ptr + row0 + local, tl.where(valid, loss, 0.0).to(loss_ptr.dtype.element_ty), mask=in_rows)


@kernel_helper
def _row_scale(scale_ptr, row0, local, in_rows, valid, SCALE_PER_ROW: tl.constexpr, BLOCK: tl.constexpr,
               ACC: tl.constexpr):
    """:math:`s_i`: one value or one per row, 0 on ignored rows."""
    if SCALE_PER_ROW:
        scale = tl.load(scale_ptr + row0 + local, mask=in_rows, other=0.0).to(ACC)
    else:
        scale = tl.zeros([BLOCK], ACC) + tl.load(scale_ptr).to(ACC)
    return tl.where(valid, scale, 0.0)


@kernel_helper
def _grad_from_probs(p, is_y, eps, num_classes, scale):
    """``dz = s (p - (1 - eps) [c = y] - eps / C)`` from the softmax ``p``; ``eps`` and ``s``
    are per-row values already broadcast against ``p`` (any tile shape)."""
    return (p - tl.where(is_y, 1.0 - eps, 0.0) - eps / num_classes) * scale


@kernel_helper
def _logit_grad(z, lse, cols, y, eps, num_classes, scale):
    """``dz = s (softmax(z) - (1 - eps) onehot(y) - eps / C)`` of a ``[rows, classes]`` tile."""
    return _grad_from_probs(tl.exp(z - lse[:, None]), cols[None, :] == y[:, None], eps[:, None], num_classes,
                            scale[:, None])


@kernel_helper
def _target_logit(z_ptr, stride_z, local, y, valid, num_classes):
    """``z[row, y]`` of each valid row, read from memory (a scalar load per row instead of
    a reduction over the row's tile; 0 on ignored rows, whose loss is 0). An id outside
    ``[0, C)`` reads nothing (0): the op layer rejects those, but a replayed CUDA graph
    skips its check, and the load must not reach into another row or past the buffer."""
    in_row = valid & (y >= 0) & (y < num_classes)
    return tl.load(z_ptr + local * stride_z + tl.where(in_row, y, 0), mask=in_row, other=0.0)


def _rows_kernel(
    z_ptr, stride_z, target_ptr, index_ptr, scale_ptr, loss_ptr,
    row0, n_rows, num_cols, num_classes, ignore_index, smoothing: tl.float64,
    HAS_INDEX: tl.constexpr, SCALE_PER_ROW: tl.constexpr, WRITE_GRAD: tl.constexpr, SMOOTHING: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr, ONE_TILE: tl.constexpr, SPLIT: tl.constexpr,
):
    """Rows ``row0 + [pid*BLOCK_R, +BLOCK_R)`` of the chunk whose logits are ``z`` (row
    ``r`` of the chunk is ``z[r - row0]``): per-row loss, and the logits' gradient in place.
    A row holds ``num_cols`` columns, the first ``num_classes`` of them classes (the rest
    padding, written 0): loads and stores cover whole rows, so that a padded row (a
    multiple of 16 columns) is read with vector loads. The target logit is one load per
    row; the sum of the logits (label smoothing) is formed only when ``SMOOTHING``.

    With ``ONE_TILE`` (the row in one ``BLOCK_C`` tile) the logits are read once, as an
    ``[SPLIT, BLOCK_R, BLOCK_C / SPLIT]`` tile whose last axis is one warp's vector loads,
    so that the warps spread over the rows and a row's reductions stay within its warp;
    the gradient comes from the registers (``softmax = e / sum(e)``). Otherwise an online
    log-sum-exp over ``[BLOCK_R, BLOCK_C]`` tiles, then a second sweep for the gradient."""
    local, in_rows, src, y, valid, eps = _block_rows(index_ptr, target_ptr, row0, n_rows, ignore_index, smoothing,
                                                     HAS_INDEX, BLOCK_R, ACC)
    z_y = _target_logit(z_ptr, stride_z, local, y, valid, num_classes).to(ACC)
    neg_inf = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    if ONE_TILE:
        PIECE: tl.constexpr = BLOCK_C // SPLIT
        cols = tl.arange(0, SPLIT)[:, None, None] * PIECE + tl.arange(0, PIECE)[None, None, :]
        ptrs = z_ptr + local[None, :, None] * stride_z + cols
        mask = in_rows[None, :, None] & (cols < num_cols)
        is_class = cols < num_classes
        z = tl.where(is_class, tl.load(ptrs, mask=mask, other=neg_inf).to(ACC), neg_inf)
        m = tl.max(tl.max(z, axis=2), axis=0)
        m = tl.where(m == neg_inf, 0.0, m)  # a row of padding only
        e = tl.exp2((z - m[None, :, None]) * LOG2E)
        s = tl.sum(tl.sum(e, axis=2), axis=0)
        s = tl.where(s > 0.0, s, 1.0)
        lse = m + tl.log(s)
        z_sum = tl.zeros([BLOCK_R], ACC)
        if SMOOTHING:
            z_sum = tl.sum(tl.sum(tl.where(mask & is_class, z, 0.0), axis=2), axis=0)
        _store_row_loss(loss_ptr, row0, local, in_rows, valid, lse, z_y, z_sum, eps, num_classes)
        if WRITE_GRAD:
            scale = _row_scale(scale_ptr, row0, local, in_rows, valid, SCALE_PER_ROW, BLOCK_R, ACC)
            dz = _grad_from_probs(e * (1.0 / s)[None, :, None], cols == y[None, :, None], eps[None, :, None],
                                  num_classes, scale[None, :, None])
            tl.store(ptrs, tl.where(is_class, dz, 0.0).to(z_ptr.dtype.element_ty), mask=mask)
    else:
        zrow = z_ptr + local[:, None] * stride_z
        cols0 = tl.arange(0, BLOCK_C)
        m = tl.full([BLOCK_R], neg_inf, ACC)
        s = tl.zeros([BLOCK_R], ACC)
        z_sum = tl.zeros([BLOCK_R], ACC)
        for c0 in range(0, num_cols, BLOCK_C):
            cols = c0 + cols0
            mask = in_rows[:, None] & (cols < num_cols)[None, :]
            is_class = (cols < num_classes)[None, :]
            z = tl.where(is_class, tl.load(zrow + cols[None, :], mask=mask, other=neg_inf).to(ACC), neg_inf)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            m_safe = tl.where(m_new == neg_inf, 0.0, m_new)  # a row of padding only
            s = s * tl.exp2((m - m_safe) * LOG2E) + tl.sum(tl.exp2((z - m_safe[:, None]) * LOG2E), axis=1)
            m = m_new
            if SMOOTHING:
                z_sum += tl.sum(tl.where(mask & is_class, z, 0.0), axis=1)
        m_safe = tl.where(m == neg_inf, 0.0, m)
        lse = m_safe + tl.log(tl.where(s > 0.0, s, 1.0))
        _store_row_loss(loss_ptr, row0, local, in_rows, valid, lse, z_y, z_sum, eps, num_classes)
        if WRITE_GRAD:
            scale = _row_scale(scale_ptr, row0, local, in_rows, valid, SCALE_PER_ROW, BLOCK_R, ACC)
            for c0 in range(0, num_cols, BLOCK_C):
                cols = c0 + cols0
                mask = in_rows[:, None] & (cols < num_cols)[None, :]
                z = tl.load(zrow + cols[None, :], mask=mask, other=0.0).to(ACC)
                dz = _logit_grad(z, lse, cols, y, eps, num_classes, scale)
                tl.store(zrow + cols[None, :], tl.where((cols < num_classes)[None, :], dz, 0.0)
                         .to(z_ptr.dtype.element_ty), mask=mask)


#: ``triton.language``, bound at the first launch (the kernel's body reads it when it is
#: jitted); importing this module imports no Triton, so the reference needs none and
#: ``TRITON_INTERPRET`` may still be set after the import.
tl = None

rows_kernel = LazyKernel(_rows_kernel)


def _head_kernel(
    h_ptr, stride_h, w_ptr, b_ptr, target_ptr, index_ptr, scale_ptr, loss_ptr, dz_ptr, stride_dz,
    dh_ptr, stride_dh, row0, n_rows, num_classes, features, ignore_index, smoothing: tl.float64,
    HAS_INDEX: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_PER_ROW: tl.constexpr,
    WRITE_DZ: tl.constexpr, WRITE_DH: tl.constexpr, DH_BY_CHUNK_ROW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, ACC: tl.constexpr,
    UPCAST: tl.constexpr, SPLIT_DZ: tl.constexpr,
):
    """Rows ``row0 + [pid*BLOCK_M, +BLOCK_M)`` with every class on chip (``C <= BLOCK_C``):
    logits ``h W^T + b`` (tensor cores, ``ACC`` accumulation), log-sum-exp, per-row loss;
    then ``dz`` (stored for the ``dW`` GEMM when ``WRITE_DZ``) and ``dh = dz W`` (stored at
    the row of ``h``, or at the chunk row when ``DH_BY_CHUNK_ROW``)."""
    local, in_rows, src, y, valid, eps = _block_rows(index_ptr, target_ptr, row0, n_rows, ignore_index, smoothing,
                                                     HAS_INDEX, BLOCK_M, ACC)
    cols = tl.arange(0, BLOCK_C)
    in_cols = cols < num_classes
    ks = tl.arange(0, BLOCK_K)
    z = tl.zeros([BLOCK_M, BLOCK_C], ACC)
    for k0 in range(0, features, BLOCK_K):
        kk = k0 + ks
        a = tl.load(h_ptr + src[:, None] * stride_h + kk[None, :],
                    mask=in_rows[:, None] & (kk < features)[None, :], other=0.0)
        wt = tl.load(w_ptr + cols[None, :] * features + kk[:, None],
                     mask=in_cols[None, :] & (kk < features)[:, None], other=0.0)
        if UPCAST:
            a, wt = a.to(ACC), wt.to(ACC)
        z += tl.dot(a, wt, input_precision="ieee", out_dtype=ACC)
    if HAS_BIAS:
        z += tl.load(b_ptr + cols, mask=in_cols, other=0.0).to(ACC)[None, :]
    z = tl.where(in_cols[None, :], z, float("-inf"))
    m = tl.max(z, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    e = tl.exp(z - m[:, None])
    lse = m + tl.log(tl.sum(e, axis=1))
    is_y = cols[None, :] == y[:, None]
    z_y = tl.sum(tl.where(is_y, z, 0.0), axis=1)
    z_sum = tl.sum(tl.where(in_cols[None, :], z, 0.0), axis=1)
    _store_row_loss(loss_ptr, row0, local, in_rows, valid, lse, z_y, z_sum, eps, num_classes)
    if WRITE_DZ or WRITE_DH:
        scale = _row_scale(scale_ptr, row0, local, in_rows, valid, SCALE_PER_ROW, BLOCK_M, ACC)
        dz_acc = tl.where(in_cols[None, :], _logit_grad(z, lse, cols, y, eps, num_classes, scale), 0.0)
        dz = dz_acc.to(dz_ptr.dtype.element_ty)
        if WRITE_DZ:
            tl.store(dz_ptr + local[:, None] * stride_dz + cols[None, :], dz,
                     mask=in_rows[:, None] & in_cols[None, :])
        if WRITE_DH:
            if DH_BY_CHUNK_ROW:
                out_rows = local
            else:
                out_rows = src
            # half inputs: dz = hi + lo, both in the input dtype, and dh = hi W + lo W -- the
            # rounding of dz (its target entry above all) would otherwise bound dh's error
            # (bfloat16 GNN heads: 2.6e-3 -> 1.7e-3 norm-wise against float32, the output's
            # own rounding); float32 / float64 have lo = 0 and skip it
            dz_lo = (dz_acc - dz.to(ACC)).to(dz.dtype)
            for k0 in range(0, features, BLOCK_K):
                kk = k0 + ks
                wk = tl.load(w_ptr + cols[:, None] * features + kk[None, :],
                             mask=in_cols[:, None] & (kk < features)[None, :], other=0.0)
                if UPCAST:
                    dh = tl.dot(dz.to(ACC), wk.to(ACC), input_precision="ieee", out_dtype=ACC)
                    if SPLIT_DZ:
                        dh += tl.dot(dz_lo.to(ACC), wk.to(ACC), input_precision="ieee", out_dtype=ACC)
                else:
                    dh = tl.dot(dz, wk, input_precision="ieee", out_dtype=ACC)
                    if SPLIT_DZ:
                        dh += tl.dot(dz_lo, wk, input_precision="ieee", out_dtype=ACC)
                tl.store(dh_ptr + out_rows[:, None] * stride_dh + kk[None, :], dh.to(dh_ptr.dtype.element_ty),
                         mask=in_rows[:, None] & (kk < features)[None, :])


head_kernel = LazyKernel(_head_kernel)


_TL_NAMES = {torch.float32: "float32", torch.float64: "float64"}


def _bind_triton_language():
    """Import ``triton.language`` and bind it as this module's ``tl`` (read by the kernels'
    bodies when they are jitted at their first launch); returns it."""
    global tl
    import triton.language as language

    tl = language
    return language


@kernel_helper
def _scale_block(x_ptr, g, block, n, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """``x[block BLOCK : (block + 1) BLOCK] *= g`` (``x`` flat, ``n`` elements), in ``ACC``,
    rounded once."""
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_x = offs < n
    x = tl.load(x_ptr + offs, mask=in_x, other=0.0).to(ACC)
    tl.store(x_ptr + offs, (x * g).to(x_ptr.dtype.element_ty), mask=in_x)


def _scale_kernel(x0_ptr, x1_ptr, x2_ptr, g_ptr, n0, n1, n2, start1, start2,
                  BLOCK: tl.constexpr, ACC: tl.constexpr):
    """``x_t *= g`` for three flat tensors (``n_t`` elements each, ``g`` one element),
    unless ``g == 1``: then every program returns after one scalar load, so the common case
    (``loss.backward()``) costs a launch, not a pass over the tensors, and needs no
    read-back of ``g`` to the host. The grid covers the tensors' blocks one after another:
    blocks ``[0, start1)`` are ``x0``'s, ``[start1, start2)`` ``x1``'s, the rest ``x2``'s
    (an absent tensor has no block)."""
    g = tl.load(g_ptr).to(ACC)
    if g != 1.0:
        pid = tl.program_id(0)
        if pid < start1:
            _scale_block(x0_ptr, g, pid, n0, BLOCK, ACC)
        elif pid < start2:
            _scale_block(x1_ptr, g, pid - start1, n1, BLOCK, ACC)
        else:
            _scale_block(x2_ptr, g, pid - start2, n2, BLOCK, ACC)


scale_kernel = LazyKernel(_scale_kernel)

_SCALE_BLOCK = 4096
#: tensors that one launch of :data:`scale_kernel` scales (the loss's ``dh``, ``dW``, ``db``)
_SCALE_MAX_TENSORS = 3


def scale_all_unless_one(tensors: Sequence[Tensor | None], g: Tensor) -> None:
    """``x *= g`` in place for each ``x`` of ``tensors`` (at most three, contiguous, one dtype
    and device; ``None`` and empty ones are skipped), computed in the accumulation dtype and
    rounded once, all in **one** launch (a launch costs more host time than a small head's
    scaling); nothing but that launch when ``g`` is 1. ``g`` is a one-element tensor on the
    tensors' device, read there: the caller never synchronises with it (capture-safe)."""
    present = [x for x in tensors if x is not None]
    if len(present) > _SCALE_MAX_TENSORS:
        raise ValueError(f"scale_all_unless_one: at most {_SCALE_MAX_TENSORS} tensors, got {len(present)}")
    if g.numel() != 1:
        raise ValueError(f"scale_all_unless_one: g must have one element, got shape {tuple(g.shape)}")
    for x in present:
        if not x.is_contiguous():
            raise ValueError("scale_all_unless_one: tensors must be contiguous")
        if x.dtype != present[0].dtype or x.device != present[0].device or x.device != g.device:
            raise ValueError("scale_all_unless_one: tensors must share one dtype and g's device, got "
                             f"{[(t.dtype, str(t.device)) for t in present]} and g on {g.device}")
    scaled = [x for x in present if x.numel() > 0]
    if not scaled:
        return
    language = _bind_triton_language()
    absent = _SCALE_MAX_TENSORS - len(scaled)
    sizes = [x.numel() for x in scaled] + [0] * absent
    blocks = [(n + _SCALE_BLOCK - 1) // _SCALE_BLOCK for n in sizes]
    acc = getattr(language, _TL_NAMES[acc_dtype(scaled[0].dtype)])
    scale_kernel[(sum(blocks),)](
        *(scaled + scaled[:1] * absent), g, *sizes, blocks[0], blocks[0] + blocks[1],
        BLOCK=_SCALE_BLOCK, ACC=acc, num_warps=4,
    )


def _launch_rows(z: Tensor, num_classes: int, target: Tensor, index: Tensor | None, scale: Tensor, loss: Tensor,
                 row0: int, ignore_index: int, smoothing: float, write_grad: bool, per_row: bool) -> None:
    """:data:`rows_kernel` over the chunk ``z`` (``[R, width]``, its first ``num_classes``
    columns the classes, the rest padding)."""
    language = _bind_triton_language()
    n_rows, num_cols = z.shape
    block_c = min(next_pow2(num_cols), _TILE)
    one_tile = num_cols <= block_c
    split = 1
    if one_tile:
        # the tile's last axis is one warp's 16-byte loads, so its warps spread over rows
        split = block_c // min(block_c, 32 * (16 // z.element_size()))
        if block_c <= _ROW_PER_WARP:
            block_r, warps = 4, 2
        else:
            block_r, warps = 1, min(8, block_c // _ROW_PER_WARP)
    else:
        block_r = max(1, min(_TILE // block_c, 64, next_pow2(n_rows)))
        warps = 4 if block_c * block_r <= 2048 else 8
    grid = ((n_rows + block_r - 1) // block_r,)
    acc = getattr(language, _TL_NAMES[acc_dtype(z.dtype)])
    dummy = target
    rows_kernel[grid](
        z, z.stride(0), target, index if index is not None else dummy, scale, loss,
        row0, n_rows, num_cols, num_classes, ignore_index, float(smoothing),
        HAS_INDEX=index is not None, SCALE_PER_ROW=per_row, WRITE_GRAD=write_grad, SMOOTHING=smoothing != 0.0,
        BLOCK_R=block_r, BLOCK_C=block_c, ACC=acc, ONE_TILE=one_tile, SPLIT=split, num_warps=warps,
    )


def _head_blocks(num_classes: int, features: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_C, BLOCK_K, warps, stages)`` of :data:`head_kernel`: about 8K
    logits on chip; the ``[BLOCK_C, BLOCK_K]`` weight tiles of the pipeline stages must fit
    the shared memory (228 KiB on an H100)."""
    block_c = max(16, next_pow2(num_classes))
    block_m = max(16, min(128, 8192 // block_c))
    block_k = max(16, min(64, next_pow2(features)))
    tile = (block_c + block_m) * block_k * torch.empty((), dtype=dtype).element_size()
    stages = max(1, min(3, (160 * 1024) // tile))
    return block_m, block_c, block_k, 8 if block_c >= 256 else 4, stages


def _launch_head(h, weight, bias, target, index, scale, loss, dz, dh, row0, n_rows, ignore_index, smoothing,
                 per_row: bool, dh_by_chunk_row: bool) -> None:
    language = _bind_triton_language()
    num_classes, features = weight.shape
    block_m, block_c, block_k, warps, stages = _head_blocks(num_classes, features, h.dtype)
    acc = getattr(language, _TL_NAMES[acc_dtype(h.dtype)])
    grid = ((n_rows + block_m - 1) // block_m,)
    head_kernel[grid](
        h, h.stride(0), weight, bias if bias is not None else weight, target,
        index if index is not None else target, scale, loss,
        dz if dz is not None else h, dz.stride(0) if dz is not None else 0,
        dh if dh is not None else h, dh.stride(0) if dh is not None else 0,
        row0, n_rows, num_classes, features, ignore_index, float(smoothing),
        HAS_INDEX=index is not None, HAS_BIAS=bias is not None, SCALE_PER_ROW=per_row,
        WRITE_DZ=dz is not None, WRITE_DH=dh is not None, DH_BY_CHUNK_ROW=dh_by_chunk_row,
        BLOCK_M=block_m, BLOCK_C=block_c, BLOCK_K=block_k, ACC=acc, num_warps=warps, num_stages=stages,
        # Triton's interpreter multiplies half-precision dot operands wrongly: upcast there
        UPCAST=interpreter_enabled() and h.dtype in _HALF, SPLIT_DZ=h.dtype in _HALF,
    )


def chunk_rows_for(num_rows: int, num_classes: int, dtype: torch.dtype, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Rows per chunk: as many as fit ``chunk_bytes`` of ``[R, C]`` logits (a multiple of
    64 when that is more than 64), at least one, at most ``num_rows``."""
    per_row = max(num_classes, 1) * torch.empty((), dtype=dtype).element_size()
    rows = max(1, chunk_bytes // per_row)
    if rows > 64:
        rows -= rows % 64
    return max(1, min(rows, num_rows))


class LossAndGrads:
    """What :func:`fused_linear_cross_entropy` returns: per-row losses (``[M]``, accumulation
    dtype, 0 on ignored rows) and, when asked for, the gradients (``None`` otherwise)."""

    __slots__ = ("loss", "grad_h", "grad_weight", "grad_bias")

    def __init__(self, loss, grad_h=None, grad_weight=None, grad_bias=None) -> None:
        self.loss, self.grad_h, self.grad_weight, self.grad_bias = loss, grad_h, grad_weight, grad_bias


def fused_linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None,
    index: Tensor | None,
    ignore_index: int,
    smoothing: float,
    scale: Tensor | None,
    *,
    grads: tuple[bool, bool, bool] = (False, False, False),
    chunk_rows: int | None = None,
) -> LossAndGrads:
    r"""Per-row losses and (optionally) gradients of ``scale``-weighted losses, chunk by chunk.

    Args:
        h: ``[N, K]`` rows (contiguous). weight: ``[C, K]``. bias: ``[C]`` or ``None``.
        target: ``[N]`` int64 class ids (``ignore_index`` rows count for nothing; ids are
            **not** range-checked here: the op layer does it).
        index: ``[M]`` int64 rows of ``h`` / ``target`` that count, or ``None`` (all ``N``).
        scale: :math:`s` of the module docstring: a one-element tensor (every row) or an
            ``[M]`` tensor (per row); only read when a gradient is asked for.
        grads: which of ``(dh, dW, db)`` to compute (``db`` only with a bias).
        chunk_rows: rows per chunk (default :func:`chunk_rows_for`).

    All inputs share one floating dtype; losses come back in its accumulation dtype, the
    gradients in the input dtype.
    """
    num_rows = index.numel() if index is not None else h.shape[0]
    num_classes, features = weight.shape
    acc = acc_dtype(h.dtype)
    loss = torch.empty(num_rows, dtype=acc, device=h.device)
    want_h, want_w, want_b = grads
    want_b = want_b and bias is not None
    grad_h = grad_w = grad_w_acc = grad_b = None
    if want_h:
        grad_h = torch.zeros_like(h) if index is not None else torch.empty_like(h)
    exact = num_classes * features * 4 <= CHUNK_BYTES
    if scale is None:
        scale = torch.ones(1, dtype=acc, device=h.device)
    per_row = scale.numel() != 1
    head = num_classes <= HEAD_MAX_CLASSES
    if head:  # dz rows padded to 8 elements: aligned rows for the dW GEMM
        width = (num_classes + 7) // 8 * 8
    else:
        w_gemm, b_gemm = _padded_classes(weight, bias)
        width = w_gemm.shape[0]
    # per chunk, one buffer each, reused by every chunk: [R, width] (the head kernel's dz
    # rows, or the GEMM path's logits: the previous chunk's are never alive beside the next
    # ones), and with index the gathered rows of h (for the GEMMs) and their dh
    gathered_rows = index is not None and num_rows > 0 and (want_w or not head)
    gathered_dh = index is not None and want_h
    if head or num_classes <= SMALL_HEAD_CLASSES:
        per_row_bytes = (width + features * (gathered_rows + gathered_dh)) * h.element_size()
        rows = chunk_rows or chunk_rows_for(num_rows, per_row_bytes, torch.uint8, HEAD_CHUNK_BYTES)
    else:
        rows = chunk_rows or chunk_rows_for(num_rows, width, h.dtype)
    # the GEMM path writing dh straight into grad_h may keep a chunk's logits in grad_h's
    # rows that no chunk has written yet (_chunk_schedule): larger chunks, no more memory
    lend = not head and want_h and index is None and chunk_rows is None and grad_h.is_contiguous()
    schedule = _chunk_schedule(num_rows, rows, lend_to=(width, features) if lend else None)
    chunk = max((r1 - r0 for r0, r1, lent in schedule if not lent), default=0)
    chunk_buf = (torch.empty(chunk, width, dtype=h.dtype, device=h.device)
                 if chunk and (not head or want_w or want_b) else None)
    dh_buf = torch.empty(chunk, features, dtype=h.dtype, device=h.device) if gathered_dh else None
    rows_buf = torch.empty(chunk, features, dtype=h.dtype, device=h.device) if gathered_rows else None
    for r0, r1, lent in schedule:
        idx = index[r0:r1] if index is not None else None
        h_rows = None
        if idx is not None and rows_buf is not None:
            h_rows = torch.index_select(h, 0, idx, out=rows_buf[: r1 - r0])
        elif idx is None:
            h_rows = h[r0:r1]
        if head:
            dz = chunk_buf[: r1 - r0, :num_classes] if chunk_buf is not None else None
            dh = grad_h if dh_buf is None else dh_buf[: r1 - r0]
            _launch_head(h, weight, bias, target, index, scale, loss, dz, dh, r0, r1 - r0, ignore_index,
                         smoothing, per_row, dh_buf is not None)
            if dh_buf is not None:
                grad_h.index_add_(0, idx, dh)
        else:
            # padded classes (columns past C): zero rows of w_gemm and b_gemm; the row kernel
            # writes them dz = 0
            if lent:  # grad_h's rows from r1 on: written by later chunks only
                padded = grad_h.view(-1)[r1 * features: r1 * features + (r1 - r0) * width].view(r1 - r0, width)
            else:
                padded = chunk_buf[: r1 - r0]
            if b_gemm is not None:
                torch.addmm(b_gemm, h_rows, w_gemm.t(), out=padded)
            else:
                torch.mm(h_rows, w_gemm.t(), out=padded)
            dz = padded[:, :num_classes]
            _launch_rows(padded, num_classes, target, index, scale, loss, r0, ignore_index, smoothing, any(grads),
                         per_row)
            if want_h:
                if idx is None:
                    torch.mm(padded, w_gemm, out=grad_h[r0:r1])
                else:
                    grad_h.index_add_(0, idx, torch.mm(padded, w_gemm, out=dh_buf[: r1 - r0]))
        if want_w:  # from the real classes' columns: a fresh [C, K] (the padding's rows are never formed)
            grad_w_acc = _accumulate_weight_grad(grad_w_acc, dz, h_rows, acc if exact else h.dtype)
        if want_b:
            db = dz.sum(0, dtype=acc)
            grad_b = db if grad_b is None else grad_b.add_(db)
    if want_w:
        if grad_w_acc is None:  # no rows
            grad_w_acc = torch.zeros(weight.shape, dtype=h.dtype, device=h.device)
        grad_w = grad_w_acc if grad_w_acc.dtype == h.dtype else grad_w_acc.to(h.dtype)
    if want_b:
        grad_b = (grad_b if grad_b is not None else torch.zeros(num_classes, dtype=acc, device=h.device)).to(h.dtype)
    return LossAndGrads(loss, grad_h, grad_w, grad_b)


def _chunk_schedule(num_rows: int, rows: int, *, lend_to: tuple[int, int] | None = None
                    ) -> list[tuple[int, int, bool]]:
    """The chunks of the rows ``[0, num_rows)`` in order, as ``(r0, r1, lent)``.

    Without ``lend_to``: chunks of ``rows`` rows (the last one shorter), none lent.

    With ``lend_to=(width, features)``: a chunk's ``[R, width]`` logits may be lent the
    rows of ``grad_h`` (``[N, features]``, written chunk by chunk in row order) from ``r1``
    on, which no chunk has written yet (``lent``), as long as that space holds more than
    ``rows`` rows of logits: ``R = (N - r0) features / (width + features)``, rounded down
    to a multiple of 64, so that ``R width <= (N - r0 - R) features``. The chunks shrink
    geometrically (ogbn-mag's 736,389 x 256 -> 352 head: 4 lent chunks, then 2 of the
    budget's 47,616 rows, instead of 16 chunks); the rest take ``rows``-row chunks in
    their own buffer."""
    if rows < 1:
        raise ValueError(f"_chunk_schedule: rows must be positive, got {rows}")
    schedule, r0 = [], 0
    while r0 < num_rows:
        lent_rows = 0
        if lend_to is not None:
            width, features = lend_to
            lent_rows = (num_rows - r0) * features // (width + features)
            if lent_rows > 64:
                lent_rows -= lent_rows % 64
        if lent_rows > rows:
            schedule.append((r0, r0 + lent_rows, True))
            r0 += lent_rows
        else:
            schedule.append((r0, min(r0 + rows, num_rows), False))
            r0 += rows
    return schedule


def _padded_classes(weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """``(W, b)`` with the classes padded by zero rows to a multiple of :data:`CLASS_ALIGN`,
    when ``C`` is not one already and the copy is at most :data:`PAD_MAX_WEIGHT_BYTES`;
    otherwise ``(weight, bias)`` themselves."""
    num_classes, features = weight.shape
    width = (num_classes + CLASS_ALIGN - 1) // CLASS_ALIGN * CLASS_ALIGN
    if width == num_classes or width * features * weight.element_size() > PAD_MAX_WEIGHT_BYTES:
        return weight, bias
    w = weight.new_zeros(width, features)
    w[:num_classes] = weight
    b = None
    if bias is not None:
        b = bias.new_zeros(width)
        b[:num_classes] = bias
    return w, b


_MM_OUT_DTYPE = {"works": None}


def _weight_grad_product(dz: Tensor, h_rows: Tensor, dtype: torch.dtype) -> Tensor:
    """``dz^T @ h_rows`` in ``dtype``: for a float32 result of half inputs through a
    float32 GEMM output where cuBLAS offers one (one rounding, none per partial sum)."""
    if dtype == dz.dtype:
        return torch.mm(dz.t(), h_rows)
    if dz.is_cuda and _MM_OUT_DTYPE["works"] is not False:
        try:
            out = torch.mm(dz.t(), h_rows, out_dtype=dtype)
            _MM_OUT_DTYPE["works"] = True
            return out
        except (TypeError, RuntimeError):  # an older torch: no mm(out_dtype=)
            _MM_OUT_DTYPE["works"] = False
    return torch.mm(dz.t(), h_rows).to(dtype)


def _accumulate_weight_grad(acc: Tensor | None, dz: Tensor, h_rows: Tensor, dtype: torch.dtype) -> Tensor:
    """``acc + dz^T @ h_rows`` in ``dtype`` (the first chunk's product is the accumulator:
    no zero fill, no addition); in place when ``acc`` has the inputs' dtype."""
    if acc is None:
        return _weight_grad_product(dz, h_rows, dtype)
    if acc.dtype == dz.dtype:
        return acc.addmm_(dz.t(), h_rows)
    return acc.add_(_weight_grad_product(dz, h_rows, dtype))


def linear_cross_entropy_reference(
    h: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    index: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """``F.cross_entropy(F.linear(h[index], weight, bias), target[index], ...)``: the
    definition (differentiable through PyTorch's autograd; materialises the logits)."""
    if index is not None:
        h, target = h.index_select(0, index), target.index_select(0, index)
    logits = F.linear(h, weight, bias)
    return F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
