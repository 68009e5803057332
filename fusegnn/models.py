r"""The two-layer models of the GCN, GAT, GATv2, GraphSAGE, GIN, SGC and APPNP papers, built from
fusegnn layers.

Used by ``examples/train.py`` and the benchmark harness; also a starting point for users
(the same architectures as PyG's examples, so results compare one to one).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.layers import GATConv, GATv2Conv, GCNConv
from fusegnn.sparse import Graph

__all__ = ["GCN", "GAT", "GATv2"]


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
