"""GCNConv and GATConv against independent dense float64 formulas, and against PyG.

The dense oracles build the (normalised / masked) adjacency with Python loops over the
edge list and use only dense torch ops, so they share no code with the layers. Gradients
are compared by running autograd through the dense formula with copies of the layer's
parameters.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fusegnn.layers import GATConv, GCNConv
from fusegnn.sparse import Graph
from tests.graphs import nasty_specs, random_graph, random_weights

SPECS = nasty_specs()
F64 = torch.float64


def _randn(*shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64)


def _consistent_weights(edge_index: torch.Tensor, seed: int) -> torch.Tensor:
    """Random positive weights where all self-loops of one node share a weight.

    (With repeated self-loops PyG's ``add_remaining_self_loops`` keeps one of their
    weights through an ``index_put`` with repeated indices, whose winner torch leaves
    unspecified; equal weights make the expected result well defined.)
    """
    w = random_weights(edge_index.size(1), seed=seed)
    loops = edge_index[0] == edge_index[1]
    w[loops] = 0.25 + 0.1 * edge_index[0, loops].double()
    return w


# ---------------------------------------------------------------------------- GCN oracle
def dense_gcn_matrix(edge_index, n, edge_weight=None, *, improved=False, add_self_loops=True,
                     normalize=True) -> torch.Tensor:
    """The propagation matrix P with ``out = P @ (X W^T) + b`` (float64, Python loops)."""
    w = [1.0] * edge_index.size(1) if edge_weight is None else edge_weight.double().tolist()
    A = torch.zeros(n, n, dtype=F64)
    loop_weight: dict[int, float] = {}
    for e, (s, d) in enumerate(edge_index.t().tolist()):
        if normalize and add_self_loops and s == d:
            loop_weight[s] = w[e]  # existing self-loops are replaced, keeping a weight
        else:
            A[d, s] += w[e]
    if not normalize:
        return A
    if add_self_loops:
        fill = 2.0 if improved else 1.0
        for i in range(n):
            A[i, i] += loop_weight.get(i, fill)
    deg = A.sum(dim=1)  # weighted in-degree
    dis = torch.tensor([d ** -0.5 if d > 0 else 0.0 for d in deg.tolist()], dtype=F64)
    return dis[:, None] * A * dis[None, :]


def _gcn_dense_forward(P, x, weight, bias):
    out = P @ (x @ weight.t())
    return out + bias if bias is not None else out


def _param_copies(layer):
    return {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}


def _compare_gcn(layer, P, x, *args):
    layer.zero_grad(set_to_none=True)
    x1 = x.clone().requires_grad_()
    out = layer(x1, *args)
    params = _param_copies(layer)
    x2 = x.clone().requires_grad_()
    expected = _gcn_dense_forward(P, x2, params["lin.weight"], params.get("bias"))
    torch.testing.assert_close(out, expected)
    grad_out = _randn(*out.shape, seed=99)
    out.backward(grad_out)
    expected.backward(grad_out)
    torch.testing.assert_close(x1.grad, x2.grad)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------- GCN tests
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("channels", [(5, 7), (7, 3)], ids=["widen", "narrow"])
@pytest.mark.parametrize(
    "opts",
    [{}, {"improved": True}, {"normalize": False}, {"add_self_loops": False}, {"bias": False}],
    ids=["default", "improved", "no_normalize", "no_self_loops", "no_bias"],
)
@pytest.mark.parametrize("weighted", [False, True])
def test_gcn_matches_dense(spec, channels, opts, weighted):
    torch.manual_seed(0)
    layer = GCNConv(*channels, **opts).double()
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    ei = spec.build()
    w = _consistent_weights(ei, seed=spec.seed) if weighted else None
    P = dense_gcn_matrix(
        ei, spec.num_nodes, w,
        improved=opts.get("improved", False),
        add_self_loops=opts.get("add_self_loops", True),
        normalize=opts.get("normalize", True),
    )
    x = _randn(spec.num_nodes, channels[0], seed=1)
    _compare_gcn(layer, P, x, ei, w)


def test_gcn_graph_input_equals_edge_index_input():
    spec = SPECS[1]
    ei = spec.build()
    w = _consistent_weights(ei, seed=3)
    torch.manual_seed(0)
    layer = GCNConv(6, 4).double()
    x = _randn(spec.num_nodes, 6, seed=0)
    ref = layer(x, ei, w)
    torch.testing.assert_close(layer(x, Graph(ei, spec.num_nodes), w), ref)
    torch.testing.assert_close(layer(x, Graph(ei, spec.num_nodes, w)), ref)  # weight on the graph
    torch.testing.assert_close(layer(x, Graph(ei.int(), spec.num_nodes), w), ref)


def test_gcn_cached_reuses_the_first_graph(monkeypatch):
    import fusegnn.layers._utils as gcn_module  # GCNConv's graph processing (normalized_graph)

    calls = []
    real_norm = gcn_module.gcn_normalized

    def counting_norm(*args, **kwargs):
        calls.append(1)
        return real_norm(*args, **kwargs)

    monkeypatch.setattr(gcn_module, "gcn_normalized", counting_norm)
    n = 10
    ei1 = random_graph(n, 30, seed=1)
    ei2 = random_graph(n, 25, seed=2)
    torch.manual_seed(0)
    layer = GCNConv(4, 3, cached=True).double()
    x = _randn(n, 4, seed=0)
    first = layer(x, ei1)
    assert len(calls) == 1
    # like PyG: the cached normalised graph is used whatever graph is passed next
    second = layer(x, ei2)
    assert len(calls) == 1
    torch.testing.assert_close(second, first)
    P1 = dense_gcn_matrix(ei1, n)
    _compare_gcn(layer, P1, _randn(n, 4, seed=5), ei2)
    # reset_parameters drops the cache
    layer.reset_parameters()
    layer(x, ei2)
    assert len(calls) == 2
    _compare_gcn(layer, dense_gcn_matrix(ei2, n), x, ei1)
    # without caching, each call normalises its own graph
    uncached = GCNConv(4, 3).double()
    uncached.load_state_dict(layer.state_dict())
    before = len(calls)
    _compare_gcn(uncached, dense_gcn_matrix(ei1, n), x, ei1)
    _compare_gcn(uncached, dense_gcn_matrix(ei2, n), x, ei2)
    assert len(calls) == before + 2


def test_gcn_float32():
    spec = SPECS[1]
    ei = spec.build()
    torch.manual_seed(0)
    layer = GCNConv(5, 4)
    x = _randn(spec.num_nodes, 5, seed=0).float()
    out = layer(x, ei)
    assert out.dtype == torch.float32
    P = dense_gcn_matrix(ei, spec.num_nodes)
    expected = _gcn_dense_forward(P, x.double(), layer.lin.weight.double(), layer.bias.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- GAT oracle
def gat_structure(edge_index, n, add_self_loops=True) -> torch.Tensor:
    """Edge multiplicities ``C[dst, src]`` after GAT's self-loop handling (existing
    self-loops removed, exactly one per node added)."""
    C = torch.zeros(n, n, dtype=F64)
    for s, d in edge_index.t().tolist():
        if not (add_self_loops and s == d):
            C[d, s] += 1
    if add_self_loops:
        C += torch.eye(n, dtype=F64)
    return C


def dense_gat(x, C, weight, att_src, att_dst, bias, heads, out_channels, concat, negative_slope):
    """Dense GAT: returns ``out`` and the per-pair attention ``[H, N, N]`` (one edge's
    coefficient; a pair with k parallel edges carries k times this)."""
    n = x.size(0)
    h = (x @ weight.t()).view(n, heads, out_channels)  # [N, H, C]
    e_src = (h * att_src).sum(-1)  # [N, H]
    e_dst = (h * att_dst).sum(-1)
    logits = F.leaky_relu(e_dst.t()[:, :, None] + e_src.t()[:, None, :], negative_slope)  # [H, i, j]
    present = C > 0
    masked = logits.masked_fill(~present, -math.inf)
    m = masked.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    p = torch.exp(logits - m) * present
    denom = (C * p).sum(-1, keepdim=True)
    per_edge = p / torch.where(denom > 0, denom, torch.ones_like(denom))  # [H, N, N]
    out = torch.einsum("hij,jhc->ihc", C * per_edge, h)
    out = out.reshape(n, heads * out_channels) if concat else out.mean(dim=1)
    if bias is not None:
        out = out + bias
    return out, per_edge


def _gat_layer(in_ch, out_ch, heads, seed=0, **opts):
    torch.manual_seed(seed)
    layer = GATConv(in_ch, out_ch, heads=heads, **opts).double()
    if layer.bias is not None:
        torch.nn.init.normal_(layer.bias)
    return layer


def _compare_gat(layer, x, edge_index_or_graph, C):
    layer.zero_grad(set_to_none=True)
    x1 = x.clone().requires_grad_()
    out, (ei_out, alpha) = layer(x1, edge_index_or_graph, return_attention_weights=True)
    params = _param_copies(layer)
    x2 = x.clone().requires_grad_()
    expected, per_edge = dense_gat(
        x2, C, params["lin.weight"], params["att_src"], params["att_dst"], params.get("bias"),
        layer.heads, layer.out_channels, layer.concat, layer.negative_slope,
    )
    torch.testing.assert_close(out, expected)
    # attention of each returned edge
    torch.testing.assert_close(alpha, per_edge[:, ei_out[1], ei_out[0]].t())
    grad_out = _randn(*out.shape, seed=42)
    out.backward(grad_out)
    expected.backward(grad_out)
    torch.testing.assert_close(x1.grad, x2.grad)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, params[name].grad, msg=lambda m: f"{name}: {m}")
    return out, ei_out, alpha


# ---------------------------------------------------------------------------- GAT tests
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("concat", [True, False], ids=["concat", "mean"])
@pytest.mark.parametrize("add_self_loops", [True, False], ids=["loops", "no_loops"])
def test_gat_matches_dense(spec, heads, concat, add_self_loops):
    layer = _gat_layer(5, 3, heads, concat=concat, add_self_loops=add_self_loops, negative_slope=0.15)
    ei = spec.build()
    C = gat_structure(ei, spec.num_nodes, add_self_loops)
    x = _randn(spec.num_nodes, 5, seed=spec.seed)
    out, ei_out, alpha = _compare_gat(layer, x, ei, C)
    assert out.shape == (spec.num_nodes, heads * 3 if concat else 3)
    # returned structure: self-loops replaced by exactly one per node
    n_loops = int((ei[0] == ei[1]).sum())
    E_out = ei.size(1) - n_loops + spec.num_nodes if add_self_loops else ei.size(1)
    assert ei_out.shape == (2, E_out) and alpha.shape == (E_out, heads)
    if add_self_loops:
        loops = ei_out[:, ei_out[0] == ei_out[1]]
        assert sorted(loops[0].tolist()) == list(range(spec.num_nodes))
    # alpha sums to 1 over each target's incoming edges, per head
    sums = torch.zeros(spec.num_nodes, heads, dtype=F64).index_add(0, ei_out[1].long(), alpha)
    has_in = torch.bincount(ei_out[1], minlength=spec.num_nodes) > 0
    torch.testing.assert_close(sums[has_in], torch.ones_like(sums[has_in]))
    assert torch.all(sums[~has_in] == 0) and not torch.isnan(out).any()


def test_gat_graph_input_equals_edge_index_input_and_ignores_weights():
    spec = SPECS[1]
    ei = spec.build()
    layer = _gat_layer(4, 2, heads=3)
    x = _randn(spec.num_nodes, 4, seed=0)
    ref = layer(x, ei)
    g = Graph(ei, spec.num_nodes)
    torch.testing.assert_close(layer(x, g), ref)
    torch.testing.assert_close(layer(x, g), ref)  # second call uses the graph's cache
    torch.testing.assert_close(layer(x, Graph(ei, spec.num_nodes, random_weights(ei.size(1), 1))), ref)
    torch.testing.assert_close(layer(x, ei.int()), ref)


def test_gat_return_attention_weights_flag():
    spec = SPECS[0]
    ei = spec.build()
    layer = _gat_layer(4, 2, heads=2)
    x = _randn(spec.num_nodes, 4, seed=0)
    plain = layer(x, ei)
    assert isinstance(plain, torch.Tensor)
    assert isinstance(layer(x, ei, return_attention_weights=False), torch.Tensor)
    out, (ei_out, alpha) = layer(x, ei, return_attention_weights=True)
    torch.testing.assert_close(out, plain)
    assert ei_out.dtype == ei.dtype and alpha.shape == (ei_out.size(1), 2)


def test_gat_dropout():
    spec = SPECS[1]
    ei = spec.build()
    x = _randn(spec.num_nodes, 4, seed=0)
    with_dropout = _gat_layer(4, 3, heads=2, seed=5, dropout=0.5)
    without = _gat_layer(4, 3, heads=2, seed=5, dropout=0.0)
    # eval: dropout has no effect
    with_dropout.eval()
    torch.testing.assert_close(with_dropout(x, ei), without(x, ei))
    # train: the output changes, deterministically under a fixed seed
    with_dropout.train()
    torch.manual_seed(123)
    a = with_dropout(x, ei)
    torch.manual_seed(123)
    b = with_dropout(x, ei)
    torch.manual_seed(124)
    c = with_dropout(x, ei)
    assert torch.equal(a, b)
    assert not torch.allclose(a, without(x, ei))
    assert not torch.allclose(a, c)
    # dropped coefficients are zero and kept ones scaled by 1 / (1 - p)
    torch.manual_seed(7)
    _, (_, alpha_train) = with_dropout(x, ei, return_attention_weights=True)
    with_dropout.eval()
    _, (_, alpha_eval) = with_dropout(x, ei, return_attention_weights=True)
    kept = alpha_train != 0
    assert 0 < int(kept.sum()) < alpha_train.numel()
    torch.testing.assert_close(alpha_train[kept], 2 * alpha_eval[kept])


# ---------------------------------------------------------------------------- PyG
from tests.pyg_compare import pyg_nn, requires_pyg  # noqa: E402  (re-exported to test_layers_library)


def _copy_params(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    dst_params = dict(dst.named_parameters())
    with torch.no_grad():
        for name, p in src.named_parameters():
            dst_params[name].copy_(p)


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@requires_pyg
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize(
    "opts",
    [{}, {"improved": True}, {"normalize": False}, {"add_self_loops": False}, {"cached": True}],
    ids=["default", "improved", "no_normalize", "no_self_loops", "cached"],
)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("channels", [(5, 7), (7, 3)], ids=["widen", "narrow"])
def test_gcn_matches_pyg(spec, opts, weighted, channels):
    torch.manual_seed(0)
    ours = GCNConv(*channels, **opts).double()
    theirs = pyg_nn.GCNConv(*channels, **opts).double()
    torch.nn.init.normal_(ours.bias)
    _copy_params(ours, theirs)
    ei = spec.build()
    w = _consistent_weights(ei, seed=2) if weighted else None
    x1 = _randn(spec.num_nodes, channels[0], seed=3).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    w_pyg = w
    if w is None and opts.get("improved"):
        # PyG 2.8 quirk: gcn_norm without edge weights gives the new self-loops weight 1
        # even when improved=True (its add_remaining_self_loops only fills weights it is
        # given), contradicting its documented A + 2I. fusegnn implements A + 2I; PyG
        # does too once the (all-ones) weights are passed explicitly.
        w_pyg = torch.ones(ei.size(1), dtype=F64)
    out1, out2 = ours(x1, ei, w), theirs(x2, ei, w_pyg)
    torch.testing.assert_close(out1, out2)
    g = _randn(*out1.shape, seed=4)
    out1.backward(g)
    out2.backward(g)
    torch.testing.assert_close(x1.grad, x2.grad)
    for name, grad in _grads(ours).items():
        torch.testing.assert_close(grad, _grads(theirs)[name], msg=lambda m: f"{name}: {m}")
    if opts.get("cached"):
        other = random_graph(spec.num_nodes, 7, seed=9)
        torch.testing.assert_close(ours(x1, other), theirs(x2, other))


@requires_pyg
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("concat", [True, False], ids=["concat", "mean"])
@pytest.mark.parametrize("add_self_loops", [True, False], ids=["loops", "no_loops"])
@pytest.mark.parametrize("channels", [(5, 3), (3, 7)], ids=["narrow", "widen"])
def test_gat_matches_pyg(spec, heads, concat, add_self_loops, channels):
    # "widen" (in < out) runs the aggregate-first form: same function, other rounding
    opts = dict(heads=heads, concat=concat, add_self_loops=add_self_loops, negative_slope=0.1)
    torch.manual_seed(0)
    ours = GATConv(*channels, **opts).double()
    theirs = pyg_nn.GATConv(*channels, **opts).double()
    torch.nn.init.normal_(ours.bias)
    _copy_params(ours, theirs)
    ei = spec.build()
    x1 = _randn(spec.num_nodes, channels[0], seed=3).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    out1, (ei1, alpha1) = ours(x1, ei, return_attention_weights=True)
    out2, (ei2, alpha2) = theirs(x2, ei, return_attention_weights=True)
    torch.testing.assert_close(out1, out2)
    assert torch.equal(ei1, ei2)
    torch.testing.assert_close(alpha1, alpha2)
    g = _randn(*out1.shape, seed=4)
    (out1 * g).sum().backward()
    (out2 * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad)
    for name, grad in _grads(ours).items():
        torch.testing.assert_close(grad, _grads(theirs)[name], msg=lambda m: f"{name}: {m}")


@requires_pyg
def test_gat_dropout_matches_pyg_under_the_same_seed():
    spec = SPECS[1]
    torch.manual_seed(0)
    ours = GATConv(4, 3, heads=2, dropout=0.4).double()
    theirs = pyg_nn.GATConv(4, 3, heads=2, dropout=0.4).double()
    _copy_params(ours, theirs)
    ei = spec.build()
    x = _randn(spec.num_nodes, 4, seed=1)
    torch.manual_seed(11)
    out1 = ours(x, ei)
    torch.manual_seed(11)
    out2 = theirs(x, ei)
    torch.testing.assert_close(out1, out2)
