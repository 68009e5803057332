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
  ``dtype``; see :func:`gcn_transform`), both applied by
  :func:`~fusegnn.sparse.processing.transformed`. Processed graphs are cached on the input graph
  by the same functions the eager layers call, unless the op was given the edge weights to
  normalise explicitly (weights that require grad): those are normalised on every call.

Dynamo reads ``graph.uid`` like any integer attribute: the first compilation specialises
on it (a guard), a call with another graph recompiles once with the handle symbolic (the
schemas declare ``SymInt``: a plain ``int`` would be specialised at every call), a graph
of other sizes once more with the sizes symbolic, and from then on every graph reuses
the compiled code. The traced part never looks a handle up. Nothing here uses
``torch._library.opaque_object`` (private and unstable): plain integers work on every
torch with ``torch.library.custom_op``.

**One description per op.** Each op is an :class:`OpSpec` (its schema arguments, the
forward and backward implementations, their fakes, which inputs are differentiable and
what the backward keeps); :func:`register_op` generates from it the forward custom op, its
fake, the backward custom op, its fake and the autograd glue. Adding an op means writing
one :class:`OpSpec`.

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
that a custom op cannot hand to its backward: ``spmm`` and ``edge_aggregate`` with
``reduce="max"`` recompute their argmax (a forward pass); the reference GAT recomputes its scores and softmax
(E-sized; the fused GAT recomputes nothing: its kernels regenerate coefficients from
the log-sum-exp, as eagerly); a GCN normalisation of weights that require grad is
recomputed to carry the gradient back to the raw weights. Gradients flow to everything
they flow to eagerly: node features, edge weights (raw or per-head), SDDMM operands,
edge scores, GAT's ``h``, ``score_src``, ``score_dst`` and ``score_edge`` (and through the returned
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

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fusegnn.sparse import reference, reference_grads
from fusegnn.sparse.dispatch import (
    Backend, backend_named, deterministic, explain, for_capture, is_deterministic, resolve_aggregation,
)
from fusegnn.sparse.graph import _REGISTRY, Graph, graph_by_uid
from fusegnn.sparse.graph_ref import (
    GAT_SELF_LOOPS,
    GraphRef,
    gcn_params,
    gcn_transform,
    graph_ref,
    with_transform,
)
from fusegnn.sparse.processing import transformed

