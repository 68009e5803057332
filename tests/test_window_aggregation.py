"""spmm(aggregation="window"): graph aggregation through Jigsaw row windows
(:mod:`fusegnn.sparse.window_aggregation`), float32 through the Triton kernels (on CUDA,
or in the interpreter on the CPU) and float64 through their PyTorch references, against
dense float64 A @ X. Everything is built on ``DEVICE``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
import torch

import fusegnn.sparse.window_aggregation as wa
from fusegnn.layers import APPNP, GATConv, GCNConv, SGConv
from fusegnn.sparse import Graph, RowWindows, graph_windows, sddmm, spmm, window_tile_density
from fusegnn.sparse.dispatch import backend_named, check_aggregation, explain, last_decision
from tests.graphs import random_graph

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def nasty_graph(nasty_graph):
    """conftest's graph, on ``DEVICE``."""
    return nasty_graph.to(DEVICE)


def _graph(n=37, e=150, seed=1, **kw) -> Graph:
    num_dst = kw.get("num_dst_nodes")
    return Graph(random_graph(n, e, seed, **kw).to(DEVICE), (n, num_dst) if num_dst is not None else n)


def _weights(graph: Graph, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return (torch.rand(graph.num_edges, generator=torch.Generator().manual_seed(seed), dtype=dtype) + 0.1).to(DEVICE)


def _x(rows: int, *shape: int, seed: int = 3, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(rows, *shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(DEVICE)


def _dense(graph: Graph, weight: torch.Tensor | None) -> torch.Tensor:
    """The aggregation matrix in float64 (duplicated edges added)."""
    g = graph if weight is None else graph.with_edge_weight(weight.detach().double())
    return g.to_dense(torch.float64)


# ---------------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_matches_dense(dtype, weighted, nasty_graph):
    """Isolated nodes, a hub of in-degree 12, self-loops, duplicates; 20 columns."""
    graph = nasty_graph
    weight = _weights(graph, dtype=dtype) if weighted else None
    x = _x(graph.num_nodes, 20, dtype=dtype)
    out = spmm(graph, x, weight, aggregation="window")
    assert last_decision().name == "window" and out.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out.double(), _dense(graph, weight) @ x.double(), rtol=tol, atol=tol)


def test_forward_graph_weights_heads_mean_bias():
    """The graph's own weights, a 3-D x ([N, 3, 5]: 15 columns), reduce='mean', a bias."""
    graph = _graph(45, 220, 4, hub_degree=20).with_edge_weight(_weights(_graph(45, 220, 4), 5))
    x = _x(45, 3, 5)
    bias = _x(3, 5, seed=9)
    out = spmm(graph, x, reduce="mean", bias=bias, aggregation="window")
    dense = _dense(graph, None)
    mean = dense @ x.double().reshape(45, 15) / graph.in_degree.clamp(min=1).double()[:, None]
    torch.testing.assert_close(out.double(), mean.reshape(45, 3, 5) + bias.double(), rtol=1e-5, atol=1e-5)
    # a second call (the prepared path of spmm) gives the same
    torch.testing.assert_close(spmm(graph, x, reduce="mean", bias=bias, aggregation="window"), out)


def test_bipartite_and_empty():
    graph = _graph(30, 90, 6, num_dst_nodes=21)
    x = _x(30, 7)
    w = _weights(graph)
    torch.testing.assert_close(spmm(graph, x, w, aggregation="window").double(), _dense(graph, w) @ x.double(),
                               rtol=1e-5, atol=1e-5)
    empty = Graph(torch.empty(2, 0, dtype=torch.long, device=DEVICE), (4, 33))  # 33 targets, 3 windows, no edge
    out = spmm(empty, _x(4, 6), aggregation="window")
    assert out.shape == (33, 6) and not out.any()


# ---------------------------------------------------------------------- gradients


@pytest.mark.parametrize("W", [16, 32])
def test_gradients_match_dense(W, nasty_graph):
    graph = nasty_graph
    x = _x(graph.num_nodes, 19).requires_grad_(True)
    w = _weights(graph).requires_grad_(True)
    out = wa.window_aggregate(graph, x, w, W)
    go = _x(graph.num_nodes, 19, seed=11)
    out.backward(go)
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    ref = torch.zeros(graph.num_nodes, 19, dtype=torch.float64, device=DEVICE).index_add(
        0, graph.dst.long(), x64[graph.src.long()] * w64[:, None])
    ref.backward(go.double())
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


def test_gradcheck_float64():
    graph = _graph(9, 24, 2, hub_degree=5)
    x = _x(9, 3, dtype=torch.float64).requires_grad_(True)
    w = _weights(graph, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: spmm(graph, a, b, aggregation="window"), (x, w))
    assert torch.autograd.gradcheck(lambda a, b: spmm(graph, a, b, "mean", aggregation="window"), (x, w))


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
def test_gradcheck_kernels_tiny():
    """The float32 kernels' backward (loose: float32 finite differences)."""
    graph = _graph(7, 16, 3)
    x = _x(7, 3).requires_grad_(True)
    w = _weights(graph).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: spmm(graph, a, b, aggregation="window"), (x, w),
                                    eps=1e-2, atol=1e-2, rtol=1e-2)


def test_plain_backward_matches_autograd(nasty_graph):
    """The backend's plain backward (what the compiled op runs) equals eager autograd."""
    graph = nasty_graph
    w = _weights(graph)
    x = _x(graph.num_nodes, 6).requires_grad_(True)
    wg = w.clone().requires_grad_(True)
    go = _x(graph.num_nodes, 6, seed=5)
    for reduce in ("sum", "mean"):
        x.grad = wg.grad = None
        spmm(graph, x, wg, reduce, aggregation="window").backward(go)
        gx, gw = backend_named("window").spmm_backward(graph, go, x.detach(), w, reduce, True, True)
        torch.testing.assert_close(gx, x.grad)
        torch.testing.assert_close(gw, wg.grad)


def test_max_and_head_weights_go_to_gar(nasty_graph):
    graph = nasty_graph
    x = _x(graph.num_nodes, 2, 4)
    out = spmm(graph, x, reduce="max", aggregation="window")
    assert last_decision().name == "gar"
    torch.testing.assert_close(out, spmm(graph, x, reduce="max", aggregation="reference"))
    heads = torch.rand(graph.num_edges, 2, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = spmm(graph, x, heads, aggregation="window")
    assert last_decision().name == "gar"
    torch.testing.assert_close(out, spmm(graph, x, heads, aggregation="reference"), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- layers


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("channels", [(12, 5), (5, 12)])
def test_gcnconv_window_equals_reference(cached, channels, nasty_graph):
    torch.manual_seed(0)
    window = GCNConv(*channels, cached=cached, aggregation="window").to(DEVICE)
    reference = GCNConv(*channels, cached=cached, aggregation="reference").to(DEVICE)
    reference.load_state_dict(window.state_dict())
    x = _x(nasty_graph.num_nodes, channels[0])
    for _ in range(2):  # the second call reuses the cached windows (and, cached, the graph)
        outs = []
        for layer in (window, reference):
            layer.zero_grad()
            out = layer(x, nasty_graph)
            out.square().sum().backward()
            outs.append(out)
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(window.lin.weight.grad, reference.lin.weight.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(window.bias.grad, reference.bias.grad, rtol=1e-4, atol=1e-5)
    assert "window" in repr(window)


def test_gcnconv_trainable_edge_weight(nasty_graph):
    """Weights given to forward that require grad: their gradient flows through the
    normalisation and the per-edge SDDMM."""
    torch.manual_seed(1)
    layer = GCNConv(6, 4, aggregation="window").to(DEVICE)
    x = _x(nasty_graph.num_nodes, 6)
    grads = []
    for aggregation in ("window", "reference"):
        layer.aggregation = aggregation
        w = _weights(nasty_graph).requires_grad_(True)
        layer(x, nasty_graph, w).sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-5)


def test_propagation_layers_accept_window(nasty_graph):
    x = _x(nasty_graph.num_nodes, 6)
    for cls, opts in ((SGConv, {"K": 2}), (APPNP, {"K": 3, "alpha": 0.2})):
        torch.manual_seed(2)
        if cls is SGConv:
            window = cls(6, 3, aggregation="window", **opts).to(DEVICE)
            reference = cls(6, 3, aggregation="reference", **opts).to(DEVICE)
            reference.load_state_dict(window.state_dict())
        else:
            window, reference = cls(aggregation="window", **opts), cls(aggregation="reference", **opts)
        torch.testing.assert_close(window(x, nasty_graph), reference(x, nasty_graph), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- structure, cache


def test_structure_is_built_once_and_shared(nasty_graph, monkeypatch):
    builds, scatters = [], []
    structure, scatter = wa.vector_structure, wa._scatter
    monkeypatch.setattr(wa, "vector_structure", lambda *a: builds.append(1) or structure(*a))
    monkeypatch.setattr(wa, "_scatter", lambda *a: scatters.append(1) or scatter(*a))
    graph = nasty_graph.with_edge_weight(_weights(nasty_graph))
    x = _x(graph.num_nodes, 8)
    first = spmm(graph, x, aggregation="window")
    second = spmm(graph, x * 2, aggregation="window")
    torch.testing.assert_close(second, first * 2)
    assert len(builds) == 1 and len(scatters) == 1  # the graph's weights: tiles memoised
    # a re-weighted copy (what GCN normalisation makes) shares the structure, scatters anew
    other = graph.with_edge_weight(_weights(graph, 7))
    spmm(other, x, aggregation="window")
    assert len(builds) == 1 and len(scatters) == 2
    assert graph_windows(other) is graph_windows(graph)
    # changing the weights in place is seen (the memo keys on the tensor's version)
    other.edge_weight.mul_(3)
    torch.testing.assert_close(spmm(other, x, aggregation="window"),
                               (_dense(other, None) @ x.double()).float(), rtol=1e-5, atol=1e-5)
    assert len(scatters) == 3
    # the backward's windows of A^T: built on the first backward only, tiles memoised
    xg = x.clone().requires_grad_(True)
    for expected in (2, 2):
        spmm(graph, xg, aggregation="window").sum().backward()
        assert len(builds) == expected
    assert len(scatters) == 4


def test_windows_and_tile_density(nasty_graph):
    graph = nasty_graph
    windows = graph_windows(graph)
    assert windows.pattern.W == wa.WINDOW_ROWS
    ones = RowWindows.from_graph(graph.with_edge_weight(torch.ones(graph.num_edges, device=DEVICE)), wa.WINDOW_ROWS)
    assert torch.equal(windows.pattern.col_idx, ones.col_idx) and torch.equal(windows.pattern.row_ptr, ones.row_ptr)
    # every edge's slot holds its (target, source) entry
    tiles = wa.window_values(graph, None, torch.float64)
    assert torch.equal(graph.to_dense(torch.float64), windows.pattern.with_values(tiles).to_dense())
    assert window_tile_density(graph) == pytest.approx(ones.tile_density)
    t = graph_windows(graph, transposed=True)
    tiles_t = wa.window_values(graph, None, torch.float64, transposed=True)
    assert torch.equal(graph.to_dense(torch.float64).t(), t.pattern.with_values(tiles_t).to_dense())
    assert 0 < window_tile_density(graph, transposed=True) <= 1
    assert 0 < window_tile_density(graph) <= 1
    assert window_tile_density(graph, 32) <= window_tile_density(graph, 16)


def test_auto_keeps_small_graphs_off_the_windows(nasty_graph):
    """Tiny work: the host-bound regime (CUDA) or the reference (CPU) comes first."""
    x = _x(nasty_graph.num_nodes, 4)
    assert explain(nasty_graph, x, op="spmm").name != "window"
    spmm(nasty_graph, x)
    assert last_decision().name != "window"


# ---------------------------------------------------------------------- bad input


def test_bad_input(nasty_graph):
    x = _x(nasty_graph.num_nodes, 4)
    with pytest.raises(ValueError, match="aggregation='window'.*spmm only"):
        sddmm(nasty_graph, x, x, aggregation="window")
    with pytest.raises(ValueError, match="aggregation='window'.*spmm only"):
        GATConv(4, 4, aggregation="window")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        GCNConv(4, 4, aggregation="windows")
    assert check_aggregation("window", "spmm") == "window"
    with pytest.raises(ValueError, match="x has 5 rows"):
        spmm(nasty_graph, x[:5], aggregation="window")
    with pytest.raises(ValueError, match="edge_weight must have shape"):
        spmm(nasty_graph, x, torch.ones(3, device=DEVICE), aggregation="window")
    with pytest.raises(TypeError, match="graph must be a fusegnn.sparse.Graph"):
        window_tile_density(nasty_graph.edge_index)
    with pytest.raises(ValueError, match="W must be one of"):
        graph_windows(nasty_graph, 8)


# ---------------------------------------------------------------------- torch.compile


def test_compiled_matches_eager(nasty_graph):
    """Under torch.compile spmm is the fusegnn::spmm custom op; "window" runs inside it,
    forward and backward (the backend's plain backward), GCN normalisation included."""
    torch.manual_seed(3)
    layer = GCNConv(6, 4, aggregation="window").to(DEVICE)
    reference = GCNConv(6, 4, aggregation="reference").to(DEVICE)
    reference.load_state_dict(layer.state_dict())
    x = _x(nasty_graph.num_nodes, 6)
    compiled = torch.compile(lambda v: layer(v, nasty_graph), fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    expected = reference(x, nasty_graph)
    expected.sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.lin.weight.grad, reference.lin.weight.grad, rtol=1e-4, atol=1e-5)
    w = _weights(nasty_graph).requires_grad_(True)
    v = _x(nasty_graph.num_nodes, 5).requires_grad_(True)
    op = torch.compile(lambda a, b: spmm(nasty_graph, a, b, aggregation="window"), fullgraph=True, backend="aot_eager")
    op(v, w).square().sum().backward()
    grads = (v.grad, w.grad)
    v.grad = w.grad = None
    spmm(nasty_graph, v, w, aggregation="reference").square().sum().backward()
    torch.testing.assert_close(grads[0], v.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads[1], w.grad, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------- review fixes


def test_zero_node_graphs_and_untouched_inputs():
    """No target or no source node: an empty / zero result and gradients (``reshape(0, -1)``
    used to raise); the inputs are never written."""
    for num_nodes, rows in (((0, 3), 0), ((3, 0), 3)):
        graph = Graph(torch.zeros(2, 0, dtype=torch.int64, device=DEVICE), num_nodes)
        x = _x(rows, 4).requires_grad_()
        out = spmm(graph, x, aggregation="window")
        assert out.shape == (graph.num_dst_nodes, 4) and not bool(out.any())
        out.sum().backward()
        assert x.grad.shape == x.shape and not bool(x.grad.any())
    graph = _graph(20, 60, seed=4)
    x, w = _x(20, 3), _weights(graph)
    x0, w0 = x.clone(), w.clone()
    spmm(graph, x, w, aggregation="window")
    assert torch.equal(x, x0) and torch.equal(w, w0)


@settings(max_examples=30, deadline=None)
@given(
    num_src=hst.integers(1, 40), num_dst=hst.integers(1, 40),
    edges=hst.lists(hst.tuples(hst.integers(0, 39), hst.integers(0, 39)), max_size=80),
    loops=hst.integers(0, 4), dup=hst.integers(0, 6), weighted=hst.booleans(),
    reduce=hst.sampled_from(["sum", "mean"]), seed=hst.integers(0, 2**16),
)
def test_property_window_equals_dense_float64(num_src, num_dst, edges, loops, dup, weighted, reduce, seed):
    """Random small graphs (rectangular, isolated nodes, self-loops, duplicated edges,
    none at all): ``spmm(aggregation="window")`` equals ``A @ x`` in float64, and so
    do the gradients of ``x`` and of the edge weights."""
    src = [s % num_src for s, _ in edges] + [i % min(num_src, num_dst) for i in range(loops)]
    dst = [d % num_dst for _, d in edges] + [i % min(num_src, num_dst) for i in range(loops)]
    src, dst = src + src[:dup], dst + dst[:dup]  # duplicates of the first edges
    graph = Graph(torch.tensor([src, dst], dtype=torch.int64, device=DEVICE).view(2, -1), (num_src, num_dst))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_src, 3, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    w = ((torch.rand(graph.num_edges, generator=gen, dtype=torch.float64) + 0.1).to(DEVICE).requires_grad_()
         if weighted else None)
    out = spmm(graph, x, w, reduce=reduce, aggregation="window")
    dense = _dense(graph, w)
    in_degree = torch.bincount(graph.dst.long(), minlength=num_dst).clamp(min=1).double()  # duplicates count
    if reduce == "mean":
        dense = dense / in_degree.view(-1, 1)
    expect = dense @ x.detach()
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)
    assert bool(torch.isfinite(out).all())
    g = torch.randn(num_dst, 3, generator=gen, dtype=torch.float64).to(DEVICE)
    out.backward(g)
    torch.testing.assert_close(x.grad, dense.t() @ g, rtol=1e-12, atol=1e-12)
    if weighted:
        per_row = g if reduce == "sum" else g / in_degree.view(-1, 1)
        expect_w = (x.detach()[graph.src.long()] * per_row[graph.dst.long()]).sum(1)
        torch.testing.assert_close(w.grad, expect_w, rtol=1e-12, atol=1e-12)
