"""Semantics of the row-window aggregation path as a user meets it (session-18 bug hunt):
``spmm(aggregation="window")`` and the layers / ops that run it (``propagate``,
``GCNConv``, ``SGConv``, ``APPNP``), ``window_spmm``, the ``auto`` rule's tile-density
threshold, the caches on the graph, and ``Graph.reorder``'s permutation round trip.

Every result is compared with float64 dense algebra (``Graph.to_dense``) or the
``"reference"`` aggregation. float32 runs the Triton kernels (on CUDA, or the interpreter on
the CPU), float64 their PyTorch references; tolerances are those of
``tests/test_window_aggregation.py`` (1e-5 float32, 1e-12 float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

import fusegnn.sparse.window_aggregation as wa
from fusegnn.layers import APPNP, GCNConv, SGConv
from fusegnn.sparse import Graph, dispatch, graph_windows, propagate, spmm, window_spmm, window_tile_density
from fusegnn.sparse.dispatch import WINDOW_MIN_TILE_DENSITY, explain, last_decision
from fusegnn.sparse.reorder import inverse_permutation
from fusegnn.sparse.tile_density import estimate_tile_density
from tests.graphs import random_graph

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _graph(n: int = 37, e: int = 150, seed: int = 1, num_dst: int | None = None, **kw) -> Graph:
    edge_index = random_graph(n, e, seed, num_dst_nodes=num_dst, **kw).to(DEVICE)
    return Graph(edge_index, (n, num_dst) if num_dst is not None else n)


def _randn(*shape: int, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=dtype).to(DEVICE)


def _weights(graph: Graph, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return (torch.rand(graph.num_edges, generator=_gen(seed), dtype=dtype) + 0.1).to(DEVICE)


def _dense(graph: Graph, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 aggregation matrix (duplicated edges add up)."""
    g = graph if weight is None else graph.with_edge_weight(weight.detach().double())
    return g.to_dense(torch.float64)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.double().reshape(t.size(0), -1)


# ---------------------------------------------------------------------- values and gradients


