r"""Vector-sparse SpMM / SDDMM on tensor cores (VecSparse's CVSE format, thesis ch.3).

A vector-sparse matrix :math:`A` (``[M, K]``) is stored as ``V``-row vectors: rows are
cut into groups of ``V`` consecutive rows (group :math:`g` holds rows
:math:`gV, \dots, gV + V - 1`; the last group may be partial), and the stored vectors of
group :math:`g` are ``row_ptr[g] .. row_ptr[g + 1] - 1``; vector :math:`v` sits in
column ``col_idx[v]`` and holds ``values[v, 0:V]``. Every op here takes those raw
tensors (this module never imports the op layer):

* :func:`vspmm` -- :math:`C = A B` (``B`` dense ``[K, N]``): one program per (row group,
  column block of ``BN``); per chunk of ``BLOCK_K`` stored vectors it gathers the
  ``B`` rows at their columns (``[BLOCK_K, BN]``) and multiplies the ``[V, BLOCK_K]``
  values tile on tensor cores (``tl.dot``). Each gathered ``B`` row is used by ``V``
  output rows (VecSparse's reuse). ``tl.dot`` needs at least 16 rows: for ``V < 16`` the
  values tile is padded to 16 rows in registers (the rows beyond ``V`` are masked), so
  ``16 - V`` of every 16 tensor-core rows are wasted; row windows of 16 or 32 rows
  (Jigsaw, the same format with ``V = W``) use them all.
* :func:`vspmm_t` -- :math:`C = A^\top B` (``B`` dense ``[M, N]``, ``C`` ``[K, N]``)
  through the column-sorted index (``t_ptr`` over columns, ``t_vec`` the vectors in
  column order, ``t_group`` their row groups): row :math:`k` of :math:`C` is
  :math:`\sum_{v \in \mathrm{col}\ k} \sum_r \mathrm{values}[v, r]\, B[g_v V + r]`. A
  row of :math:`A^\top` has a single output row, so this is a CUDA-core reduction
  (a ``[BLOCK_T, BN]`` register tile over ``BLOCK_T`` (vector, row) pairs).
* :func:`vsddmm` -- :math:`S[v, r] = \langle X[g_v V + r], Y[\mathrm{col}_v] \rangle` (the
  ``V x 1`` blocks of :math:`X Y^\top` at the pattern): per chunk of ``BLOCK_K`` vectors of
  a row group, ``[V, BF] x [BF, BLOCK_K]`` ``tl.dot`` tiles over the feature axis.

Gradients (:class:`VectorSpmm`, :class:`VectorSpmmT`, :class:`VectorSddmm`), with
:math:`G` the output gradient: for :math:`C = AB`, :math:`\partial B = A^\top G`
(:func:`vspmm_t`) and :math:`\partial\,\mathrm{values} = \mathrm{vsddmm}(G, B)`; for
:math:`C = A^\top B`, :math:`\partial B = A G` and
:math:`\partial\,\mathrm{values} = \mathrm{vsddmm}(B, G)`; for :math:`S =
\mathrm{vsddmm}(X, Y)`, :math:`\partial X = \tilde S Y` and :math:`\partial Y = \tilde
S^\top X` with :math:`\tilde S` the pattern holding :math:`\partial S`.

**Dense fallback.** The sparse kernels move gathered rows of the dense operand: ``vspmm``
and ``vsddmm`` load each gathered row once per row group (reused by ``V`` rows),
``vspmm_t`` once per stored value (no reuse). A dense tensor-core GEMM on the densified
:math:`A` does :math:`MK` multiply-adds per dense column instead. On an H100 (bf16,
``A`` 16384 x 4096, ``N`` = 8192) the dense GEMM took 1.4-1.6 ms where the sparse
kernels took 2.1-13 ms (``vspmm``, densities 0.05-0.3) and 14-150 ms (``vspmm_t``):
a sparse kernel only pays where the matrix is far sparser than a pruned linear layer.
So, for matrices of at least :data:`DENSE_MIN_ELEMENTS` and at most
:data:`DENSE_MAX_ELEMENTS` entries (small ones are launch-bound and stay on the kernels,
huge ones -- graphs -- would not fit densified), each op runs the dense product when
``density > reuse / DENSE_LOADS_PER_MAC`` (``reuse`` = ``V`` for ``vspmm`` / ``vsddmm``,
1 for ``vspmm_t``); :func:`dense_is_cheaper` is the rule and ``allow_dense=False`` turns
it off (the op layer passes ``allow_dense`` only for ``backend="auto"``: ``"triton"`` always
runs the sparse kernels). The result is the same product (one float32-accumulated GEMM, one rounding; in float32
the GEMM follows torch's matmul precision setting, IEEE unless TF32 is allowed).

Dtypes: float16 / bfloat16 (float32 accumulation, one rounding at the store) and float32
(``tl.dot`` in IEEE float32, not TF32). The ``*_reference`` functions are the pure-PyTorch
definitions the kernels must match (any dtype, differentiable by autograd).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from fusegnn.kernels._autograd import differentiable_once

from fusegnn.kernels._triton import LazyKernel, interpreter_enabled, next_pow2
from fusegnn.kernels.vector_layout import densify_vectors, vector_groups

__all__ = [
    "DENSE_LOADS_PER_MAC",
    "DENSE_MAX_ELEMENTS",
    "DENSE_MIN_ELEMENTS",
    "VECTOR_DTYPES",
    "VectorSddmm",
    "VectorSpmm",
    "VectorSpmmT",
    "dense_is_cheaper",
    "vector_groups",
    "vsddmm",
    "vsddmm_reference",
    "vspmm",
    "vspmm_reference",
    "vspmm_t",
    "vspmm_t_reference",
]

#: dtypes of the kernels (tensor-core products: no float64)
VECTOR_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

#: the dense fallback's break-even: a sparse kernel's gathered-row load costs about as
#: much as this many dense tensor-core multiply-adds (H100, bf16; see the module docstring)
DENSE_LOADS_PER_MAC = 512
#: matrices smaller than this (``M K``) always run the sparse kernels (launch-bound anyway)
DENSE_MIN_ELEMENTS = 1 << 22
#: ... and larger than this never run densified (memory: a graph's adjacency)
DENSE_MAX_ELEMENTS = 1 << 28


def dense_is_cheaper(stored: int, rows: int, cols: int, reuse: int) -> bool:
    """Whether a dense GEMM on the densified ``rows x cols`` matrix holding ``stored``
    values beats the sparse kernel whose gathered rows serve ``reuse`` output rows each."""
    elements = rows * cols
    if not DENSE_MIN_ELEMENTS <= elements <= DENSE_MAX_ELEMENTS:
        return False
    return stored * DENSE_LOADS_PER_MAC > reuse * elements


def _vspmm_kernel(
    vals, col, ptr, b, out,
    M, N, stride_bk, stride_bn, stride_om, stride_on,
    V: tl.constexpr, BM: tl.constexpr, BLOCK_K: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Rows ``g V .. g V + V - 1`` (``g = program_id(0)``), columns of block ``program_id(1)``."""
    g = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < N
    start = tl.load(ptr + g)
    end = tl.load(ptr + g + 1)
    r = tl.arange(0, BM)
    rmask = r < V
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for s in range(start, end, BLOCK_K):
        k = s + tl.arange(0, BLOCK_K)
        kmask = k < end
        c = tl.load(col + k, mask=kmask, other=0).to(tl.int64)
        a = tl.load(vals + k.to(tl.int64)[None, :] * V + r[:, None], mask=rmask[:, None] & kmask[None, :], other=0.0)
        bt = tl.load(b + c[:, None] * stride_bk + n[None, :] * stride_bn, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            bt = bt.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, bt, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, bt, acc)
    rows = g.to(tl.int64) * V + r
    omask = (rmask & (rows < M))[:, None] & nmask[None, :]
    tl.store(out + rows[:, None] * stride_om + n[None, :] * stride_on, acc.to(out.dtype.element_ty), mask=omask)


