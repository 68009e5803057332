r"""The vector-sparse ops as ``torch.library`` custom ops, so ``torch.compile`` sees each as one node.

A :class:`~fusegnn.sparse.vector_sparse.VectorSparse` is no tensor, so under
compilation (:func:`torch.compiler.is_compiling`) the public ops of
:mod:`fusegnn.sparse.vector_ops` hand these ops the matrix's tensors and sizes instead;
the ops rebuild nothing heavier than the :class:`~fusegnn.sparse.vector_sparse.VectorIndex`
tuple the kernels take:

* ``fusegnn::vspmm(values, b, row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows,
  max_vectors, transposed, backend)``: :math:`A B` (``transposed``: :math:`A^\top B`);
* ``fusegnn::vsddmm(x, y, <index>, V, max_vectors, backend)``: :math:`X Y^\top` sampled
  at the pattern's vectors (``[nnz_v, V]``);
* ``fusegnn::vector_transpose_index(row_ptr, col_idx, num_cols)``: the column-sorted
  half of the index (``t_ptr``, ``t_vec``, ``t_group``), for a matrix whose index was not
  cached before tracing (its computation sorts, which Dynamo cannot trace as one node).

``max_vectors`` (the most vectors of one row group; it only sizes the SDDMM kernel's
grid) is ``-1`` when unknown: the op then computes it from ``row_ptr``. ``backend`` is
decided inside the op, on the run-time tensors, as the eager ops decide it
(:func:`use_kernel`).

**Autograd.** Each differentiable op registers a backward that calls a second custom
op, ``fusegnn::vspmm_backward`` / ``fusegnn::vsddmm_backward``, so the backward graph is
opaque too. With :math:`G` the output gradient: for :math:`C = AB`,
:math:`\partial B = A^\top G` and :math:`\partial\,\mathrm{values} = \mathrm{vsddmm}(G, B)`;
for :math:`C = A^\top B`, :math:`\partial B = A G` and
:math:`\partial\,\mathrm{values} = \mathrm{vsddmm}(B, G)`; for
:math:`S = \mathrm{vsddmm}(X, Y)`, :math:`\partial X = \tilde S Y` and
:math:`\partial Y = \tilde S^\top X` (:math:`\tilde S` the pattern holding
:math:`\partial S`). These are the gradients of the kernels' autograd functions
(:class:`~fusegnn.kernels.vector_spmm.VectorSpmm` and friends) and, on the reference
backend, the closed forms of what autograd computes through the ``*_reference``
functions. The backward ops are not differentiable (double backward raises).

Only compiled code uses these ops: eagerly the public ops call the autograd functions
directly, without the custom-op dispatch.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fusegnn.kernels._triton import fused_can_run
from fusegnn.sparse.vector_sparse import VectorIndex, transpose_index

__all__ = ["BACKENDS", "transpose_index_op", "use_kernel", "vsddmm", "vspmm"]

#: the ``backend`` values of the vector-sparse ops
BACKENDS = ("auto", "triton", "reference")

_INDEX_ARGS = "Tensor row_ptr, Tensor col_idx, Tensor t_ptr, Tensor t_vec, Tensor t_group"


def use_kernel(backend: str, *tensors: Tensor) -> bool:
    """Whether ``backend`` runs the Triton kernels on ``tensors`` (``"auto"``: where they
    can, float16 / bfloat16 / float32 on CUDA or the interpreter; ``"triton"`` raises
    where they cannot)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return False
    ok = fused_can_run(*tensors) and all(t.dtype in (torch.float16, torch.bfloat16, torch.float32) for t in tensors)
    if backend == "triton" and not ok:
        raise RuntimeError(
            "backend='triton' needs float16 / bfloat16 / float32 tensors on CUDA (or the CPU with "
            "TRITON_INTERPRET=1) and triton installed"
        )
    return ok


def _kernels():
    from fusegnn.kernels import vector_spmm

    return vector_spmm


def _index(row_ptr: Tensor, col_idx: Tensor, t_ptr: Tensor, t_vec: Tensor, t_group: Tensor, num_rows: int,
           max_vectors: int) -> VectorIndex:
    if max_vectors < 0:
        counts = row_ptr[1:] - row_ptr[:-1]
        max_vectors = int(counts.max()) if counts.numel() else 0
    return VectorIndex(row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows, max_vectors)


