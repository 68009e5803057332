"""fusegnn.loader against PyG ``NeighborLoader``'s documented semantics, with hypothesis.

Small CPU graphs with duplicate edges, self-loops, isolated nodes and a hub; each property
is what a PyG user relies on:

* every sampled edge is an edge of the input graph (``e_id`` names it, and ``n_id`` maps
  the local ``edge_index`` back onto it);
* hop ``h`` draws, for each node that hop ``h - 1`` added, ``min(deg, k)`` distinct
  incoming edges (``k`` with ``replace``; all of them for ``k = -1``; none for ``0``);
* the seeds come first in ``n_id``, in the batch's order; ``n_id`` has no repeats;
* an epoch's batches cover the input nodes exactly once (shuffled or not, ``drop_last``);
* a fixed seed fixes every batch, another seed changes them;
* ``x`` / ``y`` of a batch are the input's rows; no input is modified;
* bad arguments are Python errors that name the argument.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fusegnn.loader import NeighborLoader, NeighborSampler
from fusegnn.sparse import Graph


# ----------------------------------------------------------------------------- strategies


@st.composite
def graphs(draw, max_nodes: int = 12, weighted: bool = False) -> Graph:
    """A small directed graph: random edges plus, at will, a hub (every node points at
    node 0), self-loops and duplicated edges; some nodes may have no edge."""
    n = draw(st.integers(1, max_nodes))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n))
    if draw(st.booleans()):
        pairs += [(v, 0) for v in range(n)]  # a hub (with a self-loop)
    if pairs and draw(st.booleans()):
        pairs += pairs[: draw(st.integers(1, len(pairs)))]  # duplicate edges
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    edge_index = torch.tensor(pairs, dtype=dtype).reshape(-1, 2).t().contiguous()
    weight = None
    if weighted:
        weight = torch.tensor(
            draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]), min_size=len(pairs), max_size=len(pairs))),
            dtype=torch.float32,
        )
    return Graph(edge_index, n, weight)


fanouts = st.lists(st.integers(-1, 4), min_size=1, max_size=3)


def seeds_of(draw, n: int) -> torch.Tensor:
    ids = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    return torch.tensor(ids, dtype=torch.int64)


# ----------------------------------------------------------------------------- invariants


def check_subgraph(graph: Graph, sub, seeds: torch.Tensor, num_neighbors: list[int], replace: bool) -> None:
    """Every structural promise of the module docstring of :mod:`fusegnn.loader.sampler`."""
    n_id, edge_index, e_id = sub.n_id, sub.edge_index, sub.e_id
    assert n_id.dtype == torch.int64 and edge_index.dtype == torch.int64
    # seeds first, in order; nodes listed once
    assert torch.equal(n_id[: seeds.numel()], seeds) and sub.batch_size == seeds.numel()
    assert n_id.unique().numel() == n_id.numel()
    assert sum(sub.num_sampled_nodes) == n_id.numel() and len(sub.num_sampled_nodes) == len(num_neighbors) + 1
    assert sum(sub.num_sampled_edges) == edge_index.size(1) == e_id.numel()
    # every sampled edge is the graph's edge e_id, in local ids
    assert torch.equal(n_id[edge_index], graph.edge_index[:, e_id].long())
    offsets = [0, *itertools.accumulate(sub.num_sampled_nodes)]
    in_degree = torch.bincount(graph.dst.long(), minlength=graph.num_nodes)
    weight = graph.edge_weight
    start = 0
    for hop, (k, count) in enumerate(zip(num_neighbors, sub.num_sampled_edges)):
        dst, src = edge_index[1, start : start + count], edge_index[0, start : start + count]
        hop_e_id = e_id[start : start + count]
        # hop h's targets are exactly the nodes hop h - 1 added; its sources are known by then
        targets = torch.arange(offsets[hop], offsets[hop + 1])
        if count:
            assert bool(((dst >= offsets[hop]) & (dst < offsets[hop + 1])).all())
            assert int(src.max()) < offsets[hop + 2]
        # the nodes this hop adds are sources of its edges
        added = set(range(offsets[hop + 1], offsets[hop + 2]))
        assert added <= set(src.tolist())
        per_target = torch.bincount(dst - offsets[hop], minlength=targets.numel()) if count else torch.zeros(
            targets.numel(), dtype=torch.int64
        )
        deg = in_degree[n_id[targets]]
        if weight is not None:  # weight-0 edges are never drawn
            deg = torch.bincount(graph.dst.long()[weight > 0], minlength=graph.num_nodes)[n_id[targets]]
            assert bool((weight[hop_e_id] > 0).all())
        if k == -1:
            expected = deg
        elif replace:
            expected = torch.where(deg > 0, k, 0)
        else:
            expected = deg.clamp(max=k)
        assert per_target.tolist() == expected.tolist(), (hop, k)
        if not replace or k == -1:  # distinct edges per target
            assert hop_e_id.unique().numel() == hop_e_id.numel()
        start += count


# ----------------------------------------------------------------------------- sampler


@given(data=st.data(), replace=st.booleans(), weighted=st.booleans(), num_neighbors=fanouts)
def test_sampled_subgraphs_keep_every_promise(data, replace, weighted, num_neighbors):
    graph = data.draw(graphs(weighted=weighted))
    seeds = seeds_of(data.draw, graph.num_nodes)
    edge_index = graph.edge_index.clone()
    weight = None if graph.edge_weight is None else graph.edge_weight.clone()
    sampler = NeighborSampler(graph, num_neighbors, replace=replace, weighted=weighted)
    sub = sampler.sample(seeds, torch.Generator().manual_seed(data.draw(st.integers(0, 2**31))))
    check_subgraph(graph, sub, seeds, num_neighbors, replace)
    assert torch.equal(graph.edge_index, edge_index)
    assert weight is None or torch.equal(graph.edge_weight, weight)


@given(data=st.data(), replace=st.booleans(), num_neighbors=fanouts)
def test_blocks_chain_from_the_input_layer_to_the_seeds(data, replace, num_neighbors):
    graph = data.draw(graphs())
    seeds = seeds_of(data.draw, graph.num_nodes)
    sub = NeighborSampler(graph, num_neighbors, replace=replace).sample(seeds, torch.Generator().manual_seed(0))
    blocks = sub.blocks
    assert len(blocks) == len(num_neighbors) and blocks[-1].num_dst_nodes == seeds.numel()
    for outer, inner in zip(blocks[:-1], blocks[1:]):
        assert outer.num_dst_nodes == inner.num_src_nodes
    assert blocks[0].num_src_nodes == sub.n_id.numel()
    for block in blocks:
        assert torch.equal(block.edge_index, sub.edge_index[:, : block.num_edges])
        if block.num_edges:
            assert int(block.dst.max()) < block.num_dst_nodes and int(block.src.max()) < block.num_src_nodes


def test_a_hubs_neighbours_are_drawn_uniformly_at_every_fanout():
    """Node 0 has 9 in-neighbours; each is drawn with probability k / 9 (k = 1 .. 8)."""
    src = torch.arange(1, 10)
    graph = Graph(torch.stack([src, torch.zeros_like(src)]), 10)
    gen = torch.Generator().manual_seed(0)
    trials = 3000
    for k in range(1, 9):
        sampler = NeighborSampler(graph, [k])
        counts = torch.zeros(10)
        for _ in range(trials):
            sub = sampler.sample(torch.tensor([0]), gen)
            counts[sub.n_id[sub.edge_index[0]]] += 1
        freq = counts[1:] / trials
        assert torch.allclose(freq, torch.full((9,), k / 9), atol=0.04), (k, freq)


# ----------------------------------------------------------------------------- loader


def as_mask(ids: torch.Tensor, n: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[ids] = True
    return mask


@given(
    data=st.data(),
    batch_size=st.integers(1, 5),
    shuffle=st.booleans(),
    drop_last=st.booleans(),
    as_bool_mask=st.booleans(),
    num_neighbors=fanouts,
)
def test_an_epoch_covers_the_input_nodes_once(data, batch_size, shuffle, drop_last, as_bool_mask, num_neighbors):
    graph = data.draw(graphs())
    n = graph.num_nodes
    ids = seeds_of(data.draw, n)
    input_nodes = as_mask(ids, n) if as_bool_mask else ids
    x = torch.randn(n, 3)
    y = torch.arange(n) * 7
    saved = [t.clone() for t in (graph.edge_index, x, y, input_nodes)]
    loader = NeighborLoader(graph, num_neighbors, batch_size, input_nodes, x=x, y=y, shuffle=shuffle,
                            drop_last=drop_last, seed=data.draw(st.integers(0, 1000)))
    expected = torch.sort(ids).values if as_bool_mask else ids
    full, rest = divmod(expected.numel(), batch_size)
    assert len(loader) == full + (0 if drop_last or not rest else 1)
    seen = []
    for batch in loader:
        seeds = batch.n_id[: batch.batch_size]
        assert batch.batch_size == batch_size or (not drop_last and batch.batch_size == rest)
        assert torch.equal(loader.input_nodes[batch.input_id], seeds)
        assert torch.equal(batch.x, x[batch.n_id]) and torch.equal(batch.y, y[seeds])
        check_subgraph(graph, batch.subgraph, seeds, num_neighbors, replace=False)
        seen += seeds.tolist()
    if drop_last:
        assert len(seen) == full * batch_size and len(set(seen)) == len(seen) and set(seen) <= set(ids.tolist())
    else:
        assert sorted(seen) == sorted(ids.tolist())
    if not shuffle:
        assert seen == expected.tolist()[: len(seen)]
    for before, after in zip(saved, (graph.edge_index, x, y, input_nodes)):
        assert torch.equal(before, after)


def epoch_signature(loader) -> list[torch.Tensor]:
    return [torch.cat([b.n_id, b.edge_index.flatten(), b.e_id]) for b in loader]


def test_a_fixed_seed_fixes_every_epoch_and_another_seed_changes_them():
    src = torch.randint(0, 40, (400,), generator=torch.Generator().manual_seed(0))
    dst = torch.randint(0, 40, (400,), generator=torch.Generator().manual_seed(1))
    graph = Graph(torch.stack([src, dst]), 40)
    for replace in (False, True):
        def run(seed):
            loader = NeighborLoader(graph, [3, 2], batch_size=7, seed=seed, replace=replace)
            return [s for _ in range(3) for s in epoch_signature(loader)]

        a, b, c = run(3), run(3), run(4)
        assert len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b))
        assert not all(torch.equal(p, q) for p, q in zip(a, c))


def test_torch_manual_seed_fixes_a_loader_without_a_seed():
    graph = Graph(torch.randint(0, 30, (2, 200), generator=torch.Generator().manual_seed(0)), 30)

    def run():
        torch.manual_seed(123)
        return epoch_signature(NeighborLoader(graph, [3, 2], batch_size=8))

    assert all(torch.equal(p, q) for p, q in zip(run(), run()))


def test_training_a_model_on_the_blocks_runs_and_learns():
    """A 2-layer SAGE on the blocks of each batch (layers take ``(x_src, x_dst)`` and a
    bipartite block) trains: the loss goes down on a learnable toy task."""
    from fusegnn.layers import SAGEConv

    torch.manual_seed(0)
    n = 60
    y = torch.arange(n) % 3
    src = torch.randint(0, n, (600,))
    dst = torch.randint(0, n, (600,))
    keep = y[src] == y[dst]  # homophilous: neighbours share the label
    graph = Graph(torch.stack([src[keep], dst[keep]]), n)
    x = torch.nn.functional.one_hot(y, 3).float() + 0.5 * torch.randn(n, 3)
    convs = torch.nn.ModuleList([SAGEConv(3, 16), SAGEConv(16, 3)])
    optimizer = torch.optim.Adam(convs.parameters(), lr=0.02)
    loader = NeighborLoader(graph, [4, 3], batch_size=16, x=x, y=y, seed=0)
    losses = []
    for _ in range(15):
        total = 0.0
        for batch in loader:
            h = batch.x
            for layer, (conv, block) in enumerate(zip(convs, batch.blocks)):
                h = conv((h, h[: block.num_dst_nodes]), block)
                if layer == 0:
                    h = torch.relu(h)
            assert h.shape == (batch.batch_size, 3)
            loss = torch.nn.functional.cross_entropy(h, batch.y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * batch.batch_size
        losses.append(total / n)
    assert losses[-1] < 0.7 * losses[0]


# ----------------------------------------------------------------------------- bad input


def small_graph() -> Graph:
    return Graph(torch.tensor([[1, 2, 3, 0], [0, 0, 1, 2]]), 5)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        (dict(batch_size=-1), ValueError, "batch_size"),
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(batch_size=2.5), ValueError, "batch_size"),
        (dict(num_neighbors=[2, -2]), ValueError, "num_neighbors"),
        (dict(num_neighbors=[]), ValueError, "num_neighbors"),
        (dict(num_neighbors=3), TypeError, "num_neighbors"),
        (dict(input_nodes=torch.tensor([5])), IndexError, "input_nodes"),
        (dict(input_nodes=torch.tensor([-1])), IndexError, "input_nodes"),
        (dict(input_nodes=torch.tensor([1, 1])), ValueError, "input_nodes"),
        (dict(input_nodes=torch.ones(4, dtype=torch.bool)), ValueError, "input_nodes"),
        (dict(input_nodes=[0, 1]), TypeError, "input_nodes"),
        (dict(x=torch.randn(4, 2)), ValueError, "x"),
        (dict(y=torch.zeros(6)), ValueError, "y"),
        (dict(seed=1.5), TypeError, "seed"),  # was silently truncated to 1
        (dict(seed="7"), TypeError, "seed"),  # was int()'s "invalid literal", no argument named
        (dict(seed=True), TypeError, "seed"),
        (dict(seed=2**64), ValueError, "seed"),  # was the generator's "Overflow when unpacking long long"
    ],
)
def test_bad_loader_arguments_name_the_argument(kwargs, error, name):
    args = dict(num_neighbors=[2])
    args.update(kwargs)
    with pytest.raises(error, match=name):
        NeighborLoader(small_graph(), **args)


def test_seeds_of_any_64_bit_integer_type_are_taken():
    import numpy as np

    graph = small_graph()
    for seed in (np.int64(5), -1, 2**64 - 1):
        loader = NeighborLoader(graph, [2], batch_size=2, seed=seed)
        assert loader.seed == int(seed)
    assert epoch_signature(NeighborLoader(graph, [2], batch_size=2, seed=np.int64(5))) is not None


def test_a_large_fanout_costs_the_edges_it_returns(monkeypatch):
    """Floyd's O(k^2) draw runs only for targets with more than k edges: a fanout of
    5000 on a graph of degree <= 9 returns every edge without building any [T, k, k]
    comparison (it used to, for every target: seconds per batch)."""
    from fusegnn.loader import draws

    shapes = []
    floyd = draws.floyd_positions

    def recording(deg, k, u):
        shapes.append((deg.numel(), k))
        return floyd(deg, k, u)

    monkeypatch.setattr(draws, "floyd_positions", recording)
    src = torch.arange(1, 10)
    graph = Graph(torch.cat([torch.stack([src, torch.zeros_like(src)]), torch.tensor([[0, 2], [1, 1]])], 1), 10)
    sub = NeighborSampler(graph, [5000]).sample(torch.arange(10), torch.Generator().manual_seed(0))
    assert shapes == [] and sorted(sub.e_id.tolist()) == list(range(graph.num_edges))
    sub = NeighborSampler(graph, [3]).sample(torch.arange(10), torch.Generator().manual_seed(0))
    assert shapes == [(1, 3)]  # node 0 (9 in-edges) only; node 1 (2) takes both
    assert torch.bincount(sub.edge_index[1], minlength=10).tolist() == [3, 2] + [0] * 8


def test_weighted_draws_with_replacement_do_not_depend_on_other_targets_weights():
    """Node 2's edges (weights 1e-8 and 3e-8) follow node 0's edge of weight 1e9 in the
    grouped order. A running sum over all edges (float64 steps by 1.2e-7 at 1e9) saw
    node 2's total as 0: it got no edge at all instead of exactly k, drawn 1 : 3."""
    graph = Graph(torch.tensor([[1, 3, 4], [0, 2, 2]]), 5, torch.tensor([1e9, 1e-8, 3e-8], dtype=torch.float64))
    sampler = NeighborSampler(graph, [400], weighted=True, replace=True)
    sub = sampler.sample(torch.tensor([2, 0]), torch.Generator().manual_seed(0))
    sources = sub.n_id[sub.edge_index[0, sub.edge_index[1] == 0]]  # node 2 is local 0
    assert sources.numel() == 400
    share = float((sources == 4).float().mean())
    assert abs(share - 0.75) < 0.07


