r"""Public sparse ops: argument checks, then dispatch to a backend.

The three ops every GNN layer and every masked attention is built from
(fuseGNN's Graph Processing + Aggregation; SDDMM -> softmax -> SpMM):

* :func:`spmm` -- aggregation :math:`\mathrm{out}_i = \sum_{j \to i} w_{ji} x_j`;
* :func:`sddmm` -- one score per edge from its endpoints' rows;
* :func:`edge_softmax` -- softmax over each target's incoming edges;
* :func:`edge_aggregate` -- aggregation of per-edge messages
  :math:`w_{ji}\,\mathrm{act}(x_j + e_{ji})` (GINE, TransformerConv with edge features).

All of them accept a :class:`~fusegnn.sparse.Graph` or an ``edge_index`` tensor (and, eagerly,
a ``torch.sparse`` adjacency or a networkx graph: :func:`~fusegnn.sparse.graph.coerce_graph`), never
modify their inputs, and are differentiable with respect to every floating input.

Under ``torch.compile`` (:func:`torch.compiler.is_compiling`) the graph argument
becomes a :class:`~fusegnn.sparse.graph_ref.GraphRef` (:func:`graph_arg`, the one place
where eager and compiled code part) and each op checks its arguments as eagerly and
then calls its ``torch.library`` custom op
(:mod:`fusegnn.sparse.library`), which Dynamo records as one opaque node and which runs
this same eager path when the compiled code runs. Eager calls never go through the
custom-op dispatcher.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fusegnn.sparse import library

from fusegnn.sparse.dispatch import (
    backend_named,
    capture_mode,
    check_aggregation,
    checks_every_call,
    host_bound_work,
    is_deterministic,
    last_decision,
    needs_grad,
    record_decision,
    resolve_aggregation,
)
from fusegnn.sparse.graph import Graph, as_graph, check_edge_weight
from fusegnn.sparse.graph_ref import GraphRef, graph_ref
from fusegnn.sparse.halo import with_halo_rows

__all__ = ["spmm", "sddmm", "edge_softmax", "edge_aggregate", "as_graph", "graph_arg", "edge_index_of"]

_REDUCES = ("sum", "mean", "max")
_SDDMM_OPS = ("dot", "add", "sub", "mul")
_ACTIVATIONS = (None, "relu")


def graph_arg(
    graph: Any,
    num_nodes: int | tuple[int, int] | None = None,
    name: str = "graph",
    *,
    device: torch.device | str | None = None,
) -> Graph | GraphRef:
    """The graph as the ops take it: eagerly :func:`as_graph`; under ``torch.compile``
    (:func:`torch.compiler.is_compiling`) a :class:`~fusegnn.sparse.graph_ref.GraphRef`
    (:func:`~fusegnn.sparse.graph_ref.graph_ref`), so that no graph is built or processed
    in the traced code. This is the one place where eager and compiled code part. ``graph``
    is any input :func:`~fusegnn.sparse.graph.coerce_graph` accepts (``device``: where a
    networkx graph is built)."""
    if torch.compiler.is_compiling():
        return graph_ref(graph, num_nodes, name)
    return as_graph(graph, num_nodes, name, device=device)


def edge_index_of(graph: Graph | GraphRef) -> Tensor:
    """``graph.edge_index``; for a :class:`~fusegnn.sparse.graph_ref.GraphRef` (under
    ``torch.compile``) a copy of the processed graph's, from the ``fusegnn::edge_index``
    op (its edge count is then known at run time only)."""
    if isinstance(graph, GraphRef):
        return library.edge_index(graph)
    return graph.edge_index


def check_node_tensor(
    x: Tensor, graph: Graph | GraphRef, num_rows: int, name: str, dims: tuple[int, ...]
) -> None:
    """``x`` is a floating tensor on the graph's device with ``num_rows`` rows (a
    ``num_rows`` of ``-1``, an unknown count under compilation, is not checked)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if x.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dimensions, got shape {tuple(x.shape)}")
    if x.device != graph.device:
        raise ValueError(
            f"{name} is on {x.device} but the graph is on {graph.device}; move them to the same device"
        )
    if num_rows >= 0 and x.size(0) != num_rows:
        raise ValueError(f"{name} has {x.size(0)} rows but the graph needs {num_rows} (one per node)")


