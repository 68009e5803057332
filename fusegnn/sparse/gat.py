r"""GAT-style graph attention as one op: scores, LeakyReLU, edge softmax, dropout, SpMM.

For every head :math:`k` and edge :math:`j \to i`:

.. math::
    e^{(k)}_{ji} = \mathrm{LeakyReLU}\big(s^{(k)}_j + t^{(k)}_i + u^{(k)}_{ji}\big), \qquad
    \alpha^{(k)}_{ji} = \operatorname{dropout}_p\Big(\operatorname{softmax}_{j \to i}\, e^{(k)}_{ji}\Big),
    \qquad
    \mathrm{out}^{(k)}_i = \sum_{j \to i} \alpha^{(k)}_{ji} \, h^{(k)}_j

with :math:`s = ` ``score_src`` (:math:`a_s \cdot h_j` in GAT), :math:`t = ` ``score_dst``
(:math:`a_t \cdot h_i`), the optional per-edge addend :math:`u = ` ``score_edge``
(:math:`a_e \cdot W_e e_{ji}` for GAT with edge features; 0 without) and dropout applied to the normalised coefficients (kept ones
scaled by :math:`1/(1-p)`), as in PyG's ``GATConv``.

Two implementations:

* the **reference composition** ``sddmm(add) -> leaky_relu -> edge_softmax -> dropout ->
  spmm`` of :mod:`fusegnn.sparse` (``aggregation="reference"``, and ``"auto"`` off CUDA);
  it materialises scores and coefficients of size ``[E, H]`` and the ``[E, H, C]``
  messages inside the reference SpMM;
* the **fused kernels** of :mod:`fusegnn.kernels.gat_fused` (``"gas"`` / ``"gar"``; ``"auto"``
  on CUDA): one pass over each target's edges with an online softmax, nothing of size
  ``E`` stored, the dropout mask regenerated in the backward from a counter-based RNG.
  ``"gar"`` runs a two-pass backward over CSR and CSC without atomics (bitwise
  reproducible); ``"gas"`` a one-pass backward with atomics into the sources (no CSC
  needed). Both run the same target-grouped forward: the online softmax needs a target's
  edges together. On the CPU they run only when asked for explicitly, under the Triton
  interpreter (``TRITON_INTERPRET=1``).

Under ``torch.compile`` the op is one ``torch.library`` custom op,
``fusegnn::gat_attention`` (:mod:`fusegnn.sparse.library`), with a backward op that runs
the fused kernels' backward (or, on the reference path, recomputes the composition).

The two agree to rounding, except for the dropout mask, which is drawn from different
random streams (``torch``'s for the reference, Philox keyed by edge and head for the
fused kernels; the fused seed is drawn from torch's default generator, so
``torch.manual_seed`` makes both reproducible).
"""

from __future__ import annotations

from numbers import Real

import torch
from torch import Tensor

from fusegnn.sparse import library, reference
from fusegnn.sparse.dispatch import check_aggregation, resolve_aggregation
from fusegnn.sparse.graph import Graph
from fusegnn.sparse.graph_ref import GraphRef
from fusegnn.sparse.halo import HaloGraph, held_graph, with_halo_rows
from fusegnn.sparse.ops import check_node_tensor, graph_arg

__all__ = ["gat_attention", "gat_layer"]


def _check_score_edge(score_edge: Tensor | None, graph: Graph | GraphRef, reference: Tensor, heads: int | None) -> None:
    """``score_edge`` is ``None`` or ``[E, H]`` (``[E]`` when ``heads`` is ``None``: one
    head, 2-D ``h``) of ``reference``'s dtype (the node scores') on the graph's device; the
    edge count is not checked while it is unknown (under compilation, after a transform)."""
    if score_edge is None:
        return
    if not isinstance(score_edge, Tensor):
        raise TypeError(f"score_edge must be a torch.Tensor or None, got {type(score_edge).__name__}")
    shape = (graph.num_edges,) if heads is None else (graph.num_edges, heads)
    if score_edge.dim() != len(shape) or (graph.num_edges >= 0 and score_edge.size(0) != graph.num_edges) or (
        heads is not None and score_edge.size(1) != heads
    ):
        expected = "[E]" if heads is None else f"[E, {heads}]"
        raise ValueError(
            f"score_edge must be {expected} with one row per edge (E={graph.num_edges}), got {tuple(score_edge.shape)}"
        )
    if score_edge.dtype != reference.dtype:
        raise TypeError(f"score_edge must have the node scores' dtype {reference.dtype}, got {score_edge.dtype}")
    if score_edge.device != graph.device:
        raise ValueError(f"score_edge is on {score_edge.device} but the graph is on {graph.device}")


