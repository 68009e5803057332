"""GATv2: the fused kernels against the reference (through Triton's CPU interpreter, on the
GPU when there is one), the reference against an independent dense float64 computation,
the op's dispatch, compilation and errors, and the layer against PyG's ``GATv2Conv``.

Graphs have isolated nodes, self-loops, duplicate edges and a hub row of hundreds of edges
that a short ``chunk`` splits into several work items.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from fusegnn.kernels.gat_fused import dropout_keep_mask  # noqa: E402
from fusegnn.kernels.gatv2_fused import fused_gatv2_attention  # noqa: E402
from fusegnn.layers import GATv2Conv  # noqa: E402
from fusegnn.sparse import Graph, dispatch, gatv2_attention, reference  # noqa: E402
from tests.graphs import random_graph  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
SLOPE = 0.2
SHORT_CHUNK = 48  # splits the hub row (in-degree 200)


def _graph(num_nodes=20, num_edges=280, seed=1, hub=200, dtype=torch.int64, **kw) -> Graph:
    ei = random_graph(num_nodes, num_edges, seed, hub_degree=hub, dtype=dtype, **kw)
    n = num_nodes if kw.get("num_dst_nodes") is None else (num_nodes, kw["num_dst_nodes"])
    return Graph(ei.to(DEVICE), n)


def _inputs(graph: Graph, heads: int, channels: int, seed: int, edge: bool = True, dtype=torch.float64):
    """``x_l, x_r, att, edge_attr (or None)``, leaves that require grad."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(graph.num_src_nodes, heads, channels), (graph.num_dst_nodes, heads, channels), (1, heads, channels)]
    if edge:
        shapes.append((graph.num_edges, heads, channels))
    values = [torch.randn(s, generator=gen, dtype=torch.float64).to(DEVICE, dtype).requires_grad_() for s in shapes]
    return (*values, None) if not edge else tuple(values)


def _leaves(values):
    return [v for v in values if v is not None]


def _reference(graph, xl, xr, att, e, keep=None, p=0.0):
    """The reference composition, with an explicit keep mask for dropout."""
    out, alpha = reference.gatv2_attention(graph, xl, xr, att, e, SLOPE)
    if keep is not None:
        out = reference.spmm(graph, xl, alpha * keep.to(alpha.dtype) / (1.0 - p))
    return out


def _compare(graph, heads, channels, *, edge=True, variant="gar", chunk=SHORT_CHUNK, p=0.0, seed=7,
             dtype=torch.float64, atol=1e-11, rtol=1e-10):
    values = _inputs(graph, heads, channels, seed=3, edge=edge, dtype=dtype)
    out = fused_gatv2_attention(graph, *values, SLOPE, p, seed=seed, aggregation=variant, chunk=chunk)
    keep = dropout_keep_mask(graph.num_edges, heads, p, seed, DEVICE) if p > 0 else None
    ref_values = [v.detach().double().requires_grad_() if v is not None else None for v in values]
    ref = _reference(graph, *ref_values, keep, p)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    g_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64).to(DEVICE)
    got = torch.autograd.grad((out.double() * g_out).sum(), _leaves(values))
    want = torch.autograd.grad((ref * g_out).sum(), _leaves(ref_values))
    for name, a, b in zip(("x_l", "x_r", "att", "edge_attr"), got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b, atol=atol * 10, rtol=rtol * 10, msg=lambda m: f"grad {name}: {m}")
    return out, got


# ------------------------------------------------------------------ kernels vs reference
@pytest.mark.parametrize(
    "heads,channels,edge,variant,chunk",
    [
        (1, 5, False, "gar", SHORT_CHUNK),
        (1, 16, True, "gas", SHORT_CHUNK),
        (3, 5, True, "gar", SHORT_CHUNK),
        (3, 7, False, "gas", 2048),
        (3, 3, True, "gar", 2048),
        (1, 1, True, "gar", SHORT_CHUNK),
        (2, 20, True, "gar", SHORT_CHUNK),  # above 16, not a multiple: runs zero-padded to 32
        (1, 41, False, "gas", 2048),  # padded to 48 (the Reddit model's output layer)
    ],
)
def test_kernels_match_reference(heads, channels, edge, variant, chunk):
    _compare(_graph(), heads, channels, edge=edge, variant=variant, chunk=chunk)


