"""fusegnn.distributed: partitions, a worker's share, the halo exchange, and GCN / GAT
trained by 2 processes (gloo on the CPU) against single-process training on the same
graph (float64: outputs and summed parameter gradients within 1e-6)."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fusegnn.distributed import DistGraph, allreduce_gradients, global_count, partition_graph
from fusegnn.layers import APPNP, GATConv, GATv2Conv, GCNConv, GINConv, SAGEConv, SGConv
from fusegnn.sparse import Graph, HaloGraph, spmm
from tests.graphs import random_graph
from tests.gloo_workers import free_port

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_NODES, NUM_EDGES, FEATURES, CLASSES = 40, 170, 6, 3


def _graph() -> Graph:
    """Isolated nodes, a hub of in-degree 15, self-loops (a duplicated one), duplicates."""
    return Graph(random_graph(NUM_NODES, NUM_EDGES, seed=3, hub_degree=15), NUM_NODES)


def _node_data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_NODES, FEATURES, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (NUM_NODES,), generator=gen)
    train = torch.rand(NUM_NODES, generator=gen) < 0.6
    return x, y, train


class TwoLayers(nn.Module):
    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x, graph):
        return self.second(F.elu(self.first(x, graph)), graph)


def _models(aggregation: str) -> dict:
    """Fresh models (seeded: the same parameters on every worker)."""
    torch.manual_seed(0)
    return {
        "gcn": TwoLayers(GCNConv(FEATURES, 8, aggregation=aggregation), GCNConv(8, CLASSES, aggregation=aggregation)),
        # first layer: in < heads' width, so GAT aggregates x first (the gat_attention path)
        "gat": TwoLayers(GATConv(FEATURES, 8, heads=2, aggregation=aggregation),
                         GATConv(16, CLASSES, heads=2, concat=False, aggregation=aggregation)),
        "gatv2": TwoLayers(GATv2Conv(FEATURES, 8, heads=2, aggregation=aggregation),
                           GATv2Conv(16, CLASSES, heads=2, concat=False, aggregation=aggregation)),
        "sage": TwoLayers(SAGEConv(FEATURES, 8, aggregation=aggregation), SAGEConv(8, CLASSES, aggregation=aggregation)),
        "gin": TwoLayers(GINConv(nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 8)),
                                 aggregation=aggregation),
                         GINConv(nn.Linear(8, CLASSES), aggregation=aggregation)),
        # SGC and APPNP: K steps of propagate, each fetching the halo of the step before
        "sgc": TwoLayers(SGConv(FEATURES, 8, K=2, aggregation=aggregation), SGConv(8, CLASSES, K=1, aggregation=aggregation)),
        "appnp": TwoLayers(SGConv(FEATURES, CLASSES, K=1, aggregation=aggregation),
                           APPNP(K=3, alpha=0.1, aggregation=aggregation)),
    }

MODELS = ("gcn", "gat", "gatv2", "sage", "gin", "sgc", "appnp")


def _loss_and_grads(model, out, y, train, count):
    loss = F.cross_entropy(out[train], y[train], reduction="sum") / count
    loss.backward()
    return loss


def _worker(rank: int, world_size: int, init: str, out_dir: str, aggregations: list[str]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        graph = _graph()
        x, y, train = _node_data()
        dg = DistGraph.build(graph, partition_graph(graph, world_size, "contiguous"))
        x_own, y_own, train_own = dg.owned_rows(x), dg.owned_rows(y), dg.owned_rows(train)
        count = global_count(train_own)
        report = {}
        for aggregation in aggregations:
            for name, model in _models(aggregation).items():
                model = model.double()
                single = copy.deepcopy(model)
                out_single = single(x, graph)
                _loss_and_grads(single, out_single, y, train, int(train.sum()))
                out = model(x_own, dg)
                _loss_and_grads(model, out, y_own, train_own, count)
                allreduce_gradients(model)
                full = dg.gather(out.detach())
                grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), single.parameters())]
                report[f"{name}-{aggregation}"] = dict(
                    out=float((full - out_single.detach()).abs().max()),
                    out_bitwise=bool(torch.equal(full, out_single.detach())),
                    grad=max(float((g - h).abs().max()) for g, h in grads),
                    grads_bitwise=all(torch.equal(g, h) for g, h in grads),
                    exchanges=dg.log.calls,
                )
                dg.log.reset()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs fused kernels on CPU tensors through Triton's interpreter, which conftest enables only without a "
                    "CUDA device")
def test_two_workers_match_single_process(tmp_path):
    """Every layer that aggregates (GCN, GAT, GATv2, GraphSAGE, GIN, SGC, APPNP), forward +
    backward, on 2 gloo workers: the same outputs and summed gradients as one process, on
    the reference path and on the fused kernels (Triton's interpreter on the CPU)."""
    mp = pytest.importorskip("torch.multiprocessing")
    aggregations = ["reference", "gar"]
    init = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_worker, args=(2, init, str(tmp_path), aggregations), nprocs=2, join=True)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(report) == sorted(f"{m}-{a}" for m in MODELS for a in aggregations)
        for case, r in report.items():
            assert r["out"] <= 1e-6, (rank, case, r)
            assert r["grad"] <= 1e-6, (rank, case, r)
            assert r["exchanges"] > 0, (rank, case, r)
        # the reference GCN aggregates every target's edges in the global order: bitwise
        assert report["gcn-reference"]["out_bitwise"], report["gcn-reference"]


