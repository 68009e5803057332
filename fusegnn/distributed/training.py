r"""Synchronising a model trained on a partitioned graph.

Every worker holds a full replica of the parameters and computes the loss of its owned
training nodes. With the loss of worker :math:`r` taken as
:math:`L_r = \frac{1}{|T|} \sum_{i \in T \cap O_r} \ell_i` (:math:`T` the training nodes
of the whole graph, :func:`global_count`), :math:`\sum_r L_r` is the single-process loss
and the sum of the workers' gradients (:func:`allreduce_gradients`) is its gradient --
the halo exchange's backward has already brought every cross-worker contribution to its
owner. ``DistributedDataParallel`` works too; it *averages* gradients, so there scale
:math:`L_r` by the world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["allreduce_gradients", "global_count", "global_sum"]


def _multi_worker(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def global_sum(value: Tensor, group=None) -> Tensor:
    """The sum of ``value`` over the workers (a new tensor; ``value`` itself unchanged)."""
    total = value.detach().clone()
    if _multi_worker(group):
        dist.all_reduce(total, group=group)
    return total


def global_count(mask: Tensor, group=None) -> int:
    """The number of ``True`` entries of the workers' ``mask`` together (e.g. the
    training nodes of the whole graph from each worker's owned ones)."""
    return int(global_sum(mask.sum().to(torch.int64), group))


def allreduce_gradients(model: nn.Module, group=None) -> None:
    """Sum every parameter's ``.grad`` over the workers, in place, with one all-reduce of
    the flattened gradients. Every parameter that requires a gradient takes part, a
    missing ``.grad`` counting as zeros, so that the workers agree on the collective's
    size even when a parameter got no gradient on some of them (a worker whose loss never
    reached it); a flag per parameter travels along, and a parameter is left with
    ``.grad = None`` only when no worker had a gradient for it. A no-op with one worker."""
    if not _multi_worker(group):
        return
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return
    present = [p.grad is not None for p in params]
    grads = [p.grad if ok else torch.zeros_like(p) for p, ok in zip(params, present)]
    flat = torch.cat([g.reshape(-1) for g in grads])
    flags = flat.new_ones(len(params))  # made on the device: no host-to-device copy a step
    for i, ok in enumerate(present):
        if not ok:
            flags[i] = 0.0
    flat = torch.cat([flat, flags])
    dist.all_reduce(flat, group=group)
    # read back (a host sync) only where a local gradient is missing: the common step has none
    had_grad = present if all(present) else [flag > 0 for flag in flat[-len(params):].tolist()]
    offset = 0
    for p, g, ok, anyone in zip(params, grads, present, had_grad):
        summed = flat[offset:offset + g.numel()].view_as(g)
        offset += g.numel()
        if ok:
            p.grad.copy_(summed)
        elif anyone:
            p.grad = summed.to(p.dtype).clone()
