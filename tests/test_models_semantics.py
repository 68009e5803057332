"""The recipes of :mod:`fusegnn.models` against the same models built from PyG's layers,
and :meth:`NodeClassifier.loss` against ``F.cross_entropy`` of the logits.

* Every model, given PyG's (randomised) weights, returns PyG's logits in float64 on the
  CPU, in eval mode and in train mode (dropout drawn from the same seeded global RNG
  stream in the same order: the same masks), through an ``edge_index`` and a
  :class:`~fusegnn.sparse.Graph`, and (eval mode) a sparse adjacency.
* ``model.loss(x, graph, y, index)`` equals ``F.cross_entropy(model(x, graph)[index],
  y[index])`` with repeated and int32 indices and narrow class-id dtypes, on the fused
  head path (GCN / GAT with a hidden width below the classes) and the logits path alike;
  both paths refuse the same bad arguments (a boolean mask, a target of the wrong length)
  with a clear error.
* ``reset_parameters`` re-draws every parameter; ``state_dict`` round-trips.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusegnn.models import APPNPNet, GAT, GATv2, GCN, GIN, GraphSAGE, SGC
from fusegnn.sparse import Graph
from tests.pyg_compare import pyg_nn, requires_pyg

F64 = torch.float64
N, F_IN, HIDDEN, CLASSES = 11, 5, 4, 7
REF = dict(aggregation="reference")


def _graph_data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, N, (2, 30), generator=gen).unique(dim=1)  # no duplicate edges
    x = torch.randn(N, F_IN, generator=gen, dtype=F64)
    y = torch.randint(0, CLASSES, (N,), generator=gen)
    return x, edge_index, y


OURS = {
    "GCN": lambda: GCN(F_IN, HIDDEN, CLASSES, **REF),
    "GAT": lambda: GAT(F_IN, HIDDEN, CLASSES, heads=2, out_heads=2, **REF),
    "GATv2": lambda: GATv2(F_IN, HIDDEN, CLASSES, heads=2, out_heads=2, **REF),
    "GraphSAGE": lambda: GraphSAGE(F_IN, HIDDEN, CLASSES, **REF),
    "GIN": lambda: GIN(F_IN, HIDDEN, CLASSES, train_eps=True, **REF),
    "SGC": lambda: SGC(F_IN, CLASSES, **REF),
    "APPNPNet": lambda: APPNPNet(F_IN, HIDDEN, CLASSES, K=3, alpha=0.2, **REF),
}


class _PygTwoLayer(nn.Module):
    """``dropout -> conv1 -> act -> dropout -> conv2``: PyG's examples' two-layer recipe."""

    def __init__(self, conv1, conv2, act, dropout):
        super().__init__()
        self.conv1, self.conv2, self.act, self.dropout = conv1, conv2, act, dropout

    def forward(self, x, edge_index):
        x = F.dropout(x, self.dropout, self.training)
        x = self.act(self.conv1(x, edge_index))
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)


class _PygSGC(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = pyg_nn.SGConv(F_IN, CLASSES, K=2, cached=True)

    def forward(self, x, edge_index):
        return self.conv(x, edge_index)


class _PygAPPNP(nn.Module):
    """PyG's APPNP example: dropout, Linear, ReLU, dropout, Linear, propagation."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(F_IN, HIDDEN), nn.Linear(HIDDEN, CLASSES)
        self.prop = pyg_nn.APPNP(K=3, alpha=0.2, cached=True)

    def forward(self, x, edge_index):
        x = F.dropout(x, 0.5, self.training)
        x = F.dropout(F.relu(self.lin1(x)), 0.5, self.training)
        return self.prop(self.lin2(x), edge_index)


def _mlp(a, b, c):
    return nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c))


def _pyg_model(name):
    P = pyg_nn
    if name == "GCN":
        return _PygTwoLayer(P.GCNConv(F_IN, HIDDEN, cached=True), P.GCNConv(HIDDEN, CLASSES, cached=True), F.relu, 0.5)
    if name in ("GAT", "GATv2"):
        conv = P.GATConv if name == "GAT" else P.GATv2Conv
        return _PygTwoLayer(conv(F_IN, HIDDEN, heads=2, dropout=0.6),
                            conv(2 * HIDDEN, CLASSES, heads=2, concat=False, dropout=0.6), F.elu, 0.6)
    if name == "GraphSAGE":
        return _PygTwoLayer(P.SAGEConv(F_IN, HIDDEN), P.SAGEConv(HIDDEN, CLASSES), F.relu, 0.5)
    if name == "GIN":
        return _PygTwoLayer(P.GINConv(_mlp(F_IN, HIDDEN, HIDDEN), train_eps=True),
                            P.GINConv(_mlp(HIDDEN, HIDDEN, CLASSES), train_eps=True), F.relu, 0.5)
    if name == "SGC":
        return _PygSGC()
    return _PygAPPNP()


def _pair(name):
    """``(ours, theirs)`` in float64, PyG's parameters random, ours the same by name."""
    torch.manual_seed(0)
    theirs, ours = _pyg_model(name).double(), OURS[name]().double()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=F64) * 0.5)
    assert sorted(theirs.state_dict()) == sorted(ours.state_dict())
    ours.load_state_dict(theirs.state_dict(), strict=True)
    return ours, theirs


def _inputs(kind, edge_index):
    if kind == "edge_index":
        return edge_index
    if kind == "Graph":
        return Graph(edge_index, N)
    return torch.sparse_coo_tensor(edge_index.flip(0), torch.ones(edge_index.size(1), dtype=F64), (N, N)).coalesce()


