"""TransformerConv against an independent dense float64 computation (Python loops over the
edge list), against PyG's ``TransformerConv`` with the same weights, through the fused
sparse ops (``"gar"`` / ``"gas"`` under Triton's interpreter on the CPU) and under
``torch.compile``; bad input."""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fusegnn import Graph  # noqa: E402
from fusegnn.sparse import edge_aggregate  # noqa: E402
from fusegnn.layers import TransformerConv  # noqa: E402
from fusegnn.layers.transformer_conv import _query_edge_scores  # noqa: E402
from tests.graphs import random_graph  # noqa: E402

F64 = torch.float64
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

try:
    import torch_geometric.nn as pyg_nn
except Exception:  # pragma: no cover - exercised only without PyG
    pyg_nn = None
requires_pyg = pytest.mark.skipif(pyg_nn is None, reason="torch_geometric is not importable")


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


CASES = {
    "plain": dict(kw=dict()),
    "heads_edges": dict(kw=dict(heads=3, edge_dim=2)),  # edge_dim < C: queries projected to the edge features
    "wide_edges": dict(kw=dict(heads=2, edge_dim=7)),  # edge_dim >= C: the transformed edge features gathered
    "mean_heads": dict(kw=dict(heads=2, concat=False, edge_dim=3)),
    "beta": dict(kw=dict(heads=2, beta=True, edge_dim=2)),
    "beta_mean": dict(kw=dict(heads=2, beta=True, concat=False)),
    "no_root": dict(kw=dict(heads=2, root_weight=False, edge_dim=2)),
    "no_bias": dict(kw=dict(heads=2, bias=False, beta=True)),
    "bipartite": dict(kw=dict(heads=2, edge_dim=2, beta=True), channels=((5, 3), 4), bipartite=True),
    "bipartite_shared": dict(kw=dict(heads=2), channels=(5, 4), bipartite=True),
}


def _case(name, aggregation="reference"):
    case = CASES[name]
    channels = case.get("channels", (5, 4))
    torch.manual_seed(0)
    layer = TransformerConv(*channels, **case["kw"], aggregation=aggregation).double()
    in_src, in_dst = channels[0] if isinstance(channels[0], tuple) else (channels[0], channels[0])
    if case.get("bipartite"):
        n_src, n_dst = 8, 5
        ei = random_graph(n_src, 26, 3, num_dst_nodes=n_dst, hub_degree=8)
        x_src = _randn(n_src, in_src, seed=1).requires_grad_()
        x_dst = _randn(n_dst, in_dst, seed=2).requires_grad_()
        x = (x_src, x_dst)
    else:
        n_dst = 9
        ei = random_graph(9, 32, 5, hub_degree=7)  # isolated nodes, self-loops, duplicates, a hub
        x_src = x_dst = x = _randn(9, in_src, seed=1).requires_grad_()
    edge_dim = case["kw"].get("edge_dim")
    edge_attr = _randn(ei.size(1), edge_dim, seed=3).requires_grad_() if edge_dim else None
    return layer, x, x_src, x_dst, ei, edge_attr, n_dst