def spmm(
    graph: Graph | Tensor,
    x: Tensor,
    edge_weight: Tensor | None = None,
    reduce: str = "sum",
    *,
    bias: Tensor | None = None,
    aggregation: str = "auto",
) -> Tensor:
    r"""Sparse-dense product: aggregate source rows of ``x`` into their targets, plus an
    optional bias (a layer's epilogue, fused into the kernels' output pass).

    .. math::
        \mathrm{out}_i = \bigoplus_{(j \to i) \in E} w_{ji} \, x_j \; + \; b

    Args:
        graph: a :class:`Graph` (or an ``edge_index`` ``[2, E]``).
        x: ``[N_src, F]`` or ``[N_src, H, F]`` source features.
        edge_weight: ``[E]`` weights, or ``[E, H]`` per-head weights for 3-D ``x``
            (e.g. attention coefficients). ``None`` uses the graph's own
            ``edge_weight`` if it has one, else 1 for every edge.
        reduce: ``"sum"``, ``"mean"`` (over incoming edges) or ``"max"``; targets with
            no incoming edge get zeros.
        bias: ``[F]`` (``[H, F]`` for 3-D ``x``: one value per output column) added to
            every output row, or ``None``.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"``, ``"window"`` (row windows on
            tensor cores, :mod:`fusegnn.sparse.window_aggregation`; ``"auto"`` takes it
            eagerly on graphs of row-window tile density >= 0.25) or ``"reference"``
            (see :mod:`fusegnn.sparse.dispatch`).

    Returns:
        ``[N_dst, F]`` or ``[N_dst, H, F]``.

    **Dtypes.** Weights of another floating dtype are cast to ``x``'s (the product is
    ``x``'s dtype); a bias of another floating dtype follows torch's type promotion, as
    ``spmm(x) + bias`` would: the result is ``torch.promote_types(x.dtype, bias.dtype)``
    (a float32 bias on half ``x`` under ``torch.autocast`` gives float32, as PyG's layers
    do), on every backend. Each gradient comes back in its input's dtype.

    On a worker's share of a distributed graph (a :class:`~fusegnn.sparse.halo.HaloGraph`)
    ``x`` holds the owned nodes' rows; the halo rows are fetched first.
    """
    graph, x = with_halo_rows(graph, x)
    if torch.compiler.is_compiling():
        graph = graph_ref(graph, x.size(0) if isinstance(x, Tensor) else None)
    elif (type(graph) is Graph and type(x) is Tensor and _plain(edge_weight) and _plain(bias)
          and isinstance(reduce, str) and isinstance(aggregation, str)):  # a call like an earlier one: no checks
        weight = edge_weight if edge_weight is not None else graph.edge_weight
        signature = (x.shape, x.dtype, x.device, _signature(weight), _signature(bias), reduce, aggregation,
                     is_deterministic(), capture_mode(), host_bound_work(needs_grad(x, weight, bias)))
        prepared = graph.cached("prepared_spmm", dict).get(signature)
        if prepared is not None:
            record_decision(prepared[1])
            return prepared[0](graph, x, weight, reduce, bias)
        out = _checked_spmm(graph, x, edge_weight, reduce, bias, aggregation)
        decision = last_decision()  # the path that ran (a backend may have handed over)
        if not checks_every_call(aggregation):
            graph.cached("prepared_spmm", dict)[signature] = (backend_named(decision.name).spmm, decision)
        return out
    else:
        graph = as_graph(graph, x.size(0) if isinstance(x, Tensor) else None)
    return _checked_spmm(graph, x, edge_weight, reduce, bias, aggregation)


