"""Registration of the fused Triton backends ``gas``, ``gar`` and ``window``: the op layer's
table of what :mod:`fusegnn.kernels` offers (the kernels never import the op layer).

:func:`register` is called by :mod:`fusegnn.sparse.dispatch` on the first dispatch. It
registers nothing when Triton cannot be imported (Triton is an optional dependency), and
it imports no kernel module (nor Triton): those are imported on the first fused op, so
that setting ``TRITON_INTERPRET=1`` any time before Triton is imported (e.g. at the top of
a test module) runs the kernels through Triton's CPU interpreter.

Where the backends run (``supports``): CUDA tensors, and CPU tensors only under the
interpreter (:func:`fusegnn.kernels._triton.interpreter_usable`); floating inputs of the
kernels' dtypes (:data:`fusegnn.kernels._triton.FLOAT_DTYPES`: fp16, bf16, fp32, fp64). ``aggregation="auto"`` still takes
the reference for CPU tensors.

``spmm``, ``sddmm`` (:mod:`fusegnn.kernels.sddmm`) and ``edge_softmax``
(:mod:`fusegnn.kernels.edge_softmax`) all run Triton kernels, forward (autograd Functions)
and backward (the same kernels' plain backward functions, for the compiled ops); the ``dot`` SDDMM's backward
runs the SpMM of the same aggregation (GAR in deterministic mode). ``reduce="max"`` and
``edge_aggregate`` (:mod:`fusegnn.kernels.edge_aggregate`) run GAR's fused passes, forward
and backward, for both backends: ``gas`` hands them to GAR and records that
(:func:`~fusegnn.sparse.dispatch.note_path`).

``window`` is an spmm-only backend (:mod:`fusegnn.sparse.window_aggregation`, the
vector-sparse kernels of :mod:`fusegnn.kernels.vector_spmm` over row windows):
``reduce="sum"`` / ``"mean"`` with ``[E]`` weights (or none); ``reduce="max"`` and
per-head ``[E, H]`` weights go to GAR, recorded with ``note_path``. The dispatcher lets
no other op ask for it (:func:`~fusegnn.sparse.dispatch.check_aggregation`).
"""

from __future__ import annotations

import importlib.util

from torch import Tensor

from fusegnn.kernels._triton import FLOAT_DTYPES, interpreter_usable
from fusegnn.sparse import reference, reference_grads
from fusegnn.sparse.dispatch import Backend, is_deterministic, note_path, register_backend
from fusegnn.sparse.graph import Graph

__all__ = ["register", "supports"]


def supports(graph: Graph, *tensors: Tensor) -> bool:
    """Whether the fused kernels can run on ``graph`` and ``tensors``."""
    device = graph.device
    if device.type == "cuda":
        pass
    elif device.type == "cpu":
        if not interpreter_usable():
            return False
    else:
        return False
    return all(t.device == device and t.dtype in FLOAT_DTYPES for t in tensors)


def _max_path(aggregation: str) -> None:
    """Record that a ``reduce="max"`` aggregation runs GAR's fused max (GAS has no atomic
    max-with-argmax: it hands max to GAR)."""
    if aggregation == "gas":
        note_path("gar", "reduce='max' runs GAR's fused max (a maximum with its argmax has no atomic GAS form)")


def _spmm(aggregation: str):
    def spmm(graph: Graph, x: Tensor, edge_weight: Tensor | None = None, reduce: str = "sum",
             bias: Tensor | None = None) -> Tensor:
        if reduce == "max":
            from fusegnn.kernels.edge_aggregate import edge_aggregate

            _max_path(aggregation)
            out = edge_aggregate(graph, x, None, edge_weight, None, "max")
            return out if bias is None else out + bias.reshape(x.shape[1:])
        from fusegnn.kernels.spmm import gar_spmm, gas_spmm

        return (gas_spmm if aggregation == "gas" else gar_spmm)(graph, x, edge_weight, reduce, bias)

    return spmm


def _spmm_backward(aggregation: str):
    def spmm_backward(graph: Graph, grad: Tensor, x: Tensor | None, weight: Tensor | None, reduce: str,
                      need_x: bool, need_w: bool) -> tuple[Tensor | None, Tensor | None]:
        if reduce == "max":  # GAR's, recomputing the forward's argmax
            from fusegnn.kernels.edge_aggregate import edge_aggregate_backward

            gx, _, gw = edge_aggregate_backward(graph, grad, x, None, weight, None, "max", None, need_x, False, need_w)
            return gx, gw
        from fusegnn.kernels.spmm import spmm_backward as fused_backward

        if reduce == "mean":
            grad = _mean_scale(graph, grad)
        return fused_backward(aggregation, graph, grad, x, weight, need_x, need_w, memoise_weight=True)

    return spmm_backward


def _edge_aggregate(aggregation: str):
    def edge_aggregate(graph: Graph, x: Tensor | None, edge_attr: Tensor | None, edge_weight: Tensor | None,
                       activation: str | None, reduce: str) -> Tensor:
        from fusegnn.kernels.edge_aggregate import edge_aggregate as fused

        if aggregation == "gas":
            note_path("gar", "edge_aggregate runs GAR's fused pass (GAS hands it over)")
        return fused(graph, x, edge_attr, edge_weight, activation, reduce)

    return edge_aggregate