# ----------------------------------------------------------------------------- run time
def _product(values: Tensor, b: Tensor, idx: VectorIndex, transposed: bool, kernel: bool, backend: str) -> Tensor:
    """:math:`A b` (``transposed``: :math:`A^\\top b`), ``A`` the index holding ``values``
    (the kernels' dense fallback for ``backend="auto"`` only)."""
    k = _kernels()
    if kernel:
        dense = backend == "auto"
        if transposed:
            return k.vspmm_t(values, idx.t_ptr, idx.t_vec, idx.t_group, b.contiguous(), idx.num_rows, allow_dense=dense)
        return k.vspmm(values, idx.col_idx, idx.row_ptr, b.contiguous(), idx.num_rows, allow_dense=dense)
    if transposed:
        return k.vspmm_t_reference(values, idx.col_idx, idx.row_ptr, b, idx.t_ptr.numel() - 1)
    return k.vspmm_reference(values, idx.col_idx, idx.row_ptr, b, idx.num_rows)


def _sample(x: Tensor, y: Tensor, idx: VectorIndex, V: int, kernel: bool, backend: str) -> Tensor:
    """:math:`X Y^\\top` at the index's vectors (``[nnz_v, V]``; the dense fallback for
    ``backend="auto"`` only)."""
    k = _kernels()
    if kernel:
        return k.vsddmm(x.contiguous(), y.contiguous(), idx.col_idx, idx.row_ptr, V, idx.max_vectors,
                        allow_dense=backend == "auto")
    return k.vsddmm_reference(x, y, idx.col_idx, idx.row_ptr, V)


def _empty(like: Tensor) -> Tensor:
    """The placeholder a backward op returns for a gradient nobody asked for."""
    return like.new_empty((0,))


# ----------------------------------------------------------------------------- vspmm
@torch.library.custom_op(
    "fusegnn::vspmm", mutates_args=(),
    schema=f"(Tensor values, Tensor b, {_INDEX_ARGS}, SymInt num_rows, SymInt max_vectors, bool transposed, "
           "str backend) -> Tensor",
)
def _vspmm_op(values, b, row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows, max_vectors, transposed, backend):
    idx = VectorIndex(row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows, max_vectors)
    return _product(values, b, idx, transposed, use_kernel(backend, values, b), backend).contiguous()


@_vspmm_op.register_fake
def _(values, b, row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows, max_vectors, transposed, backend):
    rows = t_ptr.size(0) - 1 if transposed else num_rows
    return b.new_empty((rows, b.size(1)))


@torch.library.custom_op(
    "fusegnn::vspmm_backward", mutates_args=(),
    schema=f"(Tensor grad, Tensor values, Tensor b, {_INDEX_ARGS}, SymInt num_rows, SymInt max_vectors, "
           "bool transposed, str backend, bool need_values, bool need_b) -> (Tensor, Tensor)",
)
def _vspmm_backward_op(grad, values, b, row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows, max_vectors,
                       transposed, backend, need_values, need_b):
    kernel = use_kernel(backend, values, b)
    idx = _index(row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows, max_vectors if need_values and kernel else 0)
    grad = grad.contiguous()
    grad_b = _product(values, grad, idx, not transposed, kernel, backend).contiguous() if need_b else _empty(b)
    if not need_values:
        return _empty(values), grad_b
    pair = (b, grad) if transposed else (grad, b)
    return _sample(*pair, idx, values.size(1), kernel, backend).contiguous(), grad_b


@_vspmm_backward_op.register_fake
def _(grad, values, b, row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows, max_vectors, transposed, backend,
      need_values, need_b):
    return (values.new_empty(values.shape) if need_values else _empty(values),
            b.new_empty(b.shape) if need_b else _empty(b))


def _vspmm_setup(ctx, inputs, output):
    values, b, *index = inputs[:7]
    ctx.sizes = inputs[7:]
    ctx.save_for_backward(values, b, *index)


def _vspmm_autograd(ctx, grad):
    values, b, *index = ctx.saved_tensors
    need_values, need_b = ctx.needs_input_grad[:2]
    grad_values, grad_b = _vspmm_backward_op(grad, values, b, *index, *ctx.sizes, need_values, need_b)
    return (grad_values if need_values else None, grad_b if need_b else None) + (None,) * 9


_vspmm_op.register_autograd(_vspmm_autograd, setup_context=_vspmm_setup)