def _plain(t) -> bool:
    """``t`` is ``None`` or a tensor (anything else is checked, and refused, every call)."""
    return t is None or isinstance(t, Tensor)


def _signature(t: Tensor | None) -> tuple | None:
    """What the checks read of an optional tensor argument."""
    return None if t is None else (type(t), t.shape, t.dtype, t.device)


def _checked_spmm(graph, x, edge_weight, reduce, bias, aggregation) -> Tensor:
    """:func:`spmm` after its graph argument is resolved: every check, then the op."""
    check_node_tensor(x, graph, graph.num_src_nodes, "x", (2, 3))
    if reduce not in _REDUCES:
        raise ValueError(f"reduce must be one of {_REDUCES}, got {reduce!r}")
    if edge_weight is None:
        edge_weight = graph.edge_weight  # for a GraphRef an input of the op, so its gradient flows
    if edge_weight is not None:
        if not (isinstance(graph, GraphRef) and graph.transform):  # a transform's raw weights were checked
            check_edge_weight(edge_weight, graph, "edge_weight")
        if edge_weight.dim() == 2:
            if x.dim() != 3 or edge_weight.size(1) != x.size(1):
                raise ValueError(
                    f"edge_weight of shape {tuple(edge_weight.shape)} has one weight per head; "
                    f"x must then be [N, H={edge_weight.size(1)}, F], got {tuple(x.shape)}"
                )
    if bias is not None:
        _check_bias(bias, x)
    if isinstance(graph, GraphRef):
        out = library.spmm(graph, x, edge_weight, reduce, check_aggregation(aggregation, "spmm"))
        return out if bias is None else out + bias.reshape(x.shape[1:])
    records_backward = needs_grad(x, edge_weight, bias)
    backend = resolve_aggregation(aggregation, graph, x, op="spmm", records_backward=records_backward)
    return backend.spmm(graph, x, edge_weight, reduce, bias)


def _check_bias(bias: Tensor, x: Tensor) -> None:
    """``bias`` holds one value per column of ``x`` (``x.shape[1:]``), on its device."""
    if not isinstance(bias, Tensor):
        raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if bias.numel() != math.prod(x.shape[1:]) or bias.dim() > x.dim() - 1:
        raise ValueError(
            f"bias must have shape {tuple(x.shape[1:])} (one value per output column), got {tuple(bias.shape)}"
        )
    if bias.device != x.device:
        raise ValueError(f"bias is on {bias.device} but x is on {x.device}")
    if not bias.is_floating_point():
        raise TypeError(f"bias must be a floating tensor, got dtype {bias.dtype}")


