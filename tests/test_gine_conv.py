"""GINEConv (edge features through the fused edge_aggregate) and GINConv's narrowing-MLP
path (aggregation after the first Linear), against dense formulas and PyG."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from torch.func import functional_call  # noqa: E402

from fusegnn.layers import GINConv, GINEConv  # noqa: E402
from fusegnn.sparse import Graph, dispatch  # noqa: E402
from fusegnn.sparse.dispatch import decisions_taken  # noqa: E402
from tests.test_layers_library import (  # noqa: E402
    SPECS, _bipartite, _check_against, _randn, _same_as_pyg, dense_adjacency, gin_dense,
)
from tests.test_layers import pyg_nn, requires_pyg  # noqa: E402

F64 = torch.float64


def _narrowing_mlp(width_in: int, width_out: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(width_in, 3), torch.nn.ReLU(), torch.nn.Linear(3, width_out))


def gine_dense(p, layer, x_src, x_dst, edge_attr, ei):
    """The GINE formula with a loop over the edges (the messages ReLU(x_j + e_ji))."""
    e = edge_attr if layer.lin is None else edge_attr @ p["lin.weight"].T + p["lin.bias"]
    n_dst = x_dst.size(0) if x_dst is not None else x_src.size(0)
    h = torch.zeros(n_dst, x_src.size(1), dtype=x_src.dtype)
    for k in range(ei.size(1)):
        j, i = int(ei[0, k]), int(ei[1, k])
        h = h.index_add(0, torch.tensor([i]), torch.relu(x_src[j] + e[k]).unsqueeze(0))
    if x_dst is not None:
        h = h + (1 + p["eps"]) * x_dst
    return functional_call(layer.nn, {k[3:]: v for k, v in p.items() if k.startswith("nn.")}, (h,))


@pytest.mark.parametrize("spec", SPECS[:3], ids=str)
@pytest.mark.parametrize("edge_dim", [None, 2])
def test_gine_matches_dense(spec, edge_dim):
    torch.manual_seed(0)
    layer = GINEConv(_narrowing_mlp(4, 3), eps=0.2, train_eps=True, edge_dim=edge_dim).double()
    ei, n = spec.build(), spec.num_nodes
    e = _randn(ei.size(1), edge_dim or 4, seed=5)
    _check_against(layer, lambda p, x: gine_dense(p, layer, x, x, e, ei), [_randn(n, 4, seed=1)], ei, e)


def test_gine_bipartite_matches_dense():
    ei = _bipartite()
    torch.manual_seed(0)
    layer = GINEConv(_narrowing_mlp(4, 3), edge_dim=3).double()
    xs, xd = _randn(9, 4, seed=1), _randn(6, 4, seed=2)
    e = _randn(ei.size(1), 3, seed=3)
    _check_against(layer, lambda p, a, b: gine_dense(p, layer, a, b, e, ei), [xs, xd], ei, e)


@requires_pyg
@pytest.mark.parametrize("edge_dim", [None, 2])
def test_gine_matches_pyg(edge_dim):
    torch.manual_seed(0)
    ours = GINEConv(_narrowing_mlp(4, 3), eps=0.1, train_eps=True, edge_dim=edge_dim).double()
    theirs = pyg_nn.GINEConv(_narrowing_mlp(4, 3), eps=0.1, train_eps=True, edge_dim=edge_dim).double()
    ei = SPECS[0].build()
    e = _randn(ei.size(1), edge_dim or 4, seed=7)
    _same_as_pyg(ours, theirs, _randn(SPECS[0].num_nodes, 4, seed=1), ei, e)
    xs, xd = _randn(9, 4, seed=1), _randn(6, 4, seed=2)
    eb = _randn(_bipartite().size(1), edge_dim or 4, seed=8)
    _same_as_pyg(ours, theirs, (xs, xd), _bipartite(), eb)


@pytest.mark.parametrize("aggregation", ["gas", "gar"])
def test_gine_fused_paths_match_reference(aggregation):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ei = SPECS[1].build().to(device)
    n = SPECS[1].num_nodes
    torch.manual_seed(0)
    ref = GINEConv(_narrowing_mlp(5, 3), train_eps=True, edge_dim=2).to(device)
    fused = GINEConv(_narrowing_mlp(5, 3), train_eps=True, edge_dim=2, aggregation=aggregation).to(device)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(n, 5, device=device)
    e = torch.randn(ei.size(1), 2, device=device)
    out_ref = ref(x, ei, e)
    with decisions_taken() as taken:
        out = fused(x, ei, e)
    assert taken and taken[-1].name == "gar"  # the edge messages run on GAR (GAS hands them over)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(fused.parameters()), g)
    grads_ref = torch.autograd.grad(out_ref, list(ref.parameters()), g)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["gas", "gar"])
def test_gine_unaligned_width(aggregation, monkeypatch):
    """At a node width of 41 the fused messages run at 41 columns (the edge rows are not
    padded: their copy cost more than aligned loads saved, ``fusegnn.kernels.edge_aggregate``),
    and the output and every gradient (parameters, ``x``, ``edge_attr``) are the reference
    layer's, in float64, on a graph with isolated nodes, duplicates and a hub."""
    from tests.op_cases import DEVICE, hub_graph, randn, record_edge_aggregate_launches

    forward, backward = record_edge_aggregate_launches(monkeypatch)
    graph = hub_graph(n=9, e=40, seed=30, hub=14)
    torch.manual_seed(0)
    ref = GINEConv(_narrowing_mlp(41, 3), train_eps=True, edge_dim=5).double().to(DEVICE)
    fused = GINEConv(_narrowing_mlp(41, 3), train_eps=True, edge_dim=5, aggregation=aggregation)
    fused = fused.double().to(DEVICE)
    fused.load_state_dict(ref.state_dict())
    x, e = randn(9, 41, seed=31), randn(graph.num_edges, 5, seed=32)
    xs, es, xr, er = (t.clone().requires_grad_() for t in (x, e, x, e))
    out, want = fused(xs, graph, es), ref(xr, graph.edge_index, er)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [xs, es, *fused.parameters()], g)
    expected = torch.autograd.grad(want, [xr, er, *ref.parameters()], g)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert forward.seen and backward.seen
    assert all(seen == (41, 41, 41, 41) for seen in forward.seen + backward.seen), (forward.seen, backward.seen)


