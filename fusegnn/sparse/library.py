r"""The sparse ops as ``torch.library`` custom ops, so ``torch.compile`` sees each as one node.

``torch.compile`` (Dynamo) cannot trace fuseGNN's eager path: its graph processing
(boolean masks, ``nonzero``, sorts whose output sizes depend on the data), its caches on
the :class:`~fusegnn.sparse.Graph` and the Triton launches would all break the captured
graph. This module registers every sparse op as a custom op in the ``fusegnn``
namespace instead; under compilation the public ops (:func:`fusegnn.sparse.spmm`,
:func:`~fusegnn.sparse.sddmm`, :func:`~fusegnn.sparse.edge_softmax`,
:func:`~fusegnn.sparse.gat_attention`) and the layers (``GCNConv``, ``GATConv``) call
them, and Dynamo records one opaque node per op. When the compiled code runs, each op
runs the **eager path unchanged** (argument dispatch, cached formats, GAR plans, Triton
kernels, :func:`fusegnn.sparse.dispatch.last_decision` recorded at run time).

**A graph crosses the op boundary as integers.** A :class:`~fusegnn.sparse.Graph` is no
tensor, so an op takes its :attr:`~fusegnn.sparse.Graph.uid` (a process-unique handle
that a weak registry maps back to the live graph, :func:`~fusegnn.sparse.graph.graph_by_uid`)
plus the sizes the fake (meta) implementations need to give output shapes without the
graph: ``num_src``, ``num_dst``, ``num_edges`` (``-1`` when unknown: the fake output then
gets an unbacked size). The common leading arguments of every op are::

    SymInt graph, Tensor? edge_index, SymInt num_src, SymInt num_dst, SymInt num_edges, str transform

* ``graph >= 0``: the handle of a live graph; ``edge_index`` is its edge list, which the
  backward ops use to rebuild the graph should it be garbage collected after the
  forward (a compiled model called with a temporary ``Graph(...)``).
* ``graph == -1``: a bare ``edge_index`` tensor (what eager ops accept too); the op builds
  (and validates) a transient graph from it on every call, forward and backward, like the
  eager path builds one per call. Pass a :class:`Graph` to reuse conversions.
* ``transform``: processing applied to that graph inside the op, so that no data-dependent
  code runs in the traced part: ``""`` (none), ``"gat_self_loops"``
  (:func:`~fusegnn.sparse.processing.gat_self_loops`) or ``"gcn_norm:I:L:DTYPE"``
  (:func:`~fusegnn.sparse.processing.gcn_norm` with ``improved=I``, ``add_self_loops=L``,
  ``dtype``; see :func:`gcn_transform`). Processed graphs are cached on the input graph,
  exactly as the eager layers cache them, unless the op was given the edge weights to
  normalise explicitly (weights that require grad): those are normalised on every call.

Dynamo reads ``graph.uid`` like any integer attribute: the first compilation specialises
on it (a guard), a call with another graph recompiles once with the handle symbolic (the
schemas declare ``SymInt``: a plain ``int`` would be specialised at every call), a graph
of other sizes once more with the sizes symbolic, and from then on every graph reuses
the compiled code. The traced part never looks a handle up. Nothing here uses
``torch._library.opaque_object`` (private and unstable): plain integers work on every
torch with ``torch.library.custom_op``.

**Autograd.** Each op registers a backward (``register_autograd``) that calls a second
custom op, ``fusegnn::<op>_backward``, so the backward graph is opaque too. A backward
op runs the backward function of the backend its forward ran
(:class:`~fusegnn.sparse.dispatch.Backend`'s ``spmm_backward``, ``sddmm_backward``,
``edge_softmax_backward``): for ``gas`` / ``gar`` the kernels' own backward code, which
their ``torch.autograd.Function`` classes call too (and the fused GAT backward, on the
forward's saved output and log-sum-exp); for the reference the closed-form gradients of
:mod:`fusegnn.sparse.reference_grads`. All backward code is
plain tensor code (no autograd inside an op: a custom op's implementation runs below
the autograd dispatch keys). **Recomputation**, where the eager path keeps intermediates
that a custom op cannot hand to its backward: ``spmm`` with ``reduce="max"`` recomputes
its messages and maxima; the reference GAT recomputes its scores and softmax
(E-sized; the fused GAT recomputes nothing: its kernels regenerate coefficients from
the log-sum-exp, as eagerly); a GCN normalisation of weights that require grad is
recomputed to carry the gradient back to the raw weights. Gradients flow to everything
they flow to eagerly: node features, edge weights (raw or per-head), SDDMM operands,
edge scores, GAT's ``h``, ``score_src`` and ``score_dst`` (and through the returned
coefficients). The backward ops are not differentiable (double backward raises), as on
the fused eager path.

**Dropout in GAT.** The traced part draws a one-element int64 seed with
``torch.randint`` and passes it to the op; the fused kernels regenerate the keep mask
from it in the backward (as eagerly), the reference path draws its mask from a
``torch.Generator`` seeded with it, forward and backward alike. The masks differ from
the eager reference's (``F.dropout`` on the global stream), as any two dropout draws do.

Only :func:`torch.compiler.is_compiling` code paths use these ops: in eager mode the
public ops keep their direct path (the only addition is that check, about 0.1 us). The
custom-op dispatch would cost more than that: calling ``fusegnn::spmm`` directly on a
14-node graph took 66 us against 33 us for the eager op, and 172 us against 30 us with
an input that requires grad (Python autograd wrapper), on one CPU core, which matters
on small, launch-bound graphs.
"""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fusegnn.sparse import reference, reference_grads
from fusegnn.sparse.dispatch import Backend, backend_named, explain, resolve_aggregation
from fusegnn.sparse.graph import _REGISTRY, Graph, graph_by_uid
from fusegnn.sparse.graph_ref import (
    GAT_SELF_LOOPS,
    GCN_PREFIX,
    GraphRef,
    gcn_params,
    gcn_transform,
    graph_ref,
    with_transform,
)
from fusegnn.sparse.processing import gat_self_loops, gcn_norm

