r"""The 2-layer models every backend trains, as fusegnn and as PyG modules.

The fusegnn side is :mod:`fusegnn.models` (the models of ``examples/train.py``); the PyG
side below is the same architecture layer for layer, so the same weights give the
same function:

* GCN: ``dropout -> GCNConv(in, hidden) -> ReLU -> dropout -> GCNConv(hidden, classes)``,
  dropout 0.5, both convolutions ``cached=True`` (transductive: the normalised graph
  is computed on the first call and reused; ``pyg-uncached`` renormalises every call);
* GAT: ``dropout -> GATConv(in, hidden, heads) -> ELU -> dropout ->
  GATConv(hidden * heads, classes, heads=1, concat=False)``, dropout 0.6 on the
  features and on the attention coefficients (the published recipe);
* GraphSAGE: ``dropout -> SAGEConv(in, hidden) -> ReLU -> dropout -> SAGEConv(hidden,
  classes)``, mean aggregation, dropout 0.5;
* GIN: ``dropout -> GINConv(MLP(in, hidden, hidden)) -> ReLU -> dropout ->
  GINConv(MLP(hidden, hidden, classes))``, MLPs ``Linear -> ReLU -> Linear``, dropout 0.5;
* GATv2: GAT's recipe with ``GATv2Conv``.

Parameter names agree between the two libraries (``conv1.lin.weight``,
``conv1.att_src``, ``conv1.bias``, ...); :func:`copy_weights` copies one state into the
other (and maps PyG's older ``lin_src`` name).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.cases import Case

__all__ = ["build_fusegnn_model", "build_pyg_model", "copy_weights", "GCN_DROPOUT", "GAT_DROPOUT"]

GCN_DROPOUT = 0.5
GAT_DROPOUT = 0.6
SAGE_DROPOUT = GIN_DROPOUT = 0.5


def build_fusegnn_model(case: Case, in_channels: int, num_classes: int, aggregation: str) -> nn.Module:
    """The fusegnn model of ``case`` with every sparse op on ``aggregation``."""
    import fusegnn.models as models

    if case.model == "gcn":
        return models.GCN(in_channels, case.width, num_classes, dropout=GCN_DROPOUT, cached=True,
                          aggregation=aggregation)
    if case.model in ("gat", "gatv2"):
        return (models.GAT if case.model == "gat" else models.GATv2)(
            in_channels, case.width, num_classes, heads=case.heads, out_heads=1,
            dropout=GAT_DROPOUT, aggregation=aggregation,
        )
    if case.model == "sage":
        return models.GraphSAGE(in_channels, case.width, num_classes, dropout=SAGE_DROPOUT, aggregation=aggregation)
    if case.model == "gin":
        return models.GIN(in_channels, case.width, num_classes, dropout=GIN_DROPOUT, aggregation=aggregation)
    raise ValueError(f"case {case.name!r} has no model to build (model={case.model!r})")


def build_pyg_model(case: Case, in_channels: int, num_classes: int, cached: bool = True) -> nn.Module:
    """The PyG model of ``case`` (needs ``torch_geometric``)."""
    if case.model == "gcn":
        return PygGCN(in_channels, case.width, num_classes, GCN_DROPOUT, cached=cached)
    if case.model in ("gat", "gatv2"):
        return PygGAT(in_channels, case.width, num_classes, case.heads, GAT_DROPOUT, v2=case.model == "gatv2")
    if case.model == "sage":
        return PygSAGE(in_channels, case.width, num_classes, SAGE_DROPOUT)
    if case.model == "gin":
        return PygGIN(in_channels, case.width, num_classes, GIN_DROPOUT)
    raise ValueError(f"case {case.name!r} has no model to build (model={case.model!r})")


class PygGCN(nn.Module):
    """:class:`fusegnn.models.GCN` with PyG's ``GCNConv``."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, dropout: float, cached: bool = True):
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.dropout = dropout
        self.conv1 = GCNConv(in_channels, hidden, cached=cached)
        self.conv2 = GCNConv(hidden, out_channels, cached=cached)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = F.relu(self.conv1(x, edge_index))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)


class PygGAT(nn.Module):
    """:class:`fusegnn.models.GAT` with PyG's ``GATConv`` (``v2``: :class:`fusegnn.models.GATv2`
    with its ``GATv2Conv``)."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, heads: int, dropout: float,
                 v2: bool = False):
        super().__init__()
        from torch_geometric.nn import GATConv, GATv2Conv

        conv = GATv2Conv if v2 else GATConv
        self.dropout = dropout
        self.conv1 = conv(in_channels, hidden, heads=heads, dropout=dropout)
        self.conv2 = conv(hidden * heads, out_channels, heads=1, concat=False, dropout=dropout)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)


class PygSAGE(nn.Module):
    """:class:`fusegnn.models.GraphSAGE` with PyG's ``SAGEConv`` (mean)."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, dropout: float):
        super().__init__()
        from torch_geometric.nn import SAGEConv

        self.dropout = dropout
        self.conv1 = SAGEConv(in_channels, hidden)
        self.conv2 = SAGEConv(hidden, out_channels)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = F.relu(self.conv1(x, edge_index))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)


class PygGIN(nn.Module):
    """:class:`fusegnn.models.GIN` with PyG's ``GINConv``."""

    def __init__(self, in_channels: int, hidden: int, out_channels: int, dropout: float):
        super().__init__()
        from torch_geometric.nn import GINConv

        def mlp(a: int, b: int, c: int) -> nn.Sequential:
            return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c))

        self.dropout = dropout
        self.conv1 = GINConv(mlp(in_channels, hidden, hidden))
        self.conv2 = GINConv(mlp(hidden, hidden, out_channels))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = F.dropout(x, self.dropout, self.training)
        x = F.relu(self.conv1(x, edge_index))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)


_ALIASES = {"lin_src.weight": "lin.weight", "lin.weight": "lin_src.weight"}


def copy_weights(state: dict[str, Tensor], model: nn.Module) -> None:
    """Copy ``state`` (a state dict of either library's model of the same case) into
    ``model`` in place. Every parameter of ``model`` must be found, with its shape."""
    own = model.state_dict()
    missing = []
    with torch.no_grad():
        for name, target in own.items():
            source = state.get(name)
            for old, new in _ALIASES.items():
                if source is None and name.endswith(old):
                    source = state.get(name[: -len(old)] + new)
            if source is None:
                missing.append(name)
                continue
            if source.shape != target.shape:
                raise ValueError(f"weight {name}: shape {tuple(source.shape)} does not fit {tuple(target.shape)}")
            target.copy_(source)
    if missing:
        raise KeyError(f"no weights for {missing} in the source state (has {sorted(state)})")
