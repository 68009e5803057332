"""``NodeDataset.reorder``: the same data set with its nodes renumbered in a locality order.

Checked on random data sets (isolated nodes, duplicate edges, self-loops, a hub): every
per-node tensor is taken at ``perm``, the edges are the same edges renumbered in the
same order, a model's output on the renumbered set is the original output renumbered,
repeated reorders compose in ``extra["node_order"]``, the input is never modified, and
a bad method is an error naming it. ``examples/train.py --reorder`` trains on it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fusegnn.datasets import NodeDataset
from fusegnn.layers import GCNConv
from tests.graphs import random_graph

METHODS = ["rcm", "degree"] + (["metis"] if importlib.util.find_spec("pymetis") else [])
N = 40


def _dataset(seed: int = 0) -> NodeDataset:
    gen = torch.Generator().manual_seed(seed)
    edge_index = random_graph(N, 150, seed=seed, hub_degree=20)
    masks = torch.rand(3, N, generator=gen) < 0.3
    return NodeDataset(
        name="random", x=torch.randn(N, 5, generator=gen, dtype=torch.float64),
        y=torch.randint(0, 3, (N,), generator=gen), edge_index=edge_index,
        train_mask=masks[0], val_mask=masks[1], test_mask=masks[2], num_classes=3,
        extra={"node_types": torch.arange(N) % 4, "note": "kept", "per_class": torch.ones(3)},
    )


@pytest.mark.parametrize("method", METHODS)
def test_every_per_node_tensor_is_taken_at_perm_and_the_edges_renumbered(method):
    data = _dataset()
    before = {k: v.clone() for k, v in vars(data).items() if isinstance(v, torch.Tensor)}
    new = data.reorder(method)
    perm = new.extra["node_order"]
    assert sorted(perm.tolist()) == list(range(N))
    for name in ("x", "y", "train_mask", "val_mask", "test_mask"):
        assert torch.equal(getattr(new, name), getattr(data, name)[perm]), name
    assert torch.equal(new.extra["node_types"], data.extra["node_types"][perm])
    assert new.extra["note"] == "kept" and torch.equal(new.extra["per_class"], torch.ones(3))  # not per node
    # the same edges in the same order: new edge (a, b) is old edge (perm[a], perm[b])
    assert new.edge_index.dtype == data.edge_index.dtype
    assert torch.equal(perm[new.edge_index], data.edge_index)
    assert new.graph.num_nodes == N and torch.equal(new.graph.edge_index.long(), new.edge_index)
    for name, value in before.items():  # the input data set is untouched
        assert torch.equal(getattr(data, name), value), name
    assert "node_order" not in data.extra


@pytest.mark.parametrize("method", METHODS)
def test_a_model_on_the_reordered_set_gives_the_reordered_output(method):
    data = _dataset(1)
    new = data.reorder(method)
    torch.manual_seed(0)
    conv = GCNConv(5, 4, aggregation="reference").double()
    out = conv(data.x, data.graph)
    out_new = conv(new.x, new.graph)
    torch.testing.assert_close(out_new, out[new.extra["node_order"]], rtol=1e-12, atol=1e-12)
    restored = torch.empty_like(out_new)
    restored[new.extra["node_order"]] = out_new  # the docstring's way back
    torch.testing.assert_close(restored, out, rtol=1e-12, atol=1e-12)


def test_repeated_reorders_compose_to_the_original_ids():
    data = _dataset(2)
    twice = data.reorder("degree").reorder("rcm")
    order = twice.extra["node_order"]
    assert torch.equal(twice.x, data.x[order]) and torch.equal(twice.y, data.y[order])
    assert torch.equal(order[twice.edge_index], data.edge_index)


def test_the_order_moves_with_the_data_set():
    new = _dataset(3).reorder("rcm").to("cpu")
    assert new.extra["node_order"].device.type == "cpu"


def test_a_bad_method_names_it():
    with pytest.raises(ValueError, match="method must be one of"):
        _dataset().reorder("spectral")