__all__ = [
    "GraphRef",
    "graph_ref",
    "with_transform",
    "gcn_transform",
    "GAT_SELF_LOOPS",
    "resolve",
    "spmm",
    "sddmm",
    "edge_softmax",
    "gat_attention",
    "edge_index",
]

# ----------------------------------------------------------------------------- run time
def _base_graph(uid: int, edge_index: Optional[Tensor], num_src: int, num_dst: int, validate: bool = True) -> Graph:
    """The graph an op runs on: the live graph with handle ``uid``, or one built from
    ``edge_index``.

    A compiled model hands every op the graph's ``edge_index`` along with its handle, and
    autograd keeps it for the backward. So when the graph itself was garbage collected
    between the forward and the backward (``model(x, Graph(...))`` with nobody holding the
    graph), the backward rebuilds it from its edges (ids validated once already) instead
    of failing; only the cached conversions are lost. Edge weights never come from such a
    graph: the compiled callers pass them explicitly."""
    if uid >= 0:
        graph = _REGISTRY.get(uid)
        if graph is not None:
            return graph
        if edge_index is None:
            graph_by_uid(uid)  # raises the LookupError that explains it
        validate = False
    if edge_index is None:
        raise ValueError("a fusegnn op got neither a graph handle (graph >= 0) nor an edge_index")
    num_nodes = None if num_src < 0 else (num_src, num_dst)
    return Graph(edge_index, num_nodes, validate=validate)


