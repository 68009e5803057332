r"""The two-layer models of the GCN, GAT, GATv2, GraphSAGE, GIN, SGC and APPNP papers, built from
fusegnn layers.

Used by ``examples/train.py`` and the benchmark harness; also a starting point for users
(the same architectures as PyG's examples, so results compare one to one).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.losses import linear_cross_entropy
from fusegnn.losses.checks import as_class_ids, check_target_and_index

from fusegnn.layers import APPNP, GATConv, GATv2Conv, GCNConv, GINConv, SAGEConv, SGConv
from fusegnn.sparse import Graph

__all__ = ["NodeClassifier", "TwoLayerGNN", "GCN", "GAT", "GATv2", "GraphSAGE", "GIN", "SGC", "APPNPNet"]


class NodeClassifier(nn.Module):
    r"""A node classifier: :meth:`forward` returns the logits; :meth:`loss` the training
    loss over the rows ``index`` (a GNN's training nodes), the same value as
    ``F.cross_entropy(forward(x, graph)[index], target[index])``, for class ids in any of
    the integer dtypes :func:`fusegnn.losses.linear_cross_entropy` takes (int32 ones too,
    on either path). ``index`` is a 1-D integer tensor of row ids (repeats count
    repeatedly); a boolean mask is refused on both paths (pass ``mask.nonzero().squeeze(1)``),
    as is a ``target`` that is not one integer class id per row of ``x``.

    Where the output layer's logits are a linear map of inputs it aggregates narrower
    than the classes (:meth:`head_inputs`: GCN and GAT output layers whose input width is
    below the class count, e.g. 16 -> 41 on Reddit), the loss is
    :func:`fusegnn.losses.linear_cross_entropy` of those inputs (thesis ch. 6, EVT: the
    loss epilogue fused, the ``[N, C]`` logits never written, only the ``index`` rows
    read); otherwise the logits of ``index`` rows and ``F.cross_entropy``."""

    def head_inputs(self, x: Tensor, graph) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """``(a, W, b)`` with the logits ``a @ W.T + b`` (the whole model up to its output
        layer's aggregation run on ``x``), or ``None`` where that form does not pay."""
        return None

    def loss(self, x: Tensor, graph, target: Tensor, index: Tensor | None = None, *,
             ignore_index: int = -100, label_smoothing: float = 0.0) -> Tensor:
        head = self.head_inputs(x, graph)
        if head is not None:
            a, weight, bias = head
            # checked here too: linear_cross_entropy's own errors would name its h, not this call's x
            check_target_and_index(target, index, a.shape[0], owner="loss", rows="x")
            return linear_cross_entropy(a, weight, target, bias, index=index, ignore_index=ignore_index,
                                        label_smoothing=label_smoothing)
        logits = self(x, graph)
        check_target_and_index(target, index, logits.shape[0], owner="loss", rows="x")
        target = as_class_ids(target)  # the dtypes the fused head takes
        if index is not None:
            logits, target = logits.index_select(0, index), target.index_select(0, index)
        return F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing)


class TwoLayerGNN(NodeClassifier):
    r"""``dropout -> conv1 -> activation -> dropout -> conv2`` (logits returned): the shape
    of every two-layer recipe here. Subclasses build ``conv1`` / ``conv2``; the output
    layer's fused loss head (:meth:`head_inputs`) is used when ``conv2`` has one and its
    input is narrower than the classes (otherwise the layer already aggregates at the
    class width: nothing to save)."""

    def __init__(self, dropout: float, activation=F.relu) -> None:
        super().__init__()
        self.dropout = dropout
        self.activation = activation

    def reset_parameters(self) -> None:
        self.conv1.reset_parameters()
        self.conv2.reset_parameters()

    def hidden(self, x: Tensor, graph: Graph | Tensor) -> Tensor:
        """Everything before the output layer (dropout on its input included)."""
        x = F.dropout(x, self.dropout, self.training)
        x = self.activation(self.conv1(x, graph))
        return F.dropout(x, self.dropout, self.training)

    def forward(self, x: Tensor, graph: Graph | Tensor) -> Tensor:
        return self.conv2(self.hidden(x, graph), graph)

    def head_inputs(self, x: Tensor, graph: Graph | Tensor):
        head = getattr(self.conv2, "head_inputs", None)
        if head is None or self.conv2.in_channels >= self.conv2.out_channels:
            return None
        return head(self.hidden(x, graph), graph)


class GCN(TwoLayerGNN):
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
        super().__init__(dropout, F.relu)
        self.conv1 = GCNConv(in_channels, hidden, cached=cached, aggregation=aggregation)
        self.conv2 = GCNConv(hidden, out_channels, cached=cached, aggregation=aggregation)


class GAT(TwoLayerGNN):
    r"""Velickovic et al.'s two-layer GAT: ``heads`` attention heads of width ``hidden``
    (concatenated, ELU), then ``out_heads`` heads averaged into the logits; dropout on
    each layer's input and on the attention coefficients.
    """

    conv_class = GATConv

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
        super().__init__(dropout, F.elu)
        self.conv1 = self.conv_class(in_channels, hidden, heads=heads, dropout=dropout, aggregation=aggregation)
        self.conv2 = self.conv_class(
            hidden * heads, out_channels, heads=out_heads, concat=False, dropout=dropout,
            aggregation=aggregation,
        )


class GATv2(GAT):
    r"""Brody et al.'s GATv2 in GAT's two-layer recipe (:class:`GAT` with
    :class:`~fusegnn.layers.GATv2Conv`)."""

    conv_class = GATv2Conv


class GraphSAGE(TwoLayerGNN):
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
        super().__init__(dropout, F.relu)
        self.conv1 = SAGEConv(in_channels, hidden, aggr=aggr, aggregation=aggregation)
        self.conv2 = SAGEConv(hidden, out_channels, aggr=aggr, aggregation=aggregation)


def _mlp(in_channels: int, hidden: int, out_channels: int) -> nn.Sequential:
    """GIN's update function: ``Linear -> ReLU -> Linear``."""
    return nn.Sequential(nn.Linear(in_channels, hidden), nn.ReLU(), nn.Linear(hidden, out_channels))


class GIN(TwoLayerGNN):
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
        super().__init__(dropout, F.relu)
        self.conv1 = GINConv(_mlp(in_channels, hidden, hidden), train_eps=train_eps, aggregation=aggregation)
        self.conv2 = GINConv(_mlp(hidden, hidden, out_channels), train_eps=train_eps, aggregation=aggregation)


class SGC(NodeClassifier):
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


class APPNPNet(NodeClassifier):
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
