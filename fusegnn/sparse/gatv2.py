r"""GATv2 graph attention as one op: per-edge scores, LeakyReLU, edge softmax, dropout, SpMM.

For every head and edge :math:`j \to i` (Brody et al., "How Attentive are Graph
Attention Networks?", ICLR 2022):

.. math::
    s_{ji} = a \cdot \mathrm{LeakyReLU}\big(x^l_j + x^r_i \,(+\, e_{ji})\big), \qquad
    \alpha_{ji} = \operatorname{dropout}_p\Big(\operatorname{softmax}_{j \to i}\, s_{ji}\Big),
    \qquad
    \mathrm{out}_i = \sum_{j \to i} \alpha_{ji} \, x^l_j

with :math:`x^l = \Theta_s x_{src}`, :math:`x^r = \Theta_t x_{dst}` and :math:`e` the
projected edge features (PyG's ``GATv2Conv``). Unlike GAT's, the score is no sum of a
source and a target term, so it cannot be precomputed per node.

Two implementations:

* the **reference composition** of :func:`fusegnn.sparse.reference.gatv2_attention`
  (``aggregation="reference"``, and ``"auto"`` off CUDA), which materialises ``[E, H, C]``;
* the **fused kernels** of :mod:`fusegnn.kernels.gatv2_fused` (``"gar"`` / ``"gas"``;
  ``"auto"`` on CUDA): one pass over each target's edges with an online softmax, a fused
  backward that recomputes the scores, nothing of size ``[E, H, C]`` stored but the edge
  features' own gradient. ``"gar"`` is atomic-free (deterministic mode's choice);
  ``"gas"`` scatters the source gradient with atomics. On the CPU they run only when
  asked for, under the Triton interpreter (``TRITON_INTERPRET=1``).

Dropout on the fused path regenerates its keep mask from a counter-based RNG (as the
fused GAT kernels do); ``return_alpha=True`` runs the reference (the fused kernels do not
return the coefficients), which :func:`fusegnn.sparse.dispatch.last_decision` records.

Under ``torch.compile`` the op is one ``torch.library`` custom op,
``fusegnn::gatv2_attention`` (:mod:`fusegnn.sparse.library`).

:func:`gatv2_projected_attention` takes the layer's inputs and projections instead,
:math:`x^l = x_{src} W_l^\top + b_l` and :math:`x^r = x_{dst} W_r^\top + b_r`. When an input is
narrow (:func:`projects`: ``K`` at most :data:`PROJECTION_MAX_RATIO` of the ``H * C``
padded row it stands for), the fused kernels gather the ``K``-wide input rows per edge
and project them in registers instead of gathering ``x^l_j`` (forward, backward pass R)
and ``x^r_i`` (pass C of ``"gar"``); the result and every gradient are the plain op's
(to float32 rounding). Everywhere else -- the reference, ``return_alpha``, inputs other
than float32, autocast, a distributed (halo) graph, ``torch.compile`` (its custom op
takes the projected rows) -- it forms :math:`x^l`, :math:`x^r` and runs :func:`gatv2_attention`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusegnn.kernels._edge_utils import padded_channels
from fusegnn.sparse import library, reference
from fusegnn.sparse.dispatch import needs_grad, note_path, resolve_aggregation
from fusegnn.sparse.graph import Graph
from fusegnn.sparse.graph_ref import GraphRef
from fusegnn.sparse.halo import HaloGraph, held_graph, with_halo_rows
from fusegnn.sparse.ops import check_node_tensor, graph_arg
from fusegnn.sparse.gat import attention_options

__all__ = ["gatv2_attention", "gatv2_projected_attention", "projects"]


def _check_like(t: Tensor | None, name: str, shape: tuple, x_l: Tensor, like: str = "x_l") -> None:
    """``t`` is a tensor of ``shape`` (``-1``: any size) with ``x_l``'s dtype and device
    (``like``: ``x_l``'s name in the messages)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    fits = t.dim() == len(shape) and all(want < 0 or got == want for got, want in zip(t.shape, shape))
    if not fits:
        want = ", ".join("?" if s < 0 else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{want}], got {tuple(t.shape)}")
    if t.dtype != x_l.dtype:
        raise TypeError(f"{name} must have {like}'s dtype {x_l.dtype}, got {t.dtype}")
    if t.device != x_l.device:
        raise ValueError(f"{name} is on {t.device} but {like} is on {x_l.device}; move them to the same device")


def gatv2_attention(
    graph: Graph | Tensor,
    x_l: Tensor,
    x_r: Tensor,
    att: Tensor,
    edge_attr: Tensor | None = None,
    *,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    training: bool = False,
    aggregation: str = "auto",
    return_alpha: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Multi-head GATv2 attention ``out_i = sum_j alpha_ji x_l[j]`` (see the module docstring).

    Args:
        graph: a :class:`~fusegnn.sparse.Graph` (or an ``edge_index``); edges ``j -> i``;
            bipartite graphs are fine. On a worker's share of a distributed graph (a
            :class:`~fusegnn.sparse.halo.HaloGraph`) ``x_l`` and ``x_r`` hold the owned
            nodes' rows, and the halo rows of ``x_l`` are fetched first.
        x_l: ``[N_src, H, C]`` source features :math:`\Theta_s x_j` (also the messages).
        x_r: ``[N_dst, H, C]`` target features :math:`\Theta_t x_i`.
        att: ``[1, H, C]`` (or ``[H, C]``) attention vector :math:`a`.
        edge_attr: ``[E, H, C]`` projected edge features in the graph's edge order, or ``None``.
        negative_slope: LeakyReLU slope.
        dropout: probability of dropping a coefficient, in ``[0, 1)``; only when ``training``.
        training: apply dropout.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"``
            (see :mod:`fusegnn.sparse.dispatch`).
        return_alpha: also return the coefficients after dropout, ``[E, H]`` in the
            graph's edge order (runs the reference composition).

    Returns:
        ``out`` ``[N_dst, H, C]``, or ``(out, alpha)``; differentiable with respect to
        ``x_l``, ``x_r``, ``att`` and ``edge_attr``. Targets without incoming edges get zeros.
    """
    if not isinstance(x_l, Tensor):
        raise TypeError(f"x_l must be a torch.Tensor, got {type(x_l).__name__}")
    # a worker's share of a distributed graph: x_l holds the owned sources, their halo fetched
    graph, x_l = with_halo_rows(graph, x_l)
    graph = graph_arg(graph, x_l.size(0) if x_l.dim() > 0 else None)
    check_node_tensor(x_l, graph, graph.num_src_nodes, "x_l", (3,))
    H, C = x_l.size(1), x_l.size(2)
    check_node_tensor(x_r, graph, graph.num_dst_nodes, "x_r", (3,))
    _check_like(x_r, "x_r", (-1, H, C), x_l)
    _check_like(att, "att", (H, C) if isinstance(att, Tensor) and att.dim() == 2 else (1, H, C), x_l)
    if edge_attr is not None:
        _check_like(edge_attr, "edge_attr", (graph.num_edges, H, C), x_l)
    p = attention_options(negative_slope, dropout, training, return_alpha, aggregation)
    slope = float(negative_slope)
    if isinstance(graph, GraphRef):
        out, alpha = library.gatv2_attention(graph, x_l, x_r, att, edge_attr, slope, p, return_alpha, aggregation)
        return (out, alpha) if return_alpha else out

    backend = resolve_aggregation(aggregation, graph, x_l, x_r, op="gatv2")
    if backend.name != "reference" and return_alpha:
        note_path("reference", f"return_alpha is not fused: {backend.name} hands GATv2 to the reference")
    if backend.name == "reference" or return_alpha:
        out, alpha = reference.gatv2_attention(graph, x_l, x_r, att, edge_attr, slope, p)
        return (out, alpha) if return_alpha else out
    from fusegnn.kernels.gatv2_fused import fused_gatv2_attention

    return fused_gatv2_attention(graph, x_l, x_r, att, edge_attr, slope, p, aggregation=backend.name)


#: a side is projected in the kernels when its input width ``K`` is at most this fraction of
#: the padded ``H * C`` row it replaces: the per-edge gather shrinks from ``H * C`` to ``K``
#: floats while the ``tl.dot`` adds ``K * H * C`` multiply-adds per edge
PROJECTION_MAX_RATIO = 0.5
#: dtypes the projected kernels take (float64 and half inputs keep the gathered rows)
PROJECTED_DTYPES = (torch.float32,)


def projects(in_channels: int, heads: int, channels: int) -> bool:
    """Whether the fused kernels project a side whose input has ``in_channels`` features
    (heads x channels of the attention) instead of gathering its rows: the input fits the
    register tile (:func:`~fusegnn.kernels.gatv2_fused.projectable_inputs`) and is at most
    :data:`PROJECTION_MAX_RATIO` of the padded row width."""
    from fusegnn.kernels.gatv2_fused import projectable_inputs

    return projectable_inputs(in_channels) and in_channels <= PROJECTION_MAX_RATIO * heads * padded_channels(channels)


def _check_projection(x: Tensor, weight: Tensor, bias: Tensor | None, width: int, names: tuple[str, str, str]) -> None:
    """``x`` ``[N, K]`` floating, ``weight`` ``[width, K]`` and ``bias`` ``[width]`` (or
    ``None``) of ``x``'s dtype and device."""
    x_name, w_name, b_name = names
    if not isinstance(x, Tensor):
        raise TypeError(f"{x_name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{x_name} must be a floating tensor, got dtype {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{x_name} must have 2 dimensions [num_nodes, in_channels], got shape {tuple(x.shape)}")
    _check_like(weight, w_name, (width, x.size(1)), x, x_name)
    if bias is not None:
        _check_like(bias, b_name, (width,), x, x_name)


def gatv2_projected_attention(
    graph: Graph | Tensor,
    x_src: Tensor,
    weight_l: Tensor,
    bias_l: Tensor | None,
    x_dst: Tensor,
    weight_r: Tensor,
    bias_r: Tensor | None,
    att: Tensor,
    edge_attr: Tensor | None = None,
    *,
    negative_slope: float = 0.2,
    dropout: float = 0.0,
    training: bool = False,
    aggregation: str = "auto",
    return_alpha: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    r""":func:`gatv2_attention` of ``x_l = x_src W_l^T + b_l`` and ``x_r = x_dst W_r^T + b_r``
    (PyG's ``lin_l`` / ``lin_r``), with narrow inputs projected inside the fused kernels
    (see the module docstring).

    Args:
        graph: as :func:`gatv2_attention`'s.
        x_src: ``[N_src, K_l]`` source inputs; ``weight_l`` ``[H * C, K_l]``, ``bias_l``
            ``[H * C]`` or ``None``.
        x_dst: ``[N_dst, K_r]`` target inputs; ``weight_r`` ``[H * C, K_r]``, ``bias_r``
            ``[H * C]`` or ``None``. Shared weights on one node set: pass the same
            ``x_src``, ``weight_l`` and ``bias_l`` objects again (``x_r`` is then ``x_l``).
        att: ``[1, H, C]`` (or ``[H, C]``) attention vector; it fixes ``H`` and ``C``.
        edge_attr: ``[E, H, C]`` projected edge features in the graph's edge order, or ``None``.
        negative_slope, dropout, training, aggregation, return_alpha: as :func:`gatv2_attention`'s
            (dropout draws the same mask for the same seed either way).

    Returns:
        ``out`` ``[N_dst, H, C]`` (or ``(out, alpha)``), differentiable with respect to
        every tensor argument.
    """
    if not isinstance(att, Tensor) or att.dim() not in (2, 3):
        raise ValueError(f"att must be a [1, H, C] or [H, C] tensor, got {getattr(att, 'shape', type(att).__name__)}")
    heads, channels = att.shape[-2], att.shape[-1]
    width = heads * channels
    _check_projection(x_src, weight_l, bias_l, width, ("x_src", "weight_l", "bias_l"))
    _check_like(x_dst, "x_dst", (-1, -1), x_src, "x_src")
    _check_projection(x_dst, weight_r, bias_r, width, ("x_dst", "weight_r", "bias_r"))
    shared = x_dst is x_src and weight_r is weight_l and bias_r is bias_l
    options = dict(negative_slope=negative_slope, dropout=dropout, training=training, aggregation=aggregation)

    def projected(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return torch.nn.functional.linear(x, weight, bias).view(-1, heads, channels)

    def unprojected(graph):
        x_l = projected(x_src, weight_l, bias_l)
        x_r = x_l if shared else projected(x_dst, weight_r, bias_r)
        return gatv2_attention(graph, x_l, x_r, att, edge_attr, **options, return_alpha=return_alpha)

    # the eager single-process fused path only: a halo graph and torch.compile take x_l's rows,
    # autocast its half-precision x_l
    eligible = (x_src.dtype in PROJECTED_DTYPES and not return_alpha and not torch.compiler.is_compiling()
                and not torch.is_autocast_enabled(x_src.device.type)
                and not isinstance(held_graph(graph), (HaloGraph, GraphRef)))
    project_l = projects(x_src.size(1), heads, channels)
    project_r = projects(x_dst.size(1), heads, channels)
    if not eligible or not (project_l or project_r):
        return unprojected(graph)
    graph = graph_arg(graph, x_src.size(0))
    check_node_tensor(x_src, graph, graph.num_src_nodes, "x_src", (2,))
    check_node_tensor(x_dst, graph, graph.num_dst_nodes, "x_dst", (2,))
    p = attention_options(negative_slope, dropout, training, return_alpha, aggregation)
    # the decision of the plain op on these x_l / x_r (shape, dtype and device stand-ins)
    like_l = x_src.new_empty(()).expand(graph.num_src_nodes, heads, channels)
    like_r = x_src.new_empty(()).expand(graph.num_dst_nodes, heads, channels)
    records = needs_grad(x_src, weight_l, bias_l, x_dst, weight_r, bias_r, att, edge_attr)
    backend = resolve_aggregation(aggregation, graph, like_l, like_r, op="gatv2", records_backward=records)
    if backend.name not in ("gar", "gas") or not (project_l or (project_r and backend.name == "gar")):
        return unprojected(graph)
    _check_like(att, "att", (heads, channels) if att.dim() == 2 else (1, heads, channels), x_src, "x_src")
    if edge_attr is not None:
        _check_like(edge_attr, "edge_attr", (graph.num_edges, heads, channels), x_src, "x_src")
    from fusegnn.kernels.gatv2_fused import fused_gatv2_projected_attention

    return fused_gatv2_projected_attention(
        graph, x_src, weight_l, bias_l, x_dst, weight_r, bias_r, att, edge_attr, float(negative_slope), p,
        aggregation=backend.name, project_l=project_l, project_r=project_r,
    )