def _processed(graph: Graph, transform: str, weight: Optional[Tensor] = None) -> tuple[Graph, Optional[Tensor]]:
    """``(processed graph, the weights an SpMM on it aggregates with)``.

    ``weight`` (in ``graph``'s edge order; ``None``: the graph's own) are the weights to
    aggregate with, or with a GCN transform to normalise. The normalised graph is cached
    on ``graph``, like the eager layers cache theirs, when the weights are the graph's
    own and do not require grad; other weights are normalised on every call.
    """
    if transform == "":
        return graph, weight if weight is not None else graph.edge_weight
    if transform == GAT_SELF_LOOPS:
        if weight is not None:
            raise ValueError("the gat_self_loops transform takes no edge weights")
        return gat_self_loops(graph), None
    if transform.startswith(GCN_PREFIX):
        kwargs = gcn_params(transform)
        stored = graph.edge_weight
        own = weight is None or weight is stored
        if own and (stored is None or not stored.requires_grad):
            normed = graph.cached("fusegnn." + transform, lambda: gcn_norm(graph, **kwargs))
        else:
            normed = gcn_norm(graph, weight, **kwargs)
        return normed, normed.edge_weight
    raise ValueError(f"unknown graph transform {transform!r}")


def resolve(ref: GraphRef) -> Graph:
    """The processed :class:`Graph` that ``ref`` stands for (at run time, never traced)."""
    graph, _ = _processed(_base_graph(ref.uid, ref.edge_index, ref.num_src_nodes, ref.num_dst_nodes), ref.transform)
    return graph


def _resolved(aggregation: str, graph: Graph, *tensors: Tensor) -> str:
    """The aggregation a backward runs: the forward's (an explicit choice was already checked
    by the forward; ``"auto"`` is decided again, on the same inputs, without recording)."""
    if aggregation != "auto":
        return aggregation
    return explain(graph, *tensors, aggregation="auto").name


def _backend(aggregation: str, graph: Graph, *tensors: Tensor) -> Backend:
    """The backend whose backward functions a backward op runs: the forward's."""
    return backend_named(_resolved(aggregation, graph, *tensors))


def _empty(like: Tensor) -> Tensor:
    """The placeholder an op returns for a gradient nobody asked for."""
    return like.new_empty((0,))


def _unknown_edges() -> "int | torch.SymInt":
    """An edge count the fake implementation cannot know (a transform's output)."""
    return torch.library.get_ctx().new_dynamic_size()


# ----------------------------------------------------------------------------- spmm
# SymInt, not int: an ``int`` in an explicit schema makes Dynamo specialise the value
# (a recompile for every graph); SymInt lets the handle and the sizes go symbolic.
_GRAPH_ARGS = "SymInt graph, Tensor? edge_index, SymInt num_src, SymInt num_dst, SymInt num_edges, str transform"


@torch.library.custom_op(
    "fusegnn::spmm",
    mutates_args=(),
    schema=f"({_GRAPH_ARGS}, Tensor x, Tensor? weight, str reduce, str aggregation) -> Tensor",
)
def _spmm_op(graph, edge_index, num_src, num_dst, num_edges, transform, x, weight, reduce, aggregation):
    g, w = _processed(_base_graph(graph, edge_index, num_src, num_dst), transform, weight)
    backend = resolve_aggregation(aggregation, g, x)
    return backend.spmm(g, x, w, reduce).contiguous()


@_spmm_op.register_fake
def _(graph, edge_index, num_src, num_dst, num_edges, transform, x, weight, reduce, aggregation):
    return x.new_empty((num_dst,) + tuple(x.shape[1:]))


@torch.library.custom_op(
    "fusegnn::spmm_backward",
    mutates_args=(),
    schema=(
        f"({_GRAPH_ARGS}, Tensor grad, Tensor? x, Tensor? weight, bool need_x, bool need_w, "
        "str reduce, str aggregation) -> (Tensor, Tensor)"
    ),
)
def _spmm_backward_op(graph, edge_index, num_src, num_dst, num_edges, transform, grad, x, weight,
                      need_x, need_w, reduce, aggregation):
    base = _base_graph(graph, edge_index, num_src, num_dst, validate=False)
    g, w = _processed(base, transform, weight)
    gx, gw = _backend(aggregation, g, grad).spmm_backward(g, grad, x, w, reduce, need_x, need_w)
    if need_w and transform != "":  # back through the normalisation of the given weights
        gw = reference_grads.gcn_norm_weight_grad(base, weight, gw, **gcn_params(transform))
    gx = gx.contiguous() if gx is not None else _empty(grad)
    gw = gw.contiguous() if gw is not None else _empty(grad)
    return gx, gw


