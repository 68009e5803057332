"""``aggregation="auto"`` and the row windows: the tile-density estimate
(:mod:`fusegnn.sparse.tile_density`) against the exact count, and the rule that picks
``"window"`` from :data:`~fusegnn.sparse.dispatch.WINDOW_MIN_TILE_DENSITY` up (eager
``spmm`` on CUDA; checked through ``_window_rule`` on the CPU)."""

from __future__ import annotations

import pytest
import torch

from fusegnn.sparse import Graph, dispatch, spmm, window_tile_density
from fusegnn.sparse.tile_density import WINDOW_ROWS, estimate_tile_density
from tests.graphs import random_graph

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _local_graph(num_nodes: int, degree: int, block: int, locality: float, seed: int = 0) -> Graph:
    """``degree`` in-edges per node, sources in the target's block of ``block`` nodes with
    probability ``locality`` (else anywhere)."""
    gen = torch.Generator().manual_seed(seed)
    dst = torch.arange(num_nodes).repeat_interleave(degree)
    start = (dst // block) * block
    near = start + (torch.rand(dst.numel(), generator=gen) * torch.clamp(num_nodes - start, max=block)).long()
    far = torch.randint(0, num_nodes, (dst.numel(),), generator=gen)
    src = torch.where(torch.rand(dst.numel(), generator=gen) < locality, near, far)
    return Graph(torch.stack([src, dst]).to(DEVICE), num_nodes)


@pytest.mark.parametrize("kind", ["nasty", "random", "bipartite", "local"])
def test_estimate_is_exact_when_every_window_is_counted(kind, nasty_graph):
    graph = {
        "nasty": lambda: nasty_graph.to(DEVICE),
        "random": lambda: Graph(random_graph(300, 2_000, 3, hub_degree=60).to(DEVICE), 300),
        "bipartite": lambda: Graph(random_graph(90, 700, 4, num_dst_nodes=50).to(DEVICE), (90, 50)),
        "local": lambda: _local_graph(500, 12, 32, 0.9),
    }[kind]()
    assert estimate_tile_density(graph) == pytest.approx(window_tile_density(graph, WINDOW_ROWS))


def test_sampled_estimate_is_close_and_cached(monkeypatch):
    graph = _local_graph(20_000, 10, 64, 0.7, seed=1)
    exact = window_tile_density(graph, WINDOW_ROWS)
    estimate = estimate_tile_density(graph, windows=300)  # of 1,250 windows
    assert estimate == pytest.approx(exact, rel=0.1)
    assert estimate_tile_density(graph, windows=300, cached_only=True) == estimate
    assert estimate_tile_density(graph, windows=301, cached_only=True) is None  # never computed


def test_estimate_edge_cases():
    empty = Graph(torch.zeros(2, 0, dtype=torch.long, device=DEVICE), 40)
    assert estimate_tile_density(empty) == 0.0
    with pytest.raises(ValueError, match="W and windows"):
        estimate_tile_density(empty, 0)
    block = _local_graph(64, 16, 16, 1.0)  # 16-node blocks with 16 sources each: duplicates
    assert 0.25 < estimate_tile_density(block) <= 1.0


def test_window_rule(monkeypatch):
    """Dense windows: "window"; a random graph or a capture: the rule declines."""
    monkeypatch.setattr(dispatch, "_usable", lambda name, graph, tensors: True)
    clustered = _local_graph(4_096, 16, 16, 1.0)
    scattered = _local_graph(4_096, 16, 16, 0.0)
    x = torch.zeros(4_096, 8, device=DEVICE)
    decision = dispatch._window_rule(clustered, (x,))
    assert decision.name == "window" and "tile density" in decision.reason
    assert dispatch._window_rule(scattered, (x,)) is None
    with dispatch.for_capture():
        assert dispatch._window_rule(clustered, (x,)) is None
    monkeypatch.setattr(dispatch, "_usable", lambda name, graph, tensors: False)
    assert dispatch._window_rule(clustered, (x,)) is None


def test_window_rule_declines_float64(monkeypatch):
    """The window backend takes float64 (explicitly asked for, through the vector-sparse
    reference: a ``[V, N]`` product per tile column), so ``auto`` must not pick it there:
    the vector kernels run float16 / bfloat16 / float32 only."""
    monkeypatch.setattr(dispatch, "_usable", lambda name, graph, tensors: True)
    clustered = _local_graph(4_096, 16, 16, 1.0)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        decision = dispatch._window_rule(clustered, (torch.zeros(4_096, 8, dtype=dtype, device=DEVICE),))
        assert decision is not None and decision.name == "window", dtype
    assert dispatch._window_rule(clustered, (torch.zeros(4_096, 8, dtype=torch.float64, device=DEVICE),)) is None


@pytest.mark.skipif(not CUDA, reason="auto runs fused kernels on CUDA only")
def test_auto_picks_windows_on_a_clustered_graph_on_cuda():
    clustered = _local_graph(40_000, 16, 16, 0.98)  # tile density about 0.5
    scattered = _local_graph(40_000, 16, 16, 0.0)  # about 0.065
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40_000, 64, generator=gen).to(DEVICE).requires_grad_()
    g = torch.randn(40_000, 64, generator=gen).to(DEVICE)
    out = spmm(clustered, x)
    assert dispatch.last_decision().name == "window", dispatch.last_decision()
    (dx,) = torch.autograd.grad(out, x, g)
    ref = spmm(clustered, x, aggregation="gar")
    (rdx,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dx, rdx, rtol=1e-5, atol=1e-4)
    spmm(scattered, x)  # 2^25 edge-columns: past the host-bound size of an op with a backward
    assert dispatch.last_decision().name in ("gas", "gar")