def test_weighted_draws_with_replacement_never_take_a_zero_weight_edge(monkeypatch):
    """With the largest uniform below 1, a draw must be the last edge of positive weight,
    not the weight-0 edge after it (a running sum over all edges put node 1's level at
    ``1e6 + u * 3``, which rounds up to ``1e6 + 3``, and took the weight-0 edge)."""
    from fusegnn.loader import draws

    def top_uniforms(deg, k, generator):
        return torch.full((deg.numel(), k), 1.0 - 2.0**-53, dtype=torch.float64)

    monkeypatch.setattr(draws, "_uniforms", top_uniforms)
    graph = Graph(torch.tensor([[4, 1, 2, 3], [0, 1, 1, 1]]), 5, torch.tensor([1e6, 1.0, 2.0, 0.0]))
    sub = NeighborSampler(graph, [2], weighted=True, replace=True).sample(torch.tensor([1]))
    assert sub.e_id.tolist() == [2, 2]


@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=8), data=st.data())
def test_segment_cumsum_restarts_at_every_segment(sizes, data):
    from fusegnn.loader.draws import segment_cumsum

    values = torch.tensor(data.draw(st.lists(st.floats(0, 100), min_size=sum(sizes), max_size=sum(sizes))),
                          dtype=torch.float32)
    ptr = torch.tensor([0, *itertools.accumulate(sizes)])
    expected = torch.cat([torch.cumsum(part.double(), 0) for part in values.split(sizes)])
    assert torch.allclose(segment_cumsum(values, ptr), expected, rtol=1e-12, atol=0)


