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
    the flattened gradients (parameters without a gradient are skipped: on every worker
    the same ones, as they run the same model). A no-op with one worker."""
    if not _multi_worker(group):
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
