"""GATv2 with the projections inside the fused kernels (``PROJECT``): the projected op
against the plain fused op on the same projections and against a float64 reference, for
the output and every gradient (inputs, weights, biases, attention vector, edge
features); the dispatch rule of :func:`fusegnn.sparse.gatv2_projected_attention`; and
``GATv2Conv`` with and without projection. Through Triton's CPU interpreter (on the GPU
when there is one).

Graphs have isolated targets, self-loops, duplicate edges and a hub row that a short
``chunk`` splits into several work items.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

import fusegnn.kernels.gatv2_fused as gatv2_fused  # noqa: E402
import fusegnn.sparse.gatv2 as gatv2_op  # noqa: E402
from fusegnn.kernels.gat_fused import dropout_keep_mask  # noqa: E402
from fusegnn.kernels.gatv2_fused import fused_gatv2_attention, fused_gatv2_projected_attention  # noqa: E402
from fusegnn.layers import GATv2Conv  # noqa: E402
from fusegnn.sparse import Graph, gatv2_projected_attention, reference  # noqa: E402
from fusegnn.sparse.gatv2 import projects  # noqa: E402
from tests.graphs import random_graph  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SLOPE = 0.2
CHUNK = 24  # splits the hub row (in-degree 60)
NAMES = ("x_src", "weight_l", "bias_l", "x_dst", "weight_r", "bias_r", "att", "edge_attr")


def _graph(num_nodes=14, num_edges=120, seed=1, hub=60, num_dst_nodes=None) -> Graph:
    ei = random_graph(num_nodes, num_edges, seed, hub_degree=hub, num_dst_nodes=num_dst_nodes)
    return Graph(ei.to(DEVICE), num_nodes if num_dst_nodes is None else (num_nodes, num_dst_nodes))


def _inputs(graph, heads, channels, k_src, k_dst=None, *, edge=False, shared=False, seed=3):
    """Float64 leaves (``NAMES``' order; ``None`` for absent edge features); with ``shared``
    the target side is the source side's very tensors (shared weights on one node set)."""
    gen = torch.Generator().manual_seed(seed)
    width = heads * channels

    def leaf(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()

    x_src, w_l, b_l = leaf(graph.num_src_nodes, k_src), leaf(width, k_src), leaf(width)
    if shared:
        x_dst, w_r, b_r = x_src, w_l, b_l
    else:
        k_dst = k_src if k_dst is None else k_dst
        x_dst, w_r, b_r = leaf(graph.num_dst_nodes, k_dst), leaf(width, k_dst), leaf(width)
    att = leaf(1, heads, channels)
    e = leaf(graph.num_edges, heads, channels) if edge else None
    return [x_src, w_l, b_l, x_dst, w_r, b_r, att, e]


def _cast(values, dtype):
    """Leaves of ``dtype`` holding ``values``, keeping which ones are the same tensor."""
    made = {}
    for v in values:
        if v is not None and id(v) not in made:
            made[id(v)] = v.detach().to(dtype).requires_grad_()
    return [made[id(v)] if v is not None else None for v in values]


def _unique(values):
    seen, out = set(), []
    for v in values:
        if v is not None and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _plain(graph, values, variant, p=0.0, seed=5):
    """The plain fused op on the projections formed in torch."""
    x_src, w_l, b_l, x_dst, w_r, b_r, att, e = values
    heads, channels = att.shape[-2:]
    x_l = F.linear(x_src, w_l, b_l).view(-1, heads, channels)
    x_r = x_l if x_dst is x_src and w_r is w_l else F.linear(x_dst, w_r, b_r).view(-1, heads, channels)
    return fused_gatv2_attention(graph, x_l, x_r, att, e, SLOPE, p, seed=seed, aggregation=variant, chunk=CHUNK)


def _projected(graph, values, variant, p=0.0, seed=5):
    return fused_gatv2_projected_attention(graph, *values, SLOPE, p, seed=seed, aggregation=variant, chunk=CHUNK)


def _reference(graph, values, p=0.0, seed=5):
    x_src, w_l, b_l, x_dst, w_r, b_r, att, e = values
    heads, channels = att.shape[-2:]
    x_l = F.linear(x_src, w_l, b_l).view(-1, heads, channels)
    x_r = F.linear(x_dst, w_r, b_r).view(-1, heads, channels)
    out, alpha = reference.gatv2_attention(graph, x_l, x_r, att, e, SLOPE)
    if p > 0:
        keep = dropout_keep_mask(graph.num_edges, heads, p, seed, DEVICE)
        out = reference.spmm(graph, x_l, alpha * keep.to(alpha.dtype) / (1.0 - p))
    return out


def _grads(out, values, g_out):
    leaves = _unique(values)
    got = dict(zip(map(id, leaves), torch.autograd.grad((out.double() * g_out).sum(), leaves)))
    return [got[id(v)] if v is not None else None for v in values]


def _close(a, b, tol, what):
    """``a`` within ``tol`` of ``b`` relative to ``b``'s largest entry."""
    err = (a.double() - b.double()).abs().max().item() / max(b.double().abs().max().item(), 1e-30)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def _check_all(graph, values64, variant, p=0.0, dtype=torch.float32, tol_plain=1e-5, tol_ref=1e-4):
    """Projected against plain (same dtype) and the float64 reference: output and grads."""
    proj_in, plain_in = _cast(values64, dtype), _cast(values64, dtype)
    out = _projected(graph, proj_in, variant, p)
    plain = _plain(graph, plain_in, variant, p)
    ref = _reference(graph, values64, p)
    assert out.shape == ref.shape and out.dtype == dtype
    _close(out, plain, tol_plain, "out vs plain")
    _close(out, ref, tol_ref, "out vs float64 reference")
    g_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64).to(DEVICE)
    got, want_plain, want_ref = (_grads(o, v, g_out) for o, v in ((out, proj_in), (plain, plain_in), (ref, values64)))
    for name, a, b, r in zip(NAMES, got, want_plain, want_ref):
        if a is None:
            continue
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        _close(a, b, tol_plain, f"grad {name} vs plain")
        _close(a, r, tol_ref, f"grad {name} vs float64 reference")
    return out


@pytest.mark.parametrize("variant", ["gar", "gas"])
@pytest.mark.parametrize("heads,channels", [(1, 41), (3, 5), (1, 5), (3, 41)])
@pytest.mark.parametrize("k", [16, 7])
def test_projected_matches_plain_and_reference(variant, heads, channels, k):
    graph = _graph()
    assert (graph.in_degree == 0).any() and int(graph.in_degree.max()) >= CHUNK
    _check_all(graph, _inputs(graph, heads, channels, k, edge=(heads == 3)), variant)


@pytest.mark.parametrize("variant,heads,p", [("gar", 3, 0.4), ("gas", 1, 0.25)])
def test_dropout_draws_the_plain_ops_mask(variant, heads, p):
    graph = _graph()
    _check_all(graph, _inputs(graph, heads, 41, 16), variant, p=p)


@pytest.mark.parametrize("variant", ["gar", "gas"])
def test_shared_weights_and_bipartite(variant):
    graph = _graph()
    values = _inputs(graph, 2, 9, 7, shared=True)
    assert values[3] is values[0] and values[4] is values[1]
    _check_all(graph, values, variant)
    bipartite = _graph(num_nodes=12, num_edges=70, hub=30, num_dst_nodes=7)
    assert bipartite.is_bipartite
    _check_all(bipartite, _inputs(bipartite, 3, 5, 7, k_dst=12, edge=True), variant)


@pytest.mark.parametrize("project_l,project_r", [(True, False), (False, True)])
def test_one_side_projected(project_l, project_r):
    graph = _graph()
    values = _inputs(graph, 1, 41, 16)
    out = fused_gatv2_projected_attention(graph, *_cast(values, torch.float32), SLOPE, chunk=CHUNK,
                                          project_l=project_l, project_r=project_r)
    _close(out, _plain(graph, _cast(values, torch.float32), "gar"), 1e-5, "out")


def test_float64_kernels():
    # tl.dot in float64 (the op's dispatch keeps float64 on the gathered rows)
    graph = _graph()
    _check_all(graph, _inputs(graph, 3, 5, 7, edge=True), "gar", dtype=torch.float64, tol_plain=1e-12,
               tol_ref=1e-12)


def test_no_edges_and_wide_inputs():
    empty = Graph(torch.empty(2, 0, dtype=torch.int64, device=DEVICE), 4)
    values = _cast(_inputs(empty, 2, 3, 5), torch.float32)
    out = fused_gatv2_projected_attention(empty, *values)
    assert out.shape == (4, 2, 3) and bool((out == 0).all())
    assert all(bool((g == 0).all()) for g in torch.autograd.grad(out.sum(), _unique(values)))
    graph = _graph()
    wide = _cast(_inputs(graph, 1, 41, gatv2_fused.MAX_PROJECTED_INPUTS + 1), torch.float32)
    with pytest.raises(ValueError, match="x_src has 65 features"):
        fused_gatv2_projected_attention(graph, *wide)
    out = fused_gatv2_projected_attention(graph, *wide, project_l=False, project_r=False)  # plain rows
    _close(out, _plain(graph, wide, "gar"), 1e-6, "out")


# ------------------------------------------------------------------ the op's dispatch
def test_projection_rule():
    assert projects(16, 1, 41)  # Reddit's output layer: 16 inputs for a 48-wide padded row
    assert projects(7, 3, 5) and not projects(8, 3, 5)
    assert not projects(32, 1, 41) and not projects(0, 1, 41)
    assert not projects(gatv2_fused.MAX_PROJECTED_INPUTS + 1, 8, 64)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The side flags of every call of the projected kernels through the op."""
    calls = []
    fn = gatv2_fused.fused_gatv2_projected_attention

    def spy(*args, **kwargs):
        calls.append((kwargs["project_l"], kwargs["project_r"]))
        return fn(*args, **kwargs)

    monkeypatch.setattr(gatv2_fused, "fused_gatv2_projected_attention", spy)
    return calls


@pytest.mark.parametrize("aggregation", ["gar", "gas"])
def test_op_projects_narrow_inputs(kernel_calls, aggregation):
    graph = _graph(num_nodes=12, num_edges=70, hub=30, num_dst_nodes=7)
    values = _inputs(graph, 1, 41, 16, k_dst=40, edge=True)
    out = gatv2_projected_attention(graph, *_cast(values, torch.float32), aggregation=aggregation)
    assert kernel_calls == [(True, False)]  # 40 target inputs exceed half the 48-wide row
    _close(out, _reference(graph, values), 1e-4, "out")


@pytest.mark.parametrize("case", ["float64", "return_alpha", "reference", "wide", "gas_targets_only"])
def test_op_keeps_gathered_rows(kernel_calls, case):
    graph = _graph()
    k_src = 40 if case in ("wide", "gas_targets_only") else 16
    values = _inputs(graph, 1, 41, k_src, k_dst=40 if case == "wide" else 16)
    kw = dict(aggregation="reference" if case == "reference" else ("gas" if case == "gas_targets_only" else "gar"))
    if case == "return_alpha":
        kw["return_alpha"] = True
    inputs = values if case == "float64" else _cast(values, torch.float32)
    result = gatv2_projected_attention(graph, *inputs, **kw)
    out = result[0] if case == "return_alpha" else result
    assert kernel_calls == []
    _close(out, _reference(graph, values), 1e-10 if case == "float64" else 1e-4, "out")


@pytest.mark.parametrize(
    "index,value,error,match",
    [
        (0, torch.zeros(14), ValueError, "x_src must have 2 dimensions"),
        (1, torch.zeros(41, 15), ValueError, r"weight_l must have shape \[41, 16\]"),
        (2, torch.zeros(40), ValueError, r"bias_l must have shape \[41\]"),
        (4, torch.zeros(41, 16, dtype=torch.float64), TypeError, "weight_r must have x_dst's dtype"),
        (3, torch.zeros(14, 16, dtype=torch.float64), TypeError, "x_dst must have x_src's dtype"),
        (6, torch.zeros(41), ValueError, "att must be"),
    ],
)
def test_op_rejects_bad_tensors(index, value, error, match):
    graph = _graph()
    values = _cast(_inputs(graph, 1, 41, 16), torch.float32)
    values[index] = value.to(DEVICE)
    with pytest.raises(error, match=match):
        gatv2_projected_attention(graph, *values, aggregation="gar")


# ------------------------------------------------------------------ the layer
LAYER_CASES = [
    dict(),
    dict(heads=3, out_channels=5, in_channels=7),
    dict(share_weights=True),
    dict(bias=False, concat=False, heads=2),
    dict(edge_dim=3),
    dict(residual=True),
    dict(bipartite=True),
]


@pytest.mark.parametrize("kwargs", LAYER_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_layer_projected_equals_unprojected(kwargs, kernel_calls, monkeypatch):
    kw = dict(kwargs)
    bipartite = kw.pop("bipartite", False)
    in_channels, out_channels = kw.pop("in_channels", 16), kw.pop("out_channels", 41)
    graph = random_graph(12, 70, 2, hub_degree=30, num_dst_nodes=7 if bipartite else None).to(DEVICE)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(12, in_channels, generator=gen).to(DEVICE).requires_grad_()
    x_dst = torch.randn(7, in_channels, generator=gen).to(DEVICE).requires_grad_() if bipartite else None
    ea = torch.randn(70, 3, generator=gen).to(DEVICE).requires_grad_() if "edge_dim" in kw else None
    torch.manual_seed(0)
    layer = GATv2Conv(in_channels, out_channels, dropout=0.3, aggregation="gar", **kw).to(DEVICE)
    reference_layer = GATv2Conv(in_channels, out_channels, dropout=0.3, aggregation="reference", **kw)
    reference_layer = reference_layer.double().to(DEVICE)
    reference_layer.load_state_dict(layer.state_dict())
    inputs = (x, x_dst) if bipartite else x
    leaves = [t for t in (x, x_dst, ea) if t is not None]

    def run(model, cast=None, train=True):
        model.train(train)
        torch.manual_seed(9)  # the dropout seed, drawn per call
        args = inputs if cast is None else ((x.double(), x_dst.double()) if bipartite else x.double())
        e = ea if cast is None or ea is None else ea.double()
        out = model(args, graph, e) if e is not None else model(args, graph)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE, out.dtype)
        return out, torch.autograd.grad((out * g).sum(), list(model.parameters()) + leaves)

    out, grads = run(layer)
    assert kernel_calls and all(flags[0] for flags in kernel_calls)
    monkeypatch.setattr(gatv2_op, "PROJECTION_MAX_RATIO", 0.0)  # nothing projects
    plain_out, plain_grads = run(layer)
    assert len(kernel_calls) == 1
    _close(out, plain_out, 1e-5, "out")
    for k, (a, b) in enumerate(zip(grads, plain_grads)):
        _close(a, b, 1e-5, f"grad {k}")
    # without dropout against the float64 reference layer
    monkeypatch.undo()  # the rule (and the spy) as shipped
    out, grads = run(layer, train=False)
    ref_out, ref_grads = run(reference_layer, cast=torch.float64, train=False)
    _close(out, ref_out, 1e-4, "out vs float64 reference layer")
    for k, (a, b) in enumerate(zip(grads, ref_grads)):
        _close(a, b, 1e-4, f"grad {k} vs float64 reference layer")