@_spmm_backward_op.register_fake
def _(graph, edge_index, num_src, num_dst, num_edges, transform, grad, x, weight, need_x, need_w, reduce, aggregation):
    gx = grad.new_empty((num_src,) + tuple(grad.shape[1:])) if need_x else _empty(grad)
    gw = weight.new_empty(weight.shape) if need_w else _empty(grad)
    return gx, gw


def _spmm_setup(ctx, inputs, output):
    graph, edge_index, num_src, num_dst, num_edges, transform, x, weight, reduce, aggregation = inputs
    ctx.args = (graph, num_src, num_dst, num_edges, transform, reduce, aggregation)
    keep_x = (weight is not None and weight.requires_grad) or reduce == "max"
    ctx.save_for_backward(edge_index, x if keep_x else None, weight)


def _spmm_autograd(ctx, grad):
    edge_index, x, weight = ctx.saved_tensors
    graph, num_src, num_dst, num_edges, transform, reduce, aggregation = ctx.args
    need_x, need_w = ctx.needs_input_grad[6], ctx.needs_input_grad[7]
    gx, gw = _spmm_backward_op(
        graph, edge_index, num_src, num_dst, num_edges, transform, grad, x, weight,
        need_x, need_w, reduce, aggregation,
    )
    return None, None, None, None, None, None, gx if need_x else None, gw if need_w else None, None, None


_spmm_op.register_autograd(_spmm_autograd, setup_context=_spmm_setup)


# ----------------------------------------------------------------------------- sddmm
def _sddmm_shape(a: Tensor, op: str, num_edges) -> tuple:
    return (num_edges,) + (tuple(a.shape[1:-1]) if op == "dot" else tuple(a.shape[1:]))


@torch.library.custom_op(
    "fusegnn::sddmm",
    mutates_args=(),
    schema=f"({_GRAPH_ARGS}, Tensor a, Tensor b, str op, str aggregation) -> Tensor",
)
def _sddmm_op(graph, edge_index, num_src, num_dst, num_edges, transform, a, b, op, aggregation):
    g, _ = _processed(_base_graph(graph, edge_index, num_src, num_dst), transform)
    backend = resolve_aggregation(aggregation, g, a, b)
    return backend.sddmm(g, a, b, op).contiguous()


@_sddmm_op.register_fake
def _(graph, edge_index, num_src, num_dst, num_edges, transform, a, b, op, aggregation):
    return a.new_empty(_sddmm_shape(a, op, num_edges if num_edges >= 0 else _unknown_edges()))


@torch.library.custom_op(
    "fusegnn::sddmm_backward",
    mutates_args=(),
    schema=(
        f"({_GRAPH_ARGS}, Tensor grad, Tensor a, Tensor b, str op, bool need_a, bool need_b, "
        "str aggregation) -> (Tensor, Tensor)"
    ),
)
def _sddmm_backward_op(graph, edge_index, num_src, num_dst, num_edges, transform, grad, a, b, op,
                       need_a, need_b, aggregation):
    g, _ = _processed(_base_graph(graph, edge_index, num_src, num_dst, validate=False), transform)
    ga, gb = _backend(aggregation, g, a, b).sddmm_backward(g, a, b, grad, op, need_a, need_b)
    ga = ga.contiguous() if ga is not None else _empty(grad)
    gb = gb.contiguous() if gb is not None else _empty(grad)
    return ga, gb


@_sddmm_backward_op.register_fake
def _(graph, edge_index, num_src, num_dst, num_edges, transform, grad, a, b, op, need_a, need_b, aggregation):
    ga = a.new_empty(a.shape) if need_a else _empty(grad)
    gb = b.new_empty(b.shape) if need_b else _empty(grad)
    return ga, gb


def _sddmm_setup(ctx, inputs, output):
    graph, edge_index, num_src, num_dst, num_edges, transform, a, b, op, aggregation = inputs
    ctx.args = (graph, num_src, num_dst, num_edges, transform, op, aggregation)
    ctx.save_for_backward(edge_index, a, b)