def sddmm(
    graph: Graph | Tensor,
    a: Tensor,
    b: Tensor,
    op: str = "dot",
    *,
    aggregation: str = "auto",
) -> Tensor:
    r"""Sampled dense-dense op: one value per edge from its endpoints.

    .. math::
        s_{ji} = a_j \odot b_i

    Args:
        graph: a :class:`Graph` (or an ``edge_index``).
        a: ``[N_src, *S]`` rows read at each edge's source.
        b: ``[N_dst, *S]`` rows read at each edge's target (same trailing shape as ``a``).
        op: ``"dot"`` (reduces the last axis: ``[E, *S[:-1]]``, e.g. ``q_i . k_j`` per
            head) or elementwise ``"add"``, ``"sub"``, ``"mul"`` (``[E, *S]``, e.g. GAT's
            ``a_src . h_j + a_dst . h_i``).
        aggregation: backend choice, as for :func:`spmm` (and a distributed graph's ``a``:
            the owned rows, as there).
    """
    if not isinstance(a, Tensor):
        raise TypeError(f"a must be a torch.Tensor, got {type(a).__name__}")
    graph, a = with_halo_rows(graph, a)
    graph = graph_arg(graph, a.size(0))
    check_node_tensor(a, graph, graph.num_src_nodes, "a", (1, 2, 3))
    check_node_tensor(b, graph, graph.num_dst_nodes, "b", (1, 2, 3))
    if a.shape[1:] != b.shape[1:]:
        raise ValueError(f"a and b must have the same trailing shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got {a.dtype} and {b.dtype}")
    if op not in _SDDMM_OPS:
        raise ValueError(f"op must be one of {_SDDMM_OPS}, got {op!r}")
    if op == "dot" and a.dim() < 2:
        raise ValueError("op='dot' needs a feature axis: a and b must be at least [N, F]")
    if isinstance(graph, GraphRef):
        return library.sddmm(graph, a, b, op, check_aggregation(aggregation))
    backend = resolve_aggregation(aggregation, graph, a, b)
    return backend.sddmm(graph, a, b, op)


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def edge_softmax(graph: Graph | Tensor, scores: Tensor, *, aggregation: str = "auto") -> Tensor:
    r"""Softmax of edge scores over each target's incoming edges, per head.

    .. math::
        \alpha_{ji} = \frac{\exp(s_{ji} - m_i)}{\sum_{(k \to i) \in E} \exp(s_{ki} - m_i)},
        \qquad m_i = \max_{k \to i} s_{ki}

    Args:
        graph: a :class:`Graph` (or an ``edge_index``).
        scores: ``[E]`` or ``[E, H]``; ``-inf`` masks an edge out. A target whose edges
            are all masked gets zeros, never NaN.
        aggregation: backend choice, as for :func:`spmm`.

    **Autocast.** Under CUDA autocast, half scores are normalised in float32 and the
    coefficients come back float32, as ``torch.softmax`` and ``torch.exp`` do there (both
    are on CUDA autocast's float32 list; PyG's ``softmax`` is built on ``exp``). CPU
    autocast lists neither, so there the scores' dtype is kept.
    """
    graph = graph_arg(with_halo_rows(graph)[0])
    if not isinstance(scores, Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    check_node_tensor(scores, graph, graph.num_edges, "scores", (1, 2))
    if scores.device.type == "cuda" and scores.dtype in _HALF_DTYPES and torch.is_autocast_enabled("cuda"):
        scores = scores.float()
    if isinstance(graph, GraphRef):
        return library.edge_softmax(graph, scores, check_aggregation(aggregation))
    backend = resolve_aggregation(aggregation, graph, scores)
    return backend.edge_softmax(graph, scores)


def edge_aggregate(
    graph: Graph | Tensor,
    x: Tensor | None = None,
    edge_attr: Tensor | None = None,
    *,
    edge_weight: Tensor | None = None,
    activation: str | None = None,
    reduce: str = "sum",
    aggregation: str = "auto",
) -> Tensor:
    r"""Aggregate per-edge messages made of source rows and edge rows.

    .. math::
        \mathrm{out}_i = \bigoplus_{(j \to i) \in E} w_{ji}\, \mathrm{act}(x_j + e_{ji})

    GINEConv's aggregation is ``edge_aggregate(g, x, e, activation="relu")``;
    TransformerConv's with edge features ``edge_aggregate(g, v, e, edge_weight=alpha)``
    (``alpha`` ``[E, H]``); ``x=None`` aggregates given per-edge messages.

    Args:
        graph: a :class:`Graph` (or an ``edge_index`` ``[2, E]``).
        x: ``[N_src, F]`` or ``[N_src, H, F]`` source rows, or ``None`` (no source term);
            on a distributed graph the owned rows (the halo rows are fetched, as in :func:`spmm`).
        edge_attr: ``[E, F]`` or ``[E, H, F]`` edge rows (COO order, the trailing shape of
            ``x``), or ``None``. At least one of ``x`` and ``edge_attr`` is needed.
        edge_weight: ``[E]`` weights, or ``[E, H]`` per-head weights for 3-D features.
            ``None`` uses the graph's own ``edge_weight`` if it has one, else 1.
        activation: ``None`` or ``"relu"``, applied to ``x_j + e_ji`` before the weight.
        reduce: ``"sum"``, ``"mean"`` (over incoming edges) or ``"max"`` (elementwise; ties
            go to the lowest edge id, and so does the gradient); targets with no incoming
            edge get zeros.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"``
            (:mod:`fusegnn.sparse.dispatch`; ``"gas"`` hands this op to GAR's fused pass).

    Returns:
        ``[N_dst, F]`` or ``[N_dst, H, F]``, differentiable in ``x``, ``edge_attr`` and
        ``edge_weight``.
    """
    if x is None and edge_attr is None:
        raise ValueError("edge_aggregate needs x or edge_attr (or both); got neither")
    if x is not None and not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor or None, got {type(x).__name__}")
    # a distributed graph's x holds the owned rows: the halo rows are fetched (as in spmm)
    graph, *x_rows = with_halo_rows(graph, *([x] if x is not None else []))
    x = x_rows[0] if x_rows else None
    num_src = x.size(0) if isinstance(x, Tensor) else None
    graph = graph_arg(graph, num_src)
    if x is not None:
        check_node_tensor(x, graph, graph.num_src_nodes, "x", (2, 3))
    if edge_attr is not None:
        _check_edge_rows(edge_attr, graph)
        if x is not None and (edge_attr.shape[1:] != x.shape[1:] or edge_attr.dtype != x.dtype):
            raise ValueError(
                f"edge_attr must have x's trailing shape and dtype: x is {tuple(x.shape)} {x.dtype}, "
                f"edge_attr is {tuple(edge_attr.shape)} {edge_attr.dtype}"
            )
    features = x if x is not None else edge_attr
    if reduce not in _REDUCES:
        raise ValueError(f"reduce must be one of {_REDUCES}, got {reduce!r}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")
    if edge_weight is None:
        edge_weight = graph.edge_weight
    if edge_weight is not None:
        if not (isinstance(graph, GraphRef) and graph.transform):
            check_edge_weight(edge_weight, graph, "edge_weight")
        if edge_weight.dim() == 2 and (features.dim() != 3 or edge_weight.size(1) != features.size(1)):
            raise ValueError(
                f"edge_weight of shape {tuple(edge_weight.shape)} has one weight per head; the features "
                f"must then be [N, H={edge_weight.size(1)}, F], got {tuple(features.shape)}"
            )
    if isinstance(graph, GraphRef):
        return library.edge_aggregate(graph, x, edge_attr, edge_weight, activation, reduce,
                                      check_aggregation(aggregation))
    backend = resolve_aggregation(aggregation, graph, features, *([edge_attr] if x is not None and edge_attr is not None else []))
    if backend.edge_aggregate is None:
        raise NotImplementedError(f"the {backend.name!r} backend has no edge_aggregate")
    return backend.edge_aggregate(graph, x, edge_attr, edge_weight, activation, reduce)


def _check_edge_rows(edge_attr: Tensor, graph: Graph | GraphRef) -> None:
    """``edge_attr`` is a floating ``[E, F]`` / ``[E, H, F]`` tensor on the graph's device."""
    if not isinstance(edge_attr, Tensor):
        raise TypeError(f"edge_attr must be a torch.Tensor or None, got {type(edge_attr).__name__}")
    if not edge_attr.is_floating_point():
        raise TypeError(f"edge_attr must be a floating tensor, got dtype {edge_attr.dtype}")
    if edge_attr.dim() not in (2, 3):
        raise ValueError(f"edge_attr must be [E, F] or [E, H, F], got shape {tuple(edge_attr.shape)}")
    if edge_attr.device != graph.device:
        raise ValueError(f"edge_attr is on {edge_attr.device} but the graph is on {graph.device}")
    if graph.num_edges >= 0 and edge_attr.size(0) != graph.num_edges:
        raise ValueError(
            f"edge_attr has {edge_attr.size(0)} rows but the graph has {graph.num_edges} edges (one row per edge)"
        )
