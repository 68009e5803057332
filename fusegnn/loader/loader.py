"""Mini-batches of sampled neighbourhoods: :class:`NeighborLoader`.

Iterating the loader runs one epoch: the input nodes (shuffled or in order) are split
into batches of ``batch_size`` seeds; each batch's neighbourhood is sampled on the device
by :class:`~fusegnn.loader.NeighborSampler`, its nodes' features gathered
(:func:`~fusegnn.loader.features.gather_rows`) and its seeds' labels picked, into a
:class:`~fusegnn.loader.SampledBatch`. No worker processes: sampling is a few dozen tensor
ops per hop on the GPU, where the features already are.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from fusegnn.loader.batch import SampledBatch
from fusegnn.loader.features import gather_rows
from fusegnn.loader.sampler import NeighborSampler
from fusegnn.sparse.graph import Graph, check_seed, is_integer, type_name

__all__ = ["NeighborLoader"]


class NeighborLoader:
    """Mini-batches of seed nodes with their sampled multi-hop neighbourhoods.

    Args:
        data: a :class:`~fusegnn.sparse.Graph`, a :class:`~fusegnn.datasets.NodeDataset`,
            or any object with ``edge_index`` and ``num_nodes`` (and optionally ``x``,
            ``y``, ``edge_weight``), such as a PyG ``Data``.
        num_neighbors: fanout per hop from the seeds outwards (``-1``: every neighbour),
            e.g. ``[25, 10]`` for a 2-layer GraphSAGE.
        batch_size: seeds per batch.
        input_nodes: the seeds of an epoch: a ``[N]`` bool mask or distinct node ids
            (``None``: every node).
        x, y: node features ``[N, F]`` and labels ``[N]``; override ``data``'s.
        shuffle: a new random order of the input nodes every epoch.
        replace: sample with replacement (exactly ``fanout`` edges per target that has any).
        weighted: sample in proportion to the graph's ``edge_weight``.
        seed: seed of the loader's ``torch.Generator`` (shuffling and sampling); the
            whole sequence of epochs is reproducible. ``None`` takes one from torch's
            default generator (so ``torch.manual_seed`` fixes it).
        drop_last: drop the last batch when it has fewer than ``batch_size`` seeds.
        device: where to sample and where batches go (default: the graph's device).
        pin_features: keep ``x`` in CPU memory and send each batch's rows through pinned
            staging memory with an asynchronous copy (for features that do not fit on the
            GPU); otherwise ``x`` is moved to ``device`` once.

    ``len(loader)`` is the number of batches per epoch.
    """

    def __init__(
        self,
        data: Any,
        num_neighbors: Sequence[int],
        batch_size: int = 1024,
        input_nodes: Tensor | None = None,
        *,
        x: Tensor | None = None,
        y: Tensor | None = None,
        shuffle: bool = True,
        replace: bool = False,
        weighted: bool = False,
        seed: int | None = None,
        drop_last: bool = False,
        device: torch.device | str | None = None,
        pin_features: bool = False,
    ) -> None:
        graph, data_x, data_y = _unpack(data, weighted)
        if not is_integer(batch_size) or batch_size < 1:  # NumPy ints count, as for every count
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.device = torch.device(device) if device is not None else graph.device
        self.sampler = NeighborSampler(graph, num_neighbors, replace=replace, weighted=weighted, device=self.device)
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.pin_features = bool(pin_features)
        self.input_nodes = self._resolve_input_nodes(input_nodes, graph.num_nodes)
        self.x = self._place(_node_tensor(x if x is not None else data_x, graph.num_nodes, "x"), features=True)
        self.y = self._place(_node_tensor(y if y is not None else data_y, graph.num_nodes, "y"), features=False)
        self.seed = int(torch.randint(0, 2**62, (1,))) if seed is None else check_seed(seed)
        self.generator = torch.Generator(device=self.device).manual_seed(self.seed)

    @property
    def num_neighbors(self) -> list[int]:
        return self.sampler.num_neighbors

    def __len__(self) -> int:
        n = self.input_nodes.numel()
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[SampledBatch]:
        count = self.input_nodes.numel()
        if self.shuffle:
            order = torch.randperm(count, generator=self.generator, device=self.device)
        else:
            order = torch.arange(count, device=self.device)
        for k in range(len(self)):
            input_id = order[k * self.batch_size : (k + 1) * self.batch_size]
            yield self._batch(input_id)

    def _batch(self, input_id: Tensor) -> SampledBatch:
        seeds = self.input_nodes[input_id]
        subgraph = self.sampler.sample_checked(seeds, self.generator)
        n_id_cpu = subgraph.n_id.cpu() if self.x is not None and self.x.device != self.device else None
        x = gather_rows(self.x, subgraph.n_id, self.device, n_id_cpu) if self.x is not None else None
        y = gather_rows(self.y, seeds, self.device) if self.y is not None else None
        return SampledBatch(subgraph=subgraph, x=x, y=y, input_id=input_id)

    def _resolve_input_nodes(self, input_nodes: Tensor | None, num_nodes: int) -> Tensor:
        if input_nodes is None:
            return torch.arange(num_nodes, device=self.device)
        if not isinstance(input_nodes, Tensor):
            raise TypeError(f"input_nodes must be a bool mask or a tensor of node ids, got {type_name(input_nodes)}")
        if input_nodes.dtype == torch.bool:
            if input_nodes.shape != (num_nodes,):
                raise ValueError(
                    f"input_nodes as a mask must have shape [{num_nodes}] (one flag per node), "
                    f"got {tuple(input_nodes.shape)}"
                )
            return input_nodes.to(self.device).nonzero().squeeze(1)
        return self.sampler.check_seeds(input_nodes, "input_nodes")

    def _place(self, values: Tensor | None, *, features: bool) -> Tensor | None:
        """Node tensors go to the loader's device, except features kept on the CPU
        (``pin_features``) for a CUDA device."""
        if values is None:
            return None
        if features and self.pin_features and self.device.type == "cuda":
            return values.cpu()
        return values.to(self.device)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_neighbors={self.num_neighbors}, batch_size={self.batch_size}, "
            f"input_nodes={self.input_nodes.numel()}, shuffle={self.shuffle}, device={self.device})"
        )


def _unpack(data: Any, weighted: bool) -> tuple[Graph, Tensor | None, Tensor | None]:
    """``(graph, x, y)`` of a Graph, a NodeDataset or a PyG-style data object."""
    if isinstance(data, Graph):
        return data, None, None
    edge_index = getattr(data, "edge_index", None)
    if not isinstance(edge_index, Tensor):
        raise TypeError(
            "data must be a fusegnn.sparse.Graph, a fusegnn.datasets.NodeDataset or an object with "
            f"edge_index and num_nodes (e.g. torch_geometric.data.Data), got {type_name(data)}"
        )
    graph = getattr(data, "graph", None)
    if not isinstance(graph, Graph):
        weight = getattr(data, "edge_weight", None) if weighted else None
        graph = Graph(edge_index, int(data.num_nodes), weight)
    return graph, getattr(data, "x", None), getattr(data, "y", None)


def _node_tensor(values: Tensor | None, num_nodes: int, name: str) -> Tensor | None:
    if values is None:
        return None
    if not isinstance(values, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor with one row per node, got {type_name(values)}")
    if values.dim() == 0 or values.size(0) != num_nodes:
        raise ValueError(f"{name} must have one row per node ({num_nodes}), got shape {tuple(values.shape)}")
    return values
