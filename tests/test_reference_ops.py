"""The reference sparse core (spmm, sddmm, edge_softmax) against independent oracles.

The oracles are float64 dense products (``tests.graphs.dense_matrix``, built with Python
loops) or explicit per-edge / per-target loops, never the ops under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusegnn.sparse import Graph, edge_softmax, reference, sddmm, spmm
from tests.graphs import dense_matrix, nasty_specs, random_graph, random_weights

SPECS = nasty_specs()
F64 = torch.float64


def _randn(*shape, seed: int, dtype=F64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)


def _graph(spec, dtype=torch.int64) -> Graph:
    return Graph(spec.build(dtype), spec.num_nodes)


# ---------------------------------------------------------------------------- oracles
def _spmm_loops(ei, n_dst, x, w, reduce):
    """out[t] = reduce over edges s -> t of w_e * x[s], Python loops, float64."""
    x = x.detach().double()
    out = torch.zeros((n_dst,) + tuple(x.shape[1:]), dtype=F64)
    groups: dict[int, list[torch.Tensor]] = {}
    for e, (s, d) in enumerate(ei.t().tolist()):
        msg = x[s].clone()
        if w is not None:
            we = w[e].detach().double()
            msg = msg * (we.unsqueeze(-1) if we.dim() == 1 else we)
        groups.setdefault(d, []).append(msg)
    for d, msgs in groups.items():
        stacked = torch.stack(msgs)
        if reduce == "sum":
            out[d] = stacked.sum(0)
        elif reduce == "mean":
            out[d] = stacked.mean(0)
        else:
            out[d] = stacked.max(0).values
    return out


def _sddmm_loops(ei, a, b, op):
    rows = []
    for s, d in ei.t().tolist():
        u, v = a[s].double(), b[d].double()
        rows.append({"dot": lambda: (u * v).sum(-1), "add": lambda: u + v, "sub": lambda: u - v,
                     "mul": lambda: u * v}[op]())
    return torch.stack(rows)


def _softmax_loops(ei, n_dst, scores):
    """Per target and head, softmax over the incoming edges' scores (math.exp in float64)."""
    s2 = scores.detach().double().reshape(scores.size(0), -1)
    out = torch.zeros_like(s2)
    dst = ei[1].tolist()
    for t in range(n_dst):
        edges = [e for e, d in enumerate(dst) if d == t]
        for h in range(s2.size(1)):
            vals = [s2[e, h].item() for e in edges]
            finite = [v for v in vals if v != -math.inf]
            if not finite:
                continue  # no edge, or all masked: zeros
            m = max(finite)
            exps = [math.exp(v - m) if v != -math.inf else 0.0 for v in vals]
            total = sum(exps)
            for e, ex in zip(edges, exps):
                out[e, h] = ex / total
    return out.reshape(scores.shape)


# ---------------------------------------------------------------------------- spmm
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_spmm_sum_2d_equals_dense(spec, weighted, index_dtype):
    g = _graph(spec, index_dtype)
    x = _randn(spec.num_nodes, 5, seed=spec.seed)
    w = random_weights(g.num_edges, seed=7, positive=False) if weighted else None
    A = dense_matrix(g.edge_index, spec.num_nodes, edge_weight=w)
    torch.testing.assert_close(spmm(g, x, w, aggregation="reference"), A @ x)
    torch.testing.assert_close(spmm(g, x, w), A @ x)  # "auto"


