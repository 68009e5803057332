r"""Graph attention (Velickovic et al., ICLR 2018), drop-in for PyG's ``GATConv``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fusegnn.layers._utils import check_features, glorot_, graph_for, input_linear
from fusegnn.sparse import Graph, edge_index_of, gat_attention, gat_layer
from fusegnn.sparse.processing import gat_self_loops
from fusegnn.sparse.dispatch import check_aggregation

__all__ = ["GATConv"]


class GATConv(nn.Module):
    r"""The graph attentional operator.

    For each head :math:`k` with weights :math:`\mathbf{\Theta}_k`, attention vectors
    :math:`\mathbf{a}^{(k)}_{s}, \mathbf{a}^{(k)}_{t}`:

    .. math::
        \mathbf{h}^{(k)}_j = \mathbf{\Theta}_k \mathbf{x}_j, \qquad
        e^{(k)}_{ji} = \mathrm{LeakyReLU}\left(\mathbf{a}^{(k)\top}_{s} \mathbf{h}^{(k)}_j
        + \mathbf{a}^{(k)\top}_{t} \mathbf{h}^{(k)}_i\right)

    .. math::
        \alpha^{(k)}_{ji} = \mathrm{softmax}_{j \in \mathcal{N}(i) \cup \{i\}}\big(e^{(k)}_{ji}\big),
        \qquad
        \mathbf{x}'_i = \big\Vert_{k=1}^{H} \sum_{j} \alpha^{(k)}_{ji} \mathbf{h}^{(k)}_j + \mathbf{b}

    (concatenation over heads, or their mean when ``concat=False``). When
    ``in_channels < out_channels`` the layer aggregates the inputs and transforms after,
    :math:`\mathbf{\Theta}_k \sum_j \alpha^{(k)}_{ji} \mathbf{x}_j`, with the scores
    :math:`(\mathbf{\Theta}_k^\top \mathbf{a}^{(k)}_s)^\top \mathbf{x}_j`: the same function
    (up to rounding), fewer values per edge. This is the
    SDDMM -> edge softmax -> SpMM pipeline, run by :func:`~fusegnn.sparse.gat_attention`:
    on CUDA one fused kernel per pass (online softmax, nothing of size ``E`` stored), the
    reference composition ``sddmm(graph, a_s, a_t, "add")`` ->
    :func:`~fusegnn.sparse.edge_softmax` -> :func:`~fusegnn.sparse.spmm` otherwise.
    Attention dropout drops coefficients after the softmax.

    Args:
        in_channels: input feature width, or ``-1`` to infer it from ``x`` at the first
            forward (PyG's lazy initialisation: the weight is materialised and
            Glorot-initialised then; create the optimizer after that call).
            Bipartite ``(src, dst)`` widths are not supported.
        out_channels: feature width of each head.
        heads: number of attention heads :math:`H`.
        concat: concatenate heads (``[N, H * out_channels]``) or average them
            (``[N, out_channels]``).
        negative_slope: LeakyReLU slope.
        dropout: dropout probability on the attention coefficients (training only).
        add_self_loops: replace existing self-loops by exactly one per node.
        bias: learn an additive bias.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"``.

    ``edge_index_or_graph`` is an ``edge_index`` ``[2, E]``, a
    :class:`~fusegnn.sparse.Graph`, a ``torch.sparse`` COO or CSR matrix in PyG's ``adj_t``
    orientation (rows are targets: ``adj_t[i, j] != 0`` is the edge ``j -> i``) or a
    networkx graph (nodes in ``G.nodes`` order); see
    :func:`~fusegnn.sparse.graph.coerce_graph`. Edge weights of any of them are ignored,
    as by PyG's ``GATConv`` (the attention computes its own). The sparse and networkx
    forms are converted eagerly only; under ``torch.compile`` pass the
    :class:`~fusegnn.sparse.Graph` built from them. ``x`` must have the layer's dtype
    (else a ``TypeError``).

    ``forward(x, edge_index_or_graph, return_attention_weights=None)`` returns the new
    features, or with ``return_attention_weights=True`` the pair
    ``(out, (edge_index, alpha))`` where ``edge_index`` includes the self-loops the layer
    added and ``alpha`` is ``[E, H]``.

    Under ``torch.compile`` the same code runs on a graph reference: the attention is one
    ``fusegnn::gat_attention`` custom op and the self-loop processing runs inside it (:mod:`fusegnn.sparse.library`); with
    ``return_attention_weights`` and self-loops, the edge count of ``edge_index`` and
    ``alpha`` is then a size the compiler only learns at run time. Under compilation
    ``edge_index`` is a copy of the processed graph's.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        add_self_loops: bool = True,
        bias: bool = True,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        if heads < 1:
            raise ValueError(f"heads must be >= 1, got {heads}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.heads = heads
        self.concat = concat
        self.negative_slope = negative_slope
        self.dropout = dropout
        self.add_self_loops = add_self_loops
        self.aggregation = check_aggregation(aggregation)
        self.lin = input_linear(in_channels, heads * out_channels, type(self).__name__)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        width = heads * out_channels if concat else out_channels
        self.bias = nn.Parameter(torch.empty(width)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        glorot_(self.lin.weight)
        glorot_(self.att_src)
        glorot_(self.att_dst)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def _processed_graph(self, x: Tensor, edge_index_or_graph) -> Graph:
        graph = graph_for(x, edge_index_or_graph, type(self).__name__)
        if not self.add_self_loops:
            return graph
        # A pure function of the (immutable) structure, cached on the graph, so layers
        # that share a Graph process (and convert) it once.
        return gat_self_loops(graph)

    def forward(
        self,
        x: Tensor,
        edge_index_or_graph: Graph | Tensor,
        return_attention_weights: bool | None = None,
    ):
        check_features(x, self)
        graph = self._processed_graph(x, edge_index_or_graph)
        H, C = self.heads, self.out_channels
        # Aggregate the narrower of x and h = x W^T: sum_j w_ji (W x_j) = W (sum_j w_ji x_j),
        # and the scores a . (W x) = (W^T a) . x. For GAT's output layer (16 -> 41
        # classes) the sparse pass then moves 16 instead of 41 values per edge.
        aggregate_first = self.in_channels < C
        if not aggregate_first and not return_attention_weights:
            # the common case: the sparse part is one op (one autograd node on the GPU)
            return gat_layer(
                graph, self.lin(x).view(-1, H, C), self.att_src, self.att_dst, self.bias,
                concat=self.concat, negative_slope=self.negative_slope, dropout=self.dropout,
                training=self.training, aggregation=self.aggregation,
            )
        if aggregate_first:
            weight = self.lin.weight.view(H, C, self.in_channels)
            score_src = x @ (weight * self.att_src.view(H, C, 1)).sum(dim=1).t()  # [N, H]
            score_dst = x @ (weight * self.att_dst.view(H, C, 1)).sum(dim=1).t()  # [N, H]
            values = x.unsqueeze(1).expand(-1, H, -1)  # [N, H, in]
        else:
            values = self.lin(x).view(-1, H, C)
            score_src = (values * self.att_src).sum(dim=-1)  # [N, H]
            score_dst = (values * self.att_dst).sum(dim=-1)  # [N, H]
        result = gat_attention(
            graph,
            values,
            score_src,
            score_dst,
            negative_slope=self.negative_slope,
            dropout=self.dropout,
            training=self.training,
            aggregation=self.aggregation,
            return_alpha=bool(return_attention_weights),
        )
        # out [N, H, C]; alpha [E, H], the coefficients after dropout
        out, alpha = result if return_attention_weights else (result, None)
        if aggregate_first:  # [N, H, in] -> [N, H, C]
            out = torch.einsum("nhf,hcf->nhc", out, weight)
        out = out.reshape(-1, self.heads * self.out_channels) if self.concat else out.mean(dim=1)
        if self.bias is not None:
            out = out + self.bias
        if return_attention_weights:
            return out, (edge_index_of(graph), alpha)
        return out

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, heads={self.heads}, "
            f"aggregation={self.aggregation!r}"
        )