@requires_pyg
@pytest.mark.parametrize("name", sorted(OURS))
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_model_matches_pyg(name, training):
    x, edge_index, _ = _graph_data()
    ours, theirs = _pair(name)
    ours.train(training)
    theirs.train(training)
    torch.manual_seed(7)
    expected = theirs(x, edge_index)
    # A sparse adjacency lists the edges in another order, so GAT's attention dropout
    # (one draw per edge) masks other edges there: compared in eval mode only.
    for kind in ("edge_index", "Graph") + (() if training else ("adjacency",)):
        model = OURS[name]().double().train(training)  # a fresh cache per graph input
        model.load_state_dict(ours.state_dict())
        torch.manual_seed(7)
        torch.testing.assert_close(model(x, _inputs(kind, edge_index)), expected, rtol=1e-10, atol=1e-10,
                                   msg=lambda m: f"{name} through {kind}: {m}")


# ----------------------------------------------------------------------------- loss

# GCN / GAT with HIDDEN < CLASSES take the fused head (linear_cross_entropy); the others
# the logits path.
INDICES = {
    "none": None,
    "plain": torch.tensor([0, 3, 5]),
    "repeats": torch.tensor([2, 2, 9, 2]),
    "int32": torch.tensor([1, 4, 4], dtype=torch.int32),
    "empty-but-one": torch.tensor([10]),
}


@pytest.mark.parametrize("name", sorted(OURS))
@pytest.mark.parametrize("index", sorted(INDICES))
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32, torch.uint8])
def test_loss_is_cross_entropy_of_the_logits(name, index, target_dtype):
    x, edge_index, y = _graph_data(1)
    torch.manual_seed(0)
    model = OURS[name]().double().eval()
    idx = INDICES[index]
    logits = model(x, edge_index)
    rows = slice(None) if idx is None else idx.long()
    expected = F.cross_entropy(logits[rows], y[rows])
    got = model.loss(x, edge_index, y.to(target_dtype), idx)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


BAD_LOSS_ARGUMENTS = {
    # name: (target, index, error, message fragment)
    "bool mask": (None, torch.arange(N) % 2 == 0, TypeError, "boolean mask"),
    "target too long": (torch.zeros(N + 3, dtype=torch.long), torch.tensor([0, 1]), ValueError, "per row"),
    "target too short": (torch.zeros(N - 3, dtype=torch.long), torch.tensor([0, 1]), ValueError, "per row"),
    "float target": (torch.zeros(N, dtype=F64), torch.tensor([0, 1]), TypeError, "target"),
    "float index": (None, torch.tensor([0.0, 1.0]), TypeError, "index"),
}


@pytest.mark.parametrize("name", ["GCN", "GraphSAGE", "APPNPNet"])  # fused head, logits, logits
@pytest.mark.parametrize("case", sorted(BAD_LOSS_ARGUMENTS))
def test_loss_refuses_bad_arguments_on_every_path(name, case):
    """Before the fix the logits path (every model but GCN / GAT with a narrow hidden
    layer) took a target longer or shorter than the rows and returned a loss, and a
    boolean mask failed inside ``index_select`` with no hint."""
    x, edge_index, y = _graph_data(2)
    target, index, error, fragment = BAD_LOSS_ARGUMENTS[case]
    model = OURS[name]().double().eval()
    with pytest.raises(error, match=fragment):
        model.loss(x, edge_index, y if target is None else target, index)


@pytest.mark.parametrize("case", ["target too long", "float target", "bool mask"])
def test_loss_errors_name_the_callers_arguments_on_every_path(case):
    """The fused head's path (GCN) and the logits path (GraphSAGE) refuse a bad ``target``
    / ``index`` with the same message, naming ``loss`` and the rows of ``x``: the fused
    head's message named ``linear_cross_entropy`` and its ``h``, which ``loss`` is not given."""
    x, edge_index, y = _graph_data(2)
    target, index, error, _ = BAD_LOSS_ARGUMENTS[case]
    messages = []
    for name in ("GCN", "GraphSAGE"):
        model = OURS[name]().double().eval()
        with pytest.raises(error) as info:
            model.loss(x, edge_index, y if target is None else target, index)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and messages[0].startswith("loss: "), messages
    if case == "target too long":
        assert "row of x" in messages[0]


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("name", sorted(OURS))
def test_reset_parameters_redraws_everything_and_state_dict_round_trips(name):
    x, edge_index, _ = _graph_data(3)
    model = OURS[name]().double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.125)
    before = model(x, edge_index)
    model.reset_parameters()
    stale = [n for n, p in model.named_parameters() if p.numel() > 1 and bool((p == 0.125).all())]
    assert not stale, f"reset_parameters left {stale} unchanged"
    after = model(x, edge_index)
    assert not torch.allclose(before, after), "reset_parameters kept a cache of the old weights"

    copy = OURS[name]().double().eval()
    copy.load_state_dict(model.state_dict(), strict=True)
    torch.testing.assert_close(copy(x, edge_index), after, rtol=0, atol=0)


def test_cached_layers_follow_double():
    """A cached layer (SGConv's propagated features, GCNConv / APPNP's normalised graph)
    moved to float64 by ``.double()`` after a float32 call computes in float64: SGC raised
    'mat1 and mat2 must have the same dtype', GCN / APPNP kept float32 weights (1e-7)."""
    from fusegnn.layers import APPNP, GCNConv, SGConv

    ei = torch.randint(0, 12, (2, 40), generator=torch.Generator().manual_seed(1))
    x = torch.randn(12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    for make in (lambda: SGConv(5, 3, K=2, cached=True), lambda: GCNConv(5, 3, cached=True),
                 lambda: APPNP(K=3, alpha=0.1, cached=True)):
        layer = make().eval()
        layer(x.float(), ei)
        layer.double()
        fresh = make().double().eval()
        fresh.load_state_dict(layer.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(layer(x, ei), fresh(x, ei), rtol=1e-12, atol=1e-12)