# ---------------------------------------------------------------------------------- partition
@pytest.mark.parametrize("balance_on", ["nodes", "edges"])
@pytest.mark.parametrize("num_parts", [1, 2, 3, 5])
def test_contiguous_partition(num_parts, balance_on):
    graph = _graph()
    part = partition_graph(graph, num_parts, "contiguous", balance_on=balance_on)
    assert part.method == "contiguous" and part.num_parts == num_parts
    assert sorted(part.perm.tolist()) == list(range(NUM_NODES))  # every node in exactly one part
    for p in range(num_parts):
        assert (part.parts[part.nodes(p)] == p).all()
    src, dst = graph.edge_index.tolist()
    cut = sum(1 for j, i in zip(src, dst) if part.parts[j] != part.parts[i])
    assert part.edge_cut == cut
    sizes = part.sizes()
    assert min(sizes) >= 1 and sum(sizes) == NUM_NODES
    assert part.balance == pytest.approx(max(sizes) / (NUM_NODES / num_parts))
    if balance_on == "nodes":
        assert max(sizes) - min(sizes) <= 1
    again = partition_graph(graph, num_parts, "contiguous", balance_on=balance_on)  # deterministic
    assert torch.equal(again.parts, part.parts) and torch.equal(again.perm, part.perm)


@pytest.mark.parametrize("num_parts", [2, 3])
def test_contiguous_edge_balance_cuts_nearest_the_share(num_parts):
    """``balance_on="edges"`` (the default) cuts the locality order where the running
    weight (in-degree + 1 per node) is nearest each part's share: every cut within half a
    node's weight of it. The node that crossed the share always went to the earlier part,
    so a hub there gave parts of weight 13 and 1 (a 7-node star, two parts) where 6 and 8 were open."""
    from fusegnn.distributed.partition import locality_order

    spokes = torch.arange(1, 7)
    edge_index = torch.stack([torch.cat([spokes, torch.tensor([1])]), torch.cat([torch.zeros(6, dtype=torch.long),
                                                                               torch.tensor([2])])])
    part = partition_graph(edge_index, num_parts, "contiguous")
    src, dst = edge_index.numpy()
    order = locality_order(src, dst, 7)
    weight = torch.bincount(edge_index[1], minlength=7).double() + 1
    running = torch.cumsum(weight[torch.from_numpy(order)], 0)
    sizes = torch.bincount(part.parts, minlength=num_parts)
    for k in range(1, num_parts):
        reached = float(running[int(sizes[:k].sum()) - 1])
        share = float(running[-1]) * k / num_parts
        assert abs(reached - share) <= weight.max() / 2, (k, reached, share, part.parts.tolist())


