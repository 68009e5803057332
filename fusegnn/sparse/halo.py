r"""A graph over one worker's share of the nodes whose sources include other workers' nodes.

In partition-parallel full-graph training (:mod:`fusegnn.distributed`) each worker owns a
set of nodes and holds every edge into them. Their sources are its own nodes and *halo*
nodes owned by other workers. A :class:`HaloGraph` numbers them so that the owned
nodes come first on both sides:

* targets ``0 .. num_own - 1`` are the owned nodes;
* sources ``0 .. num_own - 1`` are the same owned nodes (source ``i`` *is* target ``i``),
  sources ``num_own .. num_own + num_halo - 1`` the halo nodes;

so it is a bipartite graph of ``num_own + num_halo`` sources and ``num_own`` targets.
It carries ``exchange``, a function that turns rows of the owned nodes ``[num_own, ...]``
into rows of every source ``[num_own + num_halo, ...]`` (the owned rows, then the halo
rows fetched from their owners) and is differentiable.

The ops recognise it (:func:`with_halo_rows`): given node tensors of the owned nodes,
they exchange the source-side ones and run on :attr:`HaloGraph.local`, the plain
bipartite graph of the same edges. Graph processing that adds self-loops adds them to
the owned nodes; GCN normalisation reads a source's degree from its owner (one exchange
of the degrees, cached with the normalised graph). So a layer written for a square graph
runs unchanged on a worker's share, the exchange included. Every worker must run the
same ops in the same order: an exchange is a collective.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from fusegnn.sparse.graph import Graph

__all__ = ["HaloGraph", "held_graph", "with_halo_rows"]

Exchange = Callable[[Tensor], Tensor]


class HaloGraph(Graph):
    r"""A worker's incoming edges: ``num_own`` targets, ``num_own + num_halo`` sources, the
    first ``num_own`` sources the targets themselves (see the module docstring).

    Args:
        edge_index: ``[2, E]`` local ids: sources in ``[0, num_own + num_halo)``, targets in
            ``[0, num_own)``.
        num_own: owned nodes (targets).
        num_halo: halo nodes (sources owned elsewhere).
        exchange: ``[num_own, ...] -> [num_own + num_halo, ...]``, differentiable; a
            collective every worker calls together.
        edge_weight: optional ``[E]`` weights.
        validate: check the ids (as for :class:`~fusegnn.sparse.Graph`).
    """

    def __init__(
        self,
        edge_index: Tensor,
        num_own: int,
        num_halo: int,
        exchange: Exchange,
        edge_weight: Tensor | None = None,
        *,
        validate: bool = True,
    ) -> None:
        if not callable(exchange):
            raise TypeError(f"exchange must be callable, got {type(exchange).__name__}")
        self._exchange = exchange
        super().__init__(edge_index, (num_own + num_halo, num_own), edge_weight, validate=validate)

    @property
    def num_own(self) -> int:
        """Owned nodes: the targets, and the first sources."""
        return self.num_dst_nodes

    @property
    def num_halo(self) -> int:
        """Sources owned by other workers (after the owned ones)."""
        return self.num_src_nodes - self.num_dst_nodes

    @property
    def local(self) -> Graph:
        """The same edges and weights as a plain bipartite :class:`~fusegnn.sparse.Graph`,
        which the ops run on once the halo rows are there (built once; its edge formats
        are shared by the re-weighted copies of this graph)."""
        bare = self.cached(
            "halo.local", lambda: Graph(self.edge_index, (self.num_src_nodes, self.num_dst_nodes), validate=False),
            structural=True,
        )
        if self.edge_weight is None:
            return bare
        return self.cached("halo.local_weighted", lambda: bare.with_edge_weight(self.edge_weight))

    def source_rows(self, x: Tensor) -> Tensor:
        """Rows of every source from rows ``x`` of the owned nodes (the exchange)."""
        self.check_owned_rows(x)
        return self._exchange(x)

    def check_owned_rows(self, x: Tensor, name: str = "node features") -> None:
        """``x`` is a tensor with one row per owned node."""
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 0 or x.size(0) != self.num_own:
            raise ValueError(
                f"on a distributed graph a node tensor holds the rows of this worker's {self.num_own} "
                f"owned nodes, got {name} of shape {tuple(x.shape)}"
            )

    def with_edges(self, edge_index: Tensor, edge_weight: Tensor | None = None) -> "HaloGraph":
        """Other edges between the same nodes, with the same exchange."""
        return HaloGraph(edge_index, self.num_own, self.num_halo, self._exchange, edge_weight, validate=False)

    def to(self, device: torch.device | str) -> "HaloGraph":
        device = torch.device(device)
        if device == self.device:
            return self
        weight = self.edge_weight.to(device) if self.edge_weight is not None else None
        return HaloGraph(self.edge_index.to(device), self.num_own, self.num_halo, self._exchange, weight,
                         validate=False)

    def __repr__(self) -> str:
        weighted = ", weighted" if self.edge_weight is not None else ""
        return (f"HaloGraph(num_own={self.num_own}, num_halo={self.num_halo}, num_edges={self.num_edges}"
                f"{weighted}, device={self.device})")


def with_halo_rows(graph, *source_tensors: Tensor) -> tuple:
    """``(graph, *source_tensors)`` ready for an op: for a :class:`HaloGraph`, its
    :attr:`~HaloGraph.local` graph and the tensors with the halo rows appended (one
    exchange for all of them: they are concatenated along their flattened features);
    anything else as given. An object that holds a graph (``__fusegnn_graph__``, e.g. a
    :class:`fusegnn.distributed.DistGraph`) counts as the graph it holds. Under
    ``torch.compile`` nothing is exchanged (the ops refuse a halo graph there)."""
    graph = held_graph(graph)
    if not isinstance(graph, HaloGraph) or torch.compiler.is_compiling():
        return (graph, *source_tensors)
    if not source_tensors:  # only the local graph (an op with no source rows, e.g. edge_softmax)
        return (graph.local,)
    for t in source_tensors:
        graph.check_owned_rows(t)
    if len(source_tensors) == 1 or len({t.dtype for t in source_tensors}) > 1:
        return (graph.local, *(graph.source_rows(t) for t in source_tensors))
    n = graph.num_own
    flat = [t.reshape(n, math.prod(t.shape[1:])) for t in source_tensors]  # (n may be 0)
    widths = [f.size(1) for f in flat]
    rows = graph.source_rows(torch.cat(flat, dim=1))
    parts = rows.split(widths, dim=1)
    # the row count spelled out: a zero-width tensor ([n, 0, ...]) leaves -1 ambiguous
    return (graph.local, *(p.reshape(rows.size(0), *t.shape[1:]) for p, t in zip(parts, source_tensors)))


def held_graph(graph):
    """The graph an object that holds one gives (its type's ``__fusegnn_graph__``, e.g. a
    :class:`fusegnn.distributed.DistGraph`); anything else as it is."""
    held = getattr(type(graph), "__fusegnn_graph__", None)
    return held(graph) if held is not None else graph
