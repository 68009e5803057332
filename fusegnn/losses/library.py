r"""The fused loss under ``torch.compile``: ``torch.library`` custom ops, one graph node each.

Dynamo cannot trace the fused path's eager form (an ``autograd.Function`` launching Triton
kernels through fusegnn's own launcher, with Python-side chunk schedules), so in traced
code :func:`fusegnn.losses.linear_cross_entropy` calls :func:`compiled_fused_loss`, which
records

* ``fusegnn::linear_cross_entropy(h, weight, bias, target, index, ignore_index, reduction,
  smoothing, chunk_rows, want_h, want_weight, want_bias) -> (loss, dh, dW, db)``: the loss
  in the accumulation dtype (0-d, or ``[M]`` for ``reduction="none"``) and, for ``mean`` /
  ``sum``, the gradients of that loss that ``want_*`` ask for (loss elimination, as eagerly:
  :func:`fusegnn.losses.passes.forward_pass`); gradients not computed come back as empty
  ``[0]`` tensors, so the outputs' shapes follow from the arguments alone. The traced code
  sets ``want_*`` from ``requires_grad`` and grad mode, which Dynamo guards on.
* its backward: for ``mean`` / ``sum`` the saved gradients times the incoming gradient
  :math:`g` (plain tensor code in the backward graph: computed in the accumulation dtype,
  rounded once, as the eager scaling kernel does; the eager path's skip when :math:`g = 1`
  is a kernel that scales in place, which a graph's saved tensors must not be); for
  ``none`` ``fusegnn::linear_cross_entropy_backward``, which recomputes the logits with
  :math:`s_i = g_i` (:func:`fusegnn.losses.passes.recompute_gradients`).

The gradients are not differentiable again: AOTAutograd (the ``aot_eager`` and
``inductor`` backends) refuses a double backward of compiled code, and without it the
backward is :func:`~fusegnn.kernels._autograd.differentiable_once`, as eagerly.

The counted rows (``mean``'s divisor) are counted inside the op when the compiled code
runs; the range checks of class ids and ``index`` are in-graph assertions
(:mod:`fusegnn.losses.checks`).
"""

from typing import Optional

import torch
from torch import Tensor

from fusegnn.kernels._autograd import differentiable_once
from fusegnn.kernels._edge_utils import acc_dtype
from fusegnn.losses.passes import forward_pass, kernel_inputs, recompute_gradients

__all__ = ["compiled_fused_loss", "linear_cross_entropy_backward_op", "linear_cross_entropy_op"]


def _or_empty(grad: Optional[Tensor], like: Tensor) -> Tensor:
    """``grad``, or the ``[0]`` placeholder of a gradient not computed."""
    return grad if grad is not None else like.new_empty((0,))


@torch.library.custom_op("fusegnn::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(h: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                            index: Optional[Tensor], ignore_index: int, reduction: str, smoothing: float,
                            chunk_rows: Optional[int], want_h: bool, want_weight: bool,
                            want_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, dh, dW, db)``: see the module docstring."""
    out = forward_pass(h, weight, bias, target, index, ignore_index, reduction, smoothing, chunk_rows,
                       (want_h, want_weight, want_bias))
    grads = out.grads or (None, None, None)
    return out.loss, _or_empty(grads[0], h), _or_empty(grads[1], h), _or_empty(grads[2], h)


def _grad_like(t: Optional[Tensor], computed: bool, h: Tensor) -> Tensor:
    """The fake of a gradient of ``t``: its shape where ``computed``, else the ``[0]`` placeholder."""
    return t.new_empty(t.shape) if computed and t is not None else h.new_empty((0,))


@linear_cross_entropy_op.register_fake
def _(h, weight, bias, target, index, ignore_index, reduction, smoothing, chunk_rows, want_h, want_weight,
      want_bias):
    rows = index.shape[0] if index is not None else h.shape[0]
    loss = h.new_empty((rows,) if reduction == "none" else (), dtype=acc_dtype(h.dtype))
    eager = reduction != "none"
    return (loss, _grad_like(h, eager and want_h, h), _grad_like(weight, eager and want_weight, h),
            _grad_like(bias, eager and want_bias, h))


@torch.library.custom_op("fusegnn::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward_op(grad: Tensor, h: Tensor, weight: Tensor, bias: Optional[Tensor],
                                     target: Tensor, index: Optional[Tensor], ignore_index: int, smoothing: float,
                                     chunk_rows: Optional[int], want_h: bool, want_weight: bool,
                                     want_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(dh, dW, db)`` of the per-row losses (``reduction="none"``) for the per-row incoming
    gradient ``grad`` (``[0]`` placeholders for those not asked for)."""
    grads = recompute_gradients(kernel_inputs(h, weight, bias, target, index), grad, "none", None, ignore_index,
                                smoothing, chunk_rows, (want_h, want_weight, want_bias))
    return tuple(_or_empty(g, h) for g in grads)


@linear_cross_entropy_backward_op.register_fake
def _(grad, h, weight, bias, target, index, ignore_index, smoothing, chunk_rows, want_h, want_weight, want_bias):
    return _grad_like(h, want_h, h), _grad_like(weight, want_weight, h), _grad_like(bias, want_bias, h)


def _setup(ctx, inputs, output):
    h, weight, bias, target, index, ignore_index, reduction, smoothing, chunk_rows, *want = inputs
    _, *grads = output
    ctx.mark_non_differentiable(*grads)
    ctx.reduction, ctx.want = reduction, tuple(want)
    if reduction == "none":
        ctx.save_for_backward(h, weight, bias, target, index)
        ctx.config = (ignore_index, smoothing, chunk_rows)
    else:
        ctx.save_for_backward(*grads)


def _scaled(grad: Tensor, g: Tensor) -> Tensor:
    """``grad * g`` in the accumulation dtype, rounded once (the eager scaling kernel's arithmetic)."""
    acc = acc_dtype(grad.dtype)
    return (grad.to(acc) * g.to(acc)).to(grad.dtype)


@differentiable_once
def _backward(ctx, grad_loss, *_):
    if ctx.reduction == "none":
        h, weight, bias, target, index = ctx.saved_tensors
        grads = torch.ops.fusegnn.linear_cross_entropy_backward(
            grad_loss, h, weight, bias, target, index, *ctx.config, *ctx.want)
    else:
        grads = tuple(_scaled(g, grad_loss) for g in ctx.saved_tensors)
    dh, dw, db = (g if wanted else None for g, wanted in zip(grads, ctx.want))
    return dh, dw, db, None, None, None, None, None, None, None, None, None


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)


def compiled_fused_loss(h: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, index: Optional[Tensor],
                        ignore_index: int, reduction: str, smoothing: float,
                        chunk_rows: Optional[int]) -> Tensor:
    """The fused loss in traced code: ``fusegnn::linear_cross_entropy``'s loss (accumulation
    dtype), the gradients computed for the inputs that will need them."""
    grad_mode = torch.is_grad_enabled()
    want = [grad_mode and t is not None and t.requires_grad for t in (h, weight, bias)]
    loss, _, _, _ = torch.ops.fusegnn.linear_cross_entropy(
        h, weight, bias, target, index, ignore_index, reduction, smoothing, chunk_rows, *want)
    return loss