def test_partition_methods_and_errors():
    graph = _graph()
    auto = partition_graph(graph, 2)
    assert auto.method in ("metis", "contiguous")
    with pytest.raises(ValueError, match="method"):
        partition_graph(graph, 2, "spectral")
    with pytest.raises(ValueError, match="num_parts"):
        partition_graph(graph, 0)
    with pytest.raises(ValueError, match="exceeds"):
        partition_graph(graph, NUM_NODES + 1)


def test_metis_partition_when_installed():
    pytest.importorskip("pymetis")
    graph = _graph()
    part = partition_graph(graph, 2, "metis")
    assert part.method == "metis" and sorted(part.perm.tolist()) == list(range(NUM_NODES))
    assert torch.equal(partition_graph(graph, 2, "metis").parts, part.parts)


def test_metis_balances_edges_or_nodes():
    """METIS with ``balance_on="edges"`` (the default) evens the parts' incoming edges,
    with ``"nodes"`` their node counts: on a graph whose in-degrees are skewed, each is
    better balanced in its own measure than the other."""
    pytest.importorskip("pymetis")
    from fusegnn.datasets import generate_reddit_like

    data = generate_reddit_like(0.01, device="cpu", seed=3)
    dst = data.edge_index[1]

    def spread(part):
        edges = torch.bincount(part.parts[dst], minlength=4).double()
        nodes = torch.tensor(part.sizes(), dtype=torch.float64)
        return float(edges.max() / edges.mean()), float(nodes.max() / nodes.mean())

    by_edges, by_nodes = (partition_graph(data.edge_index, 4, "metis", balance_on=b) for b in ("edges", "nodes"))
    assert torch.equal(partition_graph(data.edge_index, 4, "metis").parts, by_edges.parts)  # the default
    assert (by_edges.balanced_on, by_nodes.balanced_on) == ("edges", "nodes")
    (e_edges, n_edges), (e_nodes, n_nodes) = spread(by_edges), spread(by_nodes)
    assert e_edges < e_nodes and e_edges <= 1.03
    assert n_nodes < n_edges and n_nodes <= 1.03


def test_metis_with_a_hub_heavier_than_a_share_keeps_every_part():
    """A hub whose incoming edges outweigh one part's share of them (a small star graph,
    4 parts) cannot be edge-balanced without leaving a part empty: METIS weighted by
    in-degree + 1 left part 0 empty and the default ``balance_on="edges"`` raised where
    ``"nodes"`` (the default before) partitioned the graph; it falls back to node counts."""
    pytest.importorskip("pymetis")
    spokes = torch.arange(1, 8)
    hub = torch.zeros_like(spokes)
    edge_index = torch.cat([torch.stack([spokes, hub]), torch.stack([hub, spokes]), torch.stack([spokes, hub])], 1)
    part = partition_graph(edge_index, 4, "metis")
    assert part.num_parts == 4 and min(part.sizes()) >= 1 and sum(part.sizes()) == 8