@pytest.mark.parametrize("variant,heads,p", [("gar", 3, 0.4), ("gas", 1, 0.25)])
def test_dropout_uses_the_gat_keep_mask_in_both_passes(variant, heads, p):
    # the forward and both backward passes regenerate the mask of dropout_keep_mask
    _compare(_graph(), heads, 3, variant=variant, p=p, seed=123)


@pytest.mark.parametrize("variant", ["gar", "gas"])
def test_bipartite_and_int32(variant):
    graph = _graph(num_nodes=12, num_edges=90, hub=40, num_dst_nodes=7, dtype=torch.int32)
    assert graph.is_bipartite and graph.index_dtype == torch.int32
    _compare(graph, 3, 5, variant=variant, chunk=16)


def test_isolated_targets_get_zeros_and_no_edges():
    graph = _graph(num_nodes=16, num_edges=40, hub=0)
    assert (graph.in_degree == 0).any()
    out, grads = _compare(graph, 2, 3, chunk=4)
    assert bool((out[graph.in_degree == 0] == 0).all()) and all(torch.isfinite(g).all() for g in grads)
    empty = Graph(torch.empty(2, 0, dtype=torch.int64, device=DEVICE), 4)
    values = _inputs(empty, 2, 3, seed=0)
    out = fused_gatv2_attention(empty, *values)
    assert out.shape == (4, 2, 3) and bool((out == 0).all())
    assert all(bool((g == 0).all()) for g in torch.autograd.grad(out.sum(), values))


def test_gar_backward_is_bitwise_reproducible():
    graph = _graph()
    values = _inputs(graph, 2, 3, seed=2)
    runs = []
    for _ in range(2):
        out = fused_gatv2_attention(graph, *values, SLOPE, 0.2, seed=1, aggregation="gar", chunk=SHORT_CHUNK)
        runs.append(torch.autograd.grad(out.square().sum(), values))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision(dtype):
    tol = {torch.float32: 2e-5, torch.bfloat16: 5e-2}[dtype]
    _compare(_graph(seed=3), 3, 5, dtype=dtype, atol=tol, rtol=tol)


def test_gradcheck_fused_with_edge_features_and_dropout():
    graph = Graph(torch.tensor([[0, 1, 2, 2, 3, 0, 1, 3], [1, 1, 0, 3, 3, 3, 0, 3]], device=DEVICE), 5)
    values = _inputs(graph, 2, 3, seed=8)

    def fn(*values):
        return fused_gatv2_attention(graph, *values, SLOPE, 0.3, seed=17, chunk=2)

    assert torch.autograd.gradcheck(fn, values, eps=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError):  # the fused backward is once-differentiable
        (gx,) = torch.autograd.grad(fn(*values).square().sum(), values[:1], create_graph=True)
        gx.sum().backward()


def test_gradcheck_reference():
    graph = Graph(torch.tensor([[0, 1, 2, 2, 3, 0], [1, 1, 0, 3, 3, 3]]), 4)
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True)
              for s in ((4, 2, 3), (4, 2, 3), (1, 2, 3), (6, 2, 3))]
    assert torch.autograd.gradcheck(lambda *v: gatv2_attention(graph, *v, aggregation="reference"), values)


# ------------------------------------------------------------------ reference vs dense float64
def _dense_gatv2(edges: list[tuple[int, int]], n_src, n_dst, xl, xr, att, e_dense=None):
    """``out`` from the formula on dense [N_dst, N_src] tensors; ``edges`` may repeat (a
    repeated edge counts once more in the softmax). Written without fusegnn."""
    count = torch.zeros(n_dst, n_src, dtype=torch.float64)
    for j, i in edges:
        count[i, j] += 1
    z = xr[:, None] + xl[None, :]  # [N_dst, N_src, H, C]
    if e_dense is not None:
        z = z + e_dense
    s = (F.leaky_relu(z, SLOPE) * att.reshape(1, 1, *att.shape[-2:])).sum(-1)  # [N_dst, N_src, H]
    present = (count > 0)[:, :, None]
    s_max = torch.where(present, s, torch.full_like(s, -1e300)).amax(dim=1, keepdim=True).detach()
    weight = count[:, :, None] * torch.exp(torch.where(present, s - s_max, torch.zeros_like(s)))
    total = weight.sum(dim=1, keepdim=True)
    alpha = weight / torch.where(total > 0, total, torch.ones_like(total))
    return torch.einsum("ijh,jhc->ihc", alpha, xl)