def _vspmm_t_kernel(
    vals, tvec, tgroup, tptr, b, out,
    M, N, stride_bm, stride_bn, stride_ok, stride_on,
    V: tl.constexpr, BLOCK_T: tl.constexpr, BN: tl.constexpr,
):
    """Row ``k = program_id(0)`` of :math:`A^\\top B`; ``BLOCK_T`` (vector, row) pairs per step."""
    kcol = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n < N
    start = tl.load(tptr + kcol).to(tl.int64) * V
    end = tl.load(tptr + kcol + 1).to(tl.int64) * V
    acc = tl.zeros([BLOCK_T, BN], dtype=tl.float32)
    for s in range(start, end, BLOCK_T):
        t = s + tl.arange(0, BLOCK_T)
        tmask = t < end
        vi = t // V
        r = t % V
        vec = tl.load(tvec + vi, mask=tmask, other=0).to(tl.int64)
        row = tl.load(tgroup + vi, mask=tmask, other=0).to(tl.int64) * V + r
        tmask = tmask & (row < M)
        w = tl.load(vals + vec * V + r, mask=tmask, other=0.0).to(tl.float32)
        x = tl.load(b + row[:, None] * stride_bm + n[None, :] * stride_bn, mask=tmask[:, None] & nmask[None, :], other=0.0)
        acc += w[:, None] * x.to(tl.float32)
    res = tl.sum(acc, axis=0)
    tl.store(out + kcol.to(tl.int64) * stride_ok + n * stride_on, res.to(out.dtype.element_ty), mask=nmask)


