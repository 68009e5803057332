"""fusegnn.loader: neighbour sampling (draws, relabeling, blocks) and NeighborLoader, on CPU."""

from __future__ import annotations

import importlib.util
import itertools
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from fusegnn.datasets import generate_reddit_like
from fusegnn.loader import NeighborLoader, NeighborSampler
from fusegnn.loader.draws import floyd_positions
from fusegnn.loader.relabel import append_new_nodes
from fusegnn.sparse import Graph

REPO = Path(__file__).resolve().parents[1]


def random_graph(num_nodes: int = 60, num_edges: int = 900, seed: int = 0, isolated: int = 0) -> Graph:
    """Random directed graph without duplicate edges; the last ``isolated`` nodes have
    no edge at all (skewed in-degrees: targets drawn from a squared uniform)."""
    gen = torch.Generator().manual_seed(seed)
    live = num_nodes - isolated
    src = torch.randint(0, live, (num_edges,), generator=gen)
    dst = (torch.rand(num_edges, generator=gen) ** 2 * live).long()
    key = torch.unique(src * num_nodes + dst)
    edge_index = torch.stack([key // num_nodes, key % num_nodes])
    perm = torch.randperm(edge_index.size(1), generator=gen)  # COO order unrelated to the grouping
    return Graph(edge_index[:, perm], num_nodes)


def global_edges(sub, graph: Graph) -> torch.Tensor:
    """The sampled edges as global ``(source, target)`` pairs."""
    return sub.n_id[sub.edge_index]


def edge_set(graph: Graph) -> set[tuple[int, int]]:
    return set(map(tuple, graph.edge_index.t().tolist()))


def sample(graph, fanouts, seeds, seed=0, **kwargs):
    sampler = NeighborSampler(graph, fanouts, **kwargs)
    return sampler.sample(torch.as_tensor(seeds), torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- draws


def sequential_floyd(n: int, k: int, u: list[float]) -> list[int]:
    chosen: list[int] = []
    for i, j in enumerate(range(n - k, n)):
        r = min(int(u[i] * (j + 1)), j)
        chosen.append(j if r in chosen else r)
    return chosen


def test_floyd_positions_match_the_sequential_algorithm():
    gen = torch.Generator().manual_seed(0)
    for k in (1, 2, 3, 5, 8, 25):
        deg = torch.randint(k + 1, 3 * k + 4, (300,), generator=gen)
        deg[:50] = k + 1  # the tightest case: many repeats
        u = torch.rand(300, k, generator=gen, dtype=torch.float64)
        got = floyd_positions(deg, k, u)
        for t in range(300):
            expected = sequential_floyd(int(deg[t]), k, u[t].tolist())
            assert got[t].tolist() == expected, (k, int(deg[t]))
            assert len(set(expected)) == k and max(expected) < int(deg[t])


def test_floyd_positions_in_chunks_match_the_sequential_algorithm():
    """Large fanouts compare their draws in row chunks (here 1677 rows of 100 x 100)."""
    k, rows = 100, 2000
    gen = torch.Generator().manual_seed(2)
    deg = torch.randint(k + 1, 2 * k, (rows,), generator=gen)
    u = torch.rand(rows, k, generator=gen, dtype=torch.float64)
    got = floyd_positions(deg, k, u)
    for t in (0, 1676, 1677, 1999):
        assert got[t].tolist() == sequential_floyd(int(deg[t]), k, u[t].tolist())


def test_floyd_subsets_are_uniform():
    """All 10 two-element subsets of 5 positions come up equally often (chi-square)."""
    n, k, trials = 5, 2, 20000
    u = torch.rand(trials, k, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    picks = floyd_positions(torch.full((trials,), n), k, u)
    counts = Counter(tuple(sorted(p)) for p in picks.tolist())
    assert set(counts) == set(itertools.combinations(range(n), k))
    expected = trials / math.comb(n, k)
    chi2 = sum((c - expected) ** 2 / expected for c in counts.values())
    assert chi2 < 27.9  # 9 degrees of freedom, p = 0.001


def test_append_new_nodes_keeps_old_ids_and_numbers_new_ones_in_order():
    n_id = torch.tensor([7, 2, 9])
    new, local = append_new_nodes(n_id, torch.tensor([5, 2, 11, 5, 7, 3]))
    assert new.tolist() == [3, 5, 11]
    assert local.tolist() == [4, 1, 5, 4, 0, 3]
    assert torch.equal(torch.cat([n_id, new])[local], torch.tensor([5, 2, 11, 5, 7, 3]))


# ----------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("replace", [False, True])
def test_sampled_edges_are_real_edges_with_bounded_degree(replace):
    graph = random_graph()
    fanouts = [4, 3]
    sub = sample(graph, fanouts, [5, 0, 17, 33], replace=replace)
    assert edge_set(graph) >= set(map(tuple, global_edges(sub, graph).t().tolist()))
    # e_id points at the same edges of the graph's edge_index
    assert torch.equal(graph.edge_index[:, sub.e_id], global_edges(sub, graph))
    start = 0
    for hop, fanout in enumerate(fanouts):
        count = sub.num_sampled_edges[hop]
        dst = sub.edge_index[1, start : start + count]
        assert int(torch.bincount(dst).max()) <= fanout
        start += count


def test_no_duplicate_edges_and_degree_at_most_fanout_takes_all():
    graph = random_graph()
    fanout = 6
    seeds = torch.arange(graph.num_nodes)
    sub = sample(graph, [fanout], seeds)
    assert sub.e_id.unique().numel() == sub.e_id.numel()
    per_target = torch.bincount(sub.edge_index[1], minlength=graph.num_nodes)
    assert torch.equal(per_target, graph.in_degree.clamp(max=fanout))
    # a target with deg <= fanout gets exactly its incoming edges
    small = int(torch.nonzero((graph.in_degree > 0) & (graph.in_degree <= fanout))[0])
    sampled = set(sub.e_id[sub.edge_index[1] == small].tolist())
    assert sampled == set(torch.nonzero(graph.dst == small).squeeze(1).tolist())


def test_without_replacement_is_uniform_over_a_hubs_neighbours():
    """Every neighbour of a node of degree 20 is drawn with probability fanout / 20."""
    src = torch.arange(1, 21)
    graph = Graph(torch.stack([src, torch.zeros_like(src)]), 21)
    sampler = NeighborSampler(graph, [5])
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(21)
    trials = 4000
    for _ in range(trials):
        sub = sampler.sample(torch.tensor([0]), gen)
        counts[sub.n_id[sub.edge_index[0]]] += 1
    freq = counts[1:] / trials
    assert torch.allclose(freq, torch.full((20,), 0.25), atol=0.035)


def test_seeds_first_in_order_and_targets_are_prefixes():
    graph = random_graph()
    seeds = [40, 3, 21, 8, 59]
    sub = sample(graph, [5, 4, 2], seeds)
    assert sub.n_id[: len(seeds)].tolist() == seeds and sub.batch_size == len(seeds)
    assert sub.n_id.unique().numel() == sub.n_id.numel()
    assert sum(sub.num_sampled_nodes) == sub.n_id.numel()
    assert sum(sub.num_sampled_edges) == sub.edge_index.size(1)
    # hop h's targets are exactly the nodes hop h - 1 added (each node is a target once)
    offsets = [0, *itertools.accumulate(sub.num_sampled_nodes)]
    start = 0
    for hop, count in enumerate(sub.num_sampled_edges):
        dst = sub.edge_index[1, start : start + count]
        src = sub.edge_index[0, start : start + count]
        if count:
            assert offsets[hop] <= int(dst.min()) and int(dst.max()) < offsets[hop + 1]
            assert int(src.max()) < offsets[hop + 2]
        start += count
    # edges are grouped by target
    assert bool((sub.edge_index[1, 1:] >= sub.edge_index[1, :-1]).all())


def test_blocks_are_consistent():
    graph = random_graph()
    sub = sample(graph, [5, 4, 2], [1, 2, 3, 4])
    blocks = sub.blocks
    assert len(blocks) == 3 and blocks[-1].num_dst_nodes == sub.batch_size
    nodes = list(itertools.accumulate(sub.num_sampled_nodes))
    edges = list(itertools.accumulate(sub.num_sampled_edges))
    for layer, block in enumerate(blocks):
        depth = 3 - layer
        assert (block.num_src_nodes, block.num_dst_nodes) == (nodes[depth], nodes[depth - 1])
        assert block.num_edges == edges[depth - 1]
        assert torch.equal(block.edge_index, sub.edge_index[:, : block.num_edges])
        assert int(block.src.max()) < block.num_src_nodes and int(block.dst.max()) < block.num_dst_nodes
    # each block's sources are the next block's... targets: widths chain
    for outer, inner in zip(blocks[:-1], blocks[1:]):
        assert outer.num_dst_nodes == inner.num_src_nodes


def test_reproducible_with_a_seed_and_different_across_seeds():
    graph = random_graph()
    a = sample(graph, [5, 3], [1, 2, 3], seed=11)
    b = sample(graph, [5, 3], [1, 2, 3], seed=11)
    c = sample(graph, [5, 3], [1, 2, 3], seed=12)
    assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index, b.edge_index)
    assert not (torch.equal(a.e_id, c.e_id) and torch.equal(a.n_id, c.n_id))


def test_isolated_seeds():
    graph = random_graph(isolated=5)
    isolated = [55, 57]
    sub = sample(graph, [4, 4], [*isolated, 3])
    assert sub.n_id[:3].tolist() == [*isolated, 3]
    targets = set(sub.n_id[sub.edge_index[1]].tolist())
    assert not targets & set(isolated) and not set(sub.n_id[sub.edge_index[0]].tolist()) & set(isolated)
    only_isolated = sample(graph, [4, 4], isolated, replace=True)
    assert only_isolated.num_sampled_nodes == [2, 0, 0] and only_isolated.edge_index.shape == (2, 0)
    assert [b.num_edges for b in only_isolated.blocks] == [0, 0]


def test_replace_draws_exactly_fanout_per_target_with_neighbours():
    graph = random_graph(isolated=3)
    seeds = torch.arange(graph.num_nodes)
    sub = sample(graph, [7], seeds, replace=True)
    per_target = torch.bincount(sub.edge_index[1], minlength=graph.num_nodes)
    assert torch.equal(per_target, torch.where(graph.in_degree > 0, 7, 0))
    # with a fanout above the degree, repeats must occur
    assert sub.e_id.unique().numel() < sub.e_id.numel()


def test_fanout_minus_one_takes_every_neighbour_and_zero_none():
    graph = random_graph()
    sub = sample(graph, [-1, 0], [4, 9])
    expected = sorted(torch.nonzero((graph.dst == 4) | (graph.dst == 9)).squeeze(1).tolist())
    assert sorted(sub.e_id.tolist()) == expected
    assert sub.num_sampled_edges[1] == 0 and sub.num_sampled_nodes[2] == 0


def star(weights: list[float]) -> Graph:
    n = len(weights)
    src = torch.arange(1, n + 1)
    return Graph(torch.stack([src, torch.zeros_like(src)]), n + 1, torch.tensor(weights))


def test_weighted_sampling_prefers_heavy_edges():
    weights = [10.0, 10.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    graph = star(weights)
    for replace in (False, True):
        sampler = NeighborSampler(graph, [2], weighted=True, replace=replace)
        gen = torch.Generator().manual_seed(5)
        counts = torch.zeros(len(weights) + 1)
        for _ in range(3000):
            sub = sampler.sample(torch.tensor([0]), gen)
            assert sub.edge_index.size(1) == 2
            counts[sub.n_id[sub.edge_index[0]]] += 1
        freq = counts[1:] / counts.sum()
        assert freq[6] == 0  # weight 0: never drawn
        assert float(freq[:2].min()) > 3 * float(freq[2:6].max())
        if replace:  # independent draws: frequencies are the normalised weights
            assert torch.allclose(freq, torch.tensor(weights) / sum(weights), atol=0.02)


def test_weighted_without_replacement_stays_distinct_and_skips_zero_weights():
    graph = star([1.0, 0.0, 2.0, 0.0])
    sub = sample(graph, [4], [0], weighted=True)
    assert sorted(sub.n_id[sub.edge_index[0]].tolist()) == [1, 3]


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(num_neighbors=5), TypeError),
        (dict(num_neighbors=[]), ValueError),
        (dict(num_neighbors=[3, -2]), ValueError),
        (dict(num_neighbors=[3], weighted=True), ValueError),
    ],
)
def test_bad_sampler_arguments(kwargs, error):
    with pytest.raises(error, match="num_neighbors|edge_weight"):
        NeighborSampler(random_graph(), **kwargs)


def test_bad_seeds():
    sampler = NeighborSampler(random_graph(), [3])
    with pytest.raises(IndexError, match="seeds"):
        sampler.sample(torch.tensor([0, 60]))
    with pytest.raises(ValueError, match="distinct"):
        sampler.sample(torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="seeds"):
        sampler.sample(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="negative|square|bipartite|source"):
        NeighborSampler(Graph(torch.tensor([[0], [1]]), (3, 2)), [2])


# ----------------------------------------------------------------------------- loader


def test_loader_covers_the_input_nodes_once_per_epoch():
    graph = random_graph()
    x = torch.randn(graph.num_nodes, 3)
    y = torch.arange(graph.num_nodes) * 10
    mask = torch.zeros(graph.num_nodes, dtype=torch.bool)
    mask[::3] = True
    loader = NeighborLoader(graph, [3, 2], batch_size=6, input_nodes=mask, x=x, y=y, seed=0)
    assert len(loader) == math.ceil(int(mask.sum()) / 6)
    seen = []
    for batch in loader:
        seeds = batch.n_id[: batch.batch_size]
        seen += seeds.tolist()
        assert torch.equal(batch.x, x[batch.n_id]) and torch.equal(batch.y, y[seeds])
        assert torch.equal(loader.input_nodes[batch.input_id], seeds)
        assert len(batch.blocks) == 2 and batch.graph.num_nodes == batch.num_nodes
    assert sorted(seen) == torch.nonzero(mask).squeeze(1).tolist()
    dropped = NeighborLoader(graph, [3], batch_size=6, input_nodes=mask, drop_last=True, shuffle=False)
    sizes = [b.batch_size for b in dropped]
    assert len(dropped) == len(sizes) == int(mask.sum()) // 6 and set(sizes) == {6}


def test_loader_epochs_are_reproducible_with_a_seed():
    graph = random_graph()

    def run(seed):
        loader = NeighborLoader(graph, [3, 2], batch_size=8, seed=seed)
        return [torch.cat([b.n_id, b.edge_index.flatten()]) for epoch in range(2) for b in loader]

    a, b, c = run(4), run(4), run(5)
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not all(torch.equal(p, q) for p, q in zip(a, c))
    assert not torch.equal(a[0], a[len(a) // 2])  # the second epoch is another draw


def test_loader_takes_a_node_dataset_and_id_inputs():
    data = generate_reddit_like(scale=0.002, seed=0, avg_degree=10)
    ids = torch.nonzero(data.val_mask).squeeze(1)
    loader = NeighborLoader(data, [4], batch_size=16, input_nodes=ids, shuffle=False)
    batch = next(iter(loader))
    assert torch.equal(batch.n_id[:16], ids[:16]) and torch.equal(batch.y, data.y[ids[:16]])
    assert batch.x.shape == (batch.num_nodes, data.num_features)
    with pytest.raises(ValueError, match="input_nodes"):
        NeighborLoader(data, [4], input_nodes=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="input_nodes"):
        NeighborLoader(data, [4], input_nodes=torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="batch_size"):
        NeighborLoader(data, [4], batch_size=0)
    with pytest.raises(TypeError, match="data must be"):
        NeighborLoader([1, 2], [4])
    with pytest.raises(ValueError, match="x must have one row per node"):
        NeighborLoader(data, [4], x=torch.randn(3, 2))


def _load_example():
    spec = importlib.util.spec_from_file_location("fusegnn_example_train_sampled", REPO / "examples" / "train_sampled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_on_sampled_batches_decreases_the_loss():
    """Two epochs of the example's SAGE on a small generated graph: the loss goes down,
    and full-graph inference runs on the same layers."""
    example = _load_example()
    torch.manual_seed(0)
    data = generate_reddit_like(scale=0.004, seed=0, avg_degree=12)
    loader = NeighborLoader(data, [5, 3], batch_size=64, input_nodes=data.train_mask, seed=0)
    model = example.SAGE(data.num_features, 32, data.num_classes, num_layers=2, dropout=0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = [example.train_epoch(model, loader, optimizer) for _ in range(2)]
    assert losses[1] < losses[0]
    acc = example.evaluate(model, data, data.graph, data.x)
    assert acc["train"] > 1.5 / data.num_classes


def test_example_cli_runs_on_a_generated_graph():
    example = _load_example()
    summary = example.main(["--dataset", "Reddit", "--synthetic", "--scale", "0.003", "--avg-degree", "10",
                            "--epochs", "1", "--hidden", "16", "--batch-size", "128", "--device", "cpu", "--quiet"])
    assert summary["epochs"] == 1 and len(summary["losses"]) == 1 and summary["val_acc"] >= 0


def _pyg_neighbor_loader_or_skip():
    """PyG's NeighborLoader, or a skip with the reason it cannot run here (it needs
    pyg-lib or torch-sparse, compiled extensions without PyPI wheels)."""
    loader_module = pytest.importorskip("torch_geometric.loader")
    from torch_geometric.data import Data

    data = Data(edge_index=torch.tensor([[0, 1], [1, 0]]), num_nodes=2)
    try:
        next(iter(loader_module.NeighborLoader(data, num_neighbors=[1], batch_size=1)))
    except ImportError as err:
        pytest.skip(f"torch_geometric.loader.NeighborLoader does not run here: {err}")
    return loader_module.NeighborLoader, Data


def test_statistics_match_pyg_neighbor_loader():
    """Mean sampled nodes / edges per hop agree with PyG's loader on the same graph."""
    PygLoader, Data = _pyg_neighbor_loader_or_skip()
    graph = random_graph(num_nodes=400, num_edges=8000, seed=2)
    data = Data(edge_index=graph.edge_index, num_nodes=graph.num_nodes)
    ours = NeighborLoader(graph, [6, 4], batch_size=32, seed=0)
    torch.manual_seed(0)
    theirs = PygLoader(data, num_neighbors=[6, 4], batch_size=32, shuffle=True)

    def means(loader):
        nodes = torch.tensor([b.num_sampled_nodes for b in loader], dtype=torch.float).mean(0)
        edges = torch.tensor([b.num_sampled_edges for b in loader], dtype=torch.float).mean(0)
        return nodes, edges

    (n_ours, e_ours), (n_pyg, e_pyg) = means(ours), means(theirs)
    # hop 1 covers every node once per epoch: sum(min(deg, 6)) in both; later hops are random
    assert e_ours[0] == e_pyg[0] and n_ours[0] == n_pyg[0]
    assert torch.allclose(e_ours, e_pyg, rtol=0.1)
    assert torch.allclose(n_ours, n_pyg, rtol=0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the lead's GPU check)")
@pytest.mark.parametrize("pin_features", [False, True])
def test_cuda_loader_samples_on_the_gpu(pin_features):
    """On CUDA: sampling on the device, features from the GPU or through pinned memory,
    reproducible with a seed, blocks on the device."""
    graph = random_graph(num_nodes=500, num_edges=20000, seed=4)
    x = torch.randn(graph.num_nodes, 8)
    y = torch.arange(graph.num_nodes)

    def epoch():
        loader = NeighborLoader(graph, [5, 3], batch_size=64, x=x, y=y, seed=1, device="cuda",
                                pin_features=pin_features)
        assert (loader.x.device.type == "cpu") == pin_features
        return list(loader)

    first, second = epoch(), epoch()
    for a, b in zip(first, second):
        assert torch.equal(a.n_id, b.n_id) and torch.equal(a.edge_index, b.edge_index)
        assert a.x.is_cuda and torch.equal(a.x.cpu(), x[a.n_id.cpu()]) and torch.equal(a.y.cpu(), a.n_id[:a.batch_size].cpu())
        assert all(block.device.type == "cuda" for block in a.blocks)
        assert edge_set(graph) >= set(map(tuple, a.n_id[a.edge_index].t().cpu().tolist()))
