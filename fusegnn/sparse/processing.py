r"""Graph processing: self-loop handling and GCN normalisation, as tensor ops on the device.

These return new :class:`~fusegnn.sparse.Graph` objects (a graph is immutable) and are
differentiable with respect to edge weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fusegnn.sparse.graph import Graph, cache_value, check_edge_weight
from fusegnn.sparse.halo import HaloGraph
from fusegnn.sparse.graph_ref import GAT_SELF_LOOPS, GCN_PREFIX, GraphRef, gcn_params, gcn_transform, with_transform

__all__ = [
    "remove_self_loops",
    "add_self_loops",
    "add_remaining_self_loops",
    "gcn_norm",
    "gat_self_loops",
    "gat_self_loop_edge_attr",
    "self_loop_attr",
    "gcn_normalized",
    "transformed",
    "self_loop_structure",
    "SelfLoopStructure",
]


def _require_square(graph: Graph, what: str) -> int:
    """The nodes that can have a self-loop ``i -> i``: all of a square graph's, a
    :class:`~fusegnn.sparse.halo.HaloGraph`'s owned nodes (source ``i`` is target ``i``);
    any other bipartite graph is a ``ValueError``."""
    if isinstance(graph, HaloGraph):
        return graph.num_own
    if graph.is_bipartite:
        raise ValueError(f"{what} needs a square graph, got a bipartite one ({graph!r})")
    return graph.num_nodes


def _with_edges(graph: Graph, edge_index: Tensor, weight: Tensor | None = None) -> Graph:
    """A graph of ``edge_index`` between ``graph``'s nodes (a halo graph stays one)."""
    if isinstance(graph, HaloGraph):
        return graph.with_edges(edge_index, weight)
    return Graph(edge_index, (graph.num_src_nodes, graph.num_dst_nodes), weight, validate=False)


def remove_self_loops(graph: Graph) -> Graph:
    """The graph without its self-loops ``i -> i`` (weights follow their edges)."""
    keep = graph.src != graph.dst
    weight = graph.edge_weight[keep] if graph.edge_weight is not None else None
    return _with_edges(graph, graph.edge_index[:, keep], weight)


def add_self_loops(graph: Graph, fill_value: float | Tensor | str | None = 1.0) -> Graph:
    """The graph with one self-loop per node appended (existing ones are kept too).

    A weighted graph's loops weigh ``fill_value``: a number, a tensor (one weight, or one
    per head for ``[E, H]`` weights) or a reduction of each node's incoming weights
    (``"add"``, ``"mean"``, ...), as PyG's ``add_self_loops`` (:func:`self_loop_attr`)."""
    n = _require_square(graph, "add_self_loops")
    loop = torch.arange(n, device=graph.device, dtype=graph.index_dtype)
    edge_index = torch.cat([graph.edge_index, loop.unsqueeze(0).expand(2, n)], dim=1)
    weight = None
    if graph.edge_weight is not None:
        w = graph.edge_weight
        weight = torch.cat([w, _loop_weights(graph, w, n, fill_value)], dim=0)
    return _with_edges(graph, edge_index, weight)


def _loop_weights(graph: Graph, w: Tensor, n: int, fill_value: float | Tensor | str | None) -> Tensor:
    """``[n, *w.shape[1:]]`` weights of the self-loops of nodes ``0..n-1``, ``fill_value``
    read as by :func:`self_loop_attr` (a plain number without a scatter)."""
    if isinstance(fill_value, (int, float)) and not isinstance(fill_value, bool):
        return w.new_full((n,) + tuple(w.shape[1:]), fill_value)
    return self_loop_attr(graph, w, fill_value)[:n]


class SelfLoopStructure(NamedTuple):
    """Where :func:`add_remaining_self_loops` puts each edge (a function of the edges only).

    Attributes:
        graph: the unweighted result graph: the non-loop edges in their order, then one
            self-loop per node ``0..n-1``.
        keep: ``[E - L]`` int64 positions (in the input) of the non-loop edges.
        loop_node: ``[K]`` int64 nodes that have at least one self-loop in the input.
        loop_edge: ``[K]`` int64 position of the *last* self-loop of each of those nodes
            (its weight is the one kept, as in PyG).
    """

    graph: Graph
    keep: Tensor
    loop_node: Tensor
    loop_edge: Tensor