@pytest.mark.parametrize("spec", SPECS[:2], ids=str)
@pytest.mark.parametrize("weights", ["none", "per_edge", "per_head"])
def test_spmm_sum_3d(spec, weights):
    H = 3
    g = _graph(spec)
    x = _randn(spec.num_nodes, H, 4, seed=1)
    w = {
        "none": None,
        "per_edge": random_weights(g.num_edges, seed=2),
        "per_head": random_weights(g.num_edges, seed=3, heads=H, positive=False),
    }[weights]
    out = spmm(g, x, w, aggregation="reference")
    assert out.shape == (spec.num_nodes, H, 4)
    A = dense_matrix(g.edge_index, spec.num_nodes, edge_weight=w)
    for h in range(H):
        A_h = A[h] if weights == "per_head" else A
        torch.testing.assert_close(out[:, h], A_h @ x[:, h])


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("shape", ["2d", "3d_per_head"])
def test_spmm_reductions_equal_loops(spec, reduce, shape):
    g = _graph(spec)
    if shape == "2d":
        x = _randn(spec.num_nodes, 3, seed=4)
        w = random_weights(g.num_edges, seed=5, positive=False)
    else:
        x = _randn(spec.num_nodes, 2, 3, seed=4)
        w = random_weights(g.num_edges, seed=5, heads=2, positive=False)
    out = spmm(g, x, w, reduce=reduce, aggregation="reference")
    torch.testing.assert_close(out, _spmm_loops(g.edge_index, spec.num_nodes, x, w, reduce))
    # targets without incoming edges get exact zeros
    assert torch.all(out[g.in_degree == 0] == 0)


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("shape", [(20,), (2, 9)])
def test_spmm_scatter_add_branch_equals_loops(spec, reduce, shape, monkeypatch):
    """The sum on CUDA's wide rows (``scatter_add_``, the index broadcast over the
    features), forced on the CPU: the loops' values, and the same gradients as the
    ``index_add_`` branch."""
    g = _graph(spec)
    w = random_weights(g.num_edges, seed=5, positive=False)
    x = _randn(spec.num_nodes, *shape, seed=4).requires_grad_()
    grad = _randn(spec.num_nodes, *shape, seed=6)
    want = spmm(g, x, w, reduce=reduce, aggregation="reference")
    (want_gx,) = torch.autograd.grad(want, x, grad)
    assert not reference.scatter_add_is_faster(want)  # the CPU keeps index_add_
    monkeypatch.setattr(reference, "scatter_add_is_faster", lambda messages: True)
    out = spmm(g, x, w, reduce=reduce, aggregation="reference")
    torch.testing.assert_close(out, _spmm_loops(g.edge_index, spec.num_nodes, x, w, reduce))
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(torch.autograd.grad(out, x, grad)[0], want_gx)


def test_spmm_bipartite_and_dtypes():
    ei = random_graph(7, 20, seed=3, num_dst_nodes=4)
    g = Graph(ei, (7, 4))
    x = _randn(7, 3, seed=0, dtype=torch.float32)
    w = random_weights(20, seed=1)  # float64 weights with float32 features
    out = spmm(g, x, w)
    assert out.shape == (4, 3) and out.dtype == torch.float32
    A = dense_matrix(ei, 7, 4, edge_weight=w)
    torch.testing.assert_close(out.double(), A @ x.double(), rtol=1e-5, atol=1e-5)


def test_spmm_uses_the_graph_weight_unless_given_and_takes_edge_index():
    spec = SPECS[0]
    ei = spec.build()
    w_graph = random_weights(spec.num_edges, seed=1)
    w_arg = random_weights(spec.num_edges, seed=2)
    g = Graph(ei, spec.num_nodes, w_graph)
    x = _randn(spec.num_nodes, 3, seed=0)
    torch.testing.assert_close(spmm(g, x), dense_matrix(ei, spec.num_nodes, edge_weight=w_graph) @ x)
    torch.testing.assert_close(spmm(g, x, w_arg), dense_matrix(ei, spec.num_nodes, edge_weight=w_arg) @ x)
    # a bare edge_index: num_nodes is x's row count (trailing isolated nodes allowed)
    x_big = _randn(spec.num_nodes + 3, 3, seed=1)
    out = spmm(ei, x_big)
    torch.testing.assert_close(out, dense_matrix(ei, spec.num_nodes + 3) @ x_big)


