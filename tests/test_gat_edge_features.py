"""GATConv's edge features (``edge_dim``, ``fill_value``), ``add_self_loops=False``,
bipartite inputs and ``residual``, and the fused kernels' per-edge score addend.

* The fused kernels (``"gar"`` / ``"gas"``, through Triton's interpreter on the CPU) with
  a per-edge addend ``score_edge`` ``[E, H]`` against the reference composition:
  output, coefficients and the gradients of ``h``, both node scores and ``score_edge``
  (with dropout, and with the hub row split into several work items).
* The layer against an independent dense float64 computation written here with Python
  loops (its own self-loop processing and loop features), forward and gradients, and
  against PyG's ``GATConv`` with the same weights where ``torch_geometric`` imports.
* Bad input: ``edge_attr`` without ``edge_dim``, wrong rows or width, bad ``edge_dim``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fusegnn import Graph  # noqa: E402
from fusegnn.layers import GATConv  # noqa: E402
from fusegnn.sparse import edge_softmax, sddmm, spmm  # noqa: E402
from fusegnn.sparse.attention_loops import attention_self_loop_edge_attr, attention_self_loops  # noqa: E402
from fusegnn.sparse.gat import gat_attention, gat_layer  # noqa: E402
from tests.graphs import random_graph  # noqa: E402

F64 = torch.float64
CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
SLOPE = 0.2

try:
    import torch_geometric.nn as pyg_nn
except Exception:  # pragma: no cover - exercised only without PyG
    pyg_nn = None
requires_pyg = pytest.mark.skipif(pyg_nn is None, reason="torch_geometric is not importable")


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _square(n=9, e=30, seed=2) -> torch.Tensor:
    """Isolated nodes, self-loops (one duplicated), duplicate edges and a hub."""
    return random_graph(n, e, seed, hub_degree=6)


def _bipartite(n_src=7, n_dst=5, e=22, seed=4) -> torch.Tensor:
    """A bipartite edge list with edges i -> i (which PyG treats as self-loops) and a duplicate."""
    ei = random_graph(n_src, e, seed, num_dst_nodes=n_dst)
    ei[:, 0] = torch.tensor([1, 1])
    ei[:, 1] = torch.tensor([3, 3])
    ei[:, 2] = ei[:, 3]
    return ei


# ------------------------------------------------------------------ kernels: the edge addend
def _kernel_inputs(graph: Graph, heads: int, channels: int, seed: int):
    h = _randn(graph.num_src_nodes, heads, channels, seed=seed)
    s = _randn(graph.num_src_nodes, heads, seed=seed + 1)
    t = _randn(graph.num_dst_nodes, heads, seed=seed + 2)
    u = _randn(graph.num_edges, heads, seed=seed + 3)
    return tuple(v.to(DEVICE).requires_grad_() for v in (h, s, t, u))


def _composition(graph, h, s, t, u, keep=None, p=0.0):
    """sddmm(add) + u -> leaky_relu -> edge_softmax -> (dropout) -> spmm, unfused."""
    z = sddmm(graph, s, t, "add", aggregation="reference") + u
    alpha = edge_softmax(graph, F.leaky_relu(z, SLOPE), aggregation="reference")
    if keep is not None:
        alpha = alpha * keep.to(alpha.dtype) / (1.0 - p)
    return spmm(graph, h, alpha, aggregation="reference"), alpha


@pytest.mark.parametrize(
    "variant,heads,channels,p,chunk",
    [("gar", 1, 3, 0.0, 48), ("gas", 2, 4, 0.0, 48), ("gar", 3, 2, 0.3, 8), ("gas", 1, 5, 0.3, 2048)],
)
def test_fused_edge_addend_matches_the_composition(variant, heads, channels, p, chunk):
    from fusegnn.kernels.gat_fused import dropout_keep_mask, fused_gat_attention

    graph = Graph(random_graph(14, 90, 5, hub_degree=60).to(DEVICE), 14)
    h, s, t, u = _kernel_inputs(graph, heads, channels, seed=10)
    out, alpha = fused_gat_attention(
        graph, h, s, t, SLOPE, p, seed=21, return_alpha=True, aggregation=variant, chunk=chunk, score_edge=u
    )
    keep = dropout_keep_mask(graph.num_edges, heads, p, 21, DEVICE) if p > 0 else None
    refs = [v.detach().clone().requires_grad_() for v in (h, s, t, u)]
    ref_out, ref_alpha = _composition(graph, *refs, keep, p)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(alpha, ref_alpha, atol=1e-12, rtol=1e-10)
    g_out, g_alpha = _randn(*out.shape, seed=1).to(DEVICE), _randn(*alpha.shape, seed=2).to(DEVICE)
    got = torch.autograd.grad((out * g_out).sum() + (alpha * g_alpha).sum(), (h, s, t, u))
    want = torch.autograd.grad((ref_out * g_out).sum() + (ref_alpha * g_alpha).sum(), refs)
    for name, a, b in zip(("h", "score_src", "score_dst", "score_edge"), got, want):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("aggregation", ["gar", "gas"])
def test_fused_layer_op_with_edge_scores_matches_the_reference(aggregation):
    # gat_layer: scores, attention, head epilogue and bias in one autograd node
    graph = Graph(_square().to(DEVICE), 9)
    h = _randn(9, 2, 3, seed=1).to(DEVICE).requires_grad_()
    att_s, att_t = (_randn(1, 2, 3, seed=k).to(DEVICE).requires_grad_() for k in (2, 3))
    bias = _randn(6, seed=4).to(DEVICE).requires_grad_()
    u = _randn(graph.num_edges, 2, seed=5).to(DEVICE).requires_grad_()
    inputs = (h, att_s, att_t, bias, u)
    outs, grads = [], []
    for agg in (aggregation, "reference"):
        out = gat_layer(graph, h, att_s, att_t, bias, aggregation=agg, score_edge=u)
        outs.append(out)
        grads.append(torch.autograd.grad((out * _randn(*out.shape, seed=6).to(DEVICE)).sum(), inputs))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-12, rtol=1e-10)
    for name, a, b in zip(("h", "att_src", "att_dst", "bias", "score_edge"), *grads):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9, msg=lambda m: f"grad {name}: {m}")


def test_single_head_op_and_score_edge_checks():
    graph = Graph(_square(), 9)
    h, s, t = _randn(9, 3, seed=1), _randn(9, seed=2), _randn(9, seed=3)
    u = _randn(graph.num_edges, seed=4)
    out = gat_attention(graph, h, s, t, score_edge=u, aggregation="reference")
    want = gat_attention(graph, h.unsqueeze(1), s.unsqueeze(1), t.unsqueeze(1), score_edge=u.unsqueeze(1))
    torch.testing.assert_close(out, want.squeeze(1))
    with pytest.raises(ValueError, match=r"score_edge must be \[E\] with one row per edge"):
        gat_attention(graph, h, s, t, score_edge=u[:-1])
    with pytest.raises(ValueError, match=r"score_edge must be \[E, 2\]"):
        gat_attention(graph, h.unsqueeze(1).expand(-1, 2, -1), s.unsqueeze(1).expand(-1, 2),
                      t.unsqueeze(1).expand(-1, 2), score_edge=u.unsqueeze(1))
    with pytest.raises(TypeError, match="score_edge must have the node scores' dtype"):
        gat_attention(graph, h, s, t, score_edge=u.float())
    with pytest.raises(TypeError, match="score_edge must be a torch.Tensor"):
        gat_attention(graph, h, s, t, score_edge=[0.0])


# ------------------------------------------------------------------ the dense oracle
def _loop_feature(rows: list[torch.Tensor], fill_value, width: int) -> torch.Tensor:
    if fill_value is None:
        return torch.ones(width, dtype=F64)
    if isinstance(fill_value, (int, float)):
        return torch.full((width,), float(fill_value), dtype=F64)
    if isinstance(fill_value, torch.Tensor):
        return fill_value.to(F64)
    if not rows:
        return torch.ones(width, dtype=F64) if fill_value == "mul" else torch.zeros(width, dtype=F64)
    stacked = torch.stack(rows)
    return {"add": stacked.sum(0), "sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.amax(0),
            "min": stacked.amin(0), "mul": stacked.prod(0)}[fill_value]


def _dense_gat(layer, x_src, x_dst, edges, edge_attr, add_loops, n_dst):
    """GATConv's formula from the edge list with Python loops: PyG's self-loop step
    (drop j -> j, one loop per i < min(N_src, N_dst) with its fill_value features), then per
    target a softmax over its incoming edges' LeakyReLU(a_s.h_j + a_t.h'_i + a_e.W_e e_ji)."""
    H, C = layer.heads, layer.out_channels
    lin_src = layer.lin if layer.lin is not None else layer.lin_src
    lin_dst = layer.lin if layer.lin is not None else layer.lin_dst
    edges = [tuple(e) for e in edges.t().tolist()]
    attrs = [edge_attr[k] for k in range(len(edges))] if edge_attr is not None else None
    if add_loops:
        kept = [k for k, (j, i) in enumerate(edges) if j != i]
        n_loops = min(x_src.size(0), n_dst)
        new_edges = [edges[k] for k in kept] + [(i, i) for i in range(n_loops)]
        if attrs is not None:
            loop_attrs = [
                _loop_feature([attrs[k] for k in kept if edges[k][1] == i], layer.fill_value, edge_attr.size(1))
                for i in range(n_loops)
            ]
            attrs = [attrs[k] for k in kept] + loop_attrs
        edges = new_edges
    h_src = (x_src @ lin_src.weight.t()).view(-1, H, C)
    h_dst = (x_dst @ lin_dst.weight.t()).view(-1, H, C) if x_dst is not None else None
    rows = []
    for i in range(n_dst):
        incoming = [k for k, (_, d) in enumerate(edges) if d == i]
        if not incoming:
            rows.append(torch.zeros(H, C, dtype=F64))
            continue
        logits = []
        for k in incoming:
            z = (h_src[edges[k][0]] * layer.att_src[0]).sum(-1)
            if h_dst is not None:
                z = z + (h_dst[i] * layer.att_dst[0]).sum(-1)
            if attrs is not None:
                z = z + ((layer.lin_edge.weight @ attrs[k]).view(H, C) * layer.att_edge[0]).sum(-1)
            logits.append(F.leaky_relu(z, layer.negative_slope))
        alpha = torch.softmax(torch.stack(logits), dim=0)  # [deg, H]
        rows.append(sum(alpha[n].unsqueeze(-1) * h_src[edges[k][0]] for n, k in enumerate(incoming)))
    out = torch.stack(rows)
    out = out.reshape(n_dst, H * C) if layer.concat else out.mean(1)
    if layer.res is not None and x_dst is not None:
        out = out + x_dst @ layer.res.weight.t()
    return out + layer.bias if layer.bias is not None else out


def _params_and_grads(layer, loss):
    params = [p for _, p in layer.named_parameters()]
    return torch.autograd.grad(loss, params, allow_unused=True)


CASES = {
    "edge_mean": dict(kw=dict(heads=2, edge_dim=3)),
    "edge_add_concat_off": dict(kw=dict(heads=3, edge_dim=2, fill_value="add", concat=False)),
    "edge_max": dict(kw=dict(heads=2, edge_dim=3, fill_value="max")),
    "edge_min": dict(kw=dict(heads=1, edge_dim=3, fill_value="min")),
    "edge_mul": dict(kw=dict(heads=2, edge_dim=2, fill_value="mul")),
    "edge_number": dict(kw=dict(heads=2, edge_dim=3, fill_value=0.5)),
    "edge_tensor": dict(kw=dict(heads=2, edge_dim=3, fill_value=torch.tensor([1.0, -2.0, 0.5], dtype=F64))),
    "edge_no_loops": dict(kw=dict(heads=2, edge_dim=3, add_self_loops=False)),
    "no_loops": dict(kw=dict(heads=2, add_self_loops=False)),
    "edge_widen": dict(kw=dict(heads=2, edge_dim=3), channels=(3, 7)),  # aggregate-first form
    "residual": dict(kw=dict(heads=2, edge_dim=1, residual=True)),
    "bipartite": dict(kw=dict(heads=2, edge_dim=3), channels=((5, 4), 3), bipartite=True),
    "bipartite_shared_lin": dict(kw=dict(heads=2, edge_dim=3, residual=True), channels=(5, 3), bipartite=True),
    "bipartite_no_dst": dict(kw=dict(heads=2, edge_dim=3, fill_value="max"), channels=((5, 4), 3),
                             bipartite=True, no_dst=True),
    "bipartite_no_loops_widen": dict(kw=dict(heads=2, add_self_loops=False), channels=((3, 4), 6), bipartite=True),
}


def _case(name):
    case = CASES[name]
    channels = case.get("channels", (5, 3))
    torch.manual_seed(0)
    layer = GATConv(*channels, **case["kw"], aggregation="reference").double()
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    in_src, in_dst = channels[0] if isinstance(channels[0], tuple) else (channels[0], channels[0])
    if case.get("bipartite"):
        ei, n_src, n_dst = _bipartite(), 7, 5
        x_src = _randn(n_src, in_src, seed=1).requires_grad_()
        x_dst = None if case.get("no_dst") else _randn(n_dst, in_dst, seed=2).requires_grad_()
        x = (x_src, x_dst)
    else:
        ei, n_src, n_dst = _square(), 9, 9
        x_src = x_dst = x = _randn(9, in_src, seed=1).requires_grad_()
    edge_dim = case["kw"].get("edge_dim")
    edge_attr = _randn(ei.size(1), edge_dim, seed=3).requires_grad_() if edge_dim else None
    if edge_dim == 1:
        edge_attr = edge_attr.detach().view(-1).requires_grad_()  # PyG's [E] form
    return layer, x, x_src, x_dst, ei, edge_attr, n_dst


@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_the_dense_formula(name):
    layer, x, x_src, x_dst, ei, edge_attr, n_dst = _case(name)
    # without x_dst the targets are x_src's rows unless size says otherwise (as in PyG)
    out = layer(x, ei, edge_attr, size=(7, 5) if CASES[name].get("no_dst") else None)
    attr2 = edge_attr.view(ei.size(1), -1) if edge_attr is not None else None
    want = _dense_gat(layer, x_src, x_dst, ei, attr2, layer.add_self_loops, n_dst)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    g = _randn(*out.shape, seed=9)
    inputs = [v for v in (x_src, x_dst if x_dst is not x_src else None, edge_attr) if v is not None]
    got = torch.autograd.grad((out * g).sum(), inputs, retain_graph=True)
    want_grads = torch.autograd.grad((want * g).sum(), inputs, retain_graph=True)
    for a, b in zip(got, want_grads):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)
    for a, b in zip(_params_and_grads(layer, (out * g).sum()), _params_and_grads(layer, (want * g).sum())):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("aggregation", ["gar", "gas"])
@pytest.mark.parametrize("name", ["edge_mean", "edge_widen", "bipartite", "edge_no_loops"])
def test_fused_layer_with_edge_features_matches_the_reference(name, aggregation):
    layer, x, x_src, x_dst, ei, edge_attr, n_dst = _case(name)
    layer = layer.to(DEVICE)  # the same inputs and weights on the kernels' device
    x_src = x_src.detach().to(DEVICE).requires_grad_()
    x_dst = x_src if x_dst is x else (None if x_dst is None else x_dst.detach().to(DEVICE))
    x = x_src if isinstance(x, torch.Tensor) else (x_src, x_dst)
    edge_attr = edge_attr.detach().to(DEVICE).requires_grad_() if edge_attr is not None else None
    ei = ei.to(DEVICE)
    fused = GATConv(layer.in_channels, layer.out_channels, **CASES[name]["kw"], aggregation=aggregation)
    fused = fused.double().to(DEVICE)
    fused.load_state_dict(layer.state_dict())
    results = []
    for module in (fused, layer):
        out = module(x, ei, edge_attr)
        out_alpha, (_, alpha) = module(x, ei, edge_attr, return_attention_weights=True)
        torch.testing.assert_close(out_alpha, out, atol=1e-12, rtol=1e-10)
        g_out, g_alpha = _randn(*out.shape, seed=5).to(DEVICE), _randn(*alpha.shape, seed=6).to(DEVICE)
        loss = (out * g_out).sum() + (alpha * g_alpha).sum()
        inputs = [v for v in (x_src, edge_attr) if v is not None] + list(module.parameters())
        results.append((out, alpha, torch.autograd.grad(loss, inputs)))
    (out, alpha, grads), (ref_out, ref_alpha, ref_grads) = results
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(alpha, ref_alpha, atol=1e-12, rtol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


def test_bipartite_self_loops_follow_pyg():
    ei = _bipartite()
    graph = Graph(ei, (7, 5))
    looped = attention_self_loops(graph)
    keep = ei[0] != ei[1]
    assert looped.num_src_nodes == 7 and looped.num_dst_nodes == 5
    assert torch.equal(looped.edge_index[:, : int(keep.sum())], ei[:, keep])
    assert torch.equal(looped.edge_index[:, int(keep.sum()):], torch.arange(5).expand(2, 5))
    attr = _randn(ei.size(1), 2, seed=1)
    out = attention_self_loop_edge_attr(graph, attr, "add")
    assert out.shape == (looped.num_edges, 2)
    for i in range(5):
        torch.testing.assert_close(out[int(keep.sum()) + i], attr[keep & (ei[1] == i)].sum(0))
    assert attention_self_loops(graph) is looped  # cached on the graph
    # more targets than sources: loops only for i < N_src
    wide = Graph(torch.tensor([[0, 1, 2], [4, 3, 0]]), (3, 6))
    assert torch.equal(attention_self_loops(wide).edge_index[:, 3:], torch.arange(3).expand(2, 3))


def test_layer_accepts_graph_sparse_and_size():
    layer, x, x_src, x_dst, ei, edge_attr, n_dst = _case("bipartite")
    want = layer(x, ei, edge_attr)
    torch.testing.assert_close(layer(x, Graph(ei, (7, 5)), edge_attr), want)
    torch.testing.assert_close(layer(x, ei, edge_attr, size=(7, 5)), want)
    layer_nd, x_nd, *_ = _case("bipartite_no_dst")
    ei_nd = _bipartite()
    out = layer_nd(x_nd, ei_nd, _randn(ei_nd.size(1), 3, seed=3), size=(7, 5))
    assert out.shape == (5, 6)
    with pytest.raises(ValueError, match=r"size\[1\]=6 but x_dst has 5 rows"):
        layer(x, ei, edge_attr, size=(7, 6))


def test_lazy_bipartite_layer_initialises_at_first_forward():
    torch.manual_seed(0)
    layer = GATConv((-1, -1), 3, heads=2, edge_dim=2).double()
    ei = _bipartite()
    out = layer((_randn(7, 5, seed=1), _randn(5, 4, seed=2)), ei, _randn(ei.size(1), 2, seed=3))
    assert out.shape == (5, 6) and layer.in_channels == (5, 4)
    assert layer.lin_src.weight.shape == (6, 5) and layer.lin_dst.weight.shape == (6, 4)


# ------------------------------------------------------------------ bad input
def test_bad_edge_input():
    layer, x, _, _, ei, edge_attr, _ = _case("edge_mean")
    with pytest.raises(ValueError, match="GATConv: edge_attr was given but the layer was built without edge_dim"):
        GATConv(5, 3, heads=2).double()(x, ei, edge_attr)
    with pytest.raises(ValueError, match=r"GATConv: edge_attr has 29 rows but the graph has 30 edges"):
        layer(x, ei, edge_attr[:-1])
    with pytest.raises(ValueError, match="GATConv: edge_attr has 2 features per edge but the layer takes 3"):
        layer(x, ei, edge_attr[:, :2])
    with pytest.raises(TypeError, match="GATConv: edge_attr must be a floating tensor"):
        layer(x, ei, torch.ones(ei.size(1), 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="GATConv: edge_attr has dtype torch.float32"):
        layer(x, ei, edge_attr.float())
    with pytest.raises(ValueError, match="edge_dim must be a positive int or None"):
        GATConv(5, 3, edge_dim=0)
    with pytest.raises(ValueError, match="fill_value must be one of"):
        GATConv(5, 3, edge_dim=3, fill_value="median").double()(x, ei, edge_attr)
    bip, xb, *_ = _case("bipartite")
    with pytest.raises(ValueError, match="GATConv: x_dst has 3 features per node but the layer takes 4"):
        bip((xb[0], _randn(5, 3, seed=1)), _bipartite())
    with pytest.raises(ValueError, match=r"the graph has 7 x 5 \(source x target\) nodes but the features give 7 x 4"):
        bip((xb[0], _randn(4, 4, seed=1)), Graph(_bipartite(), (7, 5)))
    assert torch.equal(edge_attr, edge_attr.detach().clone())  # untouched


# ------------------------------------------------------------------ PyG
def _copy_params(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    dst_params = dict(dst.named_parameters())
    assert set(dst_params) == {n for n, _ in src.named_parameters()}
    with torch.no_grad():
        for name, p in src.named_parameters():
            dst_params[name].copy_(p)


@requires_pyg
@pytest.mark.parametrize("name", list(CASES))
def test_layer_matches_pyg(name):
    layer, x, x_src, x_dst, ei, edge_attr, n_dst = _case(name)
    channels = CASES[name].get("channels", (5, 3))
    theirs = pyg_nn.GATConv(*channels, **CASES[name]["kw"]).double()
    _copy_params(layer, theirs)
    x2 = (x_src.detach().clone().requires_grad_(), None if x_dst is None else x_dst.detach().clone().requires_grad_())
    x2 = x2[0] if isinstance(x, torch.Tensor) else x2
    attr2 = edge_attr.detach().clone().requires_grad_() if edge_attr is not None else None
    size = (7, 5) if CASES[name].get("no_dst") else None
    out1, (ei1, alpha1) = layer(x, ei, edge_attr, size=size, return_attention_weights=True)
    out2, (ei2, alpha2) = theirs(x2, ei, attr2, size=size, return_attention_weights=True)
    torch.testing.assert_close(out1, out2, atol=1e-12, rtol=1e-10)
    assert torch.equal(ei1, ei2)
    torch.testing.assert_close(alpha1, alpha2, atol=1e-12, rtol=1e-10)
    g = _randn(*out1.shape, seed=4)
    (out1 * g).sum().backward()
    (out2 * g).sum().backward()
    mine = [v for v in ((x,) if isinstance(x, torch.Tensor) else x) if v is not None] + [edge_attr]
    pyg = [v for v in ((x2,) if isinstance(x2, torch.Tensor) else x2) if v is not None] + [attr2]
    for a, b in zip(mine, pyg):
        if a is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-11, rtol=1e-9)
    theirs_params = dict(theirs.named_parameters())
    for pname, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, theirs_params[pname].grad, atol=1e-11, rtol=1e-9,
                                   msg=lambda m: f"{pname}: {m}")


# ------------------------------------------------------------------ torch.compile
def test_compiled_layer_with_edge_scores_matches_eager():
    """Under torch.compile the edge term enters the fusegnn::gat_attention op (its
    gradient from the op's backward); self-loops with edge features stay eager only."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        for name in ("edge_no_loops", "bipartite_no_loops_widen"):
            layer, x, x_src, _, ei, edge_attr, n_dst = _case(name)
            graph = Graph(ei, (x_src.size(0), n_dst))
            compiled = torch.compile(lambda x, g, a: layer(x, g, a), backend="aot_eager", fullgraph=True)
            got, want = compiled(x, graph, edge_attr), layer(x, graph, edge_attr)
            torch.testing.assert_close(got, want)
            g = _randn(*want.shape, seed=2)
            wrt = [x_src] + ([edge_attr] if edge_attr is not None else [])
            for a, b in zip(torch.autograd.grad((got * g).sum(), wrt), torch.autograd.grad((want * g).sum(), wrt)):
                torch.testing.assert_close(a, b)
        layer, x, _, _, ei, edge_attr, _ = _case("edge_mean")
        compiled = torch.compile(lambda x, g, a: layer(x, g, a), backend="aot_eager", fullgraph=True)
        with pytest.raises(Exception, match="edge features with self-loops need the graph itself"):
            compiled(x, Graph(ei, 9), edge_attr)
    finally:
        torch._dynamo.reset()