def test_gine_bad_input():
    layer = GINEConv(_narrowing_mlp(4, 3), edge_dim=2).double()
    ei = SPECS[0].build()
    x = _randn(SPECS[0].num_nodes, 4, seed=1)
    with pytest.raises(ValueError, match="GINEConv: edge_attr is required"):
        layer(x, ei)
    with pytest.raises(ValueError, match="GINEConv: edge_attr has 3 features per edge but the layer takes 2"):
        layer(x, ei, _randn(ei.size(1), 3, seed=2))
    with pytest.raises(ValueError, match="GINEConv: edge_attr has 2 rows"):
        layer(x, ei, _randn(2, 2, seed=2))
    plain = GINEConv(_narrowing_mlp(4, 3)).double()
    with pytest.raises(ValueError, match=r"GINEConv: edge_attr must be \[E, 4\]"):
        plain(x, ei, _randn(ei.size(1), 2, seed=2))
    with pytest.raises(ValueError, match="GINEConv: edge_dim must be a positive int"):
        GINEConv(_narrowing_mlp(4, 3), edge_dim=0)
    with pytest.raises(ValueError, match="could not infer the input width"):
        GINEConv(torch.nn.Sequential(torch.nn.ReLU()), edge_dim=2)
    with pytest.raises(TypeError, match="GINEConv: nn must be a module or callable"):
        GINEConv(3)


# ----------------------------------------------------- GINConv: aggregate after a narrowing Linear
@pytest.mark.parametrize("spec", SPECS[:3], ids=str)
def test_gin_narrowing_mlp_matches_dense(spec):
    torch.manual_seed(0)
    layer = GINConv(_narrowing_mlp(5, 2), eps=0.3, train_eps=True).double()
    ei, n = spec.build(), spec.num_nodes
    _check_against(layer, lambda p, x: gin_dense(p, layer, x, x, ei, n), [_randn(n, 5, seed=1)], ei)
    xs, xd = _randn(9, 5, seed=1), _randn(6, 5, seed=2)
    eb = _bipartite()
    _check_against(layer, lambda p, a, b: gin_dense(p, layer, a, b, eb, 6), [xs, xd], eb)
    _check_against(layer, lambda p, a, b: gin_dense(p, layer, a, None, eb, 6), [xs, None], eb, size=(9, 6))


# (x needs a gradient, gradients on, the raw aggregation would take the host-bound reference)
# -> the width spmm sees
_ORDER_CASES = [
    (True, True, True, [3]),      # x's gradient: the sum of W x has its backward either way
    (False, True, True, [5]),     # a model's input in a small eager CUDA step: sum x, no backward
    (False, False, True, [3]),    # no_grad (inference): no backward, the narrow sum is cheaper
    (False, True, False, [3]),    # the CPU, an explicit kernel, a large graph, a capture
]


def _run_recording_widths(monkeypatch, module, layer, x_grad, grad_on, host_bound, *extra):
    """``(layer(x, edge_index, *extra), x, edge_index, n, widths)`` on SPECS[0], with ``x``
    needing a gradient or not, gradients on or off, dispatch's host-bound rule for the raw
    aggregation answering ``host_bound`` (``None``: the real rule), and the feature width of
    every ``spmm`` call made through ``module``."""
    import fusegnn.layers._utils as utils

    if host_bound is not None:
        monkeypatch.setattr(utils, "takes_host_bound_reference", lambda *a, **k: host_bound)
    widths = []
    real = module.spmm
    monkeypatch.setattr(module, "spmm", lambda g, x, *a, **k: widths.append(x.size(1)) or real(g, x, *a, **k))
    ei, n = SPECS[0].build(), SPECS[0].num_nodes
    x = _randn(n, 5, seed=1).requires_grad_(x_grad)
    with torch.set_grad_enabled(grad_on):
        out = layer(x, ei, *extra)
    return out, x, ei, n, widths


