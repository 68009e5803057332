"""Vector-sparse format (CVSE), row windows, vspmm / vsddmm kernels (on ``DEVICE``: CUDA,
or the CPU through the Triton interpreter), Graph.reorder and VectorSparseLinear, against
dense references."""

from __future__ import annotations

import pytest
import torch

from fusegnn.kernels import vector_spmm as kern
from fusegnn.layers import VectorSparseLinear
from fusegnn.sparse import Graph, RowWindows, VectorSparse, vsddmm, vspmm, window_spmm
from tests.graphs import random_graph

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sparse_dense(M, K, density, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(M, K, generator=g, dtype=dtype)
    return d * (torch.rand(M, K, generator=g) < density)


# ---------------------------------------------------------------------- format


@pytest.mark.parametrize("V", [2, 4, 8, 16])
def test_dense_round_trip(V):
    d = _sparse_dense(13, 9, 0.3, V)
    d[:V] = 0  # an empty row group
    A = VectorSparse.from_dense(d, V)
    assert A.shape == (13, 9) and A.num_groups == -(-13 // V)
    assert torch.equal(A.to_dense(), d)
    assert torch.equal(A.transpose().to_dense(), d.t())
    assert int(A.row_ptr[1]) == 0
    # every stored vector holds a non-zero, and the mask covers every non-zero
    assert bool((A.values != 0).any(1).all())
    assert bool(A.mask()[d != 0].all())


def test_from_graph_matches_to_dense():
    g = Graph(random_graph(11, 40, 3), 11)
    w = torch.rand(g.num_edges, dtype=torch.float64)
    graph = g.with_edge_weight(w)
    A = VectorSparse.from_graph(graph, 4, dtype=torch.float64)
    torch.testing.assert_close(A.to_dense(), graph.to_dense(torch.float64))


def test_from_mask():
    from fusegnn.attention import masks

    mask = masks.causal(20)
    A = VectorSparse.from_mask(mask, 4)
    assert A.shape == (20, 20)
    assert torch.equal(A.to_dense().bool(), mask.dense())


def test_prune_keeps_top_vectors():
    w = torch.randn(10, 12, generator=torch.Generator().manual_seed(0))
    V, s = 4, 0.75
    A = VectorSparse.prune(w, s, V)
    G = 3
    assert A.num_vectors == round(0.25 * G * 12)
    padded = torch.cat([w, w.new_zeros(2, 12)]).view(G, V, 12)
    norms = padded.norm(dim=1).flatten()
    kept = A.vector_groups() * 12 + A.col_idx.long()
    threshold = norms[kept].min()
    dropped = torch.ones(G * 12, dtype=torch.bool)
    dropped[kept] = False
    assert bool((norms[dropped] <= threshold).all())
    torch.testing.assert_close(A.to_dense(), w * A.mask())


def test_bad_input():
    with pytest.raises(ValueError, match="V must be one of"):
        VectorSparse.from_dense(torch.zeros(4, 4), 3)
    with pytest.raises(ValueError, match="W must be one of"):
        RowWindows.from_dense(torch.zeros(4, 4), 8)
    with pytest.raises(ValueError, match="sparsity"):
        VectorSparse.prune(torch.zeros(4, 4), 1.0, 2)
    with pytest.raises(ValueError, match="2-D"):
        VectorSparse.from_dense(torch.zeros(4), 2)
    A = VectorSparse.from_dense(torch.eye(4), 2)
    with pytest.raises(ValueError, match="b must have 4 rows"):
        vspmm(A, torch.zeros(5, 3))
    with pytest.raises(TypeError, match="dtype"):
        vspmm(A, torch.zeros(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="row_ptr"):
        VectorSparse(torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, 2), (4, 4))
    with pytest.raises(IndexError, match="col_idx"):
        VectorSparse(torch.tensor([0, 1, 1]), torch.tensor([7]), torch.ones(1, 2), (4, 4))


# ---------------------------------------------------------------------- kernels


@pytest.mark.parametrize("V", [2, 4, 8, 16])
def test_kernels_match_reference_fp32(V):
    M, K, N, F = 2 * V + 3, 37, 19, 21  # ragged: a partial last group, odd widths
    d = _sparse_dense(M, K, 0.25, V, torch.float32).to(DEVICE)
    d[V : 2 * V] = 0  # an empty row group
    A = VectorSparse.from_dense(d, V)
    idx = A.index()
    g = torch.Generator().manual_seed(1)
    b = torch.randn(K, N, generator=g).to(DEVICE)
    bt = torch.randn(M, N, generator=g).to(DEVICE)
    x, y = torch.randn(M, F, generator=g).to(DEVICE), torch.randn(K, F, generator=g).to(DEVICE)
    torch.testing.assert_close(kern.vspmm(A.values, idx.col_idx, idx.row_ptr, b, M),
                               kern.vspmm_reference(A.values, idx.col_idx, idx.row_ptr, b, M))
    torch.testing.assert_close(kern.vspmm_t(A.values, idx.t_ptr, idx.t_vec, idx.t_group, bt, M),
                               kern.vspmm_t_reference(A.values, idx.col_idx, idx.row_ptr, bt, K))
    torch.testing.assert_close(kern.vsddmm(x, y, idx.col_idx, idx.row_ptr, V, idx.max_vectors),
                               kern.vsddmm_reference(x, y, idx.col_idx, idx.row_ptr, V))
    # and the dense products, in float64
    dd = d.double()
    torch.testing.assert_close(vspmm(A, b).double(), dd @ b.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(vspmm(A.T, bt).double(), dd.t() @ bt.double(), rtol=1e-5, atol=1e-5)
    s = (x.double() @ y.double().t()) * A.mask()
    torch.testing.assert_close(A.with_values(vsddmm(x, y, A)).to_dense().double(), s, rtol=1e-5, atol=1e-5)


def test_kernel_bf16():
    V = 8
    d = _sparse_dense(24, 40, 0.2, 5, torch.float32).to(DEVICE)
    A = VectorSparse.from_dense(d, V).to(dtype=torch.bfloat16)
    b = torch.randn(40, 33, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    out = vspmm(A, b, backend="triton")
    assert out.dtype == torch.bfloat16
    ref = A.to_dense().double() @ b.double()
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("V", [4, 16])
def test_gradients_match_dense(V):
    M, K, N = V + 5, 23, 18
    d = _sparse_dense(M, K, 0.3, 7, torch.float32).to(DEVICE)
    A = VectorSparse.from_dense(d, V)
    g = torch.Generator().manual_seed(3)
    b = torch.randn(K, N, generator=g).to(DEVICE)
    go = torch.randn(M, N, generator=g).to(DEVICE)
    values = A.values.clone().requires_grad_(True)
    bk = b.clone().requires_grad_(True)
    vspmm(A.with_values(values), bk, backend="triton").backward(go)
    # the dense equivalent in float64
    v64 = A.values.double().requires_grad_(True)
    b64 = b.double().requires_grad_(True)
    (A.with_values(v64).to_dense() @ b64).backward(go.double())
    torch.testing.assert_close(bk.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values.grad.double(), v64.grad, rtol=1e-5, atol=1e-5)
    # the transposed product
    values.grad = None
    bt = torch.randn(M, N, generator=g).to(DEVICE).requires_grad_(True)
    gt = torch.randn(K, N, generator=g).to(DEVICE)
    vspmm(A.with_values(values).T, bt, backend="triton").backward(gt)
    v64.grad = None
    bt64 = bt.detach().double().requires_grad_(True)
    (A.with_values(v64).to_dense().t() @ bt64).backward(gt.double())
    torch.testing.assert_close(bt.grad.double(), bt64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values.grad.double(), v64.grad, rtol=1e-5, atol=1e-5)


def test_vsddmm_gradients_match_dense():
    V, M, K, F = 4, 10, 13, 17
    A = VectorSparse.from_dense(_sparse_dense(M, K, 0.3, 9, torch.float32).to(DEVICE), V)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(M, F, generator=g).to(DEVICE).requires_grad_()
    y = torch.randn(K, F, generator=g).to(DEVICE).requires_grad_()
    gs = torch.randn(A.num_vectors, V, generator=g).to(DEVICE)
    vsddmm(x, y, A, backend="triton").backward(gs)
    x64 = x.detach().double().requires_grad_(True)
    y64 = y.detach().double().requires_grad_(True)
    G = A.with_values(gs.double()).to_dense()
    ((x64 @ y64.t()) * G).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y.grad.double(), y64.grad, rtol=1e-5, atol=1e-5)


def test_gradcheck_reference_float64():
    A = VectorSparse.from_dense(_sparse_dense(6, 5, 0.5, 11), 2)
    values = A.values.clone().requires_grad_(True)
    b = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda v, bb: vspmm(A.with_values(v), bb), (values, b))
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda p, q: vsddmm(p, q, A), (x, y))


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
def test_gradcheck_kernels_tiny():
    """The kernel backward (the kernels take no float64: a loose float32 gradcheck, on
    CUDA as in the interpreter)."""
    A = VectorSparse.from_dense(_sparse_dense(5, 4, 0.6, 12, torch.float32).to(DEVICE), 2)
    values = A.values.clone().requires_grad_(True)
    b = torch.randn(4, 3).to(DEVICE).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda v, bb: vspmm(A.with_values(v), bb, backend="triton"), (values, b), eps=1e-2, atol=1e-2, rtol=1e-2
    )


