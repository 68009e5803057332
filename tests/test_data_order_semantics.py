"""Node orderings, data sets and the neighbour loader, in combination.

* ``NodeDataset.reorder`` renumbers the node ids an extra holds (OGB's ``split_idx``),
  not only the per-node tensors: after a reorder ``split_idx`` names the same nodes as
  the masks, and the original ids come back through ``node_order``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fusegnn.datasets import NodeDataset, generate_ogbn_like

METHODS = ["rcm", "degree"]


def _arxiv():
    return generate_ogbn_like("arxiv", 0.001, seed=0, avg_degree=6)


@pytest.mark.parametrize("method", METHODS)
def test_reorder_renumbers_the_ogb_split_idx(method):
    data = _arxiv()
    before = {k: v.clone() for k, v in data.extra["split_idx"].items()}
    new = data.reorder(method)
    order = new.extra["node_order"]
    assert not torch.equal(order, torch.arange(data.num_nodes))  # a real renumbering
    for key, mask in (("train", new.train_mask), ("valid", new.val_mask), ("test", new.test_mask)):
        ids = new.extra["split_idx"][key]
        assert ids.dtype == torch.int64
        assert torch.equal(order[ids], data.extra["split_idx"][key]), key  # the same nodes, in order
        assert int(mask.sum()) == ids.numel() and bool(mask[ids].all()), key
    for key, ids in data.extra["split_idx"].items():  # the input's ids are untouched
        assert torch.equal(ids, before[key]), key


def test_to_moves_the_tensors_inside_extras():
    data = _arxiv()
    moved = data.to("meta")
    assert moved.x.device.type == "meta" and moved.extra["node_year"].device.type == "meta"
    for key, ids in moved.extra["split_idx"].items():
        assert ids.device.type == "meta", key
    assert all(ids.device.type == "cpu" for ids in data.extra["split_idx"].values())  # the input stays


@pytest.mark.parametrize("reordered", [False, True])
def test_the_cached_graph_follows_a_new_edge_index_or_node_count(reordered):
    data = _arxiv().reorder("rcm") if reordered else _arxiv()
    graph = data.graph
    assert data.graph is graph  # cached
    fewer = dataclasses.replace(data, edge_index=data.edge_index[:, :10])
    assert fewer.graph.num_edges == 10 and torch.equal(fewer.graph.edge_index, fewer.edge_index)
    more_nodes = dataclasses.replace(data, x=torch.cat([data.x, data.x[:3]]))
    assert more_nodes.graph.num_nodes == data.num_nodes + 3
    data.edge_index = data.edge_index.flip(0)
    assert torch.equal(data.graph.edge_index, data.edge_index)
    assert graph.num_edges == data.num_edges and graph is not data.graph


@pytest.mark.parametrize("method", METHODS)
def test_reorder_keeps_per_edge_extras_when_edges_and_nodes_are_as_many(method):
    n = 7  # a directed 6-cycle, a self-loop and an isolated node: 7 nodes, 7 edges
    src = torch.tensor([0, 1, 2, 3, 4, 5, 3])
    dst = torch.tensor([1, 2, 3, 4, 5, 0, 3])
    masks = torch.arange(n) % 3 == torch.arange(3).unsqueeze(1)
    data = NodeDataset(
        name="cycle", x=torch.randn(n, 2), y=torch.arange(n) % 2, edge_index=torch.stack([src, dst]),
        train_mask=masks[0], val_mask=masks[1], test_mask=masks[2], num_classes=2,
        extra={"edge_weight": torch.arange(1.0, n + 1), "node_types": torch.arange(n)},
    )
    new = data.reorder(method)
    order = new.extra["node_order"]
    assert not torch.equal(order, torch.arange(n))
    assert torch.equal(order[new.edge_index], data.edge_index)  # same edges, same order ...
    assert torch.equal(new.extra["edge_weight"], data.extra["edge_weight"])  # ... so the same weights
    assert torch.equal(new.extra["node_types"], order)  # per node: taken at perm


def test_to_keeps_the_types_of_the_containers_in_extras():
    """``.to`` walks ``extra`` with the one tensor walk fusegnn has (``graphed_step``'s
    too): a NamedTuple of id tensors stays that NamedTuple (it came back a plain tuple,
    so ``split.train`` raised ``AttributeError`` after ``data.to(device)``)."""
    from typing import NamedTuple

    class Split(NamedTuple):
        train: torch.Tensor
        test: torch.Tensor

    data = _arxiv()
    ids = data.extra["split_idx"]
    data.extra["split"] = Split(ids["train"], ids["test"])
    moved = data.to("meta")
    assert type(moved.extra["split"]) is Split and moved.extra["split"].train.device.type == "meta"
