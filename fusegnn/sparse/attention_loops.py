r"""Self-loops of the attention layers (``GATConv``, ``GATv2Conv``) for square and bipartite graphs.

PyG's attention layers with ``add_self_loops=True`` remove every edge ``j -> i`` with
``j == i`` and append one loop ``i -> i`` for each node ``i < n``; ``n`` is the node count
of a square graph and :math:`\min(N_{src}, N_{dst})` of a bipartite one (where a "loop"
joins source ``i`` to target ``i``). Edge features follow: the kept edges' in their
order, then one row per loop from ``fill_value``
(:func:`~fusegnn.sparse.processing.self_loop_attr`).

Square graphs go through :func:`~fusegnn.sparse.processing.gat_self_loops` and
:func:`~fusegnn.sparse.processing.gat_self_loop_edge_attr` (whose edge order this keeps);
bipartite ones through the same steps here, cached on the graph. Eager only for
bipartite graphs: their loop count is data-dependent under ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusegnn.sparse.graph import Graph
from fusegnn.sparse.graph_ref import GraphRef
from fusegnn.sparse.halo import HaloGraph
from fusegnn.sparse.processing import gat_self_loop_edge_attr, gat_self_loops, self_loop_attr

__all__ = ["attention_self_loops", "attention_self_loop_edge_attr"]


def _non_loop_edges(graph: Graph) -> Tensor:
    """Positions of the edges ``j -> i`` with ``j != i`` (cached, structural)."""
    return graph.cached(
        "fusegnn.non_loop_edges", lambda: torch.nonzero(graph.src != graph.dst).flatten(), structural=True
    )


def _num_loops(graph: Graph | GraphRef) -> int:
    return min(graph.num_src_nodes, graph.num_dst_nodes)


def _bipartite_unsupported(graph: GraphRef) -> NotImplementedError:
    return NotImplementedError(
        f"self-loops on a bipartite graph ({graph.num_src_nodes} x {graph.num_dst_nodes} nodes) are added "
        "eagerly only: under torch.compile pass a graph that already has them and add_self_loops=False"
    )


def attention_self_loops(graph: Graph | GraphRef) -> Graph | GraphRef:
    """``graph`` unweighted, without its edges ``i -> i``, with one loop ``i -> i`` per
    ``i < min(N_src, N_dst)`` appended (PyG's ``remove_self_loops`` then ``add_self_loops``
    in ``GATConv``). A square graph gives :func:`~fusegnn.sparse.processing.gat_self_loops`
    (a :class:`~fusegnn.sparse.graph_ref.GraphRef` too); a bipartite one keeps its
    ``(N_src, N_dst)`` sizes; a worker's share of a distributed graph
    (:class:`~fusegnn.sparse.halo.HaloGraph`) gets its owned nodes' loops
    (:func:`~fusegnn.sparse.processing.gat_self_loops`). Cached on ``graph`` (structural)."""
    if not graph.is_bipartite or isinstance(graph, HaloGraph):  # a worker's share: loops on its own nodes
        return gat_self_loops(graph)
    if isinstance(graph, GraphRef):
        raise _bipartite_unsupported(graph)

    def build() -> Graph:
        n = _num_loops(graph)
        loop = torch.arange(n, device=graph.device, dtype=graph.index_dtype)
        kept = graph.edge_index.index_select(1, _non_loop_edges(graph))
        edge_index = torch.cat([kept, loop.unsqueeze(0).expand(2, n)], dim=1)
        return Graph(edge_index, (graph.num_src_nodes, graph.num_dst_nodes), validate=False)

    return graph.cached("fusegnn.attention_self_loops", build, structural=True)


def attention_self_loop_edge_attr(
    graph: Graph | GraphRef, edge_attr: Tensor, fill_value: float | Tensor | str | None = "mean"
) -> Tensor:
    """``edge_attr`` (one row per edge of ``graph``) in the edge order of
    :func:`attention_self_loops` ``(graph)``: the rows of the edges that are not loops,
    then one row per added loop from ``fill_value`` (a number, a feature tensor, ``None``
    for ones, or the reduction ``"add"`` / ``"sum"`` / ``"mean"`` / ``"min"`` / ``"max"`` /
    ``"mul"`` of the kept edges into each loop's target; see
    :func:`~fusegnn.sparse.processing.self_loop_attr`). Differentiable in ``edge_attr``."""
    if not graph.is_bipartite:
        return gat_self_loop_edge_attr(graph, edge_attr, fill_value)
    if isinstance(graph, GraphRef):
        raise _bipartite_unsupported(graph)
    if not isinstance(edge_attr, Tensor):
        raise TypeError(f"edge_attr must be a torch.Tensor, got {type(edge_attr).__name__}")
    if edge_attr.dim() == 0 or edge_attr.size(0) != graph.num_edges:
        raise ValueError(
            f"edge_attr must have one row per edge ({graph.num_edges}), got shape {tuple(edge_attr.shape)}"
        )
    keep = _non_loop_edges(graph)
    kept_attr = edge_attr.index_select(0, keep)
    kept = Graph(graph.edge_index.index_select(1, keep), (graph.num_src_nodes, graph.num_dst_nodes), validate=False)
    loops = self_loop_attr(kept, kept_attr, fill_value)[: _num_loops(graph)]
    return torch.cat([kept_attr, loops], dim=0)