def _dense(layer, x_src, x_dst, ei, edge_attr, n_dst):
    """The layer's formula with Python loops over each target's incoming edges."""
    H, C = layer.heads, layer.out_channels
    q = layer.lin_query(x_dst).view(-1, H, C)
    k = layer.lin_key(x_src).view(-1, H, C)
    v = layer.lin_value(x_src).view(-1, H, C)
    e = layer.lin_edge(edge_attr).view(-1, H, C) if edge_attr is not None else None
    src, dst = ei.tolist()
    rows, alphas = [], torch.zeros(len(src), H, dtype=F64)
    alpha_rows = {}
    for i in range(n_dst):
        incoming = [n for n in range(len(src)) if dst[n] == i]
        if not incoming:
            rows.append(torch.zeros(H, C, dtype=F64))
            continue
        keys = [k[src[n]] + (e[n] if e is not None else 0) for n in incoming]
        logits = torch.stack([(q[i] * key).sum(-1) / math.sqrt(C) for key in keys])  # [deg, H]
        alpha = torch.softmax(logits, dim=0)
        vals = [v[src[n]] + (e[n] if e is not None else 0) for n in incoming]
        rows.append(sum(alpha[m].unsqueeze(-1) * val for m, val in enumerate(vals)))
        for m, n in enumerate(incoming):
            alpha_rows[n] = alpha[m]
    alphas = torch.stack([alpha_rows[n] for n in range(len(src))])
    out = torch.stack(rows)
    out = out.reshape(n_dst, H * C) if layer.concat else out.mean(1)
    if layer.root_weight:
        skip = layer.lin_skip(x_dst)
        if layer.lin_beta is not None:
            gate = torch.sigmoid(layer.lin_beta(torch.cat([out, skip, out - skip], dim=-1)))
            out = gate * skip + (1 - gate) * out
        else:
            out = out + skip
    return out, alphas


def _inputs_of(x_src, x_dst, edge_attr):
    return [v for v in (x_src, x_dst if x_dst is not x_src else None, edge_attr) if v is not None]


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_dense_formula(name):
    layer, x, x_src, x_dst, ei, edge_attr, n_dst = _case(name)
    out, (ei_out, alpha) = layer(x, ei, edge_attr, return_attention_weights=True)
    want, want_alpha = _dense(layer, x_src, x_dst, ei, edge_attr, n_dst)
    assert torch.equal(ei_out, ei)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(alpha, want_alpha, atol=1e-12, rtol=1e-10)
    g = _randn(*out.shape, seed=9)
    wrt = _inputs_of(x_src, x_dst, edge_attr) + list(layer.parameters())
    got = torch.autograd.grad((out * g).sum(), wrt, allow_unused=True)
    expected = torch.autograd.grad((want * g).sum(), wrt, allow_unused=True)
    for a, b in zip(got, expected):
        assert (a is None) == (b is None)  # lin_skip is unused without root_weight
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("aggregation", ["gar", "gas"])
@pytest.mark.parametrize("name", ["heads_edges", "bipartite"])
def test_fused_ops_match_the_reference(name, aggregation):
    layer, x, x_src, x_dst, ei, edge_attr, _ = _case(name)
    fused, *_ = _case(name, aggregation)
    layer, fused = layer.to(DEVICE), fused.to(DEVICE)  # the same inputs and weights on the kernels' device
    fused.load_state_dict(layer.state_dict())
    x_src = x_src.detach().to(DEVICE).requires_grad_()
    x_dst = x_src if x_dst is x else x_dst.detach().to(DEVICE).requires_grad_()
    x = x_src if isinstance(x, torch.Tensor) else (x_src, x_dst)
    edge_attr = edge_attr.detach().to(DEVICE).requires_grad_() if edge_attr is not None else None
    results = []
    for module in (fused, layer):
        out, (_, alpha) = module(x, ei.to(DEVICE), edge_attr, return_attention_weights=True)
        g_out, g_alpha = _randn(*out.shape, seed=5).to(DEVICE), _randn(*alpha.shape, seed=6).to(DEVICE)
        loss = (out * g_out).sum() + (alpha * g_alpha).sum()
        results.append((out, alpha, torch.autograd.grad(loss, _inputs_of(x_src, x_dst, edge_attr))))
    (out, alpha, grads), (ref_out, ref_alpha, ref_grads) = results
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(alpha, ref_alpha, atol=1e-12, rtol=1e-10)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9)


