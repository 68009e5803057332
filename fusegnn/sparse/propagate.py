r"""K steps of (personalised) propagation over a graph as one op: SGC's :math:`A^K X` and
APPNP's personalised-PageRank iteration, with a backward that keeps no intermediate.

.. math::
    x^{(0)} = x, \qquad
    x^{(k+1)} = (1 - \alpha)\, A\, x^{(k)} + \alpha\, x^{(0)}, \qquad
    \mathrm{propagate}(A, x) = x^{(K)}

with :math:`A` the graph's aggregation matrix (:math:`A_{ij} = \sum w_{ji}` over the edges
:math:`j \to i`, 1 per edge when unweighted: ``spmm(graph, x) == A @ x``).

The result is a fixed matrix polynomial applied to the input,
:math:`x^{(K)} = M x` with :math:`M = \big((1-\alpha)A\big)^K + \alpha \sum_{k<K}
\big((1-\alpha)A\big)^k`, so its gradient is :math:`M^\top g`, and :math:`M^\top` is the
same polynomial in :math:`A^\top`: the backward runs the same recurrence on the reversed
graph (:meth:`~fusegnn.sparse.Graph.reversed`), starting from the incoming gradient.
Nothing of the forward is kept for it (not even the input: the map is linear), where K
chained :func:`~fusegnn.sparse.spmm` calls would give autograd K nodes and, on the
reference path, K saved ``[E, F]`` message tensors. The backward is itself a ``propagate`` call,
so double backward works and is as cheap.

When the graph's edge weights require grad (their gradient depends on every
:math:`x^{(k)}`) the op runs the K :func:`~fusegnn.sparse.spmm` calls under plain
autograd instead. Under ``torch.compile`` it does too, on the graph reference: each
``fusegnn::spmm`` custom op then keeps no features unless its weights need a gradient.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Iterator

import torch
from torch import Tensor

from fusegnn.sparse.dispatch import capture_mode, check_aggregation, deterministic, for_capture, is_deterministic
from fusegnn.sparse.graph import Graph, as_graph, is_integer
from fusegnn.sparse.graph_ref import GraphRef, graph_ref
from fusegnn.sparse.halo import HaloGraph, held_graph
from fusegnn.sparse.ops import check_node_tensor, spmm

__all__ = ["propagate", "check_propagation"]


def check_propagation(K, alpha, what: str = "propagate") -> tuple[int, float]:
    """``K`` a non-negative int and ``alpha`` a real in ``[0, 1]``; returns them as
    ``(int, float)`` (errors name ``what``)."""
    if not is_integer(K):
        raise TypeError(f"{what}: K must be an int (the number of propagation steps), got {type(K).__name__}")
    if K < 0:
        raise ValueError(f"{what}: K must be >= 0, got {K}")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise TypeError(f"{what}: alpha must be a float in [0, 1], got {type(alpha).__name__}")
    if not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"{what}: alpha must be in [0, 1], got {alpha}")
    return int(K), float(alpha)


def propagate(
    graph: Graph | Tensor, x: Tensor, K: int, alpha: float = 0.0, *, aggregation: str = "auto"
) -> Tensor:
    r"""``x`` propagated ``K`` times over ``graph`` (see the module docstring):
    :math:`x^{(k+1)} = (1 - \alpha) A x^{(k)} + \alpha x^{(0)}`, returning :math:`x^{(K)}`.

    Args:
        graph: a square :class:`~fusegnn.sparse.Graph` or an ``edge_index`` (its own
            ``edge_weight``, if any, weighs the edges; e.g. a GCN-normalised graph), or a
            worker's share of a distributed graph (a
            :class:`~fusegnn.sparse.halo.HaloGraph`, ``x`` its owned rows): then K
            :func:`~fusegnn.sparse.spmm` steps, each fetching the halo rows it aggregates.
        x: ``[N, F]`` or ``[N, H, F]`` node features.
        K: number of steps (``0`` returns ``x`` itself).
        alpha: teleport (restart) probability in ``[0, 1]``; ``0`` gives :math:`A^K x`.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"``, ``"window"`` or ``"reference"``, for every
            aggregation of the forward and the backward (see :mod:`fusegnn.sparse.dispatch`).

    Returns:
        A tensor of ``x``'s shape.
    """
    K, alpha = check_propagation(K, alpha)
    check_aggregation(aggregation, "spmm")
    if not isinstance(x, Tensor):
        raise TypeError(f"propagate: x must be a torch.Tensor, got {type(x).__name__}")
    held = held_graph(graph)
    if isinstance(held, HaloGraph) and not torch.compiler.is_compiling():
        # a worker's share of a distributed graph: square in its owned nodes, and every
        # step's spmm fetches the halo rows of the step before (so no fused K-step backward)
        return x if K == 0 else _steps(held, x, K, alpha, aggregation)
    if torch.compiler.is_compiling():
        graph = graph_ref(graph, x.size(0))
    else:
        graph = as_graph(graph, x.size(0))
    if graph.is_bipartite:
        raise ValueError(
            f"propagate needs a square graph (A x feeds the next step), got {graph.num_src_nodes} x "
            f"{graph.num_dst_nodes} nodes"
        )
    check_node_tensor(x, graph, graph.num_src_nodes, "x", (2, 3))
    if K == 0:
        return x
    weight = graph.edge_weight
    if isinstance(graph, GraphRef) or (weight is not None and weight.requires_grad):
        return _steps(graph, x, K, alpha, aggregation)
    return _Propagate.apply(x, graph, K, alpha, aggregation)


def _step(graph, x_k: Tensor, x_0: Tensor, alpha: float, aggregation: str) -> Tensor:
    """One step :math:`(1 - \\alpha) A x_k + \\alpha x_0` (differentiable)."""
    out = spmm(graph, x_k, aggregation=aggregation)
    if alpha == 0.0:
        return out
    return out.mul(1.0 - alpha).add(x_0, alpha=alpha)  # _Propagate's arithmetic: the same bits


def _steps(graph, x: Tensor, K: int, alpha: float, aggregation: str) -> Tensor:
    """The recurrence as K :func:`~fusegnn.sparse.spmm` calls under plain autograd."""
    out = x
    for _ in range(K):
        out = _step(graph, out, x, alpha, aggregation)
    return out


@contextlib.contextmanager
def _forward_modes(ctx) -> Iterator[None]:
    """The deterministic and capture modes that :class:`_Propagate`'s forward decided
    ``"auto"`` in (an explicit aggregation reads neither: its checks stay as they are)."""
    if ctx.aggregation != "auto":
        yield
        return
    with deterministic(ctx.deterministic), for_capture(ctx.for_capture):
        yield


class _Propagate(torch.autograd.Function):
    """The recurrence with a backward on the reversed graph; keeps no tensor for it.

    The backward decides ``"auto"`` again (on the reversed graph) in the forward's
    deterministic and capture modes: those switches are thread-local, and a CUDA backward
    runs in the autograd engine's own threads, where they are off (a deterministic forward
    then had GAS's atomics in its backward, and a :func:`fusegnn.graphed_step` warm-up did
    not warm the paths its capture records)."""

    @staticmethod
    def forward(ctx, x: Tensor, graph: Graph, K: int, alpha: float, aggregation: str) -> Tensor:
        ctx.graph, ctx.K, ctx.alpha, ctx.aggregation = graph, K, alpha, aggregation
        ctx.deterministic, ctx.for_capture = is_deterministic(), capture_mode()
        out = x
        for _ in range(K):  # K >= 1: out is spmm's fresh output from the first step on
            out = spmm(graph, out, aggregation=aggregation)
            if alpha != 0.0:
                out.mul_(1.0 - alpha).add_(x, alpha=alpha)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        with _forward_modes(ctx):
            grad_x = propagate(ctx.graph.reversed(), grad, ctx.K, ctx.alpha, aggregation=ctx.aggregation)
        return grad_x, None, None, None, None