def self_loop_structure(graph: Graph) -> SelfLoopStructure:
    """The :class:`SelfLoopStructure` of ``graph``, computed once and cached on it
    (``structural``: re-weighted copies share it). The data-dependent part of
    :func:`add_remaining_self_loops` (boolean masks, ``nonzero``) lives here, so the
    weights of the result are plain fixed-shape gathers of the input weights."""
    n = _require_square(graph, "add_remaining_self_loops")

    def build() -> SelfLoopStructure:
        is_loop = graph.src == graph.dst
        keep = torch.nonzero(~is_loop).flatten()
        positions = torch.nonzero(is_loop).flatten()
        # last self-loop per node: the largest position among that node's loops
        last = torch.full((n,), -1, dtype=torch.int64, device=graph.device)
        last = last.scatter_reduce(0, graph.src[positions].long(), positions, reduce="amax")
        loop_node = torch.nonzero(last >= 0).flatten()
        loop = torch.arange(n, device=graph.device, dtype=graph.index_dtype)
        edge_index = torch.cat([graph.edge_index.index_select(1, keep), loop.unsqueeze(0).expand(2, n)], dim=1)
        return SelfLoopStructure(
            graph=_with_edges(graph, edge_index),
            keep=keep,
            loop_node=loop_node,
            loop_edge=last.index_select(0, loop_node),
        )

    return graph.cached("fusegnn.remaining_self_loops", build, structural=True)


def add_remaining_self_loops(
    graph: Graph, fill_value: float | Tensor | str | None = 1.0, edge_weight: Tensor | None = None
) -> Graph:
    r"""Add a self-loop to every node that has none, PyG's ``add_remaining_self_loops``.

    Existing self-loops are moved to the end and keep their weight (with duplicated
    self-loops the last one's weight wins, as in PyG); new ones get ``fill_value`` (as
    for :func:`add_self_loops`: a number, a tensor or a reduction name). The result is
    always weighted: unweighted graphs get weight 1 on their other edges.

    The new edge list is computed once per graph (:func:`self_loop_structure`, cached
    on ``graph``); the result shares its cached formats (CSR, CSC, kernel plans), so
    re-normalising the same graph with other weights converts nothing again.
    """
    structure = self_loop_structure(graph)
    n = _require_square(graph, "add_remaining_self_loops")
    if edge_weight is not None:  # gathered by position below: one per edge, or it is cut or overrun
        check_edge_weight(edge_weight, graph, "edge_weight")
    w = edge_weight if edge_weight is not None else graph.edge_weight
    if w is None:
        w = torch.ones(graph.num_edges, device=graph.device)
    loop_weight = _loop_weights(graph, w, n, fill_value)
    loop_weight = loop_weight.index_put((structure.loop_node,), w.index_select(0, structure.loop_edge))
    weight = torch.cat([w.index_select(0, structure.keep), loop_weight], dim=0)
    return structure.graph.with_edge_weight(weight)


