r"""The k-GNN graph convolution (Morris et al., AAAI 2019), drop-in for PyG's ``GraphConv``."""

from __future__ import annotations

from torch import Tensor, nn

from fusegnn.layers._utils import (
    aggregate_linear,
    channel_pair,
    check_reduce,
    input_linear,
    layer_inputs,
)
from fusegnn.sparse import Graph
from fusegnn.sparse.dispatch import check_aggregation

__all__ = ["GraphConv"]


class GraphConv(nn.Module):
    r"""The graph neural network operator of "Weisfeiler and Leman Go Neural".

    .. math::
        \mathbf{x}'_i = \mathbf{W}_1 \mathbf{x}_i + \mathbf{W}_2
        \bigoplus_{j \in \mathcal{N}(i)} e_{j,i} \cdot \mathbf{x}_j + \mathbf{b}

    with :math:`e_{j,i}` the weight of the edge :math:`j \to i` (``edge_weight``, else the
    graph's own weights, else 1) and :math:`\bigoplus` the sum (default), mean or
    elementwise max over the incoming edges (a target without any gets zeros).
    :math:`\mathbf{W}_1` is ``lin_root`` (no bias; left out when the targets have no
    features, ``x = (x_src, None)``), :math:`\mathbf{W}_2, \mathbf{b}` ``lin_rel``: PyG's
    parameter names and shapes, so state dicts load both ways; initialisation is PyG's
    ``Linear`` default (``nn.Linear``'s). For the sum and the mean the layer aggregates at
    the narrower of the source and output widths (the bias in the aggregation's epilogue;
    :func:`~fusegnn.layers._utils.project_before_aggregating` says when).

    Args:
        in_channels: input width, ``-1`` to infer it at the first forward, or a pair
            ``(in_src, in_dst)`` (bipartite inputs; either may be ``-1``).
        out_channels: output width.
        aggr: ``"add"`` (or ``"sum"``), ``"mean"`` or ``"max"``.
        bias: learn the additive bias of ``lin_rel``.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"``
            (see :mod:`fusegnn.sparse.dispatch`).

    Shapes:
        ``x`` ``[N, in_channels]`` or ``(x_src [N_src, in_src], x_dst [N_dst, in_dst] or
        None)``; ``edge_index`` an ``edge_index``, a
        :class:`~fusegnn.sparse.Graph` or a ``torch.sparse`` ``adj_t`` ``[N_dst, N_src]``
        (rows are targets; float values are edge weights); ``edge_weight`` ``[E]``
        (optional, in the graph's edge order; replaces the graph's weights); ``size`` PyG's
        optional ``(N_src, N_dst)`` -> ``[N_dst, out_channels]``.
    """

    def __init__(
        self,
        in_channels: int | tuple[int, int],
        out_channels: int,
        aggr: str = "add",
        bias: bool = True,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.aggr = aggr
        self.reduce = check_reduce(aggr, name)
        self.aggregation = check_aggregation(aggregation)
        in_src, in_dst = channel_pair(in_channels, name)
        self.lin_rel = input_linear(in_src, out_channels, name, bias=bias)
        self.lin_root = input_linear(in_dst, out_channels, name)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.lin_rel.reset_parameters()
        self.lin_root.reset_parameters()

    def forward(
        self, x: Tensor | tuple[Tensor, Tensor | None], edge_index: Graph | Tensor,
        edge_weight: Tensor | None = None, size: tuple[int, int] | None = None,
    ) -> Tensor:
        x_src, x_dst, graph = layer_inputs(
            self, x, edge_index, size, lin_src=self.lin_rel, lin_dst=self.lin_root
        )
        out = aggregate_linear(graph, x_src, self.lin_rel, self.reduce, self.aggregation, edge_weight)
        if x_dst is not None:
            out = out + self.lin_root(x_dst)
        return out

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggr={self.aggr!r}, aggregation={self.aggregation!r}"
