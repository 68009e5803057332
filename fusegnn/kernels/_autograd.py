r"""``differentiable_once``: the backward decorator of every fused op's ``autograd.Function``.

The fused backward passes are not themselves differentiable. torch's
``once_differentiable`` says so only when the *incoming* gradient requires grad; a
gradient penalty -- ``g = grad(loss, x, create_graph=True)``, then ``(loss + |g|^2)
.backward()`` -- builds its graph with an incoming gradient of ones, which does not, so
the fused op's gradients come back as constants and the penalty's own gradient through
them is silently dropped (the weight's gradient of a GAS / GAR spmm penalty came out
1.25 where the reference gives 1.96).

:func:`differentiable_once` runs the backward without grad, as ``once_differentiable``
does, and whenever the backward is building a graph (``create_graph=True``: grad mode is
on inside it) it hands the gradients back through :class:`_NoSecondDerivative`, an
identity whose own backward raises. Nothing changes for a plain ``backward()``; a second
derivative through these gradients is a clear ``RuntimeError`` instead of a wrong value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

__all__ = ["differentiable_once"]

_MESSAGE = (
    "a fused fusegnn op is differentiable once: its gradients were asked for with "
    "create_graph=True and are being differentiated again (e.g. a gradient penalty); run "
    "that op with aggregation='reference' (or backend='reference' for the loss), whose "
    "ATen ops have second derivatives"
)


class _NoSecondDerivative(torch.autograd.Function):
    """The identity on a backward's gradients, whose backward raises."""

    @staticmethod
    def forward(ctx, *grads):
        return tuple(g.detach() for g in grads)  # not views: the gradients stay modifiable in place

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(_MESSAGE)


def _mark(outputs):
    """``outputs`` (a tensor, ``None`` or a tuple of them and other values) with every
    floating tensor passed through :class:`_NoSecondDerivative`."""
    single = not isinstance(outputs, tuple)
    items = (outputs,) if single else outputs
    slots = [i for i, g in enumerate(items) if isinstance(g, torch.Tensor) and g.is_floating_point()]
    if not slots:
        return outputs
    # leaves that require grad, so that the identity records a node (as once_differentiable does)
    marked = _NoSecondDerivative.apply(*(items[i].detach().requires_grad_() for i in slots))
    if not isinstance(marked, tuple):
        marked = (marked,)
    result = list(items)
    for i, g in zip(slots, marked):
        result[i] = g
    return result[0] if single else tuple(result)


def differentiable_once(backward: Callable) -> Callable:
    """Decorate an ``autograd.Function.backward`` in place of torch's
    ``once_differentiable``: it runs without grad, and under ``create_graph=True`` its
    gradients raise when differentiated again (see the module docstring)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        building_graph = torch.is_grad_enabled()
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        return _mark(outputs) if building_graph else outputs

    return wrapper