def attention_options(negative_slope, dropout, training, return_alpha, aggregation) -> float:
    """Check the options GAT's and GATv2's attention ops share; returns the dropout
    probability that applies (``dropout`` in training, else 0)."""
    if isinstance(negative_slope, bool) or not isinstance(negative_slope, Real):
        raise TypeError(f"negative_slope must be a real number, got {type(negative_slope).__name__}")
    if isinstance(dropout, bool) or not isinstance(dropout, Real):
        raise TypeError(f"dropout must be a real number, got {type(dropout).__name__}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if not isinstance(training, bool):
        raise TypeError(f"training must be a bool, got {type(training).__name__}")
    if not isinstance(return_alpha, bool):
        raise TypeError(f"return_alpha must be a bool, got {type(return_alpha).__name__}")
    check_aggregation(aggregation)
    return float(dropout) if training else 0.0


def gat_attention(
    graph: Graph | Tensor,
    h: Tensor,
    score_src: Tensor,
    score_dst: Tensor,
    *,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    training: bool = False,
    aggregation: str = "auto",
    return_alpha: bool = False,
    score_edge: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Multi-head graph attention ``out_i = sum_j alpha_ji h_j`` (see the module docstring).

    Args:
        graph: a :class:`~fusegnn.sparse.Graph` (or an ``edge_index``); edges ``j -> i``.
        h: ``[N_src, H, C]`` source features per head (or ``[N_src, C]`` for one head).
        score_src: ``[N_src, H]`` source scores (``[N_src]`` with a 2-D ``h``).
        score_dst: ``[N_dst, H]`` target scores (``[N_dst]`` with a 2-D ``h``); same dtype
            as ``score_src``.
        negative_slope: LeakyReLU slope.
        dropout: probability of dropping an attention coefficient, in ``[0, 1)``; only
            applied when ``training``.
        training: apply dropout.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"``
            (see :mod:`fusegnn.sparse.dispatch`).
        return_alpha: also return the coefficients actually applied (after dropout),
            ``[E, H]`` (``[E]`` with a 2-D ``h``) in the graph's edge order.
        score_edge: optional per-edge score addend :math:`u` ``[E, H]`` (``[E]`` with a
            2-D ``h``) in the graph's edge order, dtype of the node scores; added to the
            logits before the LeakyReLU (inside the fused kernels).

    Returns:
        ``out`` ``[N_dst, H, C]`` (``[N_dst, C]``), or ``(out, alpha)``. Differentiable
        with respect to ``h``, ``score_src``, ``score_dst`` and ``score_edge`` (and through
        ``alpha``).
        Targets without incoming edges get zeros.

    On a worker's share of a distributed graph (a :class:`~fusegnn.sparse.halo.HaloGraph`)
    ``h`` and ``score_src`` hold the owned nodes' rows; their halo rows are fetched first
    (one exchange for both).
    """
    if not isinstance(h, Tensor):
        raise TypeError(f"h must be a torch.Tensor, got {type(h).__name__}")
    if isinstance(score_src, Tensor):
        graph, h, score_src = with_halo_rows(graph, h, score_src)
    graph = graph_arg(graph, h.size(0) if h.dim() > 0 else None)
    check_node_tensor(h, graph, graph.num_src_nodes, "h", (2, 3))
    single = h.dim() == 2
    score_dims = (1,) if single else (2,)
    check_node_tensor(score_src, graph, graph.num_src_nodes, "score_src", score_dims)
    check_node_tensor(score_dst, graph, graph.num_dst_nodes, "score_dst", score_dims)
    if not single and (score_src.size(1) != h.size(1) or score_dst.size(1) != h.size(1)):
        raise ValueError(
            f"score_src and score_dst must have one score per head: h has H={h.size(1)} heads, "
            f"got score_src {tuple(score_src.shape)} and score_dst {tuple(score_dst.shape)}"
        )
    if score_src.dtype != score_dst.dtype:
        raise TypeError(
            f"score_src and score_dst must have the same dtype, got {score_src.dtype} and {score_dst.dtype}"
        )
    _check_score_edge(score_edge, graph, score_src, None if single else h.size(1))
    p = attention_options(negative_slope, dropout, training, return_alpha, aggregation)
    if isinstance(graph, GraphRef):
        out, alpha = library.gat_attention(
            graph, h, score_src, score_dst, float(negative_slope), p, return_alpha, aggregation, score_edge
        )
        return (out, alpha) if return_alpha else out

    backend = resolve_aggregation(aggregation, graph, h, score_src, score_dst, op="gat")
    if backend.name == "reference":
        out, alpha = reference.gat_attention(
            graph, h, score_src, score_dst, float(negative_slope), p, score_edge=score_edge
        )
    else:
        from fusegnn.kernels.gat_fused import fused_gat_attention

        if single:
            out, alpha = fused_gat_attention(
                graph, h.unsqueeze(1), score_src.unsqueeze(1), score_dst.unsqueeze(1),
                float(negative_slope), p, return_alpha=return_alpha, aggregation=backend.name,
                score_edge=score_edge.unsqueeze(1) if score_edge is not None else None,
            )
            out = out.squeeze(1)
            alpha = alpha.squeeze(1) if alpha is not None else None
        else:
            out, alpha = fused_gat_attention(
                graph, h, score_src, score_dst, float(negative_slope), p,
                return_alpha=return_alpha, aggregation=backend.name, score_edge=score_edge,
            )
    return (out, alpha) if return_alpha else out


def gat_layer(
    graph: Graph | Tensor,
    h: Tensor,
    att_src: Tensor,
    att_dst: Tensor,
    bias: Tensor | None = None,
    *,
    concat: bool = True,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    training: bool = False,
    aggregation: str = "auto",
    score_edge: Tensor | None = None,
) -> Tensor:
    r"""The sparse part of a ``GATConv`` layer as one op, from the transformed features to
    the layer's output:

    .. math::
        s^{(k)}_j = \mathbf{a}^{(k)\top}_s h^{(k)}_j, \quad t^{(k)}_i = \mathbf{a}^{(k)\top}_t h^{(k)}_i,
        \quad o^{(k)}_i = \sum_{j \to i} \alpha^{(k)}_{ji} h^{(k)}_j, \quad
        y_i = \big\Vert_{k} o^{(k)}_i + b \;\;\text{or}\;\; \tfrac{1}{H} \sum_k o^{(k)}_i + b

    with :math:`\alpha` as in :func:`gat_attention`. On the fused backends it is one
    autograd node (scores, attention, head concatenation or mean and bias in one
    forward and one backward); on the reference it is the composition.

    Args:
        graph: a square :class:`~fusegnn.sparse.Graph` (or ``edge_index``); edges ``j -> i``.
        h: ``[N, H, C]`` transformed node features.
        att_src, att_dst: ``[1, H, C]`` attention vectors :math:`\mathbf{a}_s, \mathbf{a}_t`.
        bias: ``[H * C]`` (``concat``) or ``[C]``, or ``None``.
        concat: concatenate the heads (``[N, H * C]``) or average them (``[N, C]``).
        negative_slope, dropout, training, aggregation, score_edge: as for
            :func:`gat_attention` (``score_edge`` ``[E, H]``, h's dtype).

    On a worker's share of a distributed graph (a :class:`~fusegnn.sparse.halo.HaloGraph`,
    whose targets are its first sources) ``h`` holds the owned nodes' rows: their halo
    rows are fetched, and the layer runs as :func:`gat_attention` with the target scores
    of the owned rows.
    """
    held = held_graph(graph)
    if isinstance(held, HaloGraph) and not torch.compiler.is_compiling():
        return _halo_gat_layer(held, h, att_src, att_dst, bias, concat=concat, negative_slope=negative_slope,
                               dropout=dropout, training=training, aggregation=aggregation,
                               score_edge=score_edge)
    graph = graph_arg(graph, h.size(0) if isinstance(h, Tensor) and h.dim() > 0 else None)
    check_node_tensor(h, graph, graph.num_src_nodes, "h", (3,))
    if graph.is_bipartite:
        raise ValueError("gat_layer needs a square graph (the target scores read h); use gat_attention")
    H, C = h.size(1), h.size(2)
    for name, att in (("att_src", att_src), ("att_dst", att_dst)):
        if not isinstance(att, Tensor) or att.shape != (1, H, C) or att.dtype != h.dtype or att.device != h.device:
            raise ValueError(f"{name} must be a [1, {H}, {C}] tensor of h's dtype and device")
    width = H * C if concat else C
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (width,) or bias.device != h.device):
        raise ValueError(f"bias must be a [{width}] tensor on h's device, got {getattr(bias, 'shape', bias)}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    _check_score_edge(score_edge, graph, h, H)
    p = float(dropout) if training else 0.0
    if isinstance(graph, GraphRef):  # under torch.compile: the scores, then one fusegnn::gat_attention op
        score_src, score_dst = (h * att_src).sum(dim=-1), (h * att_dst).sum(dim=-1)
        out, _ = library.gat_attention(
            graph, h, score_src, score_dst, float(negative_slope), p, False, check_aggregation(aggregation),
            score_edge,
        )
    else:
        backend = resolve_aggregation(aggregation, graph, h, op="gat")
        if backend.name != "reference":
            from fusegnn.kernels.gat_fused import fused_gat_layer

            return fused_gat_layer(
                graph, h, att_src, att_dst, bias, concat=bool(concat),
                negative_slope=float(negative_slope), dropout=p, aggregation=backend.name, score_edge=score_edge,
            )
        score_src, score_dst = (h * att_src).sum(dim=-1), (h * att_dst).sum(dim=-1)
        out, _ = reference.gat_attention(graph, h, score_src, score_dst, float(negative_slope), p, score_edge=score_edge)
    out = out.reshape(-1, H * C) if concat else out.mean(dim=1)
    return out if bias is None else out + bias


def _halo_gat_layer(graph: HaloGraph, h: Tensor, att_src: Tensor, att_dst: Tensor, bias: Tensor | None, *,
                    concat: bool, negative_slope: float, dropout: float, training: bool,
                    aggregation: str, score_edge: Tensor | None = None) -> Tensor:
    """:func:`gat_layer` on a worker's share of a distributed graph: the source scores of
    every source (owned and halo) from the exchanged ``h``, the target scores from the
    owned rows, then :func:`gat_attention` (the fused layer needs a square graph)."""
    graph.check_owned_rows(h, "h")
    if not isinstance(h, Tensor) or h.dim() != 3:
        raise ValueError(f"h must be [N, H, C], got shape {tuple(getattr(h, 'shape', ()))}")
    H, C = h.size(1), h.size(2)
    for name, att in (("att_src", att_src), ("att_dst", att_dst)):
        if not isinstance(att, Tensor) or att.shape != (1, H, C) or att.dtype != h.dtype or att.device != h.device:
            raise ValueError(f"{name} must be a [1, {H}, {C}] tensor of h's dtype and device")
    local, h_all = with_halo_rows(graph, h)
    out = gat_attention(
        local, h_all, (h_all * att_src).sum(dim=-1), (h * att_dst).sum(dim=-1), negative_slope=negative_slope,
        dropout=dropout, training=training, aggregation=aggregation, score_edge=score_edge,
    )
    out = out.reshape(-1, H * C) if concat else out.mean(dim=1)
    if bias is not None:
        width = H * C if concat else C
        if not isinstance(bias, Tensor) or bias.shape != (width,) or bias.device != h.device:
            raise ValueError(f"bias must be a [{width}] tensor on h's device, got {getattr(bias, 'shape', bias)}")
        out = out + bias
    return out
