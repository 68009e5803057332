r"""Graph transformer layer (Shi et al., 2021), drop-in for PyG's ``TransformerConv``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.layers._attention_weights import attention_weights
from fusegnn.layers._utils import (
    bipartite_graph_for,
    check_attention_args,
    check_edge_features,
    check_linear_input,
    graph_for,
    input_linear,
    node_pair,
)
from fusegnn.sparse import Graph, edge_aggregate, edge_index_of, edge_softmax, sddmm, spmm
from fusegnn.sparse.dispatch import check_aggregation

__all__ = ["TransformerConv"]


def _query_edge_scores(graph: Graph, query: Tensor, edge_attr: Tensor, lin_edge: nn.Linear,
                       edge_values: Tensor) -> Tensor:
    r"""The edge part of the attention logits, :math:`q_i \cdot e'_{ji}` per head: ``[E, H]``
    from ``query`` ``[N_dst, H, C]``, the edge features ``edge_attr`` ``[E, D_e]`` and their
    transform ``edge_values`` :math:`e'_{ji} = W_e e_{ji}` ``[E, H, C]`` (``lin_edge``, no
    bias; the graph's edge order). Plain differentiable tensor ops (a gather).

    With :math:`W_e` viewed per head as ``[H, C, D_e]``,
    :math:`q_i \cdot W_e e_{ji} = (W_e^\top q_i) \cdot e_{ji}`: when ``D_e < C`` the queries
    are projected into the edge-feature space first (``[N_dst, H, D_e]``), so the per-edge
    gather holds ``E x H x D_e`` values instead of ``E x H x C``."""
    dst = edge_index_of(graph)[1].long()
    heads, channels = query.shape[1:]
    edge_dim = edge_attr.size(-1)
    if edge_dim < channels:
        # weight and edge features in the queries' dtype: half under autocast, as PyG's
        # lin_edge(e) is there
        weight = lin_edge.weight.view(heads, channels, edge_dim).to(query.dtype)
        projected = torch.einsum("nhc,hcd->nhd", query, weight)
        return (projected.index_select(0, dst) * edge_attr.to(query.dtype).unsqueeze(1)).sum(dim=-1)
    return (query.index_select(0, dst) * edge_values).sum(dim=-1)


class TransformerConv(nn.Module):
    r"""The graph transformer operator, multi-head dot-product attention over each
    target's incoming edges.

    For each head :math:`k` (index dropped) with :math:`C` = ``out_channels``:

    .. math::
        \mathbf{q}_i = \mathbf{W}_q \mathbf{x}_i + \mathbf{b}_q, \quad
        \mathbf{k}_j = \mathbf{W}_k \mathbf{x}_j + \mathbf{b}_k, \quad
        \mathbf{v}_j = \mathbf{W}_v \mathbf{x}_j + \mathbf{b}_v, \quad
        \mathbf{e}'_{ji} = \mathbf{W}_e \mathbf{e}_{ji}

    .. math::
        \alpha_{ji} = \operatorname{softmax}_{j \to i}\left(
            \frac{\mathbf{q}_i^\top (\mathbf{k}_j + \mathbf{e}'_{ji})}{\sqrt{C}}\right),
        \qquad
        \mathbf{o}_i = \sum_{j \to i} \alpha_{ji} (\mathbf{v}_j + \mathbf{e}'_{ji})

    (the :math:`\mathbf{e}'` terms only with ``edge_dim``), heads concatenated or averaged
    (``concat``), then with ``root_weight`` the skip :math:`\mathbf{r}_i = \mathbf{W}_r
    \mathbf{x}_i + \mathbf{b}_r`: :math:`\mathbf{x}'_i = \mathbf{o}_i + \mathbf{r}_i`, or with
    ``beta`` the gated :math:`\beta_i \mathbf{r}_i + (1 - \beta_i) \mathbf{o}_i`,
    :math:`\beta_i = \sigma(\mathbf{w}_\beta^\top [\mathbf{o}_i, \mathbf{r}_i,
    \mathbf{o}_i - \mathbf{r}_i])`. Attention dropout drops coefficients after the softmax.

    The node part is the op path of sparse attention: ``sddmm(graph, k, q, "dot")`` ->
    :func:`~fusegnn.sparse.edge_softmax` -> :func:`~fusegnn.sparse.spmm` with per-head
    weights ``[E, H]``. With edge features the logits gain
    :math:`\mathbf{q}_i \cdot \mathbf{e}'_{ji}` (a gather, :func:`_query_edge_scores`) and
    the output :math:`\sum_j \alpha_{ji} (\mathbf{v}_j + \mathbf{e}'_{ji})` is one fused
    :func:`~fusegnn.sparse.edge_aggregate` (no ``[E, H, C]`` message tensor).

    Args:
        in_channels: input width, ``-1`` (inferred at the first forward) or a pair
            ``(in_src, in_dst)`` for bipartite inputs: keys and values read sources,
            queries and the skip read targets.
        out_channels: width of each head.
        heads: number of heads :math:`H`.
        concat: concatenate heads (``[N, H * out_channels]``) or average them.
        beta: gate the skip connection (only with ``root_weight``; adds ``lin_beta``).
        dropout: dropout probability on the attention coefficients (training only).
        edge_dim: edge feature width (adds ``lin_edge``, no bias), or ``None``.
        bias: biases of ``lin_key``, ``lin_query``, ``lin_value`` and ``lin_skip``.
        root_weight: add the skip :math:`\mathbf{W}_r \mathbf{x}_i` (``lin_skip``, which
            exists either way, as in PyG).
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"`` for the sparse ops.

    ``forward(x, edge_index, edge_attr=None, return_attention_weights=None)``:
    ``x`` ``[N, in]`` or a pair ``(x_src, x_dst)``; the graph as for
    :class:`~fusegnn.layers.GATConv` (edge weights ignored); ``edge_attr``
    ``[E, edge_dim]`` in the graph's edge order (required with ``edge_dim``). Returns the
    new features, or with ``return_attention_weights`` a bool (``True`` or ``False``: PyG's
    ``TransformerConv`` tests for a bool, not for truth) ``(out, (edge_index, alpha))``,
    ``alpha`` ``[E, H]`` the coefficients before dropout (as PyG returns them); for a
    ``torch.sparse`` input, as PyG, ``(out, (adj_t, alpha))`` with the input matrix
    itself (``alpha`` in the order of its stored entries). No
    self-loops are added.
    """

    def __init__(
        self,
        in_channels: int | tuple[int, int],
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        beta: bool = False,
        dropout: float = 0.0,
        edge_dim: int | None = None,
        bias: bool = True,
        root_weight: bool = True,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        check_attention_args(name, heads, dropout, edge_dim)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.beta = beta and root_weight
        self.root_weight = root_weight
        self.concat = concat
        self.dropout = dropout
        self.edge_dim = edge_dim
        self.aggregation = check_aggregation(aggregation)
        if isinstance(in_channels, (tuple, list)):
            if len(in_channels) != 2:
                raise ValueError(f"{name}: in_channels must be an int or a pair (in_src, in_dst), got {in_channels!r}")
            in_src, in_dst = in_channels
        else:
            in_src = in_dst = in_channels
        width = heads * out_channels
        self.lin_key = input_linear(in_src, width, name, bias=bias)
        self.lin_query = input_linear(in_dst, width, name, bias=bias)
        self.lin_value = input_linear(in_src, width, name, bias=bias)
        if edge_dim is not None:
            self.lin_edge = nn.Linear(edge_dim, width, bias=False)
        else:
            self.register_parameter("lin_edge", None)
        out_width = width if concat else out_channels
        self.lin_skip = input_linear(in_dst, out_width, name, bias=bias)
        if self.beta:
            self.lin_beta = nn.Linear(3 * out_width, 1, bias=False)
        else:
            self.register_parameter("lin_beta", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.lin_key, self.lin_query, self.lin_value, self.lin_edge, self.lin_skip, self.lin_beta):
            if lin is not None:  # a LazyLinear not materialised yet is initialised when it is
                lin.reset_parameters()

    def _inputs(self, x, edge_index) -> tuple[Tensor, Tensor, Graph]:
        name = type(self).__name__
        x_src, x_dst = node_pair(x, name)
        if x_dst is None:
            raise ValueError(f"{name}: x_dst (x[1]) is needed: the queries and the skip read the target features")
        bipartite = not isinstance(x, Tensor)
        src_name, dst_name = ("x_src", "x_dst") if bipartite else ("x", "x")
        # PyG's order (a lazy layer draws its weights in it): query, key, value, skip
        for lin, value, what in ((self.lin_query, x_dst, dst_name), (self.lin_key, x_src, src_name),
                                 (self.lin_value, x_src, src_name), (self.lin_skip, x_dst, dst_name)):
            check_linear_input(value, lin, name, what, glorot=False)
        if bipartite:
            graph = bipartite_graph_for(x_src, x_dst.size(0), edge_index, name)
        else:
            graph = graph_for(x, edge_index, name)
        return x_src, x_dst, graph

    def _edge_values(self, graph: Graph, edge_attr: Tensor | None) -> Tensor | None:
        """:math:`\\mathbf{W}_e \\mathbf{e}_{ji}` ``[E, H, C]``, or ``None`` without edge features."""
        name = type(self).__name__
        if self.lin_edge is None:
            if edge_attr is not None:
                raise ValueError(f"{name}: edge_attr was given but the layer was built without edge_dim")
            return None
        if edge_attr is None:
            raise ValueError(f"{name}: the layer was built with edge_dim={self.edge_dim} and needs edge_attr")
        check_edge_features(edge_attr, self.lin_edge, graph, name)
        return self.lin_edge(edge_attr).view(-1, self.heads, self.out_channels)

    def forward(
        self,
        x: Tensor | tuple[Tensor, Tensor],
        edge_index: Graph | Tensor,
        edge_attr: Tensor | None = None,
        return_attention_weights: bool | None = None,
    ):
        H, C = self.heads, self.out_channels
        x_src, x_dst, graph = self._inputs(x, edge_index)
        edge_values = self._edge_values(graph, edge_attr)
        query = self.lin_query(x_dst).view(-1, H, C)
        key = self.lin_key(x_src).view(-1, H, C)
        value = self.lin_value(x_src).view(-1, H, C)
        agg = self.aggregation
        scores = sddmm(graph, key, query, "dot", aggregation=agg)  # [E, H]: k_j . q_i
        if edge_values is not None:
            scores = scores + _query_edge_scores(graph, query, edge_attr, self.lin_edge, edge_values)
        alpha = edge_softmax(graph, scores / math.sqrt(C), aggregation=agg)
        if alpha.dtype != value.dtype:  # float32 under CUDA autocast: PyG's v_j * alpha promotes
            value = value.to(alpha.dtype)
            edge_values = edge_values.to(alpha.dtype) if edge_values is not None else None
        weights = F.dropout(alpha, p=self.dropout, training=self.training)
        if edge_values is None:
            out = spmm(graph, value, weights, aggregation=agg)  # [N_dst, H, C]
        else:  # sum_j alpha_ji (v_j + e'_ji) in one fused pass over each target's edges
            out = edge_aggregate(graph, value, edge_values, edge_weight=weights, aggregation=agg)
        out = out.reshape(-1, H * C) if self.concat else out.mean(dim=1)
        if self.root_weight:
            skip = self.lin_skip(x_dst)
            if self.lin_beta is not None:
                gate = torch.sigmoid(self.lin_beta(torch.cat([out, skip, out - skip], dim=-1)))
                out = gate * skip + (1 - gate) * out
            else:
                out = out + skip
        if isinstance(return_attention_weights, bool):  # PyG's test: False returns the pair too
            return out, attention_weights(edge_index, graph, alpha, alpha_valued=False)
        return out

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, heads={self.heads}, aggregation={self.aggregation!r}"