@pytest.mark.parametrize("edge", [False, True])
def test_reference_matches_dense_formula(edge):
    # edge features need unique edges (a dense [N, N] tensor holds one feature per pair)
    ei = random_graph(9, 30, 4, hub_degree=8, duplicates=not edge)
    graph = Graph(ei, 9)
    edges = list(zip(ei[0].tolist(), ei[1].tolist()))
    assert edge or len(set(edges)) < len(edges)  # the duplicates case has duplicates
    xl, xr, att, e = _inputs(graph, 3, 4, seed=5, edge=edge)
    xl, xr, att = (v.detach().cpu().requires_grad_() for v in (xl, xr, att))
    e_dense = None
    if edge:
        e = e.detach().cpu().requires_grad_()
        e_dense = torch.zeros(9, 9, 3, 4, dtype=torch.float64).index_put((ei[1], ei[0]), e)
    out = gatv2_attention(graph, xl, xr, att, e, aggregation="reference")
    want = _dense_gatv2(edges, 9, 9, xl, xr, att, e_dense)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    leaves = _leaves([xl, xr, att, e])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((out * g).sum(), leaves), torch.autograd.grad((want * g).sum(), leaves)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


# ------------------------------------------------------------------ the op
def test_op_dispatch_and_alpha():
    graph = _graph()
    values = _inputs(graph, 2, 3, seed=5)
    ref, ref_alpha = gatv2_attention(graph, *values, aggregation="reference", return_alpha=True)
    assert dispatch.last_backend() == "reference" and ref_alpha.shape == (graph.num_edges, 2)
    for path in ("gar", "gas"):
        torch.testing.assert_close(gatv2_attention(graph, *values, aggregation=path), ref, atol=1e-11, rtol=1e-10)
        assert dispatch.last_backend() == path
        out, alpha = gatv2_attention(graph, *values, aggregation=path, return_alpha=True)
        assert dispatch.last_backend() == "reference"  # the coefficients come from the reference
        torch.testing.assert_close(alpha, ref_alpha)
    gatv2_attention(graph, *values)
    assert dispatch.last_backend() == ("reference" if not CUDA else dispatch.last_backend())
    before = [v.detach().clone() for v in values]
    gatv2_attention(graph.edge_index, values[0], values[1], values[2][0], values[3], aggregation="gar")
    assert all(torch.equal(a, b) for a, b in zip(before, values))  # inputs untouched; att [H, C] works


def test_op_deterministic_mode_refuses_gas():
    graph = _graph()
    values = _inputs(graph, 1, 3, seed=5, edge=False)
    with dispatch.deterministic():
        with pytest.raises(RuntimeError, match="not deterministic"):
            gatv2_attention(graph, *values, aggregation="gas")


def test_op_dropout_only_in_training():
    graph = _graph()
    values = _inputs(graph, 2, 3, seed=5)
    ref = gatv2_attention(graph, *values, aggregation="reference")
    torch.testing.assert_close(gatv2_attention(graph, *values, dropout=0.5, aggregation="gar"), ref)
    torch.manual_seed(0)
    a = gatv2_attention(graph, *values, dropout=0.5, training=True, aggregation="gar")
    torch.manual_seed(0)
    b = gatv2_attention(graph, *values, dropout=0.5, training=True, aggregation="gar")
    assert torch.equal(a, b) and not torch.allclose(a, ref)