def _sddmm_autograd(ctx, grad):
    edge_index, a, b = ctx.saved_tensors
    graph, num_src, num_dst, num_edges, transform, op, aggregation = ctx.args
    need_a, need_b = ctx.needs_input_grad[6], ctx.needs_input_grad[7]
    ga, gb = _sddmm_backward_op(
        graph, edge_index, num_src, num_dst, num_edges, transform, grad, a, b, op,
        need_a, need_b, aggregation,
    )
    return None, None, None, None, None, None, ga if need_a else None, gb if need_b else None, None, None


_sddmm_op.register_autograd(_sddmm_autograd, setup_context=_sddmm_setup)


# ----------------------------------------------------------------------------- edge softmax
@torch.library.custom_op(
    "fusegnn::edge_softmax",
    mutates_args=(),
    schema=f"({_GRAPH_ARGS}, Tensor scores, str aggregation) -> Tensor",
)
def _edge_softmax_op(graph, edge_index, num_src, num_dst, num_edges, transform, scores, aggregation):
    g, _ = _processed(_base_graph(graph, edge_index, num_src, num_dst), transform)
    backend = resolve_aggregation(aggregation, g, scores)
    return backend.edge_softmax(g, scores).contiguous()


@_edge_softmax_op.register_fake
def _(graph, edge_index, num_src, num_dst, num_edges, transform, scores, aggregation):
    return scores.new_empty(scores.shape)


@torch.library.custom_op(
    "fusegnn::edge_softmax_backward",
    mutates_args=(),
    schema=f"({_GRAPH_ARGS}, Tensor alpha, Tensor grad, str aggregation) -> Tensor",
)
def _edge_softmax_backward_op(graph, edge_index, num_src, num_dst, num_edges, transform, alpha, grad, aggregation):
    g, _ = _processed(_base_graph(graph, edge_index, num_src, num_dst, validate=False), transform)
    return _backend(aggregation, g, alpha).edge_softmax_backward(g, alpha, grad).contiguous()


@_edge_softmax_backward_op.register_fake
def _(graph, edge_index, num_src, num_dst, num_edges, transform, alpha, grad, aggregation):
    return alpha.new_empty(alpha.shape)


def _edge_softmax_setup(ctx, inputs, output):
    graph, edge_index, num_src, num_dst, num_edges, transform, scores, aggregation = inputs
    ctx.args = (graph, num_src, num_dst, num_edges, transform, aggregation)
    ctx.save_for_backward(edge_index, output)


def _edge_softmax_autograd(ctx, grad):
    edge_index, alpha = ctx.saved_tensors
    graph, num_src, num_dst, num_edges, transform, aggregation = ctx.args
    gs = _edge_softmax_backward_op(
        graph, edge_index, num_src, num_dst, num_edges, transform, alpha, grad, aggregation
    )
    return None, None, None, None, None, None, gs, None


_edge_softmax_op.register_autograd(_edge_softmax_autograd, setup_context=_edge_softmax_setup)


# ----------------------------------------------------------------------------- GAT
def _lse_dtype(h: Tensor, scores: Tensor) -> torch.dtype:
    """The fused kernels' accumulation dtype (of the stored log-sum-exp)."""
    return torch.float64 if torch.promote_types(h.dtype, scores.dtype) == torch.float64 else torch.float32


@torch.library.custom_op(
    "fusegnn::gat_attention",
    mutates_args=(),
    schema=(
        f"({_GRAPH_ARGS}, Tensor h, Tensor score_src, Tensor score_dst, Tensor? seed, "
        "float negative_slope, float p, bool return_alpha, str aggregation) -> (Tensor, Tensor, Tensor)"
    ),
)
def _gat_op(graph, edge_index, num_src, num_dst, num_edges, transform, h, score_src, score_dst, seed,
            negative_slope, p, return_alpha, aggregation):
    g, _ = _processed(_base_graph(graph, edge_index, num_src, num_dst), transform)
    backend = resolve_aggregation(aggregation, g, h, score_src, score_dst)
    heads = h.size(1)
    lse = torch.zeros((g.num_dst_nodes, heads), dtype=_lse_dtype(h, score_src), device=h.device)
    alpha = None
    if backend.name == "reference":
        out, alpha = reference.gat_attention(g, h, score_src, score_dst, negative_slope, p, seed)
    else:
        from fusegnn.kernels.gat_fused import attention_config, attention_forward

        s_src, s_dst = score_src.contiguous(), score_dst.contiguous()
        cfg, hp, channels = attention_config(g, h, s_src, negative_slope, p, seed, backend.name)
        out, lse, alpha = attention_forward(cfg, hp, s_src, s_dst, return_alpha)
        out = out[..., :channels]
    if not return_alpha:
        alpha = score_src.new_empty((0, heads))
    return out.contiguous(), lse, alpha.contiguous()