# ---------------------------------------------------------------------- row windows


@pytest.mark.parametrize("W", [16, 32])
def test_window_spmm(W):
    graph = Graph(random_graph(45, 200, 4), 45)
    graph = graph.with_edge_weight(torch.rand(graph.num_edges))
    win = RowWindows.from_graph(graph, W)
    dense = graph.to_dense()
    assert torch.equal(win.to_dense(), dense)
    # a window's compacted columns are exactly its non-empty columns
    cols = win.window_columns(1)
    expected = (dense[W : 2 * W] != 0).any(0).nonzero().flatten()
    assert torch.equal(cols.long(), expected)
    b = torch.randn(45, 20, requires_grad=True)
    out = window_spmm(win, b)
    torch.testing.assert_close(out, dense @ b.detach(), rtol=1e-5, atol=1e-5)
    go = torch.randn_like(out)
    out.backward(go)
    torch.testing.assert_close(b.grad, dense.t() @ go, rtol=1e-5, atol=1e-5)
    assert 0 < win.tile_density <= 1


# ---------------------------------------------------------------------- reorder


@pytest.mark.parametrize("method", ["rcm", "degree"])
def test_reorder_is_a_relabeling(method):
    graph = Graph(random_graph(30, 90, 5), 30)
    graph = graph.with_edge_weight(torch.rand(graph.num_edges, dtype=torch.float64))
    new, perm = graph.reorder(method)
    assert torch.equal(torch.sort(perm).values, torch.arange(30))
    assert new.num_edges == graph.num_edges
    # the same edges after relabelling: new (i, j) = old (perm[i], perm[j])
    torch.testing.assert_close(new.to_dense(torch.float64), graph.to_dense(torch.float64)[perm][:, perm])
    x = torch.randn(30, 4, dtype=torch.float64)
    torch.testing.assert_close(new.to_dense(torch.float64) @ x[perm], (graph.to_dense(torch.float64) @ x)[perm])