@pytest.mark.parametrize(
    "index,value,error,match",
    [
        (0, "bad", TypeError, "x_l must be a torch.Tensor"),
        (0, torch.zeros(20, 2, 3, dtype=torch.int64), TypeError, "x_l must be a floating"),
        (1, torch.zeros(19, 2, 3, dtype=torch.float64), ValueError, "x_r has 19 rows"),
        (1, torch.zeros(20, 2, 4, dtype=torch.float64), ValueError, r"x_r must have shape \[\?, 2, 3\]"),
        (1, torch.zeros(20, 2, 3, dtype=torch.float32), TypeError, "x_r must have x_l's dtype"),
        (2, torch.zeros(1, 3, 3, dtype=torch.float64), ValueError, r"att must have shape \[1, 2, 3\]"),
        (2, None, TypeError, "att must be a torch.Tensor"),
        (3, torch.zeros(7, 2, 3, dtype=torch.float64), ValueError, "edge_attr must have shape"),
    ],
)
def test_op_rejects_bad_tensors(index, value, error, match):
    graph = Graph(random_graph(20, 50, 0), 20)
    values = [v.detach().cpu() for v in _inputs(graph, 2, 3, 0)]
    values[index] = value
    with pytest.raises(error, match=match):
        gatv2_attention(graph, *values)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"dropout": 1.0}, ValueError, "dropout must be in"),
        ({"dropout": "x"}, TypeError, "dropout must be a real"),
        ({"negative_slope": None}, TypeError, "negative_slope"),
        ({"training": 1}, TypeError, "training must be a bool"),
        ({"aggregation": "fast"}, ValueError, "aggregation must be one of"),
        ({"return_alpha": "yes"}, TypeError, "return_alpha"),
    ],
)
def test_op_rejects_bad_arguments(kwargs, error, match):
    graph = Graph(random_graph(20, 50, 0), 20)
    values = [v.detach().cpu() for v in _inputs(graph, 2, 3, 0)]
    with pytest.raises(error, match=match):
        gatv2_attention(graph, *values, **kwargs)


@pytest.mark.parametrize("aggregation", ["reference", "gar"])
def test_op_compiled_fullgraph(aggregation):
    torch._dynamo.reset()
    graph = Graph(random_graph(14, 48, seed=1, hub_degree=6).to(DEVICE), 14)
    values = _inputs(graph, 2, 3, seed=1)

    def fn(xl, xr, att, e, graph):
        out = gatv2_attention(graph, xl, xr, att, e, aggregation=aggregation)
        out2, alpha = gatv2_attention(graph, xl, xr, att, None, negative_slope=0.1, return_alpha=True,
                                      aggregation=aggregation)
        return out, out2, alpha

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got, want = compiled(*values, graph), fn(*values, graph)
    g = [torch.randn(w.shape, generator=torch.Generator().manual_seed(k), dtype=w.dtype).to(DEVICE)
         for k, w in enumerate(want)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-10)
    grads_got = torch.autograd.grad(sum((a * w).sum() for a, w in zip(got, g)), values)
    grads_want = torch.autograd.grad(sum((a * w).sum() for a, w in zip(want, g)), values)
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)
    torch._dynamo.reset()


# ------------------------------------------------------------------ the layer vs PyG
LAYER_CASES = [
    dict(),
    dict(heads=3),
    dict(share_weights=True, heads=2),
    dict(concat=False, heads=3),
    dict(edge_dim=4, heads=2),
    dict(edge_dim=4, fill_value=0.5),
    dict(edge_dim=4, fill_value="max"),
    dict(add_self_loops=False, edge_dim=4),
    dict(bias=False),
    dict(residual=True, heads=2, concat=False),
]


def _pyg_pair(in_channels, out_channels, aggregation, **kw):
    pyg = pytest.importorskip("torch_geometric.nn")
    torch.manual_seed(0)
    ours = GATv2Conv(in_channels, out_channels, aggregation=aggregation, **kw).double().to(DEVICE)
    theirs = pyg.GATv2Conv(in_channels, out_channels, **kw).double().to(DEVICE)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict())
    assert all(a.shape == b.shape for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _assert_layers_agree(ours, theirs, inputs_ours, inputs_theirs, leaves, tol=1e-10):
    out = ours(*inputs_ours)
    want = theirs(*inputs_theirs)
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype).to(DEVICE)
    params = list(ours.parameters())
    got = torch.autograd.grad((out * g).sum(), params + leaves)
    ref = torch.autograd.grad((want * g).sum(), list(theirs.parameters()) + leaves)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("aggregation", ["reference", "gar"])