def gcn_norm(
    graph: Graph,
    edge_weight: Tensor | None = None,
    *,
    improved: bool = False,
    add_self_loops: bool = True,
    dtype: torch.dtype | None = None,
    fused: bool | None = None,
) -> Graph:
    r"""Kipf & Welling's symmetric normalisation (PyG's ``gcn_norm``).

    .. math::
        \hat{A} = \hat{D}^{-1/2} (A + \lambda I) \hat{D}^{-1/2}, \qquad
        \hat{D}_{ii} = \sum_{j} \hat{A}_{ij} \text{ (weighted in-degree, self-loop included)}

    with :math:`\lambda = 2` when ``improved`` else 1, and self-loops added only to the
    nodes that have none (``add_self_loops``). Returns a graph whose ``edge_weight`` is
    :math:`\hat{w}_{ji} = d_j^{-1/2} w_{ji} d_i^{-1/2}`; zero-degree nodes get weight 0.

    ``fused`` picks the implementation: ``None`` (default) runs the two fused Triton
    kernels of :mod:`fusegnn.kernels.gcn_norm` (degree over the CSR, then the edge
    weights: no atomics, bitwise reproducible) when the graph is on a CUDA device and
    the weights need no gradient, and the composed PyTorch ops (differentiable) otherwise;
    ``True`` demands the kernels (a ``ValueError`` says why they cannot run; on the CPU
    they run under ``TRITON_INTERPRET=1``), ``False`` the composed ops.

    Under ``torch.compile`` ``graph`` is a :class:`~fusegnn.sparse.graph_ref.GraphRef`
    (:func:`~fusegnn.sparse.ops.graph_arg`); the result is then the reference with the
    ``gcn_norm`` transform, which the ``fusegnn::spmm`` op applies when it runs (the
    normalisation of the graph's own weights cached on the graph, as here; ``fused``
    decided then as by default).
    """
    if isinstance(graph, GraphRef):
        return _gcn_norm_ref(graph, edge_weight, improved, add_self_loops, dtype, fused)
    _require_square(graph, "gcn_norm")
    if edge_weight is not None:  # gathered by edge position on both paths: one per edge
        check_edge_weight(edge_weight, graph, "edge_weight")
    if fused is None or fused:
        why_not = _fused_norm_unavailable(graph, edge_weight, dtype)
        if why_not is None and (fused or graph.device.type == "cuda"):
            return _fused_gcn_norm(graph, edge_weight, improved, add_self_loops, dtype)
        if fused:
            raise ValueError(f"gcn_norm(fused=True) cannot run: {why_not}")
    if edge_weight is None:
        edge_weight = graph.edge_weight
    if edge_weight is not None and edge_weight.dim() != 1:
        raise ValueError(
            f"edge_weight must have one weight per edge ([E]) for gcn_norm, got shape {tuple(edge_weight.shape)}"
        )
    if edge_weight is None:
        edge_weight = torch.ones(graph.num_edges, device=graph.device, dtype=dtype or torch.float32)
    elif dtype is not None:
        edge_weight = edge_weight.to(dtype)
    if add_self_loops:
        graph = add_remaining_self_loops(graph, 2.0 if improved else 1.0, edge_weight)
        edge_weight = graph.edge_weight
    src, dst = graph.src.long(), graph.dst.long()
    deg = edge_weight.new_zeros(graph.num_dst_nodes).index_add_(0, dst, edge_weight)
    deg_inv_sqrt = deg.pow(-0.5)
    deg_inv_sqrt = torch.where(torch.isinf(deg_inv_sqrt), torch.zeros_like(deg_inv_sqrt), deg_inv_sqrt)
    # a halo graph's sources owned elsewhere: their owners' degrees (one exchange)
    src_inv_sqrt = graph.source_rows(deg_inv_sqrt) if isinstance(graph, HaloGraph) else deg_inv_sqrt
    norm = src_inv_sqrt.index_select(0, src) * edge_weight * deg_inv_sqrt.index_select(0, dst)
    return graph.with_edge_weight(norm)


def _gcn_norm_ref(ref: GraphRef, edge_weight: Tensor | None, improved: bool, add_self_loops: bool,
                  dtype: torch.dtype | None, fused: bool | None) -> GraphRef:
    """:func:`gcn_norm` of a graph reference: the same checks, then the transform."""
    if ref.is_bipartite:
        raise ValueError(f"gcn_norm needs a square graph, got a bipartite one ({ref.num_src_nodes} x {ref.num_dst_nodes})")
    if fused is not None:
        raise ValueError("gcn_norm(fused=...) cannot be chosen under torch.compile: the op decides when it runs")
    if edge_weight is not None:
        ref = ref.with_edge_weight(edge_weight)
    weight = ref.edge_weight
    if weight is not None and weight.dim() != 1:
        raise ValueError(
            f"edge_weight must have one weight per edge ([E]) for gcn_norm, got shape {tuple(weight.shape)}"
        )
    if dtype is None:
        dtype = weight.dtype if weight is not None else torch.float32
    return with_transform(ref, gcn_transform(improved, add_self_loops, dtype))


