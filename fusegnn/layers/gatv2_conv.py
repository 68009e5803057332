r"""GATv2 (Brody et al., "How Attentive are Graph Attention Networks?", ICLR 2022), drop-in
for PyG's ``GATv2Conv``."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from fusegnn.layers._attention_weights import attention_weights
from fusegnn.layers._utils import (
    bipartite_graph_for,
    channel_pair,
    check_attention_args,
    check_dtype,
    check_linear_input,
    glorot_,
    graph_for,
    input_linear,
    node_pair,
)
from fusegnn.sparse import Graph, gatv2_attention
from fusegnn.sparse.dispatch import check_aggregation
from fusegnn.sparse.attention_loops import attention_self_loop_edge_attr, attention_self_loops

__all__ = ["GATv2Conv"]


def _reset_linear(lin: nn.Linear | None) -> None:
    """PyG's ``Linear(..., weight_initializer='glorot')``: Glorot weight, bias uniform in
    :math:`\\pm 1/\\sqrt{\\text{in}}` (a lazy one is initialised when materialised)."""
    if lin is None or is_lazy(lin.weight):
        return
    glorot_(lin.weight)
    if lin.bias is not None:
        bound = 1.0 / math.sqrt(lin.weight.size(1))
        with torch.no_grad():
            lin.bias.uniform_(-bound, bound)


class GATv2Conv(nn.Module):
    r"""The GATv2 operator, whose attention ranking depends on the query node.

    For each head :math:`k` with source / target weights :math:`\Theta_s, \Theta_t`
    (``lin_l``, ``lin_r``; one matrix with ``share_weights``), attention vector
    :math:`\mathbf{a}` (``att``) and edge weights :math:`\Theta_e` (``lin_edge``):

    .. math::
        s_{ji} = \mathbf{a}^{\top} \mathrm{LeakyReLU}\big(\Theta_s \mathbf{x}_j
        + \Theta_t \mathbf{x}_i + \Theta_e \mathbf{e}_{ji}\big), \qquad
        \alpha_{ji} = \mathrm{softmax}_{j \in \mathcal{N}(i) \cup \{i\}}(s_{ji})

    .. math::
        \mathbf{x}'_i = \big\Vert_{k=1}^{H} \sum_{j} \alpha^{(k)}_{ji} \Theta^{(k)}_s \mathbf{x}_j
        \;\;(\text{or the mean over heads}) \; + \; \Theta_{res} \mathbf{x}_i \; + \; \mathbf{b}

    (PyG's parameter names and shapes: ``lin_l``, ``lin_r`` with biases when ``bias``,
    ``att`` ``[1, H, C]``, ``lin_edge`` without bias, ``res`` without bias, ``bias``.)
    The attention runs as :func:`~fusegnn.sparse.gatv2_attention`: on CUDA fused kernels
    (scores, LeakyReLU, online softmax and aggregation in one pass over each target's
    edges, fused backward), the reference composition otherwise.

    Args:
        in_channels: input width, a pair ``(source, target)`` of widths for bipartite
            inputs, or ``-1`` (in either place) to infer it at the first forward (create the
            optimizer after that call).
        out_channels: width of each head.
        heads: number of heads :math:`H`.
        concat: concatenate the heads (``[N, H * out_channels]``) or average them.
        negative_slope: LeakyReLU slope.
        dropout: dropout probability on the attention coefficients (training only).
        add_self_loops: replace the self-loops by exactly one per node (bipartite: one per
            node ``i < min(N_src, N_dst)``, as PyG's).
        edge_dim: edge feature width (``None``: no edge features).
        fill_value: edge features of the added self-loops: a number, a tensor, or the
            reduction ``"add"``, ``"mean"``, ``"min"``, ``"max"``, ``"mul"`` of each node's
            incoming edges' features (PyG's).
        bias: learn biases (the layer's and ``lin_l`` / ``lin_r``'s, as PyG).
        share_weights: one matrix for sources and targets (``lin_r`` is ``lin_l``).
        residual: add a learned skip connection ``res(x_dst)``.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"``.

    ``forward(x, edge_index, edge_attr=None, return_attention_weights=None)``:
    ``x`` is ``[N, F]`` or a pair ``(x_src, x_dst)`` (``x_dst`` required); the graph any
    input :func:`~fusegnn.sparse.graph.coerce_graph` takes (``edge_index``, a
    :class:`~fusegnn.sparse.Graph`, a ``torch.sparse`` ``adj_t``; edge weights are
    ignored). ``edge_attr`` ``[E, edge_dim]`` (or ``[E]``) follows the graph's edge order.
    With ``return_attention_weights`` truthy it returns ``(out, (edge_index, alpha))``
    with the self-loops included and ``alpha`` ``[E, H]`` (computed by the reference
    composition); for a ``torch.sparse`` input, as PyG, ``(out, (adj, alpha))`` with
    ``adj`` the processed ``[N_dst, N_src, H]`` sparse matrix holding ``alpha`` in its
    row-major order (:func:`~fusegnn.layers._attention_weights.attention_weights`). Under ``torch.compile``, edge features with ``add_self_loops=True`` are
    not supported (their count is data-dependent): add the loops beforehand.
    """

    def __init__(
        self,
        in_channels: int | tuple[int, int],
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        add_self_loops: bool = True,
        edge_dim: int | None = None,
        fill_value: float | Tensor | str = "mean",
        bias: bool = True,
        share_weights: bool = False,
        residual: bool = False,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        check_attention_args("GATv2Conv", heads, dropout, edge_dim)
        if isinstance(out_channels, bool) or not isinstance(out_channels, int) or out_channels < 1:
            raise ValueError(f"GATv2Conv: out_channels must be an int >= 1, got {out_channels!r}")
        in_src, in_dst = channel_pair(in_channels, "GATv2Conv")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.concat = concat
        self.negative_slope = negative_slope
        self.dropout = dropout
        self.add_self_loops = add_self_loops
        self.edge_dim = edge_dim
        self.fill_value = fill_value
        self.share_weights = share_weights
        self.residual = residual
        self.aggregation = check_aggregation(aggregation)
        width = heads * out_channels
        self.lin_l = input_linear(in_src, width, "GATv2Conv", bias=bias)
        self.lin_r = self.lin_l if share_weights else input_linear(in_dst, width, "GATv2Conv", bias=bias)
        self.att = nn.Parameter(torch.empty(1, heads, out_channels))
        self.lin_edge = nn.Linear(edge_dim, width, bias=False) if edge_dim is not None else None
        total = width if concat else out_channels
        self.res = input_linear(in_dst, total, "GATv2Conv") if residual else None
        self.bias = nn.Parameter(torch.empty(total)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.lin_l, self.lin_r, self.lin_edge, self.res):
            _reset_linear(lin)
        glorot_(self.att)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _graph(self, x, x_src: Tensor, x_dst: Tensor | None, edge_index) -> Graph:
        if isinstance(x, Tensor):
            return graph_for(x, edge_index, type(self).__name__)
        if x_dst is None:
            raise ValueError(
                "GATv2Conv: x_dst (x[1]) must be a tensor: the scores read the targets' own features"
            )
        return bipartite_graph_for(x_src, x_dst.size(0), edge_index, type(self).__name__)

    def _edge_features(self, edge_attr: Tensor, graph: Graph) -> Tensor:
        if self.lin_edge is None:
            raise ValueError("GATv2Conv: edge_attr was given but the layer was built without edge_dim")
        if not isinstance(edge_attr, Tensor) or not edge_attr.is_floating_point():
            raise TypeError(f"GATv2Conv: edge_attr must be a floating tensor, got {getattr(edge_attr, 'dtype', edge_attr)!r}")
        if edge_attr.dim() == 1:
            edge_attr = edge_attr.view(-1, 1)
        if edge_attr.dim() != 2 or edge_attr.size(1) != self.edge_dim:
            raise ValueError(
                f"GATv2Conv: edge_attr must have shape [num_edges, {self.edge_dim}], got {tuple(edge_attr.shape)}"
            )
        if graph.num_edges >= 0 and edge_attr.size(0) != graph.num_edges:
            raise ValueError(
                f"GATv2Conv: edge_attr has {edge_attr.size(0)} rows but the graph has {graph.num_edges} edges"
            )
        if edge_attr.device != graph.device:
            raise ValueError(f"GATv2Conv: edge_attr is on {edge_attr.device} but the graph is on {graph.device}")
        check_dtype(edge_attr, self.lin_edge.weight.dtype, "GATv2Conv", "edge_attr")
        return edge_attr

    def forward(
        self,
        x: Tensor | tuple[Tensor, Tensor],
        edge_index: Graph | Tensor,
        edge_attr: Tensor | None = None,
        return_attention_weights: bool | None = None,
    ):
        name = type(self).__name__
        x_src, x_dst = node_pair(x, name)
        graph = self._graph(x, x_src, x_dst, edge_index)
        bipartite_x = x_dst is not x_src
        if self.res is not None:  # (PyG's order: a lazy layer draws res, lin_l, lin_r)
            check_linear_input(x_dst, self.res, self, "x_dst" if bipartite_x else "x")
        check_linear_input(x_src, self.lin_l, self, "x_src" if bipartite_x else "x")
        if bipartite_x or self.lin_r is not self.lin_l:
            check_linear_input(x_dst, self.lin_r, self, "x_dst" if bipartite_x else "x")
        if edge_attr is not None:
            edge_attr = self._edge_features(edge_attr, graph)
        if self.add_self_loops:  # PyG's: loops i -> i for i < min(N_src, N_dst), old loops dropped
            if edge_attr is not None:
                edge_attr = attention_self_loop_edge_attr(graph, edge_attr, self.fill_value)
            graph = attention_self_loops(graph)
        H, C = self.heads, self.out_channels
        x_l = self.lin_l(x_src).view(-1, H, C)
        x_r = x_l if (self.share_weights and not bipartite_x) else self.lin_r(x_dst).view(-1, H, C)
        e = self.lin_edge(edge_attr).view(-1, H, C) if edge_attr is not None else None
        result = gatv2_attention(  # att in the features' dtype: half under autocast, as they are
            graph, x_l, x_r, self.att.to(x_l.dtype), e,
            negative_slope=self.negative_slope, dropout=self.dropout, training=self.training,
            aggregation=self.aggregation, return_alpha=bool(return_attention_weights),
        )
        out, alpha = result if return_attention_weights else (result, None)
        out = out.reshape(-1, H * C) if self.concat else out.mean(dim=1)
        if self.res is not None:
            out = out + self.res(x_dst)
        if self.bias is not None:
            out = out + self.bias
        if return_attention_weights:
            return out, attention_weights(edge_index, graph, alpha)
        return out

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, heads={self.heads}, "
            f"share_weights={self.share_weights}, aggregation={self.aggregation!r}"
        )
