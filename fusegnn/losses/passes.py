r"""The fused loss's two passes over the kernels, shared by its two autograd routes: the
eager :class:`~fusegnn.losses.function.FusedLinearCrossEntropy` and the ``torch.library``
custom ops that ``torch.compile`` records (:mod:`fusegnn.losses.library`).

* :func:`forward_pass` -- the loss, reduced (``mean`` divides by the number of counted
  rows), and for ``mean`` / ``sum`` the gradients of that loss (loss elimination: the
  gradient of a reduced loss is the same for every caller up to the scalar incoming
  gradient :math:`g`, so it comes with the loss, scaled by ``1 / n_valid`` or 1);
* :func:`recompute_gradients` -- the gradients for an incoming gradient (per row for
  ``reduction="none"``), from a second pass over the logits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fusegnn.kernels import linear_cross_entropy as kernels
from fusegnn.kernels._edge_utils import acc_dtype
from fusegnn.losses.target_memo import pair_facts

__all__ = ["FusedInputs", "FusedForward", "forward_pass", "kernel_inputs", "recompute_gradients", "valid_rows"]


def valid_rows(target: Tensor, index: Tensor | None, ignore_index: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(n_valid, 1 / n_valid)`` in ``dtype`` (0-d and ``[1]``): the rows of ``target[index]``
    that are not ``ignore_index``. Counted once for a pair of tensors that stays unchanged
    (:func:`~fusegnn.losses.target_memo.pair_facts`); not kept when counted under
    ``torch.inference_mode`` (an inference tensor could not be saved for a later training
    step's backward)."""
    facts = pair_facts(target, index)
    counted = ("counted rows", ignore_index, dtype)
    if facts is not None and counted in facts:
        return facts[counted]
    picked = target.index_select(0, index.to(torch.int64)) if index is not None else target
    # as int64: torch would cast ignore_index to a narrow target's dtype (uint8: -100 -> 156)
    n_valid = (picked.to(torch.int64) != ignore_index).sum().to(dtype)
    result = n_valid, (1.0 / n_valid).reshape(1)
    if facts is not None and not torch.is_inference_mode_enabled():
        facts[counted] = result
    return result


class FusedInputs(NamedTuple):
    """The kernels' inputs: ``h``, ``weight``, ``bias`` contiguous, ``target`` and ``index`` int64."""

    h: Tensor
    weight: Tensor
    bias: Tensor | None
    target: Tensor
    index: Tensor | None


class FusedForward(NamedTuple):
    """What :func:`forward_pass` returns.

    Attributes:
        loss: the reduced loss (0-d) or the per-row losses (``[M]``, 0 on ignored rows), in
            the accumulation dtype.
        grads: ``(dh, dW, db)`` of ``loss`` (``None`` where not asked for), or ``None`` when
            none was computed (``reduction="none"``, or no gradient asked for).
        inputs: the :class:`FusedInputs` the kernels ran on (for a recomputation).
        n_valid: the number of counted rows (0-d, accumulation dtype).
    """

    loss: Tensor
    grads: tuple[Tensor | None, Tensor | None, Tensor | None] | None
    inputs: FusedInputs
    n_valid: Tensor


def kernel_inputs(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                  index: Tensor | None) -> FusedInputs:
    """The caller's tensors as the kernels take them (:class:`FusedInputs`)."""
    return FusedInputs(
        h.contiguous(), weight.contiguous(), bias.contiguous() if bias is not None else None,
        target.to(torch.int64).contiguous(), index.to(torch.int64).contiguous() if index is not None else None,
    )


def forward_pass(h: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, index: Tensor | None,
                 ignore_index: int, reduction: str, smoothing: float, chunk_rows: int | None,
                 want: tuple[bool, bool, bool]) -> FusedForward:
    """The loss of :func:`fusegnn.losses.linear_cross_entropy` on the fused kernels and,
    for ``reduction`` ``"mean"`` / ``"sum"``, the gradients ``want`` asks for (``(dh, dW,
    db)``) of that loss. Arguments as checked by the public function."""
    n_valid, mean_scale = valid_rows(target, index, ignore_index, acc_dtype(h.dtype))  # the caller's tensors
    inputs = kernel_inputs(h, weight, bias, target, index)
    eager_grads = reduction != "none" and any(want)
    scale = None
    if eager_grads:
        scale = mean_scale if reduction == "mean" else torch.ones(1, dtype=n_valid.dtype, device=h.device)
    out = kernels.fused_linear_cross_entropy(
        inputs.h, inputs.weight, inputs.target, inputs.bias, inputs.index, ignore_index, smoothing, scale,
        grads=tuple(want) if eager_grads else (False, False, False), chunk_rows=chunk_rows,
    )
    if reduction == "mean":
        loss = out.loss.sum() / n_valid
    elif reduction == "sum":
        loss = out.loss.sum()
    else:
        loss = out.loss
    grads = (out.grad_h, out.grad_weight, out.grad_bias) if eager_grads else None
    return FusedForward(loss, grads, inputs, n_valid)


def recompute_gradients(inputs: FusedInputs, grad: Tensor, reduction: str, n_valid: Tensor | None,
                        ignore_index: int, smoothing: float, chunk_rows: int | None,
                        want: tuple[bool, bool, bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dh, dW, db)`` (``None`` where ``want`` does not ask) for the incoming gradient
    ``grad`` of the loss: per row (``[M]``) for ``reduction="none"``, else one element
    (``mean`` divides it by ``n_valid``). A second pass over the logits."""
    scale = grad.to(acc_dtype(inputs.h.dtype)).reshape(-1)
    if reduction == "mean":
        scale = scale / n_valid
    out = kernels.fused_linear_cross_entropy(
        inputs.h, inputs.weight, inputs.target, inputs.bias, inputs.index, ignore_index, smoothing,
        scale.contiguous(), grads=tuple(want), chunk_rows=chunk_rows,
    )
    return out.grad_h, out.grad_weight, out.grad_bias