# ----------------------------------------------------------------------------- vsddmm
@torch.library.custom_op(
    "fusegnn::vsddmm", mutates_args=(),
    schema=f"(Tensor x, Tensor y, {_INDEX_ARGS}, SymInt V, SymInt max_vectors, str backend) -> Tensor",
)
def _vsddmm_op(x, y, row_ptr, col_idx, t_ptr, t_vec, t_group, V, max_vectors, backend):
    kernel = use_kernel(backend, x, y)
    idx = _index(row_ptr, col_idx, t_ptr, t_vec, t_group, x.size(0), max_vectors if kernel else 0)
    return _sample(x, y, idx, V, kernel, backend).contiguous()


@_vsddmm_op.register_fake
def _(x, y, row_ptr, col_idx, t_ptr, t_vec, t_group, V, max_vectors, backend):
    return x.new_empty((col_idx.size(0), V))


@torch.library.custom_op(
    "fusegnn::vsddmm_backward", mutates_args=(),
    schema=f"(Tensor grad, Tensor x, Tensor y, {_INDEX_ARGS}, str backend, bool need_x, bool need_y) "
           "-> (Tensor, Tensor)",
)
def _vsddmm_backward_op(grad, x, y, row_ptr, col_idx, t_ptr, t_vec, t_group, backend, need_x, need_y):
    idx = VectorIndex(row_ptr, col_idx, t_ptr, t_vec, t_group, x.size(0), 0)
    kernel = use_kernel(backend, x, y)
    grad = grad.contiguous()
    grad_x = _product(grad, y, idx, False, kernel, backend).contiguous() if need_x else _empty(x)
    grad_y = _product(grad, x, idx, True, kernel, backend).contiguous() if need_y else _empty(y)
    return grad_x, grad_y


@_vsddmm_backward_op.register_fake
def _(grad, x, y, row_ptr, col_idx, t_ptr, t_vec, t_group, backend, need_x, need_y):
    return (x.new_empty(x.shape) if need_x else _empty(x), y.new_empty(y.shape) if need_y else _empty(y))


def _vsddmm_setup(ctx, inputs, output):
    x, y, *index = inputs[:7]
    ctx.backend = inputs[9]
    ctx.save_for_backward(x, y, *index)


def _vsddmm_autograd(ctx, grad):
    x, y, *index = ctx.saved_tensors
    need_x, need_y = ctx.needs_input_grad[:2]
    grad_x, grad_y = _vsddmm_backward_op(grad, x, y, *index, ctx.backend, need_x, need_y)
    return (grad_x if need_x else None, grad_y if need_y else None) + (None,) * 8


_vsddmm_op.register_autograd(_vsddmm_autograd, setup_context=_vsddmm_setup)


# ----------------------------------------------------------------------------- transpose index
@torch.library.custom_op(
    "fusegnn::vector_transpose_index", mutates_args=(),
    schema="(Tensor row_ptr, Tensor col_idx, SymInt num_cols) -> (Tensor, Tensor, Tensor)",
)
def _transpose_index_op(row_ptr, col_idx, num_cols):
    return transpose_index(row_ptr, col_idx, num_cols)


@_transpose_index_op.register_fake
def _(row_ptr, col_idx, num_cols):
    nnz = col_idx.size(0)
    return (row_ptr.new_empty((num_cols + 1,)), col_idx.new_empty((nnz,)), col_idx.new_empty((nnz,)))


# ----------------------------------------------------------------------------- traced-side API
def transpose_index_op(row_ptr: Tensor, col_idx: Tensor, num_rows: int, num_cols: int,
                       max_vectors: Optional[int] = None) -> VectorIndex:
    """The full :class:`VectorIndex` of a matrix, its column-sorted half from
    ``fusegnn::vector_transpose_index`` (``max_vectors`` ``-1``: unknown)."""
    t_ptr, t_vec, t_group = _transpose_index_op(row_ptr, col_idx, num_cols)
    return VectorIndex(row_ptr, col_idx, t_ptr, t_vec, t_group, num_rows, -1 if max_vectors is None else max_vectors)


def vspmm(values: Tensor, b: Tensor, index: VectorIndex, transposed: bool, backend: str) -> Tensor:
    """``fusegnn::vspmm``: :func:`fusegnn.sparse.vspmm` on the matrix ``(values, index)``
    (arguments checked by the caller)."""
    return _vspmm_op(values, b, *index, transposed, backend)


def vsddmm(x: Tensor, y: Tensor, index: VectorIndex, V: int, backend: str) -> Tensor:
    """``fusegnn::vsddmm``: :func:`fusegnn.sparse.vsddmm` at the pattern ``index``
    (arguments checked by the caller)."""
    return _vsddmm_op(x, y, *index[:5], V, index.max_vectors, backend)