def _edge_aggregate_backward(graph: Graph, grad: Tensor, x: Tensor | None, edge_attr: Tensor | None,
                             weight: Tensor | None, activation: str | None, reduce: str, need_x: bool,
                             need_e: bool, need_w: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    from fusegnn.kernels.edge_aggregate import edge_aggregate_backward

    return edge_aggregate_backward(graph, grad, x, edge_attr, weight, activation, reduce, None, need_x, need_e, need_w)


def _sddmm_aggregation(aggregation: str) -> str:
    """The fused SpMM the ``dot`` SDDMM's backward runs: GAR for ``gar``; for ``gas`` GAS,
    unless deterministic mode asks for no atomics."""
    return "gar" if aggregation == "gar" or is_deterministic() else "gas"


def _sddmm(aggregation: str):
    def sddmm(graph: Graph, a: Tensor, b: Tensor, op: str = "dot") -> Tensor:
        from fusegnn.kernels.sddmm import sddmm as fused_sddmm

        return fused_sddmm(graph, a, b, op, aggregation=_sddmm_aggregation(aggregation))

    return sddmm


def _sddmm_backward(aggregation: str):
    def sddmm_backward(graph: Graph, a: Tensor, b: Tensor, grad: Tensor, op: str, need_a: bool,
                       need_b: bool) -> tuple[Tensor | None, Tensor | None]:
        from fusegnn.kernels.sddmm import sddmm_backward as fused_backward

        return fused_backward(
            graph, a.contiguous(), b.contiguous(), grad, op, _sddmm_aggregation(aggregation), need_a, need_b
        )

    return sddmm_backward


def _edge_softmax(graph: Graph, scores: Tensor) -> Tensor:
    from fusegnn.kernels.edge_softmax import edge_softmax

    return edge_softmax(graph, scores)


def _edge_softmax_backward(graph: Graph, alpha: Tensor, grad: Tensor) -> Tensor:
    from fusegnn.kernels.edge_softmax import edge_softmax_backward

    return edge_softmax_backward(graph, alpha.contiguous(), grad)


def _window_hand_over(graph: Graph, reduce: str, weight: Tensor | None) -> str | None:
    """Why the window backend hands this spmm to GAR, or ``None`` when it runs it."""
    if graph.num_src_nodes == 0 or graph.num_dst_nodes == 0:
        return "a graph without source or target nodes has no row windows (an empty product)"
    if reduce == "max":
        return "reduce='max' runs GAR's fused max (row windows hold sums)"
    if weight is not None and weight.dim() == 2:
        return "per-head [E, H] weights run on GAR (a row window holds one weight per edge)"
    return None


def _mean_scale(graph: Graph, t: Tensor) -> Tensor:
    """``t`` (``[N_dst, *S]``) divided by the in-degrees clamped to 1: a mean from a sum."""
    return t / reference.mean_divisor(graph, t.dtype, t.dim())


def _window_spmm(graph: Graph, x: Tensor, edge_weight: Tensor | None = None, reduce: str = "sum",
                 bias: Tensor | None = None) -> Tensor:
    if (why := _window_hand_over(graph, reduce, edge_weight)) is not None:
        note_path("gar", why)
        return _spmm("gar")(graph, x, edge_weight, reduce, bias)
    from fusegnn.sparse.window_aggregation import window_aggregate

    out = window_aggregate(graph, x, edge_weight)
    if reduce == "mean":
        out = _mean_scale(graph, out)
    return out if bias is None else out + bias.reshape(x.shape[1:])


def _window_spmm_backward(graph: Graph, grad: Tensor, x: Tensor | None, weight: Tensor | None, reduce: str,
                          need_x: bool, need_w: bool) -> tuple[Tensor | None, Tensor | None]:
    if _window_hand_over(graph, reduce, weight) is not None:
        return _spmm_backward("gar")(graph, grad, x, weight, reduce, need_x, need_w)
    from fusegnn.sparse.window_aggregation import window_aggregate_backward

    if reduce == "mean":
        grad = _mean_scale(graph, grad)
    return window_aggregate_backward(graph, grad, x, weight, need_x, need_w)


def _spmm_only(op: str):
    def refuse(*args, **kwargs):
        raise NotImplementedError(f"the 'window' backend runs spmm only, not {op}")

    return refuse


def register() -> bool:
    """Register ``gas``, ``gar`` and ``window`` if Triton is importable; returns whether it did."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover - a broken Triton install
        return False
    for aggregation in ("gas", "gar"):
        register_backend(
            Backend(
                name=aggregation,
                spmm=_spmm(aggregation),
                sddmm=_sddmm(aggregation),
                edge_softmax=_edge_softmax,
                supports=supports,
                spmm_backward=_spmm_backward(aggregation),
                sddmm_backward=_sddmm_backward(aggregation),
                edge_softmax_backward=_edge_softmax_backward,
                edge_aggregate=_edge_aggregate(aggregation),
                edge_aggregate_backward=_edge_aggregate_backward,
            )
        )
    register_backend(
        Backend(
            name="window",
            spmm=_window_spmm,
            sddmm=_spmm_only("sddmm"),
            edge_softmax=_spmm_only("edge_softmax"),
            supports=supports,
            spmm_backward=_window_spmm_backward,
        )
    )
    return True