def _vsddmm_kernel(
    x, y, col, ptr, out,
    M, F, stride_xm, stride_xf, stride_yk, stride_yf,
    V: tl.constexpr, BM: tl.constexpr, BLOCK_K: tl.constexpr, BF: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    """Chunks ``program_id(1), program_id(1) + SPLIT, ...`` of the vectors of row group ``program_id(0)``."""
    g = tl.program_id(0)
    start = tl.load(ptr + g)
    end = tl.load(ptr + g + 1)
    r = tl.arange(0, BM)
    rows = g.to(tl.int64) * V + r
    rmask = (r < V) & (rows < M)
    for s in range(start + tl.program_id(1) * BLOCK_K, end, BLOCK_K * SPLIT):
        k = s + tl.arange(0, BLOCK_K)
        kmask = k < end
        c = tl.load(col + k, mask=kmask, other=0).to(tl.int64)
        acc = tl.zeros([BM, BLOCK_K], dtype=tl.float32)
        for f0 in range(0, F, BF):
            f = f0 + tl.arange(0, BF)
            fmask = f < F
            xt = tl.load(x + rows[:, None] * stride_xm + f[None, :] * stride_xf, mask=rmask[:, None] & fmask[None, :], other=0.0)
            yt = tl.load(y + c[None, :] * stride_yk + f[:, None] * stride_yf, mask=fmask[:, None] & kmask[None, :], other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                yt = yt.to(tl.float32)
            if IEEE:
                acc = tl.dot(xt, yt, acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, yt, acc)
        omask = (r < V)[:, None] & kmask[None, :]
        tl.store(out + k.to(tl.int64)[None, :] * V + r[:, None], acc.to(out.dtype.element_ty), mask=omask)


_vspmm = LazyKernel(_vspmm_kernel)
_vspmm_t = LazyKernel(_vspmm_t_kernel)
_vsddmm = LazyKernel(_vsddmm_kernel)


def _check_dtypes(name: str, *tensors: Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    if dtype not in VECTOR_DTYPES:
        raise TypeError(f"{name}: the vector-sparse kernels take float16, bfloat16 or float32, got {dtype}")
    for t in tensors[1:]:
        if t.dtype != dtype:
            raise TypeError(f"{name}: operands must share one dtype, got {dtype} and {t.dtype}")
    return dtype


def _upcast(dtype: torch.dtype) -> bool:
    """The Triton interpreter's ``tl.dot`` on bfloat16 multiplies the raw uint16 bit
    patterns: there (never on a GPU) bfloat16 tiles are converted to float32 after loading."""
    return dtype == torch.bfloat16 and interpreter_enabled()


def _column_block(n: int) -> int:
    return max(16, min(128, next_pow2(n)))


def vspmm(values: Tensor, col_idx: Tensor, row_ptr: Tensor, b: Tensor, num_rows: int, *,
          allow_dense: bool = True) -> Tensor:
    """``A @ b`` for the vector-sparse ``A`` (``values [nnz_v, V]``, ``num_rows`` rows) and
    ``b [K, N]``: a new ``[num_rows, N]`` tensor in ``b``'s dtype (the dense fallback where
    :func:`dense_is_cheaper` and ``allow_dense``)."""
    dtype = _check_dtypes("vspmm", values, b)
    V = values.size(1)
    G = row_ptr.numel() - 1
    N = b.size(1)
    if allow_dense and N > 0 and dense_is_cheaper(values.numel(), num_rows, b.size(0), V):
        a = densify_vectors(values, vector_groups(row_ptr, col_idx.numel()), col_idx, num_rows, b.size(0))
        return a @ b
    out = torch.empty(num_rows, N, dtype=dtype, device=b.device)
    if num_rows == 0 or N == 0:
        return out
    BN = _column_block(N)
    _vspmm[(G, triton.cdiv(N, BN))](
        values.contiguous(), col_idx, row_ptr, b, out,
        num_rows, N, b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        V=V, BM=max(16, V), BLOCK_K=32, BN=BN, IEEE=dtype == torch.float32, UPCAST=_upcast(dtype),
    )
    return out


def vspmm_t(
    values: Tensor, t_ptr: Tensor, t_vec: Tensor, t_group: Tensor, b: Tensor, num_rows: int, *,
    allow_dense: bool = True,
) -> Tensor:
    """``A^T @ b`` for the vector-sparse ``A`` (``num_rows`` rows, ``t_ptr.numel() - 1``
    columns) and ``b [num_rows, N]``: a new ``[K, N]`` tensor in ``b``'s dtype (the dense
    fallback where :func:`dense_is_cheaper` and ``allow_dense``)."""
    dtype = _check_dtypes("vspmm_t", values, b)
    V = values.size(1)
    K = t_ptr.numel() - 1
    N = b.size(1)
    if allow_dense and N > 0 and dense_is_cheaper(values.numel(), num_rows, K, 1):
        cols = vector_groups(t_ptr, t_vec.numel())  # the column of each vector in column order
        a = densify_vectors(values[t_vec.long()], t_group, cols, num_rows, K)
        return a.t() @ b
    out = torch.empty(K, N, dtype=dtype, device=b.device)
    if K == 0 or N == 0:
        return out
    BN = _column_block(N)
    block_t = max(V, 2048 // BN)
    _vspmm_t[(K, triton.cdiv(N, BN))](
        values.contiguous(), t_vec, t_group, t_ptr, b, out,
        num_rows, N, b.stride(0), b.stride(1), out.stride(0), out.stride(1),
        V=V, BLOCK_T=block_t, BN=BN,
    )
    return out


def vsddmm(x: Tensor, y: Tensor, col_idx: Tensor, row_ptr: Tensor, V: int, max_vectors: int, *,
           allow_dense: bool = True) -> Tensor:
    """``S[v, r] = <x[g_v V + r], y[col_idx[v]]>`` (``x [M, F]``, ``y [K, F]``): a new
    ``[nnz_v, V]`` tensor in ``x``'s dtype. ``max_vectors`` (the most vectors in one row
    group) sets how many programs share a row group. The dense fallback (where
    :func:`dense_is_cheaper` and ``allow_dense``) computes :math:`X Y^\top` and gathers."""
    dtype = _check_dtypes("vsddmm", x, y)
    G = row_ptr.numel() - 1
    nnz = col_idx.numel()
    if allow_dense and nnz > 0 and x.size(1) > 0 and dense_is_cheaper(nnz * V, x.size(0), y.size(0), V):
        rows = G * V
        xp = x if x.size(0) == rows else torch.cat([x, x.new_zeros(rows - x.size(0), x.size(1))])
        full = (xp @ y.t()).view(G, V, y.size(0))
        return full[vector_groups(row_ptr, nnz), :, col_idx.long()]
    out = torch.empty(nnz, V, dtype=dtype, device=x.device)
    if nnz == 0:
        return out
    F = x.size(1)
    if F == 0:
        return out.zero_()
    block_k = 32
    split = min(max(triton.cdiv(max_vectors, block_k), 1), 16)
    _vsddmm[(G, split)](
        x, y, col_idx, row_ptr, out,
        x.size(0), F, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        V=V, BM=max(16, V), BLOCK_K=block_k, BF=max(16, min(64, next_pow2(F))), SPLIT=split,
        IEEE=dtype == torch.float32, UPCAST=_upcast(dtype),
    )
    return out


# ---------------------------------------------------------------------- references


def _padded_rows(num_rows: int, V: int, groups: int) -> int:
    return max(groups * V, num_rows)


def vspmm_reference(values: Tensor, col_idx: Tensor, row_ptr: Tensor, b: Tensor, num_rows: int) -> Tensor:
    """Pure-PyTorch :func:`vspmm` (differentiable in ``values`` and ``b``)."""
    V = values.size(1)
    G = row_ptr.numel() - 1
    grp = vector_groups(row_ptr, col_idx.numel())
    contrib = values.unsqueeze(2) * b[col_idx.long()].unsqueeze(1)  # [nnz_v, V, N]
    out = torch.zeros(G, V, b.size(1), dtype=torch.promote_types(values.dtype, b.dtype), device=b.device)
    out = out.index_add_(0, grp, contrib)
    return out.reshape(G * V, b.size(1))[:num_rows]  # explicit width: no -1 to infer from 0 elements


def vspmm_t_reference(values: Tensor, col_idx: Tensor, row_ptr: Tensor, b: Tensor, num_cols: int) -> Tensor:
    """Pure-PyTorch :func:`vspmm_t`: ``A^T @ b`` with ``A`` given by its rows."""
    V = values.size(1)
    G = row_ptr.numel() - 1
    grp = vector_groups(row_ptr, col_idx.numel())
    rows = _padded_rows(b.size(0), V, G)
    bp = torch.cat([b, b.new_zeros(rows - b.size(0), b.size(1))]).view(-1, V, b.size(1))
    contrib = (values.unsqueeze(2) * bp[grp]).sum(1)  # [nnz_v, N]
    out = torch.zeros(num_cols, b.size(1), dtype=contrib.dtype, device=b.device)
    return out.index_add_(0, col_idx.long(), contrib)


def vsddmm_reference(x: Tensor, y: Tensor, col_idx: Tensor, row_ptr: Tensor, V: int) -> Tensor:
    """Pure-PyTorch :func:`vsddmm` (differentiable in ``x`` and ``y``)."""
    G = row_ptr.numel() - 1
    grp = vector_groups(row_ptr, col_idx.numel())
    rows = _padded_rows(x.size(0), V, G)
    xp = torch.cat([x, x.new_zeros(rows - x.size(0), x.size(1))]).view(-1, V, x.size(1))
    return (xp[grp] * y[col_idx.long()].unsqueeze(1)).sum(2)


# ---------------------------------------------------------------------- autograd


class VectorSpmm(torch.autograd.Function):
    """``A @ b`` through :func:`vspmm`, differentiable in ``values`` and ``b``. ``index`` is
    ``(row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows, max_vectors)``; ``allow_dense``
    lets every product of the op (forward and backward) take the dense fallback."""

    @staticmethod
    def forward(ctx, values: Tensor, b: Tensor, index: tuple, allow_dense: bool = True) -> Tensor:
        row_ptr, col_idx = index[0], index[1]
        ctx.index, ctx.allow_dense = index, allow_dense
        ctx.save_for_backward(values, b)
        return vspmm(values, col_idx, row_ptr, b, index[5], allow_dense=allow_dense)

    @staticmethod
    @differentiable_once
    def backward(ctx, grad: Tensor):
        values, b = ctx.saved_tensors
        row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows, max_vectors = ctx.index
        grad_values = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_b = vspmm_t(values, t_ptr, t_vec, t_group, grad, num_rows, allow_dense=ctx.allow_dense)
        if ctx.needs_input_grad[0]:
            grad_values = vsddmm(grad, b, col_idx, row_ptr, values.size(1), max_vectors, allow_dense=ctx.allow_dense)
        return grad_values, grad_b, None, None


class VectorSpmmT(torch.autograd.Function):
    """``A^T @ b`` through :func:`vspmm_t`, differentiable in ``values`` and ``b`` (same
    ``index`` and ``allow_dense``)."""

    @staticmethod
    def forward(ctx, values: Tensor, b: Tensor, index: tuple, allow_dense: bool = True) -> Tensor:
        ctx.index, ctx.allow_dense = index, allow_dense
        ctx.save_for_backward(values, b)
        return vspmm_t(values, index[2], index[3], index[4], b, index[5], allow_dense=allow_dense)

    @staticmethod
    @differentiable_once
    def backward(ctx, grad: Tensor):
        values, b = ctx.saved_tensors
        row_ptr, col_idx, _, _, _, num_rows, max_vectors = ctx.index
        grad_values = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_b = vspmm(values, col_idx, row_ptr, grad, num_rows, allow_dense=ctx.allow_dense)
        if ctx.needs_input_grad[0]:
            grad_values = vsddmm(b, grad, col_idx, row_ptr, values.size(1), max_vectors, allow_dense=ctx.allow_dense)
        return grad_values, grad_b, None, None


class VectorSddmm(torch.autograd.Function):
    """:func:`vsddmm` of ``x [M, F]`` and ``y [K, F]``, differentiable in both (same ``index``
    and ``allow_dense``)."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, V: int, index: tuple, allow_dense: bool = True) -> Tensor:
        ctx.index, ctx.allow_dense = index, allow_dense
        ctx.save_for_backward(x, y)
        return vsddmm(x, y, index[1], index[0], V, index[6], allow_dense=allow_dense)

    @staticmethod
    @differentiable_once
    def backward(ctx, grad: Tensor):
        x, y = ctx.saved_tensors
        row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows, _ = ctx.index
        grad = grad.contiguous()
        grad_x = grad_y = None
        if ctx.needs_input_grad[0]:
            grad_x = vspmm(grad, col_idx, row_ptr, y, num_rows, allow_dense=ctx.allow_dense)
        if ctx.needs_input_grad[1]:
            grad_y = vspmm_t(grad, t_ptr, t_vec, t_group, x, num_rows, allow_dense=ctx.allow_dense)
        return grad_x, grad_y, None, None, None