@_gat_op.register_fake
def _(graph, edge_index, num_src, num_dst, num_edges, transform, h, score_src, score_dst, seed,
      negative_slope, p, return_alpha, aggregation):
    heads = h.size(1)
    out = h.new_empty((num_dst,) + tuple(h.shape[1:]))
    lse = torch.empty((num_dst, heads), dtype=_lse_dtype(h, score_src), device=h.device)
    if return_alpha:
        edges = num_edges if num_edges >= 0 else _unknown_edges()
        alpha = score_src.new_empty((edges, heads))
    else:
        alpha = score_src.new_empty((0, heads))
    return out, lse, alpha


@torch.library.custom_op(
    "fusegnn::gat_attention_backward",
    mutates_args=(),
    schema=(
        f"({_GRAPH_ARGS}, Tensor h, Tensor score_src, Tensor score_dst, Tensor? seed, Tensor out, "
        "Tensor lse, Tensor alpha, Tensor grad_out, Tensor? grad_alpha, float negative_slope, float p, "
        "str aggregation) -> (Tensor, Tensor, Tensor)"
    ),
)
def _gat_backward_op(graph, edge_index, num_src, num_dst, num_edges, transform, h, score_src, score_dst,
                     seed, out, lse, alpha, grad_out, grad_alpha, negative_slope, p, aggregation):
    g, _ = _processed(_base_graph(graph, edge_index, num_src, num_dst, validate=False), transform)
    aggregation = _resolved(aggregation, g, h, score_src, score_dst)
    if aggregation == "reference":
        gh, gs, gt = reference_grads.gat_attention_backward(
            g, h, score_src, score_dst, negative_slope, p, seed, grad_out, grad_alpha
        )
    else:  # the fused kernels' backward, on the forward's out and log-sum-exp
        from fusegnn.kernels.gat_fused import attention_backward, attention_config

        s_src, s_dst = score_src.contiguous(), score_dst.contiguous()
        cfg, hp, channels = attention_config(g, h, s_src, negative_slope, p, seed, aggregation)
        pad = hp.size(2) - channels
        out_p = F.pad(out, (0, pad)) if pad else out.contiguous()
        grad_p = F.pad(grad_out, (0, pad)) if pad else grad_out
        gh, gs, gt = attention_backward(
            cfg, hp, s_src, s_dst, out_p, lse, grad_p, alpha if grad_alpha is not None else None, grad_alpha
        )
        gh = gh[..., :channels]
    return gh.contiguous(), gs.contiguous(), gt.contiguous()


@_gat_backward_op.register_fake
def _(graph, edge_index, num_src, num_dst, num_edges, transform, h, score_src, score_dst, seed, out, lse,
      alpha, grad_out, grad_alpha, negative_slope, p, aggregation):
    return h.new_empty(h.shape), score_src.new_empty(score_src.shape), score_dst.new_empty(score_dst.shape)


def _gat_setup(ctx, inputs, output):
    (graph, edge_index, num_src, num_dst, num_edges, transform, h, score_src, score_dst, seed,
     negative_slope, p, return_alpha, aggregation) = inputs
    out, lse, alpha = output
    ctx.args = (graph, num_src, num_dst, num_edges, transform, negative_slope, p, return_alpha, aggregation)
    ctx.save_for_backward(edge_index, h, score_src, score_dst, seed, out, lse, alpha)