def gat_self_loops(graph: Graph) -> Graph:
    """GAT's processed graph: ``graph`` unweighted, its self-loops replaced by exactly one
    per node (PyG's ``GATConv`` with ``add_self_loops=True``). A pure function of the
    structure, cached on ``graph`` (``structural``), so layers and compiled ops that share
    a graph process (and convert) it once. A :class:`~fusegnn.sparse.graph_ref.GraphRef`
    (under ``torch.compile``) gets the ``gat_self_loops`` transform instead, which the op
    applies (and caches on the graph) when it runs."""
    if isinstance(graph, GraphRef):
        return with_transform(graph.with_edge_weight(None), GAT_SELF_LOOPS)
    return graph.cached(
        "gat_self_loops",
        lambda: add_self_loops(remove_self_loops(graph.with_edge_weight(None))),
        structural=True,
    )


# PyG's string fill values and the scatter reduction each is (min / max / mul as its scatter's)
_LOOP_ATTR_REDUCES = {"add": "sum", "sum": "sum", "mean": "mean", "min": "amin", "max": "amax", "mul": "prod"}


def self_loop_attr(graph: Graph, edge_attr: Tensor, fill_value: float | Tensor | str | None = "mean") -> Tensor:
    r"""The edge features of the self-loops that a layer adds, one row per target node
    (PyG's ``compute_loop_attr``):

    * ``None``: ones; a number: that value everywhere; a tensor: that feature vector
      (``edge_attr.shape[1:]``) for every loop;
    * ``"add"`` / ``"sum"``, ``"mean"``, ``"min"``, ``"max"``, ``"mul"``: the reduction of
      each node's incoming edges' features,
      :math:`e_{ii} = igoplus_{(j 	o i) \in E} e_{ji}`; a node without incoming edges
      gets zeros (ones for ``"mul"``, as PyG's ``scatter``).

    Differentiable with respect to ``edge_attr`` (and a tensor ``fill_value``).
    Returns ``[N_dst, *edge_attr.shape[1:]]``.
    """
    if not isinstance(edge_attr, Tensor):
        raise TypeError(f"edge_attr must be a torch.Tensor, got {type(edge_attr).__name__}")
    if edge_attr.dim() == 0 or edge_attr.size(0) != graph.num_edges:
        raise ValueError(
            f"edge_attr must have one row per edge ({graph.num_edges}), got shape {tuple(edge_attr.shape)}"
        )
    size = (graph.num_dst_nodes,) + tuple(edge_attr.shape[1:])
    if fill_value is None:
        return edge_attr.new_ones(size)
    if isinstance(fill_value, bool):
        raise TypeError("fill_value must be a number, a tensor, a reduction name or None, got a bool")
    if isinstance(fill_value, (int, float)):
        return edge_attr.new_full(size, float(fill_value))
    if isinstance(fill_value, Tensor):
        loop = fill_value.to(edge_attr.device, edge_attr.dtype)
        if loop.dim() != edge_attr.dim():
            loop = loop.unsqueeze(0)
        try:
            return loop.expand(size).contiguous()
        except RuntimeError:
            raise ValueError(
                f"fill_value of shape {tuple(fill_value.shape)} does not fit edge features of shape "
                f"{tuple(edge_attr.shape[1:])}"
            ) from None
    if isinstance(fill_value, str):
        reduce = _LOOP_ATTR_REDUCES.get(fill_value)
        if reduce is None:
            raise ValueError(f"fill_value must be one of {tuple(_LOOP_ATTR_REDUCES)} as a string, got {fill_value!r}")
        index = graph.dst.long().view((-1,) + (1,) * (edge_attr.dim() - 1)).expand_as(edge_attr)
        initial = edge_attr.new_ones(size) if reduce == "prod" else edge_attr.new_zeros(size)
        return initial.scatter_reduce(0, index, edge_attr, reduce=reduce, include_self=reduce == "prod")
    raise TypeError(f"fill_value must be a number, a tensor, a reduction name or None, got {type(fill_value).__name__}")