def test_reorder_bad_method():
    graph = Graph(random_graph(8, 10, 0), 8)
    with pytest.raises(ValueError, match="method"):
        graph.reorder("nope")
    with pytest.raises(ValueError, match="square"):
        Graph(torch.tensor([[0], [1]]), (3, 2)).reorder("rcm")


# ---------------------------------------------------------------------- layer


@pytest.mark.parametrize("V", [4, 8])
def test_layer_matches_masked_dense_linear(V):
    torch.manual_seed(0)
    lin = VectorSparseLinear(24, 16, 0.6, V=V)
    assert lin.values.numel() == round(0.4 * (16 // V) * 24) * V
    x = torch.randn(2, 3, 24, requires_grad=True)
    y = lin(x)
    assert y.shape == (2, 3, 16)
    go = torch.randn_like(y)
    y.backward(go)
    mask = lin.pattern().mask()
    W = lin.dense_weight().detach().double().requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    b64 = lin.bias.detach().double().requires_grad_(True)
    y64 = x64 @ W.t() + b64
    y64.backward(go.double())
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin.bias.grad.double(), b64.grad, rtol=1e-5, atol=1e-5)
    grad_w = lin.pattern().with_values(lin.values.grad).to_dense().double()
    torch.testing.assert_close(grad_w, W.grad * mask, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("V, bias", [(4, True), (8, False)])
def test_from_linear_keeps_trained_weight_at_pattern(V, bias):
    """``from_linear``: the kept vectors hold the trained weight (the largest-norm ones),
    the bias is a copy, and the output equals a dense linear with the pruned weight."""
    torch.manual_seed(1)
    dense = torch.nn.Linear(24, 16, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        dense.weight.mul_(torch.rand(16, 24, dtype=torch.float64) * 3)  # a "trained" weight, not the init
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    lin = VectorSparseLinear.from_linear(dense, 0.75, V)
    assert lin.values.dtype == torch.float64 and lin.V == V
    assert lin.values.numel() == round(0.25 * (16 // V) * 24) * V
    mask = lin.pattern().mask()
    W = lin.dense_weight().detach()
    assert torch.equal(W, dense.weight.detach() * mask)  # the trained values, exactly
    norms = dense.weight.detach().view(16 // V, V, 24).norm(dim=1)  # [groups, in]
    kept = mask.view(16 // V, V, 24)[:, 0]
    assert norms[kept].min() >= norms[~kept].max()  # magnitude pruning
    x = torch.randn(2, 3, 24, dtype=torch.float64, requires_grad=True)
    y = lin(x)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, W, dense.bias))
    y.sum().backward()
    assert lin.values.grad is not None and dense.weight.grad is None
    if bias:
        assert lin.bias is not dense.bias and torch.equal(lin.bias, dense.bias)
    else:
        assert lin.bias is None
    for k, v in dense.state_dict().items():  # the source layer is unchanged
        assert torch.equal(v, before[k])


def test_from_linear_bad_input():
    with pytest.raises(TypeError, match="linear"):
        VectorSparseLinear.from_linear(torch.nn.Conv1d(2, 2, 1), 0.5, 4)
    with pytest.raises(ValueError, match="sparsity"):
        VectorSparseLinear.from_linear(torch.nn.Linear(8, 8), 1.0, 4)
    with pytest.raises(ValueError, match="V"):
        VectorSparseLinear.from_linear(torch.nn.Linear(8, 8), 0.5, 3)


# ---------------------------------------------------------------------- torch.compile


@pytest.fixture
def fresh_dynamo():
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _assert_same_with_grads(compiled, eager, inputs, **tol):
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, **tol)
    seeds = [torch.randn(e.shape, generator=torch.Generator().manual_seed(i), dtype=e.dtype).to(e.device)
             for i, e in enumerate(eager)]
    gc = torch.autograd.grad([(c * s).sum() for c, s in zip(compiled, seeds)], inputs)
    ge = torch.autograd.grad([(e * s).sum() for e, s in zip(eager, seeds)], inputs)
    for c, e in zip(gc, ge):
        torch.testing.assert_close(c, e, **tol)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend, dtype", [("reference", torch.float64), ("triton", torch.float32)])
def test_ops_compiled_match_eager(backend, dtype):
    """fullgraph compile (aot_eager) of vspmm, vspmm on A^T, vsddmm and window_spmm, with the
    index cached before tracing and without; outputs and gradients (values and dense
    operands) equal the eager ops'."""
    M, K, V = 10, 7, 4
    d = _sparse_dense(M, K, 0.4, 21, dtype).to(DEVICE)
    g = torch.Generator().manual_seed(22)
    values = VectorSparse.from_dense(d, V).values.clone().requires_grad_(True)
    b, bt, x, y = (torch.randn(*shape, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
                   for shape in ((K, 3), (M, 3), (M, 5), (K, 5)))
    win_dense = _sparse_dense(20, 9, 0.3, 23, dtype).to(DEVICE)
    bw = torch.randn(9, 4, generator=g, dtype=dtype).to(DEVICE).requires_grad_()

    def fn(values, b, bt, x, y, bw, A, win):
        Av = A.with_values(values)
        return (vspmm(Av, b, backend=backend), vspmm(Av.T, bt, backend=backend),
                vsddmm(x, y, A, backend=backend), window_spmm(win, bw, backend=backend))

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    inputs = [values, b, bt, x, y, bw]
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for cached in (True, False):
        A, win = VectorSparse.from_dense(d, V), RowWindows.from_dense(win_dense, 16)
        if cached:
            A.index(), win.index()
        out = compiled(*inputs, A, win)
        A, win = VectorSparse.from_dense(d, V), RowWindows.from_dense(win_dense, 16)
        _assert_same_with_grads(out, fn(*inputs, A, win), inputs, **tol)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend, dtype", [("reference", torch.float64), ("triton", torch.float32)])
def test_layer_compiled_matches_eager(backend, dtype):
    import copy

    import torch._dynamo.testing

    torch.manual_seed(0)
    lin = VectorSparseLinear(12, 8, 0.5, V=4, backend=backend, dtype=dtype).to(DEVICE)
    twin = copy.deepcopy(lin)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(twin, fullgraph=True, backend=counter)
    x = torch.randn(2, 3, 12, dtype=dtype).to(DEVICE).requires_grad_()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for _ in range(2):  # the second call reuses the compiled code
        out = compiled(x)
        params = [x, twin.values, twin.bias]
        expected = lin(x)
        torch.testing.assert_close(out, expected, **tol)
        go = torch.randn_like(out)
        gc = torch.autograd.grad(out, params, go)
        ge = torch.autograd.grad(expected, [x, lin.values, lin.bias], go)
        for c, e in zip(gc, ge):
            torch.testing.assert_close(c, e, **tol)
    assert counter.frame_count == 1


def test_opcheck_vector_ops():
    from fusegnn.sparse import vector_library  # noqa: F401  (registers the ops)

    ops = torch.ops.fusegnn
    M, K, V = 10, 7, 4
    A = VectorSparse.from_dense(_sparse_dense(M, K, 0.4, 31), V)
    index = tuple(A.index())
    tensors, (num_rows, max_vectors) = index[:5], index[5:]
    g = torch.Generator().manual_seed(32)
    values = A.values.clone().requires_grad_(True)
    b = torch.randn(K, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bt = torch.randn(M, 3, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(M, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(K, 5, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(M, 3, generator=g, dtype=torch.float64)
    grad_s = torch.randn(A.num_vectors, V, generator=g, dtype=torch.float64)
    cases = [
        (ops.vspmm.default, (values, b, *tensors, num_rows, max_vectors, False, "auto")),
        (ops.vspmm.default, (values, bt, *tensors, num_rows, -1, True, "reference")),
        (ops.vsddmm.default, (x, y, *tensors, V, max_vectors, "auto")),
        (ops.vspmm_backward.default,
         (grad, values.detach(), b.detach(), *tensors, num_rows, max_vectors, False, "auto", True, True)),
        (ops.vspmm_backward.default,
         (grad[:K], values.detach(), bt.detach(), *tensors, num_rows, -1, True, "auto", True, False)),
        (ops.vsddmm_backward.default, (grad_s, x.detach(), y.detach(), *tensors, "auto", True, True)),
        (ops.vector_transpose_index.default, (A.row_ptr, A.col_idx, K)),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (op, result)
    # the op's transpose index is the cached one
    for got, want in zip(ops.vector_transpose_index.default(A.row_ptr, A.col_idx, K), index[2:5]):
        assert torch.equal(got, want)
