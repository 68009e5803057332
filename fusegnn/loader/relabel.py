"""Local node ids for a sampled subgraph: the nodes seen so far keep theirs, new ones are appended.

A sampled subgraph lists its nodes once each, in ``n_id`` (global ids): the seeds first,
in their given order, then the nodes each hop adds (PyG's convention, so that the targets
of every hop are a prefix of its sources). Each hop draws edges whose sources are global
ids, some already in ``n_id``, some new, some repeated; :func:`append_new_nodes` returns
the new distinct ones (in increasing global id) and every source's local id.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["append_new_nodes"]


def append_new_nodes(n_id: Tensor, sources: Tensor) -> tuple[Tensor, Tensor]:
    """``(new, local)``: the distinct ids of ``sources`` not in ``n_id`` (sorted), and the
    local id of each entry of ``sources`` in ``cat([n_id, new])``.

    One ``torch.unique`` over ``n_id`` and ``sources`` together; ``n_id`` must hold
    distinct ids. Two host syncs (the sizes of the unique and of the new nodes)."""
    num_old = n_id.numel()
    unique, inverse = torch.unique(torch.cat([n_id, sources]), return_inverse=True)
    local_of_unique = torch.full_like(unique, -1)
    local_of_unique[inverse[:num_old]] = torch.arange(num_old, device=n_id.device)
    is_new = local_of_unique < 0
    new = unique[is_new]
    local_of_unique[is_new] = torch.arange(num_old, num_old + new.numel(), device=n_id.device)
    return new, local_of_unique[inverse[num_old:]]
