r"""Multi-hop neighbour sampling on the graph's device: :class:`NeighborSampler`.

From a set of seed nodes, hop ``h = 1 .. L`` draws up to ``num_neighbors[h - 1]``
incoming edges of each node that hop ``h - 1`` added (hop 0 adds the seeds), as
GraphSAGE (Hamilton et al., 2017) and PyG's ``NeighborLoader`` do. Every node is a target
once, in the hop after it appeared; the sources that are new join the subgraph.

The result follows PyG's conventions:

* ``n_id``: global ids of the subgraph's nodes, the seeds first in their order, then the
  nodes of hop 1, hop 2, ... (``num_sampled_nodes`` per hop, seeds included);
* ``edge_index``: the sampled edges in local ids, row 0 the source (neighbour), row 1
  the target, hop after hop (``num_sampled_edges`` per hop) and grouped by target;
  ``e_id`` their positions in the graph's ``edge_index``;
* ``blocks``: for an ``L``-layer model, ``blocks[l]`` is the bipartite graph that layer
  ``l`` (``0`` = the input layer) runs on. Its targets are the nodes of hops
  ``0 .. L - 1 - l``, its sources those of hops ``0 .. L - l`` (the targets are a prefix
  of the sources, so ``x_dst = x_src[:num_dst_nodes]``), its edges those of hops
  ``1 .. L - l``: a prefix of ``edge_index``. The last block's targets are the seeds.

Edges are drawn per target by :mod:`fusegnn.loader.draws` (uniform or weighted, with or
without replacement) from the graph's edges grouped by target (:attr:`Graph.csr`), and
new nodes are numbered by :mod:`fusegnn.loader.relabel`. Work per hop is proportional to
the sampled edges (plus, for weighted sampling without replacement, all edges of the
targets), never to the whole graph; a hop needs a few host syncs (output sizes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from fusegnn.loader import draws
from fusegnn.loader.relabel import append_new_nodes
from fusegnn.sparse.graph import Graph, is_integer, type_name

__all__ = ["NeighborSampler", "SampledSubgraph", "check_num_neighbors"]


@dataclass
class SampledSubgraph:
    """What :meth:`NeighborSampler.sample` returns (see the module docstring)."""

    n_id: Tensor
    edge_index: Tensor
    e_id: Tensor
    num_sampled_nodes: list[int]
    num_sampled_edges: list[int]

    @property
    def batch_size(self) -> int:
        """Number of seeds (the first ``batch_size`` entries of ``n_id``)."""
        return self.num_sampled_nodes[0]

    @cached_property
    def blocks(self) -> list[Graph]:
        """Per layer, from the input layer: bipartite graphs whose targets are a prefix of
        their sources and whose edges are a prefix of ``edge_index``."""
        hops = len(self.num_sampled_edges)
        blocks = []
        for layer in range(hops):
            depth = hops - layer  # hops of edges this layer aggregates
            num_src = sum(self.num_sampled_nodes[: depth + 1])
            num_dst = sum(self.num_sampled_nodes[:depth])
            num_edges = sum(self.num_sampled_edges[:depth])
            blocks.append(Graph(self.edge_index[:, :num_edges], (num_src, num_dst), validate=False))
        return blocks


def check_num_neighbors(num_neighbors: Sequence[int]) -> list[int]:
    """``num_neighbors`` as a list of ints ``>= 0`` or ``-1`` (every neighbour)."""
    if isinstance(num_neighbors, (int, Tensor)) or not isinstance(num_neighbors, Sequence):
        raise TypeError(
            f"num_neighbors must be a list of ints (one fanout per hop), got {type_name(num_neighbors)}"
        )
    fanouts = list(num_neighbors)
    if not fanouts:
        raise ValueError("num_neighbors must name at least one hop, got an empty list")
    for fanout in fanouts:
        # numpy / other integral scalars count (list(np.array([25, 10])) holds np.int64)
        if not is_integer(fanout) or fanout < -1:
            raise ValueError(
                f"num_neighbors must hold ints >= 0 (or -1 for every neighbour), got {num_neighbors!r}"
            )
    return [int(fanout) for fanout in fanouts]


class NeighborSampler:
    """Samples multi-hop neighbourhoods of seed nodes, on the graph's device.

    Args:
        graph: the graph; a node's neighbours are the sources of its incoming edges.
        num_neighbors: fanout per hop, from the seeds outwards (``-1``: every neighbour).
        replace: draw with replacement (exactly ``fanout`` edges per target with at least
            one incoming edge, repeats possible), as PyG's ``replace=True``.
        weighted: draw edges in proportion to the graph's ``edge_weight`` (1-D, >= 0).
        device: where to sample (default: the graph's device); the graph is moved there.

    The sampler holds the graph's edges grouped by target (and for weighted sampling the
    weights in that order); :meth:`sample` allocates only per-batch tensors.
    """

    def __init__(
        self,
        graph: Graph,
        num_neighbors: Sequence[int],
        *,
        replace: bool = False,
        weighted: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(graph, Graph):
            raise TypeError(f"graph must be a fusegnn.sparse.Graph, got {type_name(graph)}")
        if graph.is_bipartite:
            raise ValueError(
                f"graph must be square to sample multi-hop neighbourhoods, got "
                f"{graph.num_src_nodes} source x {graph.num_dst_nodes} target nodes"
            )
        self.num_neighbors = check_num_neighbors(num_neighbors)
        self.replace = bool(replace)
        self.weighted = bool(weighted)
        self.device = torch.device(device) if device is not None else graph.device
        graph = graph.to(self.device)
        self.num_nodes = graph.num_nodes
        csr = graph.csr  # grouped by target: index = sources
        self._ptr = csr.ptr
        self._sources = csr.index.to(torch.int64)
        self._edge_ids = csr.perm
        self._weight: Tensor | None = None
        self._cumulative: Tensor | None = None
        if self.weighted:
            self._weight = _grouped_weight(graph, csr.perm)
            if self.replace:
                self._cumulative = draws.segment_cumsum(self._weight, self._ptr)
                degree = self._ptr[1:] - self._ptr[:-1]
                self._max_degree = int(degree.max()) if degree.numel() else 0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_nodes={self.num_nodes}, num_neighbors={self.num_neighbors}, "
            f"replace={self.replace}, weighted={self.weighted}, device={self.device})"
        )

    def sample(self, seeds: Tensor, generator: torch.Generator | None = None) -> SampledSubgraph:
        """The sampled neighbourhood of ``seeds`` (distinct global node ids, int).

        ``generator`` (on the sampler's device) makes the draws reproducible; ``None``
        uses torch's default generator of that device."""
        seeds = self.check_seeds(seeds)
        return self.sample_checked(seeds, generator)

    def check_seeds(self, seeds: Tensor, name: str = "seeds") -> Tensor:
        """``seeds`` as int64 on the sampler's device, checked: 1-D, in range, distinct
        (errors name the argument ``name``)."""
        if not isinstance(seeds, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of node ids, got {type_name(seeds)}")
        if seeds.dim() != 1 or seeds.is_floating_point() or seeds.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a 1-D integer tensor of node ids, got shape {tuple(seeds.shape)} "
                f"and dtype {seeds.dtype}"
            )
        seeds = seeds.to(self.device, torch.int64)
        if seeds.numel():
            low, high = torch.stack([seeds.min(), seeds.max()]).tolist()
            if low < 0 or high >= self.num_nodes:
                raise IndexError(f"{name} must be node ids in [0, {self.num_nodes}), got ids from {low} to {high}")
            distinct = torch.unique(seeds).numel()
            if distinct != seeds.numel():
                raise ValueError(f"{name} must be distinct node ids, got {seeds.numel() - distinct} repeated id(s)")
        return seeds

    def sample_checked(self, seeds: Tensor, generator: torch.Generator | None = None) -> SampledSubgraph:
        """:meth:`sample` for ``seeds`` already checked by :meth:`check_seeds`."""
        n_id = seeds
        num_nodes = [seeds.numel()]
        edges: list[tuple[Tensor, Tensor, Tensor]] = []
        frontier_start = 0
        for fanout in self.num_neighbors:
            targets = n_id[frontier_start:]
            row, pos = self._draw(targets, fanout, generator)
            new, src_local = append_new_nodes(n_id, self._sources[pos])
            edges.append((src_local, row + frontier_start, self._edge_ids[pos]))
            frontier_start = n_id.numel()
            n_id = torch.cat([n_id, new])
            num_nodes.append(new.numel())
        edge_index = torch.stack([torch.cat([s for s, _, _ in edges]), torch.cat([d for _, d, _ in edges])])
        return SampledSubgraph(
            n_id=n_id,
            edge_index=edge_index,
            e_id=torch.cat([e for _, _, e in edges]),
            num_sampled_nodes=num_nodes,
            num_sampled_edges=[s.numel() for s, _, _ in edges],
        )

    def _draw(self, targets: Tensor, fanout: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        start = self._ptr[targets]
        deg = self._ptr[targets + 1] - start
        if fanout == -1:
            if self._weight is not None:  # every edge of positive weight
                row, pos = draws.all_edges(start, deg)
                keep = self._weight[pos] > 0
                return row[keep], pos[keep]
            return draws.all_edges(start, deg)
        if self._weight is None:
            return draws.uniform(start, deg, fanout, generator, replace=self.replace)
        if self.replace:
            return draws.weighted_with_replacement(start, deg, fanout, self._cumulative, generator, self._max_degree)
        return draws.weighted_without_replacement(start, deg, fanout, self._weight, generator)


def _grouped_weight(graph: Graph, perm: Tensor) -> Tensor:
    """The graph's 1-D, finite, non-negative edge weights in the grouped (by target) order."""
    weight = graph.edge_weight
    if weight is None:
        raise ValueError("weighted=True needs a graph with edge_weight (Graph(edge_index, n, edge_weight))")
    if weight.dim() != 1:
        raise ValueError(f"weighted sampling needs one weight per edge ([E]), got edge_weight of shape {tuple(weight.shape)}")
    if weight.numel() and not bool(torch.isfinite(weight).all() & (weight >= 0).all()):
        raise ValueError("weighted sampling needs finite, non-negative edge weights")
    return weight[perm]