@settings(max_examples=12, deadline=None)
@given(
    num_src=hst.integers(1, 40), num_dst=hst.integers(1, 40), num_edges=hst.integers(0, 90),
    shape=hst.sampled_from([(1,), (3,), (17,), (2, 3)]), weighted=hst.booleans(),
    reduce=hst.sampled_from(["sum", "mean"]), int32=hst.booleans(), seed=hst.integers(0, 2**16),
)
def test_float32_kernels_match_dense(num_src, num_dst, num_edges, shape, weighted, reduce, int32, seed):
    """The Triton path (float32): rectangular graphs, targets in a partial last window,
    widths that are no multiple of 8 / 16, 3-D features, int32 indices; output and the
    gradients of ``x`` and of the weights."""
    gen = _gen(seed)
    src = torch.randint(0, num_src, (num_edges,), generator=gen)
    dst = torch.randint(0, num_dst, (num_edges,), generator=gen)
    edge_index = torch.stack([src, dst]).to(torch.int32 if int32 else torch.int64)
    graph = Graph(edge_index.to(DEVICE), (num_src, num_dst))
    x = torch.randn(num_src, *shape, generator=gen).to(DEVICE).requires_grad_()
    w = (torch.rand(num_edges, generator=gen) + 0.1).to(DEVICE).requires_grad_() if weighted else None
    out = spmm(graph, x, w, reduce, aggregation="window")
    assert out.shape == (num_dst, *shape) and out.dtype == torch.float32
    dense = _dense(graph, w)
    if reduce == "mean":
        dense = dense / torch.bincount(dst, minlength=num_dst).clamp(min=1).double().to(DEVICE)[:, None]
    torch.testing.assert_close(_flat(out), dense @ _flat(x.detach()), rtol=1e-5, atol=1e-5)
    g = torch.randn(out.shape, generator=gen).to(DEVICE)
    out.backward(g)
    torch.testing.assert_close(_flat(x.grad), dense.t() @ _flat(g), rtol=1e-5, atol=1e-5)
    if weighted:
        per_row = _flat(g)
        if reduce == "mean":
            per_row = per_row / torch.bincount(dst, minlength=num_dst).clamp(min=1).double().to(DEVICE)[:, None]
        expect = (_flat(x.detach())[graph.src.long()] * per_row[graph.dst.long()]).sum(1)
        torch.testing.assert_close(w.grad.double(), expect, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layouts_and_dtypes_of_the_inputs(dtype):
    """Transposed, expanded (stride 0) and column-strided ``x``; weights in another dtype
    or strided: the result is ``A @ x`` in ``x``'s dtype, and no input is written."""
    graph = _graph(37, 150, 1, hub_degree=10)
    dense = _dense(graph)
    xs = {
        "transposed": _randn(9, 37, dtype=dtype).t(),
        "expanded": _randn(1, 5, dtype=dtype).expand(37, 5),
        "strided": _randn(37, 10, dtype=dtype)[:, ::2],
    }
    for name, x in xs.items():
        before = x.clone()
        out = spmm(graph, x, aggregation="window")
        assert last_decision().name == "window", name
        torch.testing.assert_close(_flat(out), dense @ _flat(x), rtol=TOL[dtype], atol=TOL[dtype])
        assert torch.equal(x, before)
    x = _randn(37, 5, dtype=dtype)
    other = torch.float64 if dtype == torch.float32 else torch.float32
    for w in (_weights(graph, 2, other), torch.rand(graph.num_edges, 2, generator=_gen(3)).to(DEVICE)[:, 1]):
        before = w.clone()
        out = spmm(graph, x, w, aggregation="window")
        assert out.dtype == dtype
        tol = max(TOL[dtype], TOL[w.dtype])
        torch.testing.assert_close(_flat(out), _dense(graph, w) @ x.double(), rtol=tol, atol=tol)
        assert torch.equal(w, before)


def test_per_head_weights_and_max_are_handed_to_gar():
    graph = _graph(30, 100, 4)
    x = _randn(30, 2, 3, seed=1)
    heads = torch.rand(graph.num_edges, 2, generator=_gen(5)).to(DEVICE)
    for weight, reduce in ((heads, "sum"), (None, "max")):
        out = spmm(graph, x, weight, reduce, aggregation="window")
        assert last_decision().name == "gar"
        torch.testing.assert_close(out, spmm(graph, x, weight, reduce, aggregation="reference"), rtol=1e-5, atol=1e-5)
        # the prepared path of a repeated call records the same decision
        spmm(graph, x, weight, reduce, aggregation="window")
        assert last_decision().name == "gar"


def test_nodes_beyond_the_last_full_window():
    """Every edge targets the partial last window (rows 32..36 of 37), and sources beyond
    the last full window of A^T (the backward's windows)."""
    src = torch.tensor([36, 35, 0, 33, 36, 36, 1, 34])
    dst = torch.tensor([32, 36, 36, 33, 34, 34, 35, 32])
    graph = Graph(torch.stack([src, dst]).to(DEVICE), 37)
    x = _randn(37, 17, seed=2).requires_grad_()
    w = _weights(graph, 4).requires_grad_()
    out = spmm(graph, x, w, aggregation="window")
    torch.testing.assert_close(out.double(), _dense(graph, w) @ x.detach().double(), rtol=1e-5, atol=1e-5)
    assert not out[:32].any()
    out.square().sum().backward()
    g = 2 * out.detach().double()
    torch.testing.assert_close(x.grad.double(), _dense(graph, w).t() @ g, rtol=1e-5, atol=1e-5)
    expect_w = (x.detach().double()[src] * g[dst]).sum(1)
    torch.testing.assert_close(w.grad.double(), expect_w.to(DEVICE), rtol=1e-5, atol=1e-5)


def test_edgeless_and_featureless():
    graph = Graph(torch.zeros(2, 0, dtype=torch.long, device=DEVICE), 20)
    x = _randn(20, 3).requires_grad_()
    w = torch.zeros(0, device=DEVICE, requires_grad=True)
    out = spmm(graph, x, w, aggregation="window")
    out.sum().backward()
    assert out.shape == (20, 3) and not out.any() and not x.grad.any() and w.grad.shape == (0,)
    assert window_tile_density(graph) == 0.0 and estimate_tile_density(graph) == 0.0
    full = _graph()
    x0 = _randn(37, 2, 0).requires_grad_()
    w0 = _weights(full).requires_grad_()
    out = spmm(full, x0, w0, aggregation="window")
    out.sum().backward()
    assert out.shape == (37, 2, 0) and x0.grad.shape == x0.shape and not w0.grad.any()


# ---------------------------------------------------------------------- bad input


@pytest.mark.parametrize("W", [16.0, 32.0, torch.tensor(16), "16", True, 8])
def test_window_rows_must_be_an_allowed_int(W):
    """``W`` is 16 or 32 (a NumPy int too); a float 16.0 used to fail deep inside
    ``torch.bincount`` and a 0-d tensor was taken (and cached under its repr)."""
    graph = _graph()
    for call in (lambda: graph_windows(graph, W), lambda: window_tile_density(graph, W),
                 lambda: wa.window_aggregate(graph, _randn(37, 3), None, W)):
        with pytest.raises(ValueError, match="W must be one of"):
            call()
    assert graph_windows(graph, np.int64(16)) is graph_windows(graph, 16)


@pytest.mark.parametrize("kw", [{"W": 16.0}, {"W": True}, {"windows": 10.5}, {"windows": 0}, {"W": 0}])
def test_estimate_refuses_non_int_sizes(kw):
    with pytest.raises(ValueError, match="W and windows must be"):
        estimate_tile_density(_graph(), **kw)


# ---------------------------------------------------------------------- the auto rule


def _block_graph(filled: int) -> Graph:
    """One window (16 targets) with a single source column holding ``filled`` edges:
    tile density ``filled / 16``."""
    src = torch.zeros(filled, dtype=torch.long)
    return Graph(torch.stack([src, torch.arange(filled)]).to(DEVICE), 16)


def test_auto_rule_threshold_is_inclusive_and_stable(monkeypatch):
    """``"window"`` from a tile density of exactly 0.25 up (the README's "at least"), not
    below; the same decision on every call (the estimate cached on the structure, shared
    with re-weighted copies)."""
    monkeypatch.setattr(dispatch, "_usable", lambda name, graph, tensors: True)
    assert WINDOW_MIN_TILE_DENSITY == 0.25
    x = torch.zeros(16, 8, device=DEVICE)
    at, below = _block_graph(4), _block_graph(3)
    assert window_tile_density(at) == estimate_tile_density(at) == 0.25
    assert window_tile_density(below) == estimate_tile_density(below) == 0.1875
    for _ in range(2):
        decision = dispatch._window_rule(at, (x,))
        assert decision is not None and decision.name == "window" and "0.250 >= 0.25" in decision.reason
        assert dispatch._window_rule(below, (x,)) is None
        assert dispatch._window_rule(at.with_edge_weight(torch.rand(4, device=DEVICE)), (x,)) == decision
    assert dispatch._window_rule(at, (x.double(),)) is None  # float64: the vector kernels do not run it


def test_rule_reads_the_forward_density_only():
    """As the dispatch docstring states: the estimate is of A's windows; A^T's (the
    backward's) can be as sparse as 1 / 16 on a graph whose forward windows are dense
    (target window w reads sources w, 16 + w, ..., 240 + w)."""
    dst = torch.arange(256).repeat_interleave(16)
    src = torch.arange(16).repeat(256) * 16 + dst // 16
    graph = Graph(torch.stack([src, dst]).to(DEVICE), 256)
    assert estimate_tile_density(graph) == window_tile_density(graph) == 1.0
    assert window_tile_density(graph, transposed=True) == 1 / 16


def test_explain_is_stable_across_calls():
    graph = _graph(37, 150, 1, hub_degree=10)
    x = _randn(37, 4)
    first = explain(graph, x, op="spmm")
    for _ in range(3):
        spmm(graph, x)
        assert last_decision() == first == explain(graph, x, op="spmm")


# ---------------------------------------------------------------------- caches


def test_layout_built_once_per_structure_and_anew_after_reorder(monkeypatch):
    builds = []
    structure = wa.vector_structure
    monkeypatch.setattr(wa, "vector_structure", lambda *a: builds.append(a[2]) or structure(*a))
    graph = _graph(45, 200, 2, hub_degree=10)
    x = _randn(45, 6).requires_grad_()
    for _ in range(3):
        spmm(graph, x, aggregation="window").sum().backward()
        spmm(graph.with_edge_weight(_weights(graph)), x, aggregation="window")
    assert len(builds) == 2  # A's windows and A^T's (first backward), once each
    new, perm = graph.reorder("rcm")
    assert graph_windows(new) is not graph_windows(graph) and len(builds) == 3
    out = spmm(new, x.detach()[perm], aggregation="window")
    torch.testing.assert_close(out[inverse_permutation(perm)], spmm(graph, x.detach(), aggregation="reference"),
                               rtol=1e-5, atol=1e-5)


def test_inference_mode_first_then_training_window_path():
    """The windows, their tiles and the graph's weight memo made under inference_mode
    serve a later training step (no inference tensor kept in a cache)."""
    graph = _graph(37, 150, 3).with_edge_weight(_weights(_graph(37, 150, 3), 1))
    with torch.inference_mode():
        first = spmm(graph, _randn(37, 4), aggregation="window")
        propagate(graph, _randn(37, 4), 2, 0.1, aggregation="window")
    x = _randn(37, 4).requires_grad_()
    out = spmm(graph, x, aggregation="window")
    out.sum().backward()
    torch.testing.assert_close(first, out.detach(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad.double(), _dense(graph).t() @ torch.ones(37, 4, dtype=torch.float64, device=DEVICE),
                               rtol=1e-5, atol=1e-5)
    w = graph.edge_weight.clone().requires_grad_()
    spmm(graph, x, w, aggregation="window").sum().backward()
    assert w.grad is not None
    y = _randn(37, 4).requires_grad_()
    propagate(graph, y, 2, 0.1, aggregation="window").sum().backward()
    assert y.grad is not None


@pytest.mark.parametrize("layer", ["SGConv", "APPNP", "GCNConv"])
def test_cached_layers_evaluated_under_inference_mode_then_trained(layer):
    """A cached layer's first call under ``torch.inference_mode()`` (a sanity check of an
    untrained model) must not leave an inference tensor in the layer's cache: SGConv kept
    its propagated features as one, and the next training step raised "Inference tensors
    cannot be saved for backward"."""
    torch.manual_seed(0)
    make = {"SGConv": lambda: SGConv(6, 4, K=2, cached=True, aggregation="window"),
            "APPNP": lambda: APPNP(2, 0.1, cached=True, aggregation="window"),
            "GCNConv": lambda: GCNConv(6, 4, cached=True, aggregation="window")}[layer]
    module = make().to(DEVICE)
    graph = _graph(37, 150, 1, hub_degree=10)
    x = _randn(37, 6)
    with torch.inference_mode():
        evaluated = module(x, graph)
    trained = module(x.clone().requires_grad_(), graph)
    trained.square().sum().backward()
    torch.testing.assert_close(trained.detach(), evaluated.clone(), rtol=1e-6, atol=1e-6)
    for p in module.parameters():
        assert p.grad is not None


# ---------------------------------------------------------------------- reorder


@settings(max_examples=10, deadline=None)
@given(n=hst.integers(1, 40), e=hst.integers(0, 120), method=hst.sampled_from(["rcm", "degree"]),
       weighted=hst.booleans(), int32=hst.booleans(), seed=hst.integers(0, 2**16))
def test_reorder_round_trip_through_the_windows(n, e, method, weighted, int32, seed):
    """``spmm(new, x[perm], "window")[inverse(perm)] == spmm(graph, x)``; ``perm`` a
    permutation; the input graph and its weights untouched; gradients flow to the
    original weights."""
    gen = _gen(seed)
    edge_index = torch.randint(0, n, (2, e), generator=gen)
    edge_index = (edge_index.int() if int32 else edge_index).to(DEVICE)
    weight = (torch.rand(e, generator=gen) + 0.1).to(DEVICE).requires_grad_() if weighted else None
    graph = Graph(edge_index, n, weight)
    ei_before = graph.edge_index.clone()
    w_before = weight.detach().clone() if weighted else None
    new, perm = graph.reorder(method)
    assert perm.dtype == torch.int64 and torch.equal(torch.sort(perm.cpu()).values, torch.arange(n))
    assert new.edge_index.dtype == graph.edge_index.dtype
    inverse = inverse_permutation(perm)
    assert torch.equal(perm[inverse], torch.arange(n, device=perm.device))
    x = torch.randn(n, 5, generator=gen).to(DEVICE)
    out = spmm(new, x[perm], aggregation="window")[inverse]
    torch.testing.assert_close(out.double(), _dense(graph, weight) @ x.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_dense(new, weight), _dense(graph, weight)[perm][:, perm])
    assert torch.equal(graph.edge_index, ei_before)
    if weighted:
        assert torch.equal(weight.detach(), w_before)
        out.sum().backward()
        assert weight.grad is not None and weight.grad.shape == (e,)


# ---------------------------------------------------------------------- propagate


def _polynomial(A: torch.Tensor, K: int, alpha: float) -> torch.Tensor:
    step = (1 - alpha) * A
    eye = torch.eye(A.size(0), dtype=A.dtype, device=A.device)
    M, power = torch.zeros_like(A), eye
    for _ in range(K):
        M = M + alpha * power
        power = step @ power
    return M + power


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K, alpha", [(1, 0.0), (3, 0.2), (2, 1.0)])
def test_propagate_window_matches_the_matrix_polynomial(dtype, K, alpha):
    graph = _graph(37, 150, 1, hub_degree=10)
    graph = graph.with_edge_weight(_weights(graph, 1, dtype))
    M = _polynomial(_dense(graph), K, alpha)
    x = _randn(37, 2, 3, dtype=dtype).requires_grad_()
    out = propagate(graph, x, K, alpha, aggregation="window")
    g = _randn(37, 2, 3, seed=4, dtype=dtype)
    out.backward(g)
    tol = 1e-4 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(_flat(out), M @ _flat(x.detach()), rtol=tol, atol=tol)
    torch.testing.assert_close(_flat(x.grad), M.t() @ _flat(g), rtol=tol, atol=tol)


def test_propagate_arguments():
    graph = _graph()
    x = _randn(37, 3)
    ok = propagate(graph, x, np.int64(2), np.float32(0.5), aggregation="window")
    torch.testing.assert_close(ok, propagate(graph, x, 2, 0.5, aggregation="reference"), rtol=1e-5, atol=1e-5)
    assert propagate(graph, x, 0, aggregation="window") is x
    for K, err in ((True, TypeError), (2.0, TypeError), (-1, ValueError), (torch.tensor(2), TypeError)):
        with pytest.raises(err, match="K must be"):
            propagate(graph, x, K)
    for alpha, err in ((float("nan"), ValueError), (1.5, ValueError), (True, TypeError), (torch.tensor(0.1), TypeError)):
        with pytest.raises(err, match="alpha must be"):
            propagate(graph, x, 2, alpha)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        propagate(graph, x, 2, aggregation="windows")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        propagate(graph, x.cpu().numpy(), 2)
    with pytest.raises(ValueError, match="square graph"):
        propagate(_graph(30, 90, 6, num_dst=21), _randn(30, 3), 2, aggregation="window")


def test_propagate_edgeless_graph_with_teleport():
    """No edge: every step is ``alpha x`` (the in-place restart on spmm's zeros)."""
    graph = Graph(torch.zeros(2, 0, dtype=torch.long, device=DEVICE), 20)
    x = _randn(20, 3).requires_grad_()
    out = propagate(graph, x, 3, 0.3, aggregation="window")
    out.sum().backward()
    torch.testing.assert_close(out, 0.3 * x.detach())
    torch.testing.assert_close(x.grad, torch.full_like(x, 0.3))


# ---------------------------------------------------------------------- torch.compile


def _compiled(fn):
    """``fn`` compiled whole (``fullgraph``, ``aot_eager``) by a Dynamo with no earlier code."""
    import torch._dynamo

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def test_compiled_window_spmm_bipartite_heads_mean():
    graph = _graph(30, 90, 6, num_dst=21)
    w = _weights(graph, 2).requires_grad_()
    x = _randn(30, 2, 3).requires_grad_()
    compiled = _compiled(lambda a, b: spmm(graph, a, b, "mean", aggregation="window"))
    out = compiled(x, w)
    assert last_decision().name == "window"
    out.square().sum().backward()
    grads = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    expect = spmm(graph, x, w, "mean", aggregation="reference")
    expect.square().sum().backward()
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], w.grad, rtol=1e-5, atol=1e-5)


def test_compiled_window_spmm_on_a_graphs_windows():
    """``window_spmm`` on ``graph_windows(graph).pattern.with_values(tiles)`` compiles
    (fullgraph, aot_eager) and equals the eager op and ``A @ b``, gradients included."""
    graph = _graph(37, 150, 1, hub_degree=10)
    graph = graph.with_edge_weight(_weights(graph))
    pattern = graph_windows(graph).pattern
    tiles = wa.window_values(graph, graph.edge_weight, torch.float32).clone().requires_grad_()
    b = _randn(37, 7).requires_grad_()
    compiled = _compiled(lambda t, bb: window_spmm(pattern.with_values(t), bb))
    out = compiled(tiles, b)
    out.square().sum().backward()
    grads = (tiles.grad.clone(), b.grad.clone())
    tiles.grad = b.grad = None
    eager = window_spmm(pattern.with_values(tiles), b)
    eager.square().sum().backward()
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), _dense(graph) @ b.detach().double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], tiles.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[1], b.grad, rtol=1e-6, atol=1e-6)