def test_spmm_empty_graph_and_float32_matches_float64():
    g = Graph(torch.empty(2, 0, dtype=torch.int64), 4)
    x = _randn(4, 2, seed=0)
    for reduce in ("sum", "mean", "max"):
        assert torch.equal(spmm(g, x, reduce=reduce), torch.zeros(4, 2, dtype=F64))
    spec = SPECS[1]
    g = _graph(spec)
    x64 = _randn(spec.num_nodes, 6, seed=3)
    torch.testing.assert_close(spmm(g, x64.float()).double(), spmm(g, x64), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- sddmm
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("op", ["dot", "add", "sub", "mul"])
@pytest.mark.parametrize("shape", [(4,), (3, 5)], ids=["2d", "multihead"])
def test_sddmm_equals_loops(spec, op, shape):
    g = _graph(spec)
    a = _randn(spec.num_nodes, *shape, seed=1)
    b = _randn(spec.num_nodes, *shape, seed=2)
    out = sddmm(g, a, b, op, aggregation="reference")
    expected_shape = (g.num_edges,) + (shape[:-1] if op == "dot" else shape)
    assert out.shape == expected_shape
    torch.testing.assert_close(out, _sddmm_loops(g.edge_index, a, b, op))


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_sddmm_per_node_scalars_and_bipartite(op):
    """GAT's score shape: a, b of [N, H] per-node scalars per head, elementwise op."""
    ei = random_graph(6, 18, seed=4, num_dst_nodes=5)
    g = Graph(ei, (6, 5))
    a, b = _randn(6, 2, seed=0), _randn(5, 2, seed=1)
    torch.testing.assert_close(sddmm(g, a, b, op), _sddmm_loops(ei, a, b, op))
    a1, b1 = _randn(6, seed=0), _randn(5, seed=1)  # [N] vectors
    torch.testing.assert_close(sddmm(g, a1, b1, op), _sddmm_loops(ei, a1, b1, op))


def test_sddmm_dot_is_q_k_attention_logits():
    """sddmm(dot) on a full bipartite pattern equals the dense Q K^T at the edges."""
    Lq, Lk, H, D = 4, 6, 2, 3
    ei = torch.stack(torch.meshgrid(torch.arange(Lk), torch.arange(Lq), indexing="ij")).reshape(2, -1)
    g = Graph(ei, (Lk, Lq))
    k, q = _randn(Lk, H, D, seed=0), _randn(Lq, H, D, seed=1)
    logits = sddmm(g, k, q, "dot")  # [E, H]
    dense = torch.einsum("qhd,khd->hqk", q, k)
    torch.testing.assert_close(logits, dense[:, ei[1], ei[0]].t())


# ---------------------------------------------------------------------------- edge_softmax
@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("heads", [None, 1, 4])
def test_edge_softmax_equals_loops(spec, heads):
    g = _graph(spec)
    shape = (g.num_edges,) if heads is None else (g.num_edges, heads)
    scores = _randn(*shape, seed=spec.seed) * 3
    alpha = edge_softmax(g, scores, aggregation="reference")
    assert alpha.shape == scores.shape
    assert not torch.isnan(alpha).any()
    torch.testing.assert_close(alpha, _softmax_loops(g.edge_index, spec.num_nodes, scores))
    sums = torch.zeros((spec.num_nodes,) + shape[1:], dtype=F64).index_add(0, g.dst.long(), alpha)
    has_edges = g.in_degree > 0
    torch.testing.assert_close(sums[has_edges], torch.ones_like(sums[has_edges]))
    assert torch.all(sums[~has_edges] == 0)


def test_edge_softmax_heads_are_independent():
    g = _graph(SPECS[1])
    scores = _randn(g.num_edges, 3, seed=0)
    alpha = edge_softmax(g, scores)
    for h in range(3):
        torch.testing.assert_close(alpha[:, h], edge_softmax(g, scores[:, h].contiguous()))


def test_edge_softmax_masked_and_fully_masked_targets():
    # target 0: edges from 1, 2 (edge from 2 masked); target 1: all masked; target 2: none
    ei = torch.tensor([[1, 2, 0, 2, 0], [0, 0, 1, 1, 3]])
    g = Graph(ei, 4)
    inf = math.inf
    scores = torch.tensor([[0.3, -inf], [-inf, -inf], [-inf, 2.0], [-inf, 5.0], [1.0, -inf]],
                          dtype=F64, requires_grad=True)
    alpha = edge_softmax(g, scores)
    expected = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1 / (1 + math.exp(3))],
                             [0.0, 1 / (1 + math.exp(-3))], [1.0, 0.0]], dtype=F64)
    torch.testing.assert_close(alpha, expected)
    (alpha * _randn(5, 2, seed=0)).sum().backward()
    assert torch.isfinite(scores.grad).all()