def gat_self_loop_edge_attr(graph: Graph, edge_attr: Tensor, fill_value: float | Tensor | str | None = "mean") -> Tensor:
    """``edge_attr`` in the edge order of :func:`gat_self_loops` ``(graph)``: the features of
    the edges that are not self-loops in their order, then one loop per node with
    :func:`self_loop_attr` of those edges (PyG's ``remove_self_loops`` then
    ``add_self_loops(..., fill_value)`` on ``edge_attr``, as its ``GATConv`` and
    ``GATv2Conv`` do). Eager only: under ``torch.compile`` the edge count is data-dependent."""
    if isinstance(graph, GraphRef):
        raise NotImplementedError(
            "edge features with self-loops need the graph itself: call the layer eagerly, or pass a graph "
            "that already has its self-loops and add_self_loops=False under torch.compile"
        )
    _require_square(graph, "gat_self_loop_edge_attr")
    if not isinstance(edge_attr, Tensor):
        raise TypeError(f"edge_attr must be a torch.Tensor, got {type(edge_attr).__name__}")
    if edge_attr.dim() == 0 or edge_attr.size(0) != graph.num_edges:
        raise ValueError(
            f"edge_attr must have one row per edge ({graph.num_edges}), got shape {tuple(edge_attr.shape)}"
        )
    keep = graph.cached(
        "fusegnn.non_loop_edges", lambda: torch.nonzero(graph.src != graph.dst).flatten(), structural=True
    )
    kept_attr = edge_attr.index_select(0, keep)
    without_loops = remove_self_loops(graph.with_edge_weight(None))
    loops = self_loop_attr(without_loops, kept_attr, fill_value)
    return torch.cat([kept_attr, loops], dim=0)


def gcn_normalized(graph: Graph, *, improved: bool = False, add_self_loops: bool = True,
                   dtype: torch.dtype | None = None) -> Graph:
    """:func:`gcn_norm` of ``graph``'s own weights, cached on ``graph`` when they need no
    gradient (a graph is immutable: its normalisation is a function of it). The GCN layers
    and the ``fusegnn::spmm`` op (:func:`transformed`) both normalise through here, so an
    eager layer and a compiled one share the cached result. A
    :class:`~fusegnn.sparse.graph_ref.GraphRef` gets the ``gcn_norm`` transform."""
    def normalise() -> Graph:
        return gcn_norm(graph, improved=improved, add_self_loops=add_self_loops, dtype=dtype)

    if isinstance(graph, GraphRef) or (graph.edge_weight is not None and graph.edge_weight.requires_grad):
        return normalise()
    try:
        key = gcn_transform(improved, add_self_loops, dtype if dtype is not None else _weight_dtype(graph))
    except TypeError:  # weights of no float dtype: gcn_norm says what is wrong, or copes
        return normalise()
    # The graph holds the caller's weight tensor, not a copy: a weight changed in place
    # (a re-weighting schedule under no_grad) moves its version counter, and the cached
    # normalisation is computed again, as spmm on the graph reads the new weights.
    memo = graph.cached("fusegnn." + key, dict)
    version = _weight_version(graph)
    if "graph" not in memo or memo["version"] != version:
        memo["graph"] = cache_value(normalise, graph.device)
        memo["version"] = version
    return memo["graph"]


def _weight_version(graph: Graph) -> int | None:
    """The version counter of ``graph``'s weights (``None``: no weights, or an inference
    tensor, which keeps no counter)."""
    if graph.edge_weight is None:
        return None
    try:
        return graph.edge_weight._version
    except RuntimeError:
        return None


def _weight_dtype(graph: Graph) -> torch.dtype:
    """The dtype :func:`gcn_norm` gives a graph's weights when no ``dtype`` is asked for."""
    return graph.edge_weight.dtype if graph.edge_weight is not None else torch.float32