__all__ = [
    "OpSpec",
    "OpGraph",
    "Sizes",
    "register_op",
    "GraphRef",
    "graph_ref",
    "with_transform",
    "gcn_transform",
    "GAT_SELF_LOOPS",
    "resolve",
    "spmm",
    "sddmm",
    "edge_softmax",
    "edge_aggregate",
    "gat_attention",
    "gatv2_attention",
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


def resolve(ref: GraphRef) -> Graph:
    """The processed :class:`Graph` that ``ref`` stands for (at run time, never traced)."""
    graph, _ = transformed(_base_graph(ref.uid, ref.edge_index, ref.num_src_nodes, ref.num_dst_nodes), ref.transform)
    return graph


#: What a compiled call passes its op for ``aggregation="auto"`` in deterministic mode
#: (:func:`traced_aggregation`): the op and its backward op then both decide ``"auto"``
#: inside :func:`~fusegnn.sparse.dispatch.deterministic`. The mode is thread-local, and a
#: CUDA backward runs in the autograd engine's own threads, where it is off: re-deciding
#: ``"auto"`` there took GAS (atomics) after a deterministic forward.
DETERMINISTIC_AUTO = "auto:deterministic"
#: What a backward op is handed for ``"auto"`` decided outside deterministic mode
#: (:func:`pinned_aggregation`): it then decides with fuseGNN's own switch off, as its forward
#: did, also in a thread where only :func:`~fusegnn.sparse.dispatch.set_deterministic`'s
#: global switch (on) is seen, not the ``deterministic(False)`` block of the forward.
NONDETERMINISTIC_AUTO = "auto:nondeterministic"
_PINNED_MODES = {DETERMINISTIC_AUTO: True, NONDETERMINISTIC_AUTO: False}


def traced_aggregation(aggregation: str) -> str:
    """``aggregation`` as a compiled call hands it to its op: :data:`DETERMINISTIC_AUTO` for
    ``"auto"`` in deterministic mode. Read while Dynamo traces, so the mode is guarded: a
    call after the mode changed recompiles."""
    return DETERMINISTIC_AUTO if aggregation == "auto" and is_deterministic() else aggregation


def pinned_aggregation(aggregation: str) -> str:
    """``aggregation`` as a forward op hands it to its backward op: ``"auto"`` with the mode
    the forward decided it in (:data:`DETERMINISTIC_AUTO` or :data:`NONDETERMINISTIC_AUTO`),
    read when autograd records the op (under ``torch.compile``, while tracing: the mode is
    then guarded by :func:`traced_aggregation`). The backward runs where the forward's
    thread-local mode may not be seen (the CUDA autograd engine's threads)."""
    if aggregation != "auto":
        return aggregation
    return DETERMINISTIC_AUTO if is_deterministic() else NONDETERMINISTIC_AUTO


def _resolved(aggregation: str, graph: Graph, *tensors: Tensor, op: str = "") -> str:
    """The aggregation a backward runs: the forward's (an explicit choice was already checked
    by the forward; ``"auto"`` is decided again, on the same inputs and ``op``, without
    recording)."""
    if aggregation != "auto":
        return aggregation
    return explain(graph, *tensors, aggregation="auto", op=op).name


def _backend(aggregation: str, graph: Graph, *tensors: Tensor) -> Backend:
    """The backend whose backward functions a backward op runs: the forward's."""
    return backend_named(_resolved(aggregation, graph, *tensors))


def _empty(like: Tensor) -> Tensor:
    """The placeholder an op returns for a gradient nobody asked for."""
    return like.new_empty((0,))


def _unknown_edges() -> "int | torch.SymInt":
    """An edge count the fake implementation cannot know (a transform's output)."""
    return torch.library.get_ctx().new_dynamic_size()


# ----------------------------------------------------------------------------- op descriptions
# SymInt, not int: an ``int`` in an explicit schema makes Dynamo specialise the value
# (a recompile for every graph); SymInt lets the handle and the sizes go symbolic.
_GRAPH_ARGS = "SymInt graph, Tensor? edge_index, SymInt num_src, SymInt num_dst, SymInt num_edges, str transform"
_NUM_GRAPH_ARGS = 6


class OpGraph(NamedTuple):
    """The graph an op implementation runs on (built by :func:`register_op`'s wrapper).

    Attributes:
        graph: the processed graph (``transform`` applied to ``base``).
        base: the graph before the transform (a backward needs it to carry a gradient
            back through a normalisation of given weights).
        transform: the transform string the op was given.
        weight: the edge weights an aggregation on ``graph`` uses (the op's
            :attr:`OpSpec.weighted` input, processed by the transform; else the
            processed graph's own).
    """

    graph: Graph
    base: Graph
    transform: str
    weight: Optional[Tensor]


class Sizes(NamedTuple):
    """What a fake (meta) implementation knows of the graph: its sizes (``num_edges`` -1
    when unknown; :meth:`edges` then gives an unbacked size)."""

    num_src: "int | torch.SymInt"
    num_dst: "int | torch.SymInt"
    num_edges: "int | torch.SymInt"

    def edges(self) -> "int | torch.SymInt":
        return self.num_edges if self.num_edges >= 0 else _unknown_edges()


@dataclass(frozen=True)
class OpSpec:
    """A sparse op, described once; :func:`register_op` makes the ``fusegnn::<name>``
    custom op, its fake, ``fusegnn::<name>_backward``, its fake and the autograd glue.

    Every implementation takes its schema's arguments in order (named as there). The op schemas
    are ``(<graph args>, <inputs>) -> <outputs>`` and, with a backward,
    ``(<graph args>, <backward_inputs>) -> <one Tensor per differentiable input>``.
    A backward input is filled, by name, from: ``grad`` (the gradient of a single output)
    or ``grad_<output>``; ``need_<input>`` (whether that input needs a gradient); a
    forward input or output of that name (kept from the forward: only those the backward
    names, and of those only what :attr:`save` leaves).

    Attributes:
        name: the op name in the ``fusegnn`` namespace.
        inputs: the forward schema's arguments after the graph arguments.
        outputs: names of the forward's outputs (all tensors).
        forward: ``forward(og: OpGraph, *inputs)`` -> output(s).
        fake: ``fake(sizes: Sizes, *inputs)`` -> empty output(s) of the right shape.
        weighted: the input holding edge weights that the graph's transform processes
            (:attr:`OpGraph.weight`), or ``None``.
        backward_inputs: the backward schema's arguments after the graph arguments
            (empty: the op is not differentiable).
        differentiable: the inputs the backward returns gradients for, in order.
        backward: ``backward(og, *backward_inputs)`` -> gradient(s) (``None``: not asked).
        backward_fake: ``backward_fake(sizes, *backward_inputs)`` -> empty gradient(s).
        need_flags: other names for ``need_<input>`` flags (``{"weight": "need_w"}``).
        save: edits the dict of values kept for the backward (``None`` drops a tensor
            the backward does not need), at forward time.
        grads: edits the backward's arguments before the call (e.g. fills a gradient
            that autograd left ``None``).
    """

    name: str
    inputs: str
    outputs: tuple[str, ...]
    forward: Callable[..., Any]
    fake: Callable[..., Any]
    weighted: Optional[str] = None
    backward_inputs: str = ""
    differentiable: tuple[str, ...] = ()
    backward: Optional[Callable[..., Any]] = None
    backward_fake: Optional[Callable[..., Any]] = None
    need_flags: Optional[dict[str, str]] = None
    save: Optional[Callable[[dict], None]] = None
    grads: Optional[Callable[[dict], None]] = None


def _args(args: str) -> list[tuple[str, str]]:
    """``(type, name)`` of a schema's argument list (``"Tensor x, str op"``)."""
    return [tuple(arg.split()) for arg in args.split(",") if arg.strip()]


def _returns(count: int) -> str:
    return "Tensor" if count == 1 else "(" + ", ".join(["Tensor"] * count) + ")"


def _empty_in_place_of_none(result: Any, values: tuple) -> Any:
    """An op's gradients with each ``None`` (a gradient nobody asked for) replaced by the
    empty placeholder (like the op's first tensor argument)."""
    like = values[0] if isinstance(values[0], Tensor) else next(v for v in values if isinstance(v, Tensor))
    if not isinstance(result, tuple):
        return _empty(like)
    return tuple(r if r is not None else _empty(like) for r in result)


def _custom_op(name: str, inputs: str, returns: int, impl: Callable[..., Any], fake: Callable[..., Any],
               weighted: Optional[str], validate: bool) -> Callable[..., Any]:
    """``fusegnn::<name>`` with the graph arguments then ``inputs``: runs
    ``impl(OpGraph, *inputs)`` (every tensor returned contiguous, a ``None`` the empty
    placeholder), its fake ``fake(Sizes, *inputs)``. Arguments pass by position (the
    implementations name them as the schema does): this wrapper is on the host path of
    every compiled call."""
    names = [n for _, n in _args(inputs)]
    w_at = _NUM_GRAPH_ARGS + names.index(weighted) if weighted else None
    agg_at = _NUM_GRAPH_ARGS + names.index("aggregation") if "aggregation" in names else None

    def run(*args):
        if agg_at is not None and args[agg_at] in _PINNED_MODES:
            with deterministic(_PINNED_MODES[args[agg_at]]):
                return run(*args[:agg_at], "auto", *args[agg_at + 1:])
        graph, edge_index, num_src, num_dst, _, transform = args[:_NUM_GRAPH_ARGS]
        base = _base_graph(graph, edge_index, num_src, num_dst, validate)
        processed, weight = transformed(base, transform, args[w_at] if w_at is not None else None)
        result = impl(OpGraph(processed, base, transform, weight), *args[_NUM_GRAPH_ARGS:])
        if isinstance(result, tuple):
            if any(r is None for r in result):
                result = _empty_in_place_of_none(result, args[_NUM_GRAPH_ARGS:])
            return tuple([r.contiguous() for r in result])
        if result is None:
            result = _empty_in_place_of_none(result, args[_NUM_GRAPH_ARGS:])
        return result.contiguous()

    def run_fake(*args):
        result = fake(Sizes(*args[2:5]), *args[_NUM_GRAPH_ARGS:])
        none = result is None or (isinstance(result, tuple) and any(r is None for r in result))
        return _empty_in_place_of_none(result, args[_NUM_GRAPH_ARGS:]) if none else result

    op = torch.library.custom_op(
        f"fusegnn::{name}", run, mutates_args=(), schema=f"({_GRAPH_ARGS}, {inputs}) -> {_returns(returns)}"
    )
    op.register_fake(run_fake)
    return op


def register_op(spec: OpSpec) -> Callable[..., Any]:
    """Register ``spec`` as ``fusegnn::<name>`` (and its backward op and autograd); returns
    the forward custom op, called with the graph arguments then the inputs."""
    inputs = _args(spec.inputs)
    names = [n for _, n in inputs]
    op = _custom_op(spec.name, spec.inputs, len(spec.outputs), spec.forward, spec.fake, spec.weighted, True)
    if spec.backward is None:
        return op
    backward_op = _custom_op(
        f"{spec.name}_backward", spec.backward_inputs, len(spec.differentiable), spec.backward,
        spec.backward_fake, spec.weighted, False,
    )
    backward_names = [n for _, n in _args(spec.backward_inputs)]
    grad_names = ["grad"] if len(spec.outputs) == 1 else [f"grad_{o}" for o in spec.outputs]
    need_names = [(spec.need_flags or {}).get(n, f"need_{n}") for n in names]
    # Kept for the backward: the tensor inputs and the outputs that it names (save_for_backward),
    # every non-tensor input (small; the hooks read them too).
    saved = [n for t, n in inputs if t.startswith("Tensor") and n in backward_names]
    saved += [o for o in spec.outputs if o in backward_names]
    kept = [n for t, n in inputs if not t.startswith("Tensor")]
    saved_at = [names.index(n) if n in names else len(names) + spec.outputs.index(n) for n in saved]
    kept_at = [names.index(n) for n in kept]
    # where each backward argument comes from: (source, position)
    sources = {n: ("saved", i) for i, n in enumerate(saved)}
    sources.update({n: ("kept", i) for i, n in enumerate(kept)})
    sources.update({n: ("grads", i) for i, n in enumerate(grad_names)})
    sources.update({n: ("needs", i) for i, n in enumerate(need_names)})
    plan = [sources[n] for n in backward_names]
    returned = [spec.differentiable.index(n) if n in spec.differentiable else -1 for n in names]

    def setup_context(ctx, inputs, output):
        values = inputs[_NUM_GRAPH_ARGS:] + (output if isinstance(output, tuple) else (output,))
        tensors = [values[i] for i in saved_at]
        if spec.save is not None:
            by_name = dict(zip(saved + kept, tensors + [values[i] for i in kept_at]))
            spec.save(by_name)
            tensors = [by_name[n] for n in saved]
        ctx.graph_args = inputs[:_NUM_GRAPH_ARGS]
        ctx.kept = [values[i] for i in kept_at]
        if "aggregation" in kept:  # the backward decides "auto" in the forward's mode
            at = kept.index("aggregation")
            ctx.kept[at] = pinned_aggregation(ctx.kept[at])
        # the edge list rides along: the backward rebuilds a collected graph from it
        ctx.save_for_backward(inputs[1], *tensors)

    def autograd_backward(ctx, *grads):
        edge_index, *tensors = ctx.saved_tensors
        needs = ctx.needs_input_grad[_NUM_GRAPH_ARGS:]
        source = {"saved": tensors, "kept": ctx.kept, "grads": grads, "needs": needs}
        args = [source[where][i] for where, i in plan]
        if spec.grads is not None:
            by_name = dict(zip(saved + kept, tensors + ctx.kept))
            by_name.update(zip(backward_names, args))
            spec.grads(by_name)
            args = [by_name[n] for n in backward_names]
        graph, _, num_src, num_dst, num_edges, transform = ctx.graph_args
        result = backward_op(graph, edge_index, num_src, num_dst, num_edges, transform, *args)
        result = result if isinstance(result, tuple) else (result,)
        return (None,) * _NUM_GRAPH_ARGS + tuple(
            result[k] if k >= 0 and need else None for k, need in zip(returned, needs)
        )

    op.register_autograd(autograd_backward, setup_context=setup_context)
    return op


# ----------------------------------------------------------------------------- spmm
def _spmm(og: OpGraph, x, weight, reduce, aggregation):
    # op="spmm" admits aggregation="window"; under for_capture "auto" decides as the compiled
    # op always has (no host-bound regime: compiled code is replayed)
    with for_capture():
        backend = resolve_aggregation(aggregation, og.graph, x, op="spmm")
    return backend.spmm(og.graph, x, og.weight, reduce)


def _spmm_fake(sizes: Sizes, x, weight, reduce, aggregation):
    return x.new_empty((sizes.num_dst,) + tuple(x.shape[1:]))


def _spmm_backward(og: OpGraph, grad, x, weight, need_x, need_w, reduce, aggregation):
    backend = _backend(aggregation, og.graph, grad)
    gx, gw = backend.spmm_backward(og.graph, grad, x, og.weight, reduce, need_x, need_w)
    if need_w and og.transform != "":  # back through the normalisation of the given weights
        gw = reference_grads.gcn_norm_weight_grad(og.base, weight, gw, **gcn_params(og.transform))
    return gx, gw


def _spmm_backward_fake(sizes: Sizes, grad, x, weight, need_x, need_w, reduce, aggregation):
    gx = grad.new_empty((sizes.num_src,) + tuple(grad.shape[1:])) if need_x else None
    return gx, weight.new_empty(weight.shape) if need_w else None


def _spmm_save(values: dict) -> None:
    # x serves only the weights' gradient and max's recomputation
    weight = values["weight"]
    if not ((weight is not None and weight.requires_grad) or values["reduce"] == "max"):
        values["x"] = None


_spmm_op = register_op(OpSpec(
    name="spmm",
    inputs="Tensor x, Tensor? weight, str reduce, str aggregation",
    outputs=("out",),
    forward=_spmm,
    fake=_spmm_fake,
    weighted="weight",
    backward_inputs="Tensor grad, Tensor? x, Tensor? weight, bool need_x, bool need_w, str reduce, str aggregation",
    differentiable=("x", "weight"),
    need_flags={"weight": "need_w"},
    backward=_spmm_backward,
    backward_fake=_spmm_backward_fake,
    save=_spmm_save,
))


# ----------------------------------------------------------------------------- edge_aggregate
def _edge_aggregate_backend(og: OpGraph, aggregation: str, *tensors: Optional[Tensor]) -> Backend:
    if og.transform != "":
        raise ValueError(f"edge_aggregate takes a graph without processing, got transform {og.transform!r}")
    return resolve_aggregation(aggregation, og.graph, *[t for t in tensors if t is not None])


def _edge_aggregate(og: OpGraph, x, edge_attr, weight, activation, reduce, aggregation):
    backend = _edge_aggregate_backend(og, aggregation, x, edge_attr)
    return backend.edge_aggregate(og.graph, x, edge_attr, og.weight, activation or None, reduce)


def _edge_aggregate_fake(sizes: Sizes, x, edge_attr, weight, activation, reduce, aggregation):
    like = x if x is not None else edge_attr
    return like.new_empty((sizes.num_dst,) + tuple(like.shape[1:]))


def _edge_aggregate_backward(og: OpGraph, grad, x, edge_attr, weight, need_x, need_edge_attr, need_w,
                             activation, reduce, aggregation):
    backend = _backend(aggregation, og.graph, *[t for t in (x, edge_attr) if t is not None])
    return backend.edge_aggregate_backward(
        og.graph, grad, x, edge_attr, og.weight, activation or None, reduce, need_x, need_edge_attr, need_w
    )


def _edge_aggregate_backward_fake(sizes: Sizes, grad, x, edge_attr, weight, need_x, need_edge_attr, need_w,
                                  activation, reduce, aggregation):
    return (
        x.new_empty(x.shape) if need_x and x is not None else None,
        edge_attr.new_empty(edge_attr.shape) if need_edge_attr and edge_attr is not None else None,
        weight.new_empty(weight.shape) if need_w and weight is not None else None,
    )


_edge_aggregate_op = register_op(OpSpec(
    name="edge_aggregate",
    inputs="Tensor? x, Tensor? edge_attr, Tensor? weight, str activation, str reduce, str aggregation",
    outputs=("out",),
    forward=_edge_aggregate,
    fake=_edge_aggregate_fake,
    weighted="weight",
    backward_inputs=(
        "Tensor grad, Tensor? x, Tensor? edge_attr, Tensor? weight, bool need_x, bool need_edge_attr, "
        "bool need_w, str activation, str reduce, str aggregation"
    ),
    differentiable=("x", "edge_attr", "weight"),
    need_flags={"weight": "need_w"},
    backward=_edge_aggregate_backward,
    backward_fake=_edge_aggregate_backward_fake,
))


# ----------------------------------------------------------------------------- sddmm
def _sddmm(og: OpGraph, a, b, op, aggregation):
    return resolve_aggregation(aggregation, og.graph, a, b).sddmm(og.graph, a, b, op)


def _sddmm_fake(sizes: Sizes, a, b, op, aggregation):
    return a.new_empty((sizes.edges(),) + (tuple(a.shape[1:-1]) if op == "dot" else tuple(a.shape[1:])))


def _sddmm_backward(og: OpGraph, grad, a, b, op, need_a, need_b, aggregation):
    return _backend(aggregation, og.graph, a, b).sddmm_backward(og.graph, a, b, grad, op, need_a, need_b)


def _sddmm_backward_fake(sizes: Sizes, grad, a, b, op, need_a, need_b, aggregation):
    return a.new_empty(a.shape) if need_a else None, b.new_empty(b.shape) if need_b else None


_sddmm_op = register_op(OpSpec(
    name="sddmm",
    inputs="Tensor a, Tensor b, str op, str aggregation",
    outputs=("out",),
    forward=_sddmm,
    fake=_sddmm_fake,
    backward_inputs="Tensor grad, Tensor a, Tensor b, str op, bool need_a, bool need_b, str aggregation",
    differentiable=("a", "b"),
    backward=_sddmm_backward,
    backward_fake=_sddmm_backward_fake,
))


# ----------------------------------------------------------------------------- edge softmax
def _edge_softmax(og: OpGraph, scores, aggregation):
    return resolve_aggregation(aggregation, og.graph, scores).edge_softmax(og.graph, scores)


def _edge_softmax_backward(og: OpGraph, alpha, grad, aggregation):
    return _backend(aggregation, og.graph, alpha).edge_softmax_backward(og.graph, alpha, grad)


_edge_softmax_op = register_op(OpSpec(
    name="edge_softmax",
    inputs="Tensor scores, str aggregation",
    outputs=("alpha",),
    forward=_edge_softmax,
    fake=lambda sizes, scores, aggregation: scores.new_empty(scores.shape),
    backward_inputs="Tensor alpha, Tensor grad, str aggregation",
    differentiable=("scores",),
    backward=_edge_softmax_backward,
    backward_fake=lambda sizes, alpha, grad, aggregation: alpha.new_empty(alpha.shape),
))


# ----------------------------------------------------------------------------- GAT
def _lse_dtype(h: Tensor, scores: Tensor) -> torch.dtype:
    """The fused kernels' accumulation dtype (of the stored log-sum-exp)."""
    return torch.float64 if torch.promote_types(h.dtype, scores.dtype) == torch.float64 else torch.float32


def _gat(og: OpGraph, h, score_src, score_dst, score_edge, seed, negative_slope, p, return_alpha, aggregation):
    g = og.graph
    backend = resolve_aggregation(aggregation, g, h, score_src, score_dst, op="gat")
    heads = h.size(1)
    lse = torch.zeros((g.num_dst_nodes, heads), dtype=_lse_dtype(h, score_src), device=h.device)
    alpha = None
    if backend.name == "reference":
        out, alpha = reference.gat_attention(g, h, score_src, score_dst, negative_slope, p, seed, score_edge)
    else:
        from fusegnn.kernels.gat_fused import attention_config, attention_forward

        s_src, s_dst = score_src.contiguous(), score_dst.contiguous()
        s_edge = score_edge.contiguous() if score_edge is not None else None
        cfg, hp, channels = attention_config(g, h, s_src, negative_slope, p, seed, backend.name)
        out, lse, alpha = attention_forward(cfg, hp, s_src, s_dst, return_alpha, s_edge)
        out = out[..., :channels]
    if not return_alpha:
        alpha = score_src.new_empty((0, heads))
    return out, lse, alpha


def _gat_fake(sizes: Sizes, h, score_src, score_dst, score_edge, seed, negative_slope, p, return_alpha, aggregation):
    heads = h.size(1)
    out = h.new_empty((sizes.num_dst,) + tuple(h.shape[1:]))
    lse = torch.empty((sizes.num_dst, heads), dtype=_lse_dtype(h, score_src), device=h.device)
    alpha = score_src.new_empty((sizes.edges() if return_alpha else 0, heads))
    return out, lse, alpha


def _gat_backward(og: OpGraph, h, score_src, score_dst, score_edge, seed, out, lse, alpha, grad_out, grad_alpha,
                  negative_slope, p, aggregation):
    g = og.graph
    aggregation = _resolved(aggregation, g, h, score_src, score_dst, op="gat")
    if aggregation == "reference":
        return reference_grads.gat_attention_backward(
            g, h, score_src, score_dst, negative_slope, p, seed, grad_out, grad_alpha, score_edge
        )
    # the fused kernels' backward, on the forward's out and log-sum-exp
    from fusegnn.kernels.gat_fused import attention_backward, attention_config

    s_src, s_dst = score_src.contiguous(), score_dst.contiguous()
    s_edge = score_edge.contiguous() if score_edge is not None else None
    cfg, hp, channels = attention_config(g, h, s_src, negative_slope, p, seed, aggregation)
    pad = hp.size(2) - channels
    out_p = F.pad(out, (0, pad)) if pad else out.contiguous()
    grad_p = F.pad(grad_out, (0, pad)) if pad else grad_out
    gh, gs, gt, ge = attention_backward(
        cfg, hp, s_src, s_dst, out_p, lse, grad_p, alpha if grad_alpha is not None else None, grad_alpha, s_edge
    )
    return gh[..., :channels], gs, gt, ge


def _gat_backward_fake(sizes: Sizes, h, score_src, score_dst, score_edge, seed, out, lse, alpha, grad_out,
                       grad_alpha, negative_slope, p, aggregation):
    ge = score_edge.new_empty(score_edge.shape) if score_edge is not None else None
    return h.new_empty(h.shape), score_src.new_empty(score_src.shape), score_dst.new_empty(score_dst.shape), ge


def _gat_grads(values: dict) -> None:
    if values["grad_out"] is None:  # only alpha was used
        values["grad_out"] = torch.zeros_like(values["out"])
    if not values["return_alpha"]:  # the placeholder alpha carries no gradient
        values["grad_alpha"] = None


_gat_op = register_op(OpSpec(
    name="gat_attention",
    inputs=(
        "Tensor h, Tensor score_src, Tensor score_dst, Tensor? score_edge, Tensor? seed, float negative_slope, "
        "float p, bool return_alpha, str aggregation"
    ),
    outputs=("out", "lse", "alpha"),
    forward=_gat,
    fake=_gat_fake,
    backward_inputs=(
        "Tensor h, Tensor score_src, Tensor score_dst, Tensor? score_edge, Tensor? seed, Tensor out, Tensor lse, "
        "Tensor alpha, Tensor grad_out, Tensor? grad_alpha, float negative_slope, float p, str aggregation"
    ),
    differentiable=("h", "score_src", "score_dst", "score_edge"),
    backward=_gat_backward,
    backward_fake=_gat_backward_fake,
    grads=_gat_grads,
))


# ----------------------------------------------------------------------------- GATv2
def _gatv2_reference_path(backend: Backend, return_alpha: bool) -> bool:
    """Whether a GATv2 op runs the reference: asked for, or the coefficients are returned
    (the fused kernels do not return them; the eager op does the same)."""
    return backend.name == "reference" or return_alpha


def _gatv2(og: OpGraph, x_l, x_r, att, edge_attr, seed, negative_slope, p, return_alpha, aggregation):
    g = og.graph
    backend = resolve_aggregation(aggregation, g, x_l, x_r, op="gatv2")
    heads = x_l.size(1)
    lse = torch.zeros((g.num_dst_nodes, heads), dtype=_lse_dtype(x_l, att), device=x_l.device)
    if _gatv2_reference_path(backend, return_alpha):
        out, alpha = reference.gatv2_attention(g, x_l, x_r, att, edge_attr, negative_slope, p, seed)
        return out, lse, (alpha if return_alpha else att.new_empty((0, heads)))
    from fusegnn.kernels.gatv2_fused import gatv2_config, gatv2_forward

    cfg = gatv2_config(g, x_l, att, negative_slope, p, seed, backend.name)
    edge = edge_attr.contiguous() if edge_attr is not None else None
    out, lse = gatv2_forward(cfg, x_l.contiguous(), x_r.contiguous(), att.contiguous(), edge)
    return out, lse, att.new_empty((0, heads))


def _gatv2_fake(sizes: Sizes, x_l, x_r, att, edge_attr, seed, negative_slope, p, return_alpha, aggregation):
    heads = x_l.size(1)
    out = x_l.new_empty((sizes.num_dst,) + tuple(x_l.shape[1:]))
    lse = torch.empty((sizes.num_dst, heads), dtype=_lse_dtype(x_l, att), device=x_l.device)
    return out, lse, att.new_empty((sizes.edges() if return_alpha else 0, heads))


def _gatv2_backward(og: OpGraph, x_l, x_r, att, edge_attr, seed, out, lse, grad_out, grad_alpha,
                    negative_slope, p, return_alpha, aggregation):
    g = og.graph
    if _gatv2_reference_path(backend_named(_resolved(aggregation, g, x_l, x_r, op="gatv2")), return_alpha):
        return reference_grads.gatv2_attention_backward(
            g, x_l, x_r, att, edge_attr, negative_slope, p, seed, grad_out, grad_alpha
        )
    from fusegnn.kernels.gatv2_fused import gatv2_backward, gatv2_config

    cfg = gatv2_config(g, x_l, att, negative_slope, p, seed, _resolved(aggregation, g, x_l, x_r, op="gatv2"))
    edge = edge_attr.contiguous() if edge_attr is not None else None
    return gatv2_backward(cfg, x_l.contiguous(), x_r.contiguous(), att.contiguous(), edge, out, lse, grad_out)


def _gatv2_backward_fake(sizes: Sizes, x_l, x_r, att, edge_attr, seed, out, lse, grad_out, grad_alpha,
                         negative_slope, p, return_alpha, aggregation):
    grad_edge = edge_attr.new_empty(edge_attr.shape) if edge_attr is not None else None
    return x_l.new_empty(x_l.shape), x_r.new_empty(x_r.shape), att.new_empty(att.shape), grad_edge


_gatv2_op = register_op(OpSpec(
    name="gatv2_attention",
    inputs=(
        "Tensor x_l, Tensor x_r, Tensor att, Tensor? edge_attr, Tensor? seed, float negative_slope, float p, "
        "bool return_alpha, str aggregation"
    ),
    outputs=("out", "lse", "alpha"),
    forward=_gatv2,
    fake=_gatv2_fake,
    backward_inputs=(
        "Tensor x_l, Tensor x_r, Tensor att, Tensor? edge_attr, Tensor? seed, Tensor out, Tensor lse, "
        "Tensor grad_out, Tensor? grad_alpha, float negative_slope, float p, bool return_alpha, str aggregation"
    ),
    differentiable=("x_l", "x_r", "att", "edge_attr"),
    backward=_gatv2_backward,
    backward_fake=_gatv2_backward_fake,
    grads=_gat_grads,
))


# ----------------------------------------------------------------------------- edge list
def _edge_index(og: OpGraph, dtype, device):
    return og.graph.edge_index.to(dtype).clone()  # a copy: the graph's own tensor stays the graph's


_edge_index_op = register_op(OpSpec(
    name="edge_index",
    inputs="ScalarType dtype, Device device",
    outputs=("edge_index",),
    forward=_edge_index,
    fake=lambda sizes, dtype, device: torch.empty((2, sizes.edges()), dtype=dtype, device=device),
))


# ----------------------------------------------------------------------------- traced-side API
def _graph_args(ref: GraphRef) -> tuple:
    return ref.uid, ref.edge_index, ref.num_src_nodes, ref.num_dst_nodes, ref.num_edges, ref.transform


def spmm(ref: GraphRef, x: Tensor, weight: Optional[Tensor], reduce: str, aggregation: str) -> Tensor:
    """``fusegnn::spmm``: :func:`fusegnn.sparse.spmm` on ``ref`` (arguments checked by the
    caller). ``weight`` ``None`` aggregates with the processed graph's own weights."""
    return _spmm_op(*_graph_args(ref), x, weight, reduce, traced_aggregation(aggregation))


def edge_aggregate(ref: GraphRef, x: Optional[Tensor], edge_attr: Optional[Tensor], weight: Optional[Tensor],
                   activation: Optional[str], reduce: str, aggregation: str) -> Tensor:
    """``fusegnn::edge_aggregate``: :func:`fusegnn.sparse.edge_aggregate` on ``ref``
    (arguments checked; ``activation`` ``None`` travels as ``""``)."""
    return _edge_aggregate_op(*_graph_args(ref), x, edge_attr, weight, activation or "", reduce,
                              traced_aggregation(aggregation))


def sddmm(ref: GraphRef, a: Tensor, b: Tensor, op: str, aggregation: str) -> Tensor:
    """``fusegnn::sddmm``: :func:`fusegnn.sparse.sddmm` on ``ref`` (arguments checked)."""
    return _sddmm_op(*_graph_args(ref), a, b, op, traced_aggregation(aggregation))


def edge_softmax(ref: GraphRef, scores: Tensor, aggregation: str) -> Tensor:
    """``fusegnn::edge_softmax``: :func:`fusegnn.sparse.edge_softmax` on ``ref``."""
    return _edge_softmax_op(*_graph_args(ref), scores, traced_aggregation(aggregation))


def gat_attention(ref: GraphRef, h: Tensor, score_src: Tensor, score_dst: Tensor, negative_slope: float,
                  p: float, return_alpha: bool, aggregation: str,
                  score_edge: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """``fusegnn::gat_attention``: :func:`fusegnn.sparse.gat_attention` on ``ref``
    (arguments checked; ``p`` the dropout probability, 0 outside training; ``score_edge``
    the optional per-edge score addend). Returns ``(out, alpha or None)`` with the shapes
    of the eager op."""
    single = h.dim() == 2
    if single:
        h, score_src, score_dst = h.unsqueeze(1), score_src.unsqueeze(1), score_dst.unsqueeze(1)
        score_edge = score_edge.unsqueeze(1) if score_edge is not None else None
    seed = (
        torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=h.device) if p > 0.0 else None
    )
    out, _, alpha = _gat_op(
        *_graph_args(ref), h, score_src, score_dst, score_edge, seed, float(negative_slope), float(p),
        bool(return_alpha), traced_aggregation(aggregation),
    )
    if single:
        out, alpha = out.squeeze(1), alpha.squeeze(1)
    return out, (alpha if return_alpha else None)


def edge_index(ref: GraphRef) -> Tensor:
    """``fusegnn::edge_index``: a copy of the processed graph's ``edge_index``."""
    return _edge_index_op(*_graph_args(ref), ref.index_dtype, ref.device)


def gatv2_attention(ref: GraphRef, x_l: Tensor, x_r: Tensor, att: Tensor, edge_attr: Optional[Tensor],
                    negative_slope: float, p: float, return_alpha: bool,
                    aggregation: str) -> tuple[Tensor, Optional[Tensor]]:
    """``fusegnn::gatv2_attention``: :func:`fusegnn.sparse.gatv2_attention` on ``ref``
    (arguments checked; ``p`` the dropout probability, 0 outside training)."""
    seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=x_l.device) if p > 0.0 else None
    out, _, alpha = _gatv2_op(
        *_graph_args(ref), x_l, x_r, att, edge_attr, seed, float(negative_slope), float(p),
        bool(return_alpha), traced_aggregation(aggregation),
    )
    return out, (alpha if return_alpha else None)
