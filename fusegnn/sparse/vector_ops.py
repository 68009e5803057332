r"""Public vector-sparse ops: :func:`vspmm`, :func:`vsddmm`, :func:`window_spmm`.

* ``vspmm(A, B)``: :math:`A B` for a :class:`~fusegnn.sparse.vector_sparse.VectorSparse`
  ``A`` (or :math:`A^\top B` for ``A.transpose()``) and a dense ``B``;
* ``vsddmm(X, Y, pattern)``: :math:`(X Y^\top)` sampled at ``pattern``'s vectors, as
  ``[nnz_v, V]`` values (``pattern.with_values(...)`` makes it a matrix again);
* ``window_spmm(windows, B)``: :math:`A B` over Jigsaw row windows
  (:class:`~fusegnn.sparse.vector_sparse.RowWindows`).

All are differentiable in the values and the dense operands. ``backend="auto"`` runs the
Triton kernels of :mod:`fusegnn.kernels.vector_spmm` where they can (CUDA tensors, or the
CPU with ``TRITON_INTERPRET=1``; float16 / bfloat16 / float32) and the pure-PyTorch
reference otherwise (float64 included); ``"triton"`` and ``"reference"`` force one. Only
``"auto"`` lets the kernels hand a large, dense-ish product to one dense GEMM
(:func:`fusegnn.kernels.vector_spmm.dense_is_cheaper`).

Under ``torch.compile`` (:func:`torch.compiler.is_compiling`) they call the custom ops of
:mod:`fusegnn.sparse.vector_library` instead (one opaque node each, forward and
backward), with the matrix's tensors as arguments; eagerly they call the autograd
functions directly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fusegnn.sparse import vector_library
from fusegnn.sparse.graph import type_name
from fusegnn.sparse.vector_library import BACKENDS, use_kernel
from fusegnn.sparse.vector_sparse import RowWindows, TransposedVectorSparse, VectorIndex, VectorSparse

__all__ = ["prefers_dense", "vsddmm", "vspmm", "window_spmm"]


def _kernels():
    from fusegnn.kernels import vector_spmm

    return vector_spmm


def _traced_index(a: VectorSparse, backend: str) -> VectorIndex:
    """The index compiled code passes to the custom ops: the cached one, else the custom
    op computing it (no sort traced); ``backend`` checked here, at trace time."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    index = a.cached_index()
    if index is not None:
        return index
    return vector_library.transpose_index_op(a.row_ptr, a.col_idx, a.shape[0], a.shape[1])


def _check_dense(t: Any, name: str, rows: int, rows_name: str) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type_name(t)}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.size(0) != rows:
        raise ValueError(f"{name} must have {rows} rows ({rows_name}), got {t.size(0)}")
    return t


def _check_same(a: VectorSparse, t: Tensor, name: str) -> None:
    if t.device != a.device:
        raise ValueError(f"{name} is on {t.device} but the sparse matrix is on {a.device}")
    if t.dtype != a.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the sparse matrix's values are {a.dtype}")


def prefers_dense(a: VectorSparse, *, backend: str = "auto") -> bool:
    """Whether products with ``a`` are cheaper as dense GEMMs on ``a.to_dense()`` than
    through the vector-sparse kernels (:func:`fusegnn.kernels.vector_spmm.dense_is_cheaper`
    with the kernels' reuse of ``V``): only for ``backend="auto"``, which
    :class:`~fusegnn.layers.VectorSparseLinear` then runs as ``F.linear`` on the densified
    weight (gradients: two dense GEMMs, the weight's gathered at the pattern)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(a, VectorSparse):
        raise TypeError(f"a must be a VectorSparse, got {type_name(a)}")
    return backend == "auto" and _kernels().dense_is_cheaper(a.values.numel(), a.shape[0], a.shape[1], a.V)


def vspmm(a: VectorSparse | TransposedVectorSparse, b: Tensor, *, backend: str = "auto") -> Tensor:
    """:math:`A B` (``[M, N]``) for ``a`` ``[M, K]`` vector-sparse and ``b`` ``[K, N]``
    dense in ``a``'s dtype; ``a = A.transpose()`` gives :math:`A^\\top B` (``b``
    ``[M, N]``, result ``[K, N]``)."""
    transposed = isinstance(a, TransposedVectorSparse)
    base = a.base if transposed else a
    if not isinstance(base, VectorSparse):
        raise TypeError(f"a must be a VectorSparse (or its .transpose()), got {type_name(a)}")
    b = _check_dense(b, "b", a.shape[1], "the sparse matrix's columns")
    _check_same(base, b, "b")
    if torch.compiler.is_compiling():
        return vector_library.vspmm(base.values, b, _traced_index(base, backend), transposed, backend)
    index = base.index()
    if use_kernel(backend, base.values, b):
        fn = _kernels().VectorSpmmT if transposed else _kernels().VectorSpmm
        return fn.apply(base.values, b, tuple(index), backend == "auto")
    k = _kernels()
    if transposed:
        return k.vspmm_t_reference(base.values, index.col_idx, index.row_ptr, b, base.shape[1])
    return k.vspmm_reference(base.values, index.col_idx, index.row_ptr, b, base.shape[0])


def vsddmm(x: Tensor, y: Tensor, pattern: VectorSparse, *, backend: str = "auto") -> Tensor:
    """``S[v, r] = <x[g_v V + r], y[col_idx[v]]>``: :math:`X Y^\\top` (``x`` ``[M, F]``,
    ``y`` ``[K, F]``) at ``pattern``'s (``[M, K]``) stored vectors, as ``[nnz_v, V]``
    values in ``x``'s dtype (``pattern``'s own values are not read)."""
    if not isinstance(pattern, VectorSparse):
        raise TypeError(f"pattern must be a VectorSparse, got {type_name(pattern)}")
    x = _check_dense(x, "x", pattern.shape[0], "the pattern's rows")
    y = _check_dense(y, "y", pattern.shape[1], "the pattern's columns")
    if x.size(1) != y.size(1):
        raise ValueError(f"x and y must have the same number of columns, got {x.size(1)} and {y.size(1)}")
    if x.device != y.device or x.device != pattern.device:
        raise ValueError("x, y and pattern must be on the same device")
    if x.dtype != y.dtype:
        raise TypeError(f"x and y must share one dtype, got {x.dtype} and {y.dtype}")
    if torch.compiler.is_compiling():
        return vector_library.vsddmm(x, y, _traced_index(pattern, backend), pattern.V, backend)
    index = pattern.index()
    if use_kernel(backend, x, y):
        return _kernels().VectorSddmm.apply(x, y, pattern.V, tuple(index), backend == "auto")
    return _kernels().vsddmm_reference(x, y, index.col_idx, index.row_ptr, pattern.V)


def window_spmm(windows: RowWindows, b: Tensor, *, backend: str = "auto") -> Tensor:
    """:math:`A B` over Jigsaw row windows: per window, dense ``[W, BLOCK_K] x [BLOCK_K,
    BN]`` tensor-core tiles with ``b``'s rows gathered by the window's compacted column
    list. Differentiable in ``b`` (:math:`A^\\top G` through the column-sorted index) and
    in the window values."""
    if not isinstance(windows, RowWindows):
        raise TypeError(f"windows must be a RowWindows, got {type_name(windows)}")
    return vspmm(windows, b, backend=backend)