# ---------------------------------------------------------------------------------- DistGraph
def test_shares_are_consistent():
    """Every worker's incoming edges are the global ones of its nodes, in order; what
    ``r`` sends to ``q`` is, row for row, what ``q`` expects from ``r``."""
    graph = _graph()
    part = partition_graph(graph, 3, "contiguous")
    shares = [DistGraph.build(graph, part, rank) for rank in range(3)]
    src, dst = graph.edge_index
    assert sum(s.num_own for s in shares) == NUM_NODES
    for r, share in enumerate(shares):
        g = share.graph
        assert isinstance(g, HaloGraph) and g.num_src_nodes == share.num_own + share.num_halo
        assert g.num_dst_nodes == share.num_own
        ids = torch.cat([share.owned, share.halo])  # local id -> global id
        mine = part.parts[dst] == r
        assert torch.equal(ids[g.src], src[mine]) and torch.equal(ids[g.dst], dst[mine])
        assert (part.parts[share.halo] != r).all() and share.recv_counts[r] == 0 and share.send_counts[r] == 0
        send_global = share.owned[share.send_index]
        for q, other in enumerate(shares):
            sent = send_global[sum(share.send_counts[:q]):sum(share.send_counts[:q + 1])]
            expected = other.halo[sum(other.recv_counts[:r]):sum(other.recv_counts[:r + 1])]
            assert torch.equal(sent, expected), (r, q)


def test_one_worker_is_the_single_process_model():
    """N = 1 without a process group: no halo, no collective, the same numbers bitwise."""
    graph = _graph()
    x, _, _ = _node_data()
    dg = DistGraph.build(graph, partition_graph(graph, 1))
    assert dg.num_halo == 0 and dg.send_index.numel() == 0
    x_own = dg.owned_rows(x)
    for model in _models("reference").values():
        model = model.double()
        out = dg.gather(model(x_own, dg))
        assert torch.equal(out, model(x, graph))
    assert torch.equal(dg.gather(spmm(dg, x_own)), spmm(graph, x))


def test_halo_graph_processing_and_errors():
    """A HaloGraph keeps its kind through re-weighting and self-loop processing, wants
    owned rows, and is refused under torch.compile's graph references."""
    from fusegnn.sparse.graph_ref import graph_ref
    from fusegnn.sparse.processing import gat_self_loops

    graph = _graph()
    dg = DistGraph.build(graph, partition_graph(graph, 2, "contiguous"), 0)
    g = dg.graph
    assert isinstance(g.with_edge_weight(torch.ones(g.num_edges)), HaloGraph)
    loops = gat_self_loops(g)
    assert isinstance(loops, HaloGraph) and loops.num_own == g.num_own
    own_loops = loops.src == loops.dst
    assert int(own_loops.sum()) == g.num_own and (loops.src[own_loops] < g.num_own).all()
    with pytest.raises(ValueError, match="owned nodes"):
        spmm(dg, torch.zeros(NUM_NODES, 2))
    with pytest.raises(ValueError, match="owns"):
        GCNConv(FEATURES, 2)(torch.zeros(NUM_NODES, FEATURES), dg)
    with pytest.raises(TypeError, match="eagerly"):
        graph_ref(dg)


# ---------------------------------------------------------------------------------- the example
def test_example_on_two_cpu_workers():
    """``torchrun --nproc-per-node 2 examples/train_distributed.py --device cpu`` trains GCN
    on Cora (gloo) and rank 0 prints the JSON summary."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    data = os.environ.get("FUSEGNN_DATA") or str(repo.parent / "shared" / "data" / "planetoid")
    if not (Path(data) / "Cora" / "raw" / "ind.cora.graph").is_file():
        pytest.skip("Planetoid raw files not found ($FUSEGNN_DATA or ../shared/data/planetoid)")
    env = dict(os.environ, FUSEGNN_DATA=data, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
         str(repo / "examples" / "train_distributed.py"), "--device", "cpu", "--runs", "1", "--epochs", "3",
         "--json", "--quiet"],
        capture_output=True, text=True, env=env, timeout=300, cwd=repo,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1  # rank 0 only
    summary = json.loads(summaries[0])
    assert summary["world_size"] == 2 and summary["dataset"] == "Cora" and summary["model"] == "gcn"
    assert summary["partition"]["edge_cut"] > 0 and min(summary["halo_nodes"]) > 0
    assert summary["bytes_sent_per_step_rank0"] > 0 and 0.0 <= summary["test_acc_mean"] <= 1.0