def transformed(graph: Graph, transform: str, weight: Tensor | None = None) -> tuple[Graph, Tensor | None]:
    """``(graph processed by transform, the weights an SpMM on it aggregates with)``: the
    processing a :class:`~fusegnn.sparse.graph_ref.GraphRef`'s ``transform`` stands for,
    run by the ``torch.compile`` custom ops (:mod:`fusegnn.sparse.library`) through the
    same functions as the eager layers (:func:`gat_self_loops`, :func:`gcn_normalized`).

    ``weight`` (in ``graph``'s edge order; ``None``: the graph's own) are the weights to
    aggregate with, or with a GCN transform to normalise. Normalising the graph's own
    weights is cached on ``graph`` (:func:`gcn_normalized`); other weights are normalised
    on every call.
    """
    if transform == "":
        return graph, weight if weight is not None else graph.edge_weight
    if transform == GAT_SELF_LOOPS:
        if weight is not None:
            raise ValueError("the gat_self_loops transform takes no edge weights")
        return gat_self_loops(graph), None
    if transform.startswith(GCN_PREFIX):
        kwargs = gcn_params(transform)
        if weight is None or weight is graph.edge_weight:
            normed = gcn_normalized(graph, **kwargs)
        else:
            normed = gcn_norm(graph, weight, **kwargs)
        return normed, normed.edge_weight
    raise ValueError(f"unknown graph transform {transform!r}")


def _fused_norm_unavailable(graph: Graph, edge_weight: Tensor | None, dtype: torch.dtype | None) -> str | None:
    """Why the fused normalisation kernels cannot run on these inputs (``None``: they can)."""
    from fusegnn.kernels._triton import FLOAT_DTYPES, fused_can_run

    if isinstance(graph, HaloGraph):
        return "the graph is a worker's share of a distributed graph (its sources' degrees come from their owners)"
    weight = edge_weight if edge_weight is not None else graph.edge_weight
    if weight is not None and weight.dim() != 1:
        return f"edge_weight must be [E], got shape {tuple(weight.shape)}"
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        return "edge_weight requires grad (the kernels are not differentiable)"
    out_dtype = dtype or (weight.dtype if weight is not None else torch.float32)
    if not out_dtype.is_floating_point:
        return f"dtype must be floating, got {out_dtype}"
    probe = [graph.src] + ([weight] if weight is not None else [])
    if out_dtype not in FLOAT_DTYPES or not fused_can_run(*probe):
        return (
            f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 on the CPU) of dtype "
            f"fp16/bf16/fp32/fp64 and Triton installed; got {graph.device} and {out_dtype}"
        )
    return None


def _loop_source_edges(graph: Graph) -> tuple[Graph, Tensor]:
    """The graph of :func:`add_remaining_self_loops` and, for each of its edges, the input
    edge it comes from (``-1`` for an added loop); cached on ``graph`` (structural)."""
    structure = self_loop_structure(graph)

    def build() -> Tensor:
        n = graph.num_nodes
        loops = torch.full((n,), -1, dtype=torch.int64, device=graph.device)
        loops = loops.index_put((structure.loop_node,), structure.loop_edge)
        return torch.cat([structure.keep, loops])

    return structure.graph, graph.cached("fusegnn.gcn_norm.source_edge", build, structural=True)


def _fused_gcn_norm(graph: Graph, edge_weight: Tensor | None, improved: bool, add_self_loops: bool,
                    dtype: torch.dtype | None) -> Graph:
    from fusegnn.kernels.gcn_norm import fused_gcn_norm_weights

    weight = edge_weight if edge_weight is not None else graph.edge_weight
    if weight is not None:
        weight = weight.detach()
    out_dtype = dtype or (weight.dtype if weight is not None else torch.float32)
    if add_self_loops:
        result, source = _loop_source_edges(graph)
    else:
        result, source = graph, None
    norm = fused_gcn_norm_weights(result, weight, source, 2.0 if improved else 1.0, out_dtype)
    return result.with_edge_weight(norm)