class _Weighted:
    """A stand-in for ``lin_edge`` whose weight is a gradcheck input."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


@pytest.mark.parametrize("edge_dim", [2, 5])  # < C: queries projected to the edge features; >= C: e' gathered
def test_edge_terms(edge_dim):
    # the query-edge logit term against loops; the fused value term (edge_aggregate) against loops
    graph = Graph(random_graph(6, 15, 1), 6)
    q = _randn(6, 2, 3, seed=1).requires_grad_()
    lin_edge = torch.nn.Linear(edge_dim, 2 * 3, bias=False).double()
    edge_attr = _randn(15, edge_dim, seed=2).requires_grad_()
    e = lin_edge(edge_attr).view(15, 2, 3)
    alpha = _randn(15, 2, seed=3).requires_grad_()
    src, dst = graph.edge_index.tolist()
    scores = _query_edge_scores(graph, q, edge_attr, lin_edge, e)
    for n in range(15):
        torch.testing.assert_close(scores[n], (q[dst[n]] * e[n]).sum(-1))
    assert torch.autograd.gradcheck(
        lambda q, a, w: _query_edge_scores(graph, q, a, _Weighted(w), (a @ w.t()).view(15, 2, 3)),
        (q, edge_attr, lin_edge.weight.detach().clone().requires_grad_()))
    e = e.detach().requires_grad_()
    v = _randn(6, 2, 3, seed=4).requires_grad_()
    summed = edge_aggregate(graph, v, e, edge_weight=alpha)
    for i in range(6):
        want = sum((alpha[n].unsqueeze(-1) * (v[src[n]] + e[n]) for n in range(15) if dst[n] == i),
                   torch.zeros(2, 3, dtype=F64))
        torch.testing.assert_close(summed[i], want)
    assert torch.autograd.gradcheck(lambda a, v, e: edge_aggregate(graph, v, e, edge_weight=a), (alpha, v, e))


def test_dropout_keeps_returned_alpha_and_changes_output():
    layer, x, *_, ei, edge_attr, _ = _case("heads_edges")
    layer.dropout = 0.5
    out_eval, (_, alpha_eval) = layer.eval()(x, ei, edge_attr, return_attention_weights=True)
    torch.manual_seed(3)
    out_train, (_, alpha_train) = layer.train()(x, ei, edge_attr, return_attention_weights=True)
    torch.testing.assert_close(alpha_train, alpha_eval)  # PyG returns the coefficients before dropout
    assert not torch.allclose(out_train, out_eval)


def test_lazy_layer_and_graph_inputs():
    torch.manual_seed(0)
    layer = TransformerConv((-1, -1), 4, heads=2).double()
    ei = random_graph(8, 20, 2, num_dst_nodes=5)
    x = (_randn(8, 5, seed=1), _randn(5, 3, seed=2))
    out = layer(x, ei)
    assert out.shape == (5, 8)
    assert layer.lin_key.weight.shape == (8, 5) and layer.lin_query.weight.shape == (8, 3)
    assert layer.lin_skip.weight.shape == (8, 3) and layer.lin_skip.bias.shape == (8,)
    torch.testing.assert_close(layer(x, Graph(ei, (8, 5))), out)
    square = random_graph(6, 14, 3)
    sq_layer = TransformerConv(4, 2, heads=2).double()
    xs = _randn(6, 4, seed=3)
    adj_t = torch.sparse_coo_tensor(square.flip(0), torch.ones(14, dtype=F64), (6, 6)).coalesce()
    stored = adj_t.indices().flip(0)
    torch.testing.assert_close(sq_layer(xs, adj_t), sq_layer(xs, stored))


def test_compiled_layer_matches_eager():
    import torch._dynamo

    torch._dynamo.reset()
    layer, x, *_, ei, edge_attr, _ = _case("heads_edges")
    graph = Graph(ei, 9)
    compiled = torch.compile(lambda x, g, a: layer(x, g, a), backend="aot_eager", fullgraph=True)
    got = compiled(x, graph, edge_attr)
    want = layer(x, graph, edge_attr)
    torch.testing.assert_close(got, want)
    g = _randn(*want.shape, seed=2)
    got_grads = torch.autograd.grad((got * g).sum(), (x, edge_attr))
    want_grads = torch.autograd.grad((want * g).sum(), (x, edge_attr))
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_bad_input():
    layer, x, *_, ei, edge_attr, _ = _case("heads_edges")
    with pytest.raises(ValueError, match="TransformerConv: edge_attr was given but the layer was built without edge_dim"):
        _case("plain")[0](x, ei, edge_attr)
    with pytest.raises(ValueError, match="TransformerConv: the layer was built with edge_dim=2 and needs edge_attr"):
        layer(x, ei)
    with pytest.raises(ValueError, match="TransformerConv: edge_attr has 31 rows but the graph has 32 edges"):
        layer(x, ei, edge_attr[:-1])
    with pytest.raises(ValueError, match="TransformerConv: edge_attr has 1 features per edge but the layer takes 2"):
        layer(x, ei, edge_attr[:, :1])
    with pytest.raises(TypeError, match="TransformerConv: edge_attr has dtype torch.float32"):
        layer(x, ei, edge_attr.float())
    with pytest.raises(ValueError, match="TransformerConv: x has 4 features per node but the layer takes 5"):
        layer(x[:, :4], ei, edge_attr)
    with pytest.raises(ValueError, match=r"TransformerConv: x_dst \(x\[1\]\) is needed"):
        layer((x, None), ei, edge_attr)
    with pytest.raises(ValueError, match="edge_dim must be a positive int or None"):
        TransformerConv(5, 4, edge_dim=0)
    with pytest.raises(ValueError, match="dropout must be in"):
        TransformerConv(5, 4, dropout=1.0)
    with pytest.raises(ValueError, match="in_channels must be positive"):
        TransformerConv(0, 4)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        TransformerConv(5, 4, aggregation="GAR")


# ------------------------------------------------------------------ PyG
@requires_pyg
@pytest.mark.parametrize("name", list(CASES))
def test_matches_pyg(name):
    layer, x, x_src, x_dst, ei, edge_attr, _ = _case(name)
    theirs = pyg_nn.TransformerConv(*CASES[name].get("channels", (5, 4)), **CASES[name]["kw"]).double()
    assert {n for n, _ in theirs.named_parameters()} == {n for n, _ in layer.named_parameters()}
    theirs.load_state_dict(layer.state_dict())
    x2 = x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) else tuple(
        v.detach().clone().requires_grad_() for v in x)
    attr2 = edge_attr.detach().clone().requires_grad_() if edge_attr is not None else None
    out1, (ei1, alpha1) = layer(x, ei, edge_attr, return_attention_weights=True)
    out2, (ei2, alpha2) = theirs(x2, ei, attr2, return_attention_weights=True)
    torch.testing.assert_close(out1, out2, atol=1e-12, rtol=1e-10)
    assert torch.equal(ei1, ei2)
    torch.testing.assert_close(alpha1, alpha2, atol=1e-12, rtol=1e-10)
    g = _randn(*out1.shape, seed=4)
    (out1 * g).sum().backward()
    (out2 * g).sum().backward()
    mine = (list(x) if isinstance(x, tuple) else [x]) + [edge_attr]
    pyg = (list(x2) if isinstance(x2, tuple) else [x2]) + [attr2]
    for a, b in zip(mine, pyg):
        if a is not None:
            torch.testing.assert_close(a.grad, b.grad, atol=1e-11, rtol=1e-9)
    theirs_params = dict(theirs.named_parameters())
    for pname, p in layer.named_parameters():
        assert (p.grad is None) == (theirs_params[pname].grad is None), pname
        if p.grad is None:
            continue
        torch.testing.assert_close(p.grad, theirs_params[pname].grad, atol=1e-11, rtol=1e-9,
                                   msg=lambda m: f"{pname}: {m}")


@requires_pyg
def test_dropout_matches_pyg_under_the_same_seed():
    layer, x, *_, ei, edge_attr, _ = _case("heads_edges")
    theirs = pyg_nn.TransformerConv(5, 4, heads=3, edge_dim=2, dropout=0.4).double()
    theirs.load_state_dict(layer.state_dict())
    layer.dropout = 0.4
    torch.manual_seed(11)
    out1 = layer.train()(x, ei, edge_attr)
    torch.manual_seed(11)
    out2 = theirs.train()(x, ei, edge_attr)
    torch.testing.assert_close(out1, out2)
