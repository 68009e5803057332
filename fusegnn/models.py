r"""The two-layer models of the GCN, GAT, GATv2, GraphSAGE, GIN, SGC and APPNP papers, built from
fusegnn layers.

Used by ``examples/train.py`` and the benchmark harness; also a starting point for users
(the same architectures as PyG's examples, so results compare one to one).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.layers import APPNP, GATConv, GATv2Conv, GCNConv, GINConv, SAGEConv, SGConv
from fusegnn.sparse import Graph

__all__ = ["GCN", "GAT", "GATv2", "GraphSAGE", "GIN", "SGC", "APPNPNet"]


class GCN(nn.Module):
    r"""Kipf & Welling's two-layer GCN:
    :math:`\mathrm{softmax}(\hat{A}\,\mathrm{ReLU}(\hat{A} X W_1) W_2)` (logits returned),
    dropout on the input of each layer.

    ``cached=True`` keeps the normalised graph after the first call (transductive).
    """

    def __init__(
        self,
        in_channels: int,
        hidden: int,
        out_channels: int,
        dropout: float = 0.5,
        cached: bool = True,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        self.dropout = dropout
        self.conv1 = GCNConv(in_channels, hidden, cached=cached, aggregation=aggregation)
        self.conv2 = GCNConv(hidden, out_channels, cached=cached, aggregation=aggregation)

    def reset_parameters(self) -> None:
        self.conv1.reset_parameters()
        self.conv2.reset_parameters()

    def forward(self, x: Tensor, graph: Graph | Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = F.relu(self.conv1(x, graph))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, graph)


class GAT(nn.Module):
    r"""Velickovic et al.'s two-layer GAT: ``heads`` attention heads of width ``hidden``
    (concatenated, ELU), then ``out_heads`` heads averaged into the logits; dropout on
    each layer's input and on the attention coefficients.
    """

    def __init__(
        self,
        in_channels: int,
        hidden: int,
        out_channels: int,
        heads: int = 8,
        out_heads: int = 1,
        dropout: float = 0.6,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        self.dropout = dropout
        self.conv1 = GATConv(in_channels, hidden, heads=heads, dropout=dropout, aggregation=aggregation)
        self.conv2 = GATConv(
            hidden * heads, out_channels, heads=out_heads, concat=False, dropout=dropout,
            aggregation=aggregation,
        )

    def reset_parameters(self) -> None:
        self.conv1.reset_parameters()
        self.conv2.reset_parameters()

    def forward(self, x: Tensor, graph: Graph | Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = F.elu(self.conv1(x, graph))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, graph)


class GATv2(nn.Module):
    r"""Brody et al.'s GATv2 in GAT's two-layer recipe: ``heads`` heads of width ``hidden``
    (concatenated, ELU), then ``out_heads`` heads averaged into the logits; dropout on each
    layer's input and on the attention coefficients.
    """

    def __init__(
        self,
        in_channels: int,
        hidden: int,
        out_channels: int,
        heads: int = 8,
        out_heads: int = 1,
        dropout: float = 0.6,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        self.dropout = dropout
        self.conv1 = GATv2Conv(in_channels, hidden, heads=heads, dropout=dropout, aggregation=aggregation)
        self.conv2 = GATv2Conv(
            hidden * heads, out_channels, heads=out_heads, concat=False, dropout=dropout,
            aggregation=aggregation,
        )

    def reset_parameters(self) -> None:
        self.conv1.reset_parameters()
        self.conv2.reset_parameters()

    def forward(self, x: Tensor, graph: Graph | Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = F.elu(self.conv1(x, graph))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, graph)


class GraphSAGE(nn.Module):
    r"""Hamilton et al.'s two-layer GraphSAGE for full-graph node classification:
    ``SAGEConv(in, hidden) -> ReLU -> SAGEConv(hidden, classes)`` with mean aggregation by
    default and dropout on each layer's input (PyG's ``GraphSAGE`` model with two layers).
    """

    def __init__(
        self,
        in_channels: int,
        hidden: int,
        out_channels: int,
        dropout: float = 0.5,
        aggr: str = "mean",
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        self.dropout = dropout
        self.conv1 = SAGEConv(in_channels, hidden, aggr=aggr, aggregation=aggregation)
        self.conv2 = SAGEConv(hidden, out_channels, aggr=aggr, aggregation=aggregation)

    def reset_parameters(self) -> None:
        self.conv1.reset_parameters()
        self.conv2.reset_parameters()

    def forward(self, x: Tensor, graph: Graph | Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = F.relu(self.conv1(x, graph))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, graph)


def _mlp(in_channels: int, hidden: int, out_channels: int) -> nn.Sequential:
    """GIN's update function: ``Linear -> ReLU -> Linear``."""
    return nn.Sequential(nn.Linear(in_channels, hidden), nn.ReLU(), nn.Linear(hidden, out_channels))


