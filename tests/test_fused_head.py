"""The fused node-classification head (issue #15): an output layer's logits as a linear map
of aggregated inputs, and NodeClassifier.loss through fusegnn.losses.linear_cross_entropy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fusegnn.layers import GATConv, GCNConv
from fusegnn.losses import linear_cross_entropy
from fusegnn.models import GAT, GCN, GATv2, GraphSAGE
from tests.graphs import random_graph

F64 = torch.float64


def _data(n=40, features=12, classes=20, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(n, features, dtype=F64)
    ei = random_graph(n, 160, seed, hub_degree=15)
    y = torch.randint(0, classes, (n,))
    return x, ei, y


@pytest.mark.parametrize("layer", [
    lambda: GCNConv(12, 20),
    lambda: GATConv(12, 20, heads=1),
    lambda: GATConv(12, 20, heads=3, concat=False),
    lambda: GATConv(12, 5, heads=2, concat=False, add_self_loops=False),
], ids=["gcn", "gat-1", "gat-3-mean", "gat-no-loops"])
def test_head_inputs_reproduce_the_layer(layer):
    x, ei, _ = _data()
    conv = layer().double().eval()
    with torch.no_grad():
        for p in conv.parameters():
            p.add_(0.1 * torch.randn_like(p))  # non-zero biases
    a, weight, bias = conv.head_inputs(x, ei)
    torch.testing.assert_close(F.linear(a, weight, bias), conv(x, ei))


@pytest.mark.parametrize("model", [
    lambda: GCN(12, 8, 20), lambda: GAT(12, 4, 20, heads=2, out_heads=3), lambda: GAT(12, 4, 20, heads=2),
], ids=["gcn", "gat-3-heads", "gat"])
def test_model_loss_is_cross_entropy_of_the_index_rows(model):
    x, ei, y = _data()
    m = model().double().eval()
    assert m.head_inputs(x, ei) is not None  # 8 or 4 x heads hidden channels < 20 classes: the fused head
    index = torch.tensor([1, 3, 5, 7, 9, 3, 39])  # repeats count twice
    loss = m.loss(x, ei, y, index, label_smoothing=0.1)
    want = F.cross_entropy(m(x, ei)[index], y[index], label_smoothing=0.1)
    torch.testing.assert_close(loss, want)
    got = torch.autograd.grad(loss, list(m.parameters()))
    ref = torch.autograd.grad(want, list(m.parameters()))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_model_loss_falls_back_to_logits_where_the_head_does_not_pay():
    x, ei, y = _data(classes=5)
    for m in (GCN(12, 8, 5), GraphSAGE(12, 8, 5), GATv2(12, 4, 5, heads=2)):
        m = m.double().eval()
        assert m.head_inputs(x, ei) is None
        torch.testing.assert_close(m.loss(x, ei, y), F.cross_entropy(m(x, ei), y))


def test_gat_head_inputs_refuses_what_it_cannot_express():
    x, ei, _ = _data()
    with pytest.raises(ValueError, match="output layer"):
        GATConv(12, 4, heads=2).double().head_inputs(x, ei)
    with pytest.raises(ValueError, match="residual or edge_dim"):
        GATConv(12, 4, residual=True).double().head_inputs(x, ei)


def test_loss_checks_target_once_per_version():
    """A training loop passes the same target every step: its values are checked (a host
    read-back) once; an in-place change is checked again."""
    h = torch.randn(6, 3, dtype=F64)
    w = torch.randn(4, 3, dtype=F64)
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    linear_cross_entropy(h, w, y)
    linear_cross_entropy(h, w, y)
    y[2] = 7
    with pytest.raises(ValueError, match="class id 7"):
        linear_cross_entropy(h, w, y)
