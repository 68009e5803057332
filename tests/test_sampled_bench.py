"""Suite ``sampled`` (benchmarks/sampled.py): a CPU smoke run and its plain-torch baseline sampler."""

from __future__ import annotations

import json

import torch

from benchmarks.sampled import pyg_unavailable, run_sampled
from benchmarks.sampled_baseline import SortingLoader
from fusegnn.datasets import generate_reddit_like


def test_sampled_suite_smoke_on_cpu(tmp_path):
    """Every backend gets a record (PyG's: a result or the reason it cannot run), the
    JSON and the markdown are written."""
    markdown = run_sampled(torch.device("cpu"), tmp_path, scale=0.001, avg_degree=8, cases=["sampled-reddit-*"],
                           backends=["fusegnn", "torch", "pyg"], phase_s=30, png=False)
    doc = json.loads((tmp_path / "sampled" / "cpu.json").read_text())
    records = {r["backend"]: r for r in doc["records"]}
    assert set(records) == {"fusegnn", "torch", "pyg"}
    for backend in ("fusegnn", "torch"):
        r = records[backend]
        assert r["ok"] and r["case"] == "sampled-reddit-sage-25x10"
        assert r["sample_s"] > 0 and r["train_s"] > 0 and r["seeds_per_s"] > 0
        assert r["sample_batches"] == r["train_batches"] == r["batches"] == 1
    reason = pyg_unavailable()
    assert records["pyg"]["ok"] == (reason is None)
    if reason is not None:
        assert reason in records["pyg"]["error"] and reason in doc["unavailable"]["pyg"]
    assert doc["datasets"]["reddit"]["nodes"] == 233
    assert "| sampled-reddit-sage-25x10 | fusegnn |" in markdown
    assert (tmp_path / "sampled" / "cpu.md").read_text().startswith("## `sampled`")


def test_sorting_baseline_samples_real_edges_within_the_fanout():
    data = generate_reddit_like(scale=0.002, seed=0, avg_degree=30)
    graph = data.graph
    seeds = torch.nonzero(data.train_mask).squeeze(1)
    loader = SortingLoader(graph, data.x, data.y, seeds, [6, 3], batch_size=50, seed=0)
    edges = set(map(tuple, graph.edge_index.t().tolist()))
    batch = next(iter(loader))
    outer, inner = batch.blocks
    assert inner.num_dst_nodes == batch.batch_size == 50 and outer.num_dst_nodes == inner.num_src_nodes
    assert int(torch.bincount(inner.dst).max()) <= 6 and int(torch.bincount(outer.dst[inner.num_edges:]).max()) <= 3
    n_id = batch.n_id
    assert n_id.unique().numel() == n_id.numel() and torch.equal(batch.x, data.x[n_id])
    assert set(map(tuple, n_id[outer.edge_index].t().tolist())) <= edges
    assert torch.equal(batch.y, data.y[n_id[:50]])