class GIN(nn.Module):
    r"""Xu et al.'s Graph Isomorphism Network, two layers for node classification:
    :math:`h_i' = \mathrm{MLP}((1 + \epsilon) h_i + \sum_{j \to i} h_j)` with two-layer MLPs
    (``Linear -> ReLU -> Linear``), ReLU between the layers, dropout on each layer's input;
    ``train_eps`` learns :math:`\epsilon` (0 at the start).
    """

    def __init__(
        self,
        in_channels: int,
        hidden: int,
        out_channels: int,
        dropout: float = 0.5,
        train_eps: bool = False,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        self.dropout = dropout
        self.conv1 = GINConv(_mlp(in_channels, hidden, hidden), train_eps=train_eps, aggregation=aggregation)
        self.conv2 = GINConv(_mlp(hidden, hidden, out_channels), train_eps=train_eps, aggregation=aggregation)

    def reset_parameters(self) -> None:
        self.conv1.reset_parameters()
        self.conv2.reset_parameters()

    def forward(self, x: Tensor, graph: Graph | Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = F.relu(self.conv1(x, graph))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, graph)


class SGC(nn.Module):
    r"""Wu et al.'s Simplifying Graph Convolution: one linear map of the ``K``-times
    propagated features, :math:`\mathrm{softmax}(\hat{A}^K X \Theta)` (logits returned);
    the propagated features are cached after the first call (transductive)."""

    def __init__(self, in_channels: int, out_channels: int, K: int = 2, cached: bool = True,
                 aggregation: str = "auto") -> None:
        super().__init__()
        self.conv = SGConv(in_channels, out_channels, K=K, cached=cached, aggregation=aggregation)

    def reset_parameters(self) -> None:
        self.conv.reset_parameters()

    def forward(self, x: Tensor, graph: Graph | Tensor) -> Tensor:
        return self.conv(x, graph)


class APPNPNet(nn.Module):
    r"""Klicpera et al.'s APPNP: predict with a two-layer MLP, then propagate the
    predictions by personalised PageRank,
    :math:`Z^{(k+1)} = (1 - \alpha) \hat{A} Z^{(k)} + \alpha H`, :math:`Z^{(0)} = H`,
    for ``K`` steps (dropout on the MLP's inputs)."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, K: int = 10, alpha: float = 0.1,
                 dropout: float = 0.5, cached: bool = True, aggregation: str = "auto") -> None:
        super().__init__()
        self.dropout = dropout
        self.lin1 = nn.Linear(in_channels, hidden)
        self.lin2 = nn.Linear(hidden, out_channels)
        self.prop = APPNP(K=K, alpha=alpha, cached=cached, aggregation=aggregation)

    def reset_parameters(self) -> None:
        self.lin1.reset_parameters()
        self.lin2.reset_parameters()
        self.prop.reset_parameters()

    def forward(self, x: Tensor, graph: Graph | Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = F.relu(self.lin1(x))
        x = F.dropout(x, self.dropout, self.training)
        return self.prop(self.lin2(x), graph)