@pytest.mark.parametrize("x_grad, grad_on, host_bound, widths_seen", _ORDER_CASES)
def test_gin_narrowing_order(monkeypatch, x_grad, grad_on, host_bound, widths_seen):
    """The narrowing Linear comes before the sum except for a gradient-free input of a small
    eager step (project_before_aggregating); both orders give the same output."""
    import fusegnn.layers.gin_conv as gin_module

    torch.manual_seed(0)
    layer = GINConv(_narrowing_mlp(5, 2), eps=0.2).double()
    out, x, ei, n, widths = _run_recording_widths(monkeypatch, gin_module, layer, x_grad, grad_on, host_bound)
    assert widths == widths_seen
    p = dict(layer.named_parameters()) | dict(layer.named_buffers())
    torch.testing.assert_close(out, gin_dense(p, layer, x, x, ei, n), rtol=1e-10, atol=1e-12)


def test_order_on_the_cpu_projects_first(monkeypatch):
    """On the CPU nothing is host-bound (the reference computes; the narrow sum is cheaper)."""
    import fusegnn.layers.gin_conv as gin_module

    layer = GINConv(_narrowing_mlp(5, 2)).double()
    _, x, ei, n, widths = _run_recording_widths(monkeypatch, gin_module, layer, False, True, None)
    assert widths == [3]
    assert not dispatch.takes_host_bound_reference(Graph(ei, n), x, "auto", records_backward=False)


def test_order_with_learnt_edge_weights_projects_first(monkeypatch):
    """Edge weights that need a gradient give the raw aggregation a backward: project first."""
    import fusegnn.layers._utils as utils
    from fusegnn.layers import GraphConv

    layer = GraphConv(5, 3).double()
    w = _randn(SPECS[0].build().size(1), seed=4).abs().requires_grad_()
    _, _, _, _, widths = _run_recording_widths(monkeypatch, utils, layer, False, True, True, w)
    assert widths == [3]
    _, _, _, _, widths = _run_recording_widths(monkeypatch, utils, layer, False, True, True, w.detach())
    assert widths == [5]


def test_order_on_a_worker_share_projects_first(monkeypatch):
    """A HaloGraph (a worker's share of a distributed graph) always projects first: every
    worker must exchange features of the same width, and their local edge counts differ."""
    from fusegnn.layers._utils import project_before_aggregating
    from fusegnn.sparse.halo import HaloGraph

    import fusegnn.layers._utils as utils

    monkeypatch.setattr(utils, "takes_host_bound_reference", lambda *a, **k: True)
    ei = torch.tensor([[0, 1, 2], [1, 0, 1]])
    share = HaloGraph(ei, 2, 1, lambda x: torch.cat([x, x[:1]]))
    x = torch.randn(2, 5, dtype=F64)
    assert project_before_aggregating(share, x, 5, 3, "sum", "auto")
    assert not project_before_aggregating(Graph(ei, 3), torch.randn(3, 5, dtype=F64), 5, 3, "sum", "auto")


@pytest.mark.parametrize("x_grad, grad_on, host_bound, widths_seen", _ORDER_CASES)
def test_aggregate_linear_order(monkeypatch, x_grad, grad_on, host_bound, widths_seen):
    """SAGE's (and GraphConv's) lin(mean x_j) takes the same rule as GIN's sum."""
    import fusegnn.layers._utils as utils
    from fusegnn.layers import SAGEConv

    torch.manual_seed(0)
    layer = SAGEConv(5, 3).double()
    out, x, ei, n, widths = _run_recording_widths(monkeypatch, utils, layer, x_grad, grad_on, host_bound)
    assert widths == widths_seen
    with torch.no_grad():
        adj = dense_adjacency(ei, n, n)
        mean = adj @ x / adj.sum(1, keepdim=True).clamp(min=1)
        expected = layer.lin_l(mean) + layer.lin_r(x)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-10, atol=1e-12)


@requires_pyg
def test_gin_narrowing_matches_pyg():
    torch.manual_seed(0)
    ours = GINConv(_narrowing_mlp(5, 2), eps=0.1, train_eps=True).double()
    theirs = pyg_nn.GINConv(_narrowing_mlp(5, 2), eps=0.1, train_eps=True).double()
    _same_as_pyg(ours, theirs, _randn(SPECS[0].num_nodes, 5, seed=1), SPECS[0].build())
    w = _randn(SPECS[0].build().size(1), seed=3).abs()
    graph = Graph(SPECS[0].build(), SPECS[0].num_nodes, w)
    adj = dense_adjacency(SPECS[0].build(), SPECS[0].num_nodes, SPECS[0].num_nodes, w)
    assert adj.shape[0] == SPECS[0].num_nodes
    out = ours(_randn(SPECS[0].num_nodes, 5, seed=1), graph)
    assert out.shape == (SPECS[0].num_nodes, 2)