def test_edge_softmax_large_scores_do_not_overflow():
    ei = torch.tensor([[0, 1, 2, 0], [1, 1, 1, 2]])
    g = Graph(ei, 3)
    for dtype in (torch.float32, F64, torch.float16, torch.bfloat16):
        scores = torch.tensor([1e4, 1e4 - 1.0, -1e4, 3e4], dtype=dtype)
        alpha = edge_softmax(g, scores)
        assert torch.isfinite(alpha).all(), dtype
        assert alpha[3] == 1  # a single edge gets exactly 1
    scores = torch.tensor([1e4, 1e4 - 1.0, -1e4, 3e4], dtype=F64)
    torch.testing.assert_close(edge_softmax(g, scores), _softmax_loops(ei, 3, scores))


def test_edge_softmax_is_shift_invariant_per_target():
    g = _graph(SPECS[0])
    scores = _randn(g.num_edges, 2, seed=3)
    shift = _randn(g.num_nodes, 2, seed=4) * 100
    torch.testing.assert_close(edge_softmax(g, scores + shift[g.dst.long()]), edge_softmax(g, scores))


# ---------------------------------------------------------------------------- gradients
def _small():
    ei = random_graph(6, 14, seed=11, hub_degree=4)
    return Graph(ei, 6)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("heads", [None, 2])
def test_gradcheck_spmm(reduce, heads):
    g = _small()
    x_shape = (6, 3) if heads is None else (6, heads, 3)
    x = _randn(*x_shape, seed=0).requires_grad_()
    w = random_weights(g.num_edges, seed=1, heads=heads, positive=False).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: spmm(g, x, w, reduce=reduce), (x, w))
    if reduce != "max":  # unweighted max has exact ties on duplicate edges
        assert torch.autograd.gradcheck(lambda x: spmm(g, x, reduce=reduce), (x,))


@pytest.mark.parametrize("op", ["dot", "add", "sub", "mul"])
def test_gradcheck_sddmm(op):
    g = _small()
    a = _randn(6, 2, 3, seed=0).requires_grad_()
    b = _randn(6, 2, 3, seed=1).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: sddmm(g, a, b, op), (a, b))


@pytest.mark.parametrize("heads", [None, 3])
def test_gradcheck_edge_softmax(heads):
    g = _small()
    shape = (g.num_edges,) if heads is None else (g.num_edges, heads)
    s = _randn(*shape, seed=2).requires_grad_()
    assert torch.autograd.gradcheck(lambda s: edge_softmax(g, s), (s,))


def test_spmm_gradient_equals_dense_transpose():
    spec = SPECS[1]
    g = _graph(spec)
    w = random_weights(g.num_edges, seed=0, positive=False)
    x = _randn(spec.num_nodes, 4, seed=1).requires_grad_()
    grad_out = _randn(spec.num_nodes, 4, seed=2)
    spmm(g, x, w).backward(grad_out)
    A = dense_matrix(g.edge_index, spec.num_nodes, edge_weight=w)
    torch.testing.assert_close(x.grad, A.t() @ grad_out)