def _gat_autograd(ctx, grad_out, grad_lse, grad_alpha):
    edge_index, h, score_src, score_dst, seed, out, lse, alpha = ctx.saved_tensors
    graph, num_src, num_dst, num_edges, transform, negative_slope, p, return_alpha, aggregation = ctx.args
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    gh, gs, gt = _gat_backward_op(
        graph, edge_index, num_src, num_dst, num_edges, transform, h, score_src, score_dst, seed,
        out, lse, alpha, grad_out, grad_alpha if return_alpha else None, negative_slope, p, aggregation,
    )
    return (None,) * 6 + (gh, gs, gt) + (None,) * 5


_gat_op.register_autograd(_gat_autograd, setup_context=_gat_setup)


# ----------------------------------------------------------------------------- edge list
@torch.library.custom_op(
    "fusegnn::edge_index",
    mutates_args=(),
    schema=f"({_GRAPH_ARGS}, ScalarType dtype, Device device) -> Tensor",
)
def _edge_index_op(graph, edge_index, num_src, num_dst, num_edges, transform, dtype, device):
    g, _ = _processed(_base_graph(graph, edge_index, num_src, num_dst), transform)
    return g.edge_index.to(dtype).clone()  # a copy: the graph's own tensor stays the graph's


@_edge_index_op.register_fake
def _(graph, edge_index, num_src, num_dst, num_edges, transform, dtype, device):
    edges = num_edges if num_edges >= 0 else _unknown_edges()
    return torch.empty((2, edges), dtype=dtype, device=device)


# ----------------------------------------------------------------------------- traced-side API
def _graph_args(ref: GraphRef) -> tuple:
    return ref.uid, ref.edge_index, ref.num_src_nodes, ref.num_dst_nodes, ref.num_edges, ref.transform


def spmm(ref: GraphRef, x: Tensor, weight: Optional[Tensor], reduce: str, aggregation: str) -> Tensor:
    """``fusegnn::spmm``: :func:`fusegnn.sparse.spmm` on ``ref`` (arguments checked by the
    caller). ``weight`` ``None`` aggregates with the processed graph's own weights."""
    return _spmm_op(*_graph_args(ref), x, weight, reduce, aggregation)


def sddmm(ref: GraphRef, a: Tensor, b: Tensor, op: str, aggregation: str) -> Tensor:
    """``fusegnn::sddmm``: :func:`fusegnn.sparse.sddmm` on ``ref`` (arguments checked)."""
    return _sddmm_op(*_graph_args(ref), a, b, op, aggregation)


def edge_softmax(ref: GraphRef, scores: Tensor, aggregation: str) -> Tensor:
    """``fusegnn::edge_softmax``: :func:`fusegnn.sparse.edge_softmax` on ``ref``."""
    return _edge_softmax_op(*_graph_args(ref), scores, aggregation)


def gat_attention(ref: GraphRef, h: Tensor, score_src: Tensor, score_dst: Tensor, negative_slope: float,
                  p: float, return_alpha: bool, aggregation: str) -> tuple[Tensor, Optional[Tensor]]:
    """``fusegnn::gat_attention``: :func:`fusegnn.sparse.gat_attention` on ``ref``
    (arguments checked; ``p`` the dropout probability, 0 outside training). Returns
    ``(out, alpha or None)`` with the shapes of the eager op."""
    single = h.dim() == 2
    if single:
        h, score_src, score_dst = h.unsqueeze(1), score_src.unsqueeze(1), score_dst.unsqueeze(1)
    seed = (
        torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=h.device) if p > 0.0 else None
    )
    out, _, alpha = _gat_op(
        *_graph_args(ref), h, score_src, score_dst, seed, float(negative_slope), float(p),
        bool(return_alpha), aggregation,
    )
    if single:
        out, alpha = out.squeeze(1), alpha.squeeze(1)
    return out, (alpha if return_alpha else None)


def edge_index(ref: GraphRef) -> Tensor:
    """``fusegnn::edge_index``: a copy of the processed graph's ``edge_index``."""
    return _edge_index_op(*_graph_args(ref), ref.index_dtype, ref.device)