@pytest.mark.parametrize("kwargs", LAYER_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_layer_matches_pyg(kwargs, aggregation):
    ei = random_graph(20, 90, 1, hub_degree=60).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, 6, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    ea = torch.randn(90, 4, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    ours, theirs = _pyg_pair(6, 5, aggregation, **kwargs)
    args = (x, ei, ea) if "edge_dim" in kwargs else (x, ei)
    _assert_layers_agree(ours, theirs, args, args, [x, ea] if "edge_dim" in kwargs else [x])


@pytest.mark.parametrize("aggregation", ["reference", "gas"])
def test_layer_bipartite_matches_pyg(aggregation):
    ei = random_graph(12, 60, 2, hub_degree=20, num_dst_nodes=7).to(DEVICE)
    gen = torch.Generator().manual_seed(2)
    xs = torch.randn(12, 6, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    xd = torch.randn(7, 4, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    ea = torch.randn(60, 3, generator=gen, dtype=torch.float64).to(DEVICE)
    ours, theirs = _pyg_pair((6, 4), 5, aggregation, heads=2, add_self_loops=False, edge_dim=3, residual=True)
    _assert_layers_agree(ours, theirs, ((xs, xd), Graph(ei, (12, 7)), ea), ((xs, xd), ei, ea), [xs, xd])
    # an edge_index with the sizes taken from the pair
    torch.testing.assert_close(ours((xs, xd), ei, ea), theirs((xs, xd), ei, ea))


@pytest.mark.parametrize("fill_value", ["mean", 0.5])
def test_layer_bipartite_self_loops_match_pyg(fill_value):
    """PyG's bipartite self-loops: every i -> i dropped, one loop per i < min(N_src, N_dst)."""
    ei = random_graph(12, 60, 2, hub_degree=20, num_dst_nodes=7).to(DEVICE)
    ei = torch.cat([ei, torch.tensor([[3, 5], [3, 5]], device=DEVICE)], dim=1)  # loops to drop
    gen = torch.Generator().manual_seed(5)
    xs = torch.randn(12, 6, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    xd = torch.randn(7, 6, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    ea = torch.randn(62, 3, generator=gen, dtype=torch.float64).to(DEVICE)
    ours, theirs = _pyg_pair(6, 5, "reference", heads=2, edge_dim=3, fill_value=fill_value)
    _assert_layers_agree(ours, theirs, ((xs, xd), ei, ea), ((xs, xd), ei, ea), [xs, xd])


def test_layer_graph_inputs_and_attention_weights():
    ei = random_graph(15, 60, 3, hub_degree=10, duplicates=False).to(DEVICE)
    x = torch.randn(15, 6, dtype=torch.float64, device=DEVICE)
    ours, theirs = _pyg_pair(6, 4, "auto", heads=2)
    want, (want_ei, want_alpha) = theirs(x, ei, return_attention_weights=True)
    out, (got_ei, alpha) = ours(x, ei, return_attention_weights=True)
    assert torch.equal(got_ei, want_ei)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(alpha, want_alpha)
    adj_t = torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.size(1), dtype=torch.float64, device=DEVICE),
                                    (15, 15), check_invariants=True)
    for graph in (Graph(ei, 15), adj_t, adj_t.to_sparse_csr()):
        torch.testing.assert_close(ours(x, graph), want)


def test_layer_lazy_in_channels():
    layer = GATv2Conv(-1, 4, heads=2, residual=True).double()
    x = torch.randn(10, 7, dtype=torch.float64)
    ei = random_graph(10, 30, 0)
    out = layer(x, ei)
    assert out.shape == (10, 8) and layer.lin_l.weight.shape == (8, 7) and layer.lin_r.weight.shape == (8, 7)
    assert layer.res.weight.shape == (8, 7)
    assert layer.lin_l.bias.abs().max() <= 7 ** -0.5  # PyG's uniform bias, not torch's default
    assert torch.isfinite(out).all()
    bip = GATv2Conv((-1, -1), 3, add_self_loops=False).double()
    assert bip((x, x[:4, :5]), random_graph(10, 30, 1, num_dst_nodes=4)).shape == (4, 3)
    assert bip.lin_r.weight.shape == (3, 5)


def test_layer_dropout_and_modes():
    ei = random_graph(15, 60, 3, hub_degree=10).to(DEVICE)
    x = torch.randn(15, 6, dtype=torch.float64, device=DEVICE)
    layer = GATv2Conv(6, 4, heads=2, dropout=0.5, aggregation="gar").double().to(DEVICE)
    layer.eval()
    ref = layer(x, ei)
    layer.train()
    out = layer(x, ei)
    assert not torch.allclose(out, ref)
    layer.eval()
    torch.testing.assert_close(layer(x, ei), ref)


@pytest.mark.parametrize(
    "build,call,error,match",
    [
        (dict(), lambda l, x, ei, ea: l(x, ei, ea), ValueError, "without edge_dim"),
        (dict(edge_dim=4), lambda l, x, ei, ea: l(x, ei, ea[:, :3]), ValueError, r"edge_attr must have shape \[num_edges, 4\]"),
        (dict(edge_dim=4), lambda l, x, ei, ea: l(x, ei, ea[:-1]), ValueError, "edge_attr has 29 rows"),
        (dict(), lambda l, x, ei, ea: l(x[:, :5], ei), ValueError, "x has 5 features"),
        (dict(), lambda l, x, ei, ea: l(x.float(), ei), TypeError, "dtype"),
        (dict(), lambda l, x, ei, ea: l((x, None), ei), ValueError, "x_dst"),
        (dict(), lambda l, x, ei, ea: l(x[:9], ei), IndexError, "node id 9"),
    ],
)
def test_layer_rejects_bad_input(build, call, error, match):
    layer = GATv2Conv(6, 4, **build).double()
    x = torch.randn(10, 6, dtype=torch.float64)
    ei = random_graph(10, 30, 0)
    ea = torch.randn(30, 4, dtype=torch.float64)
    with pytest.raises(error, match=match):
        call(layer, x, ei, ea)


def test_layer_rejects_bad_arguments():
    with pytest.raises(ValueError, match="heads"):
        GATv2Conv(6, 4, heads=0)
    with pytest.raises(ValueError, match="dropout"):
        GATv2Conv(6, 4, dropout=1.0)
    with pytest.raises(ValueError, match="edge_dim"):
        GATv2Conv(6, 4, edge_dim=0)
    with pytest.raises(ValueError, match="in_channels"):
        GATv2Conv((6, 4, 2), 4)
    with pytest.raises(TypeError, match="in_channels"):
        GATv2Conv(6.0, 4)
    with pytest.raises(ValueError, match="aggregation"):
        GATv2Conv(6, 4, aggregation="fast")


def test_launch_tiles(monkeypatch):
    """GATV2_TILES: one head 512 / 512 / 256 values, several heads 256 / 128 / GAT's column
    launch, one warp (the H100 sweeps' best); never more edges than a row has (<= 128
    here), at least 1; several heads on a graph of few rows: 1,024-value forward and row
    tiles on 4 warps; the ``tuning`` overrides win."""
    from fusegnn.kernels import gat_fused, gatv2_fused
    from fusegnn.kernels.gatv2_fused import gatv2_config

    L = gat_fused.Launch
    n = 160  # complete graph: average degree 160 -> at most 128 edges a step
    src, dst = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    graph = Graph(torch.stack([src.flatten(), dst.flatten()]), n)

    def launches(heads, channels):
        x, att = torch.zeros(n, heads, channels), torch.zeros(heads, channels)
        cfg = gatv2_config(graph, x, att, 0.2, 0.0, None, "gar")
        return cfg.fwd, cfg.row, cfg.col

    gat = gat_fused._block_sizes(8, 16, graph.avg_degree)
    assert graph.num_dst_nodes < gatv2_fused.GATV2_FEW_ROWS
    assert launches(8, 16) == (L(8, 4), L(8, 4), gat.col)  # 160 rows: few
    assert launches(1, 48) == (L(8, 1), L(8, 1), L(4, 1))  # one head: never widened
    monkeypatch.setattr(gatv2_fused, "GATV2_FEW_ROWS", 0)  # as on a graph of many rows
    assert launches(1, 48) == (L(8, 1), L(8, 1), L(4, 1))
    assert launches(1, 16) == (L(32, 1), L(32, 1), L(16, 1))
    assert launches(1, 1) == (L(128, 1), L(128, 1), L(128, 1))
    assert launches(8, 16) == (L(2, 1), L(1, 1), gat.col)
    assert launches(8, 64)[:2] == (L(1, 1), L(1, 1))
    with gat_fused.tuning(fwd=(4, 2), col=(2, 1)):
        assert launches(1, 48) == (L(4, 2), L(8, 1), L(2, 1))