# ---------------------------------------------------------------------------- no in-place
def test_inputs_are_never_modified():
    spec = SPECS[1]
    ei = spec.build()
    ei_copy = ei.clone()
    g = Graph(ei, spec.num_nodes)
    x = _randn(spec.num_nodes, 2, 3, seed=0).requires_grad_()
    w = random_weights(g.num_edges, seed=1, heads=2).requires_grad_()
    a, b = _randn(spec.num_nodes, 2, seed=2), _randn(spec.num_nodes, 2, seed=3)
    s = _randn(g.num_edges, 2, seed=4)
    s[0] = -math.inf
    saved = [t.detach().clone() for t in (x, w, a, b, s)]
    out = spmm(g, x, w).sum() + spmm(g, x, w, reduce="max").sum() + spmm(g, x, reduce="mean").sum()
    out.backward()
    for op in ("dot", "add", "sub", "mul"):
        sddmm(g, a, b, op)
    edge_softmax(g, s)
    for t, before in zip((x, w, a, b, s), saved):
        assert torch.equal(t.detach(), before)
    assert torch.equal(ei, ei_copy) and g.edge_index is ei


def test_reference_module_is_what_reference_dispatch_runs():
    g = _graph(SPECS[0])
    x = _randn(g.num_nodes, 3, seed=0)
    assert torch.equal(spmm(g, x, aggregation="reference"), reference.spmm(g, x))


# ---------------------------------------------------------------------------- properties
@st.composite
def _graph_case(draw):
    n = draw(st.integers(1, 12))
    e = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**16))
    hub = draw(st.integers(0, e))
    ei = random_graph(n, e, seed, hub_degree=hub)
    return Graph(ei, n), seed


@settings(max_examples=25, deadline=None)
@given(case=_graph_case(), f=st.integers(1, 6), heads=st.sampled_from([None, 1, 3]),
       weighted=st.booleans())
def test_property_spmm_equals_dense(case, f, heads, weighted):
    g, seed = case
    x_shape = (g.num_nodes, f) if heads is None else (g.num_nodes, heads, f)
    x = _randn(*x_shape, seed=seed)
    w = random_weights(g.num_edges, seed=seed + 1, heads=heads, positive=False) if weighted else None
    out = spmm(g, x, w)
    A = dense_matrix(g.edge_index, g.num_nodes, edge_weight=w)
    if heads is None:
        torch.testing.assert_close(out, A @ x)
    else:
        for h in range(heads):
            torch.testing.assert_close(out[:, h], (A[h] if weighted else A) @ x[:, h])


@settings(max_examples=25, deadline=None)
@given(case=_graph_case(), heads=st.sampled_from([None, 1, 4]),
       scale=st.sampled_from([1.0, 50.0, 1e4]))
def test_property_edge_softmax_sums_to_one(case, heads, scale):
    g, seed = case
    shape = (g.num_edges,) if heads is None else (g.num_edges, heads)
    scores = _randn(*shape, seed=seed) * scale
    alpha = edge_softmax(g, scores)
    assert torch.isfinite(alpha).all() and (alpha >= 0).all()
    sums = torch.zeros((g.num_nodes,) + tuple(shape[1:]), dtype=F64).index_add(0, g.dst.long(), alpha)
    has = g.in_degree > 0
    torch.testing.assert_close(sums[has], torch.ones_like(sums[has]))
    assert torch.all(sums[~has] == 0)


def test_mean_after_inference_mode_trains():
    """A mean first run under ``torch.inference_mode()`` (evaluation) leaves no inference
    tensor in the graph's cache: the next training step's backward still works, and the
    divisor cached by that step is shared by the following ones."""
    spec = SPECS[1]
    g = Graph(spec.build(), spec.num_nodes)
    x = _randn(spec.num_nodes, 3, seed=5).requires_grad_()
    with torch.inference_mode():
        evaluated = spmm(g, x.detach(), reduce="mean", aggregation="reference")
    out = spmm(g, x, reduce="mean", aggregation="reference")
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out.detach(), evaluated.clone())
    A = dense_matrix(g.edge_index, g.num_nodes)
    mean = A / g.in_degree.clamp(min=1).double()[:, None]
    torch.testing.assert_close(grad, mean.t() @ torch.ones_like(out))
    cached = g.peek_cached(f"mean_divisor:{F64}:2", structural=True)
    assert cached is not None and not cached.is_inference()