def test_num_neighbors_of_numpy_ints_are_taken_as_ints():
    """``list(np.array([2, 1]))`` holds np.int64: it was refused as 'not ints'."""
    import numpy as np

    loader = NeighborLoader(small_graph(), list(np.array([2, 1])), batch_size=2, seed=0)
    assert loader.num_neighbors == [2, 1] and all(type(k) is int for k in loader.num_neighbors)
    assert len(next(iter(loader)).blocks) == 2


def test_a_batch_size_of_numpy_int_is_taken_as_an_int():
    """``batch_size=np.int64(2)`` (a size computed with NumPy) was refused with 'batch_size
    must be a positive int, got np.int64(2)'; counts elsewhere take NumPy ints."""
    import numpy as np

    loader = NeighborLoader(small_graph(), [2], batch_size=np.int64(2), seed=0, shuffle=False)
    assert loader.batch_size == 2 and type(loader.batch_size) is int and len(loader) == 3
    assert [batch.batch_size for batch in loader] == [2, 2, 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the lead's GPU check)")
@pytest.mark.parametrize("replace", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_cuda_sampling_keeps_every_promise(replace, weighted):
    """The same invariants with sampling on the GPU (Floyd on hub rows only, the
    segmented running sums and binary search of weighted draws with replacement)."""
    gen = torch.Generator().manual_seed(0)
    src = torch.cat([torch.randint(0, 300, (3000,), generator=gen), torch.arange(1, 300)])
    dst = torch.cat([torch.randint(0, 300, (3000,), generator=gen), torch.zeros(299, dtype=torch.int64)])
    weight = torch.rand(src.numel(), generator=gen).double() * 10.0 ** torch.randint(-9, 9, (src.numel(),), generator=gen)
    graph = Graph(torch.stack([src, dst]), 300, weight if weighted else None)
    sampler = NeighborSampler(graph, [40, 5, -1], replace=replace, weighted=weighted, device="cuda")
    seeds = torch.randperm(300, generator=gen)[:64]
    cuda_gen = torch.Generator(device="cuda").manual_seed(1)
    first = sampler.sample(seeds, cuda_gen)
    assert first.n_id.is_cuda and first.edge_index.is_cuda
    cpu = type(first)(first.n_id.cpu(), first.edge_index.cpu(), first.e_id.cpu(), first.num_sampled_nodes,
                      first.num_sampled_edges)
    check_subgraph(graph, cpu, seeds, [40, 5, -1], replace)
    again = sampler.sample(seeds, torch.Generator(device="cuda").manual_seed(1))
    assert torch.equal(first.e_id, again.e_id) and torch.equal(first.n_id, again.n_id)
