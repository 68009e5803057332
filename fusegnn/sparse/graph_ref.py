r"""What the traced part of a ``torch.compile``-d model knows of a graph: :class:`GraphRef`.

A :class:`~fusegnn.sparse.Graph` is no tensor and its processing (self-loops, GCN
normalisation, sorted formats) is data-dependent, so under compilation the public ops and
the graph processing functions work on a :class:`GraphRef` instead: the graph's handle
(:attr:`~fusegnn.sparse.Graph.uid`), its sizes, its edge list and weights, and the
processing (``transform``) that the ``torch.library`` ops of :mod:`fusegnn.sparse.library`
apply when they run. Nothing here reads a tensor's values.

The eager / compiled fork of the op layer is :func:`fusegnn.sparse.ops.graph_arg`: a
:class:`Graph` eagerly, a :class:`GraphRef` under compilation. The processing functions
:func:`~fusegnn.sparse.processing.gcn_norm` and
:func:`~fusegnn.sparse.processing.gat_self_loops` given a reference return it with their
transform, so a layer writes its graph processing once for both modes.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from fusegnn.sparse.graph import Graph, check_edge_weight, coerce_graph, square_node_count
from fusegnn.sparse.halo import HaloGraph

__all__ = [
    "GraphRef",
    "graph_ref",
    "with_transform",
    "gcn_transform",
    "gcn_params",
    "GAT_SELF_LOOPS",
    "GCN_PREFIX",
]

GAT_SELF_LOOPS = "gat_self_loops"
GCN_PREFIX = "gcn_norm:"
_DTYPE_NAMES = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
    torch.float64: "float64",
}
_INDEX_DTYPES = (torch.int32, torch.int64)


class GraphRef(NamedTuple):
    """What the traced part of a compiled model knows of a graph: integers and metadata.

    Attribute names follow :class:`~fusegnn.sparse.Graph` (``num_src_nodes``, ``device``,
    ``edge_weight``, ``is_bipartite``, :meth:`with_edge_weight`, ...) so argument checks
    and graph processing written for graphs accept a reference too.

    Attributes:
        uid: handle of a live :class:`Graph` (:attr:`Graph.uid`), or ``-1`` for a bare
            ``edge_index``.
        edge_index: the ``[2, E]`` edge list: the bare tensor, or the graph's own (from
            which a backward rebuilds a graph that died after its forward).
        num_src_nodes: source nodes (``-1``: inferred from ``edge_index`` at run time).
        num_dst_nodes: target nodes (``-1`` likewise).
        num_edges: edges of the processed graph (``-1`` when a transform changes them).
        device: the graph's device.
        index_dtype: dtype of the graph's ``edge_index``.
        transform: processing the ops apply before running (see
            :mod:`fusegnn.sparse.library`).
        edge_weight: the weights in ``edge_index``'s order (the graph's own or given),
            passed to the ops explicitly so that their gradient flows; with a GCN
            transform, the raw weights the op normalises. ``None``: unweighted.
    """

    uid: int
    edge_index: Optional[Tensor]
    num_src_nodes: int
    num_dst_nodes: int
    num_edges: int
    device: torch.device
    index_dtype: torch.dtype
    transform: str
    edge_weight: Optional[Tensor] = None

    @property
    def is_bipartite(self) -> bool:
        return self.num_src_nodes != self.num_dst_nodes

    @property
    def num_nodes(self) -> int:
        """Number of nodes of a square graph (``-1`` when unknown), as :attr:`Graph.num_nodes`."""
        return square_node_count(self.num_src_nodes, self.num_dst_nodes)

    def with_edge_weight(self, edge_weight: Optional[Tensor]) -> "GraphRef":
        """The same edges with other weights (checked as :meth:`Graph.with_edge_weight` does)."""
        if self.transform:
            raise ValueError(f"cannot re-weight a graph reference that carries transform {self.transform!r}")
        if edge_weight is not None:
            check_edge_weight(edge_weight, self, "edge_weight")
        return GraphRef(
            self.uid, self.edge_index, self.num_src_nodes, self.num_dst_nodes, self.num_edges, self.device,
            self.index_dtype, self.transform, edge_weight,
        )


def graph_ref(
    graph: "Graph | Tensor | GraphRef", num_nodes: "int | tuple[int, int] | None" = None, name: str = "graph"
) -> GraphRef:
    """A :class:`GraphRef` to ``graph`` (a :class:`Graph`, or an ``edge_index`` tensor with
    optional ``num_nodes`` as for :class:`Graph`; a reference is returned as it is).
    Checks what can be checked without reading ``edge_index``'s values (those are
    validated when the op builds the graph). Other graph inputs go through
    :func:`~fusegnn.sparse.graph.coerce_graph`: converted eagerly, refused with a clear
    error under compilation."""
    if isinstance(graph, GraphRef):
        return graph
    graph = coerce_graph(graph, name)
    if isinstance(graph, HaloGraph):
        raise TypeError(
            "a distributed graph (a worker's HaloGraph / DistGraph) runs eagerly only: its ops exchange "
            "halo rows between workers, which torch.compile does not trace"
        )
    if isinstance(graph, Graph):
        return GraphRef(
            graph.uid, graph.edge_index, graph.num_src_nodes, graph.num_dst_nodes, graph.num_edges,
            graph.device, graph.index_dtype, "", graph.edge_weight,
        )
    if isinstance(graph, Tensor):
        if graph.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name}: edge_index must hold int32 or int64 node ids, got dtype {graph.dtype}")
        if graph.dim() != 2 or graph.size(0) != 2:
            raise ValueError(f"{name}: edge_index must have shape [2, E], got {tuple(graph.shape)}")
        if graph.layout != torch.strided:
            raise TypeError(f"{name}: edge_index must be a dense (strided) tensor; use Graph.from_sparse")
        if num_nodes is None:
            num_src = num_dst = -1
        elif isinstance(num_nodes, (tuple, list)):
            if len(num_nodes) != 2:
                raise ValueError(
                    f"num_nodes must be an int or a pair (num_src_nodes, num_dst_nodes), got {num_nodes!r}"
                )
            num_src, num_dst = num_nodes
        else:
            num_src = num_dst = num_nodes
        return GraphRef(-1, graph, num_src, num_dst, graph.size(1), graph.device, graph.dtype, "")
    raise TypeError(f"{name} must be a fusegnn.sparse.Graph or an edge_index tensor, got {type(graph).__name__}")


def with_transform(ref: GraphRef, transform: str) -> GraphRef:
    """``ref`` with the processing ``transform`` (its edge count becomes unknown)."""
    if ref.transform:
        raise ValueError(f"the graph reference already carries transform {ref.transform!r}")
    return GraphRef(
        ref.uid, ref.edge_index, ref.num_src_nodes, ref.num_dst_nodes, -1, ref.device,
        ref.index_dtype, transform, ref.edge_weight,
    )


def gcn_transform(improved: bool, add_self_loops: bool, dtype: torch.dtype) -> str:
    """The ``transform`` string of :func:`~fusegnn.sparse.processing.gcn_norm` with these
    arguments (``dtype``: of the normalised weights)."""
    if dtype not in _DTYPE_NAMES:
        raise TypeError(f"gcn_norm weights must be float16, bfloat16, float32 or float64, got {dtype}")
    return f"{GCN_PREFIX}{int(bool(improved))}:{int(bool(add_self_loops))}:{_DTYPE_NAMES[dtype]}"


def gcn_params(transform: str) -> dict:
    """The keyword arguments of :func:`~fusegnn.sparse.processing.gcn_norm` that a
    :func:`gcn_transform` string stands for."""
    parts = transform[len(GCN_PREFIX):].split(":")
    if len(parts) != 3 or parts[2] not in _DTYPE_NAMES.values():
        raise ValueError(f"malformed gcn_norm transform {transform!r}")
    return dict(improved=parts[0] == "1", add_self_loops=parts[1] == "1", dtype=getattr(torch, parts[2]))
