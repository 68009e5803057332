r"""``sparse_attention`` under ``torch.compile``: the block kernels as ``torch.library``
custom ops (the path decision is made once, outside the traced code, by
:func:`fusegnn.attention.sparse_attention.compiled_decision`).

Compiled code cannot trace fusegnn's block-sparse kernels (Triton launched through
fusegnn's own launcher) nor the decision (the cost model reads the mask's block layout,
built with host reads). So, under compilation, :func:`~fusegnn.attention.sparse_attention.sparse_attention`

1. asks :func:`fusegnn.attention.sparse_attention.compiled_decision` -- marked ``torch.compiler.assume_constant_result``: Dynamo calls
   it with constants (the mask's handle, shapes, dtype, device) and keeps its result --
   for the path, building and caching on the mask whatever that path reads (the block
   layout, SDPA's boolean mask, the element path's graph);
2. runs the path: dense SDPA, the reference and the element path (whose ``sddmm`` /
   ``edge_softmax`` / ``spmm`` are the GNN custom ops) are traced as they are; the block
   path is one op, ``fusegnn::block_attention(q, k, v, layout, scale, precision,
   dilation, nm_n, nm_m) -> (out, lse)`` (``nm_m = 0``: no N:M sparsity), whose backward is ``fusegnn::block_attention_backward``
   (the same kernels as the eager ``BlockSparseAttentionFunction``); the vector path is
   ``fusegnn::vector_attention(q, k, v, mask, window, block_n, scale, precision) -> (out,
   lse)`` with ``fusegnn::vector_attention_backward`` (the kernels of
   :mod:`fusegnn.kernels.vector_attention`, on the structure cached on the mask).

Objects travel as integer handles (:mod:`fusegnn.attention.handles`): the model must keep
its masks referenced.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusegnn.attention import handles

__all__ = ["block_attention", "block_attention_backward"]


@torch.library.custom_op("fusegnn::block_attention", mutates_args=())
def block_attention(q: Tensor, k: Tensor, v: Tensor, layout: int, scale: float, precision: str,
                    dilation: int, nm_n: int = 0, nm_m: int = 0) -> tuple[Tensor, Tensor]:
    """Block-sparse attention of the layout with handle ``layout``: ``(out, lse)``
    (N:M sparse when ``nm_m > 0``)."""
    from fusegnn.kernels.block_attention import _forward, _last_contiguous

    out, lse = _forward(_last_contiguous(q), _last_contiguous(k), _last_contiguous(v),
                        handles.lookup(layout), scale, precision, None, dilation, _nm(nm_n, nm_m))
    return out, lse


def _nm(nm_n: int, nm_m: int) -> tuple[int, int] | None:
    return (nm_n, nm_m) if nm_m > 0 else None


@block_attention.register_fake
def _(q, k, v, layout, scale, precision, dilation, nm_n=0, nm_m=0):
    out = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
    return out, q.new_empty(tuple(q.shape[:-1]), dtype=torch.float32)


@torch.library.custom_op("fusegnn::block_attention_backward", mutates_args=())
def block_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                             layout: int, scale: float, precision: str, dilation: int, nm_n: int = 0,
                             nm_m: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`block_attention` for ``grad = dL/dout``."""
    from fusegnn.kernels.block_attention import _backward, _last_contiguous

    dq, dk, dv = _backward(
        grad.contiguous(), _last_contiguous(q), _last_contiguous(k), _last_contiguous(v), out, lse,
        handles.lookup(layout), scale, precision, True, True, None, dilation, _nm(nm_n, nm_m),
    )
    return dq, dk, dv


@block_attention_backward.register_fake
def _(grad, q, k, v, out, lse, layout, scale, precision, dilation, nm_n=0, nm_m=0):
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)


def _contiguous_like(t: Tensor) -> Tensor:
    """A fake gradient of ``t`` as the backward kernels allocate theirs: contiguous,
    whatever ``t``'s strides (``empty_like`` would keep a transposed view's strides, and
    the compiled graph would then view the real, contiguous gradient by them)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    q, k, v, layout, scale, precision, dilation, nm_n, nm_m = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (layout, scale, precision, dilation, nm_n, nm_m)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fusegnn.block_attention_backward(grad_out, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


block_attention.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("fusegnn::vector_attention", mutates_args=())
def vector_attention(q: Tensor, k: Tensor, v: Tensor, mask: int, window: int, block_n: int, scale: float,
                     precision: str) -> tuple[Tensor, Tensor]:
    """The vector path (:mod:`fusegnn.kernels.vector_attention`) of the mask with handle
    ``mask``, windows of ``window`` queries: ``(out, lse)``. The structure is the one
    cached on the mask (:func:`fusegnn.attention.vector_windows.vector_structure`)."""
    from fusegnn.attention.vector_windows import vector_structure
    from fusegnn.kernels.vector_attention import _forward

    structure = vector_structure(handles.lookup(mask), window, q.device)
    return _forward(_contiguous_last(q), _contiguous_last(k), _contiguous_last(v), structure, scale, precision,
                    block_n)


def _contiguous_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@vector_attention.register_fake
def _(q, k, v, mask, window, block_n, scale, precision):
    out = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
    return out, q.new_empty(tuple(q.shape[:-1]), dtype=torch.float32)


@torch.library.custom_op("fusegnn::vector_attention_backward", mutates_args=())
def vector_attention_backward(grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: int,
                              window: int, block_n: int, scale: float,
                              precision: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of :func:`vector_attention` for ``grad = dL/dout``."""
    from fusegnn.attention.vector_windows import vector_structure
    from fusegnn.kernels.vector_attention import _backward

    structure = vector_structure(handles.lookup(mask), window, q.device)
    return _backward(grad.contiguous(), _contiguous_last(q), _contiguous_last(k), _contiguous_last(v), out, lse,
                     structure, scale, precision, block_n, True, True)


@vector_attention_backward.register_fake
def _(grad, q, k, v, out, lse, mask, window, block_n, scale, precision):
    return _contiguous_like(q), _contiguous_like(k), _contiguous_like(v)


def _setup_vector(ctx, inputs, output):
    q, k, v, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = tuple(args)
    ctx.mark_non_differentiable(lse)


def _backward_vector(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fusegnn.vector_attention_backward(grad_out, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


vector_attention.register_autograd(_backward_vector, setup_context=_setup_vector)
