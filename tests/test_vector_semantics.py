"""Vector sparsity as a demanding user calls it: the documented semantics of
:class:`~fusegnn.sparse.VectorSparse` (builders, pruning), ``vspmm`` / ``vsddmm``
against dense float64 products (forward and backward), :class:`VectorSparseLinear` as a
masked ``nn.Linear`` (state dict, ``reset_parameters``, dtypes, optimizer steps),
``Graph.reorder`` as a relabelling, and bad input. Tiny shapes: on the CPU the Triton
kernels run in the interpreter."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusegnn.layers import VectorSparseLinear
from fusegnn.sparse import Graph, VectorSparse, vsddmm, vspmm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.usefixtures("one_thread")


def _dense(M, K, density, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g, dtype=dtype) * (torch.rand(M, K, generator=g) < density)


# ---------------------------------------------------------------------- VectorSparseLinear


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_layer_load_state_dict_of_another_pattern(backend):
    """Loading the state dict of a layer with another pattern (same sizes: same sparsity
    gives the same vector count) after a forward: the loaded layer computes what the
    source does, forward and backward, and its dense weight is the source's."""
    torch.manual_seed(0)
    a = VectorSparseLinear(16, 8, 0.5, V=4, backend=backend).to(DEVICE)
    b = VectorSparseLinear(16, 8, 0.5, V=4, backend=backend).to(DEVICE)
    assert not torch.equal(a.dense_weight() != 0, b.dense_weight() != 0)  # two patterns
    x = torch.randn(3, 16, device=DEVICE)
    a(x).sum().backward()  # fills a's cached structure and index
    a.dense_weight()
    a.load_state_dict(b.state_dict())
    a.zero_grad()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = a(xa), b(xb)
    torch.testing.assert_close(ya, yb)
    go = torch.randn_like(ya)
    ya.backward(go)
    yb.backward(go)
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(a.values.grad, b.values.grad)
    assert torch.equal(a.dense_weight(), b.dense_weight())
    assert torch.equal(a.pattern().mask(), b.pattern().mask())


# ---------------------------------------------------------------------- prune


def _prune_reference(weight: torch.Tensor, sparsity: float, V: int) -> torch.Tensor:
    """The documented pruning, by brute force: the ``[G, K]`` mask of the kept vectors
    (largest float64 L2 norm first, ties by position ``g K + k``)."""
    M, K = weight.shape
    G = -(-M // V)
    w = weight.detach().double()
    norms = [(-float(w[g * V:(g + 1) * V, k].norm()), g * K + k) for g in range(G) for k in range(K)]
    keep = int(round((1.0 - sparsity) * G * K))
    mask = torch.zeros(G * K, dtype=torch.bool)
    for _, position in sorted(norms)[:keep]:
        mask[position] = True
    return mask.view(G, K)


@settings(max_examples=30)
@given(
    M=st.integers(1, 11), K=st.integers(1, 7), V=st.sampled_from([2, 4, 8, 16]),
    sparsity=st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 0.9]), seed=st.integers(0, 2**16),
    ties=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_prune_keeps_the_documented_vectors(M, K, V, sparsity, seed, ties, dtype):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(M, K, generator=g, dtype=dtype)
    if ties:  # exact ties: repeated columns, some vectors zero
        weight = weight[:, torch.randint(0, max(K // 2, 1), (K,), generator=g)]
        weight[:, 0] = 0
    before = weight.clone()
    A = VectorSparse.prune(weight, sparsity, V)
    G = -(-M // V)
    kept = torch.zeros(G, K, dtype=torch.bool)
    kept[A.vector_groups(), A.col_idx.long()] = True
    assert torch.equal(kept, _prune_reference(weight, sparsity, V))
    assert A.shape == (M, K) and A.V == V and A.dtype == dtype
    assert A.num_vectors == int(round((1 - sparsity) * G * K))
    mask = kept.repeat_interleave(V, 0)[:M]
    assert torch.equal(A.to_dense(), weight * mask)  # the values: a copy of the weight's
    assert torch.equal(weight, before)  # the input is left alone
    A.values.add_(1)
    assert torch.equal(weight, before)  # and not aliased


def test_prune_float64_norms_are_not_rounded_to_float32():
    """Two float64 vectors whose norms differ by less than float32 resolves: the larger
    one is kept (computing the norms in float32 tied them and kept the first)."""
    w = torch.tensor([[1.0, 1.0 + 1e-12]], dtype=torch.float64).repeat(2, 1)
    A = VectorSparse.prune(w, 0.5, 2)
    assert A.col_idx.tolist() == [1]


def test_prune_ties_keep_the_first_positions():
    """Equal norms: the first vectors in row-group-major order are kept (the docstring's
    'ties by position'; topk kept the last group here)."""
    A = VectorSparse.prune(torch.ones(4, 6), 0.5, 2)
    assert A.vector_groups().tolist() == [0] * 6 and A.col_idx.tolist() == list(range(6))
    A = VectorSparse.prune(torch.zeros(4, 6), 0.75, 2)
    assert A.vector_groups().tolist() == [0, 0, 0] and A.col_idx.tolist() == [0, 1, 2]


# ---------------------------------------------------------------------- VectorSparseLinear as a masked nn.Linear


def _masked_linear_check(layer: VectorSparseLinear, x: torch.Tensor) -> None:
    """``layer`` against ``F.linear`` with its dense (masked) weight in float64: output,
    dx, d(bias) and d(values) = the dense weight gradient at the kept entries."""
    mask = layer.pattern().mask()
    x = x.clone().requires_grad_()
    y = layer(x)
    assert y.shape == (*x.shape[:-1], layer.out_features) and y.dtype == x.dtype
    go = torch.randn(y.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(y)
    layer.zero_grad()
    y.backward(go)
    W = layer.dense_weight().detach().double().requires_grad_()
    b = None if layer.bias is None else layer.bias.detach().double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    y64 = torch.nn.functional.linear(x64, W, b)
    y64.backward(go.double())
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(y.double(), y64, **tol)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    if b is not None:
        torch.testing.assert_close(layer.bias.grad.double(), b.grad, **tol)
    grad_w = layer.pattern().with_values(layer.values.grad).to_dense().double()
    torch.testing.assert_close(grad_w, W.grad * mask, **tol)


@settings(max_examples=12)
@given(
    in_f=st.integers(1, 9), out_f=st.integers(1, 9), V=st.sampled_from([2, 4, 8, 16]),
    sparsity=st.sampled_from([0.0, 0.5, 0.8]), bias=st.booleans(), lead=st.sampled_from([(), (3,), (2, 2), (0,)]),
    backend=st.sampled_from(["reference", "triton"]), seed=st.integers(0, 2**16),
)
def test_layer_is_a_masked_linear(in_f, out_f, V, sparsity, bias, lead, backend, seed):
    torch.manual_seed(seed)
    layer = VectorSparseLinear(in_f, out_f, sparsity, V=V, bias=bias, backend=backend).to(DEVICE)
    x = torch.randn(*lead, in_f, device=DEVICE)
    _masked_linear_check(layer, x)


@pytest.mark.parametrize("convert", ["double", "to"])
def test_layer_in_float64(convert):
    torch.manual_seed(1)
    layer = VectorSparseLinear(7, 5, 0.5, V=2).to(DEVICE)
    layer = layer.double() if convert == "double" else layer.to(torch.float64)
    assert layer.values.dtype == torch.float64 and layer.bias.dtype == torch.float64
    assert layer.row_ptr.dtype == torch.int32 and layer.col_idx.dtype == torch.int32
    _masked_linear_check(layer, torch.randn(4, 7, dtype=torch.float64, device=DEVICE))


def test_layer_state_dict_round_trip_through_a_file(tmp_path):
    torch.manual_seed(2)
    a = VectorSparseLinear(10, 6, 0.6, V=4).to(DEVICE)
    torch.save(a.state_dict(), tmp_path / "a.pt")
    b = VectorSparseLinear(10, 6, 0.6, V=4).to(DEVICE)
    b(torch.randn(1, 10, device=DEVICE))  # a cached structure of b's own pattern
    b.load_state_dict(torch.load(tmp_path / "a.pt"))
    assert set(b.state_dict()) == {"values", "bias", "row_ptr", "col_idx"}
    for k, v in a.state_dict().items():
        assert torch.equal(b.state_dict()[k], v)
    x = torch.randn(3, 10, device=DEVICE)
    torch.testing.assert_close(b(x), a(x))
    _masked_linear_check(b, x)
    # another sparsity has another vector count: a clear size mismatch
    with pytest.raises(RuntimeError, match="size mismatch for values"):
        VectorSparseLinear(10, 6, 0.2, V=4).load_state_dict(a.state_dict())


def test_layer_pattern_stays_fixed_through_optimizer_steps():
    torch.manual_seed(3)
    layer = VectorSparseLinear(12, 8, 0.75, V=4).to(DEVICE)
    mask = layer.pattern().mask().clone()
    structure = (layer.row_ptr.clone(), layer.col_idx.clone())
    assert [name for name, _ in layer.named_parameters()] == ["values", "bias"]
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.1)
    x = torch.randn(5, 12, device=DEVICE)
    for _ in range(3):
        opt.zero_grad()
        layer(x).pow(2).sum().backward()
        opt.step()
    assert torch.equal(layer.row_ptr, structure[0]) and torch.equal(layer.col_idx, structure[1])
    W = layer.dense_weight()
    assert not bool(W[~mask].any())  # nothing outside the pattern
    _masked_linear_check(layer, x)


@pytest.mark.parametrize("out_f, V", [(8, 4), (5, 4), (3, 16)])
def test_layer_reset_parameters(out_f, V):
    """``reset_parameters`` (nn.Linear's, which generic re-initialisation such as
    ``fusegnn.layers._utils.reset`` calls) draws new values at the same pattern, within
    nn.Linear's bound; padding rows stay 0."""
    torch.manual_seed(4)
    layer = VectorSparseLinear(16, out_f, 0.5, V=V).to(DEVICE)
    x = torch.randn(2, 16, device=DEVICE)
    layer(x)
    mask = layer.pattern().mask().clone()
    before = layer.values.detach().clone()
    bias_before = layer.bias.detach().clone()
    layer.reset_parameters()
    assert torch.equal(layer.pattern().mask(), mask)
    assert not torch.equal(layer.values, before) and not torch.equal(layer.bias, bias_before)
    bound = 1 / math.sqrt(16)
    assert float(layer.values.detach().abs().max()) <= bound and float(layer.bias.detach().abs().max()) <= bound
    rows = layer.pattern().vector_groups()[:, None] * V + torch.arange(V, device=DEVICE)
    assert not bool(layer.values[rows >= out_f].any())
    assert layer.values.requires_grad and layer.values.grad is None
    _masked_linear_check(layer, x)


def test_layer_bad_input():
    with pytest.raises(ValueError, match="backend must be one of"):
        VectorSparseLinear(8, 8, 0.5, V=4, backend="nope")
    with pytest.raises(ValueError, match="backend must be one of"):
        VectorSparseLinear.from_linear(torch.nn.Linear(8, 8), 0.5, 4, backend="cuda")
    with pytest.raises(ValueError, match="sparsity"):
        VectorSparseLinear(8, 8, 1.5, V=4)
    with pytest.raises(ValueError, match="V must be one of"):
        VectorSparseLinear(8, 8, 0.5, V=3)
    with pytest.raises(ValueError, match="in_features"):
        VectorSparseLinear(0, 8, 0.5)
    layer = VectorSparseLinear(8, 8, 0.5, V=4)
    with pytest.raises(TypeError, match="x has dtype torch.float64 but the layer's weight is torch.float32"):
        layer(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must have 8 features"):
        layer(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="x must have 8 features"):
        layer(torch.tensor(1.0))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        layer([[0.0] * 8])
    r = repr(layer)
    assert "in_features=8, out_features=8, V=4, sparsity=0.5" in r and "bias=True" in r


# ---------------------------------------------------------------------- builders


@settings(max_examples=25)
@given(M=st.integers(0, 13), K=st.integers(0, 9), V=st.sampled_from([2, 4, 8, 16]),
       density=st.sampled_from([0.0, 0.2, 0.6, 1.0]), seed=st.integers(0, 2**16))
def test_from_dense_round_trip(M, K, V, density, seed):
    d = _dense(M, K, density, seed)
    before = d.clone()
    A = VectorSparse.from_dense(d, V)
    assert A.shape == (M, K) and A.num_groups == -(-M // V) and A.V == V
    assert torch.equal(A.to_dense(), d) and torch.equal(d, before)
    # exactly the vectors holding a non-zero, sorted by column within a group
    G = -(-M // V)
    padded = torch.cat([d, d.new_zeros(G * V - M, K)]).view(G, V, K)
    expected = padded.ne(0).any(1)  # [G, K]
    kept = torch.zeros(G, K, dtype=torch.bool)
    kept[A.vector_groups(), A.col_idx.long()] = True
    assert torch.equal(kept, expected) and A.num_vectors == int(expected.sum())
    for g in range(G):
        cols = A.col_idx[int(A.row_ptr[g]):int(A.row_ptr[g + 1])]
        assert bool((cols[1:] > cols[:-1]).all())
    torch.testing.assert_close(A.transpose().to_dense(), d.t())
    assert torch.equal(A.mask(), expected.repeat_interleave(V, 0)[:M])


@settings(max_examples=15)
@given(n=st.integers(1, 12), m=st.integers(1, 12), E=st.integers(0, 40), V=st.sampled_from([2, 4, 8, 16]),
       weighted=st.booleans(), seed=st.integers(0, 2**16))
def test_from_graph_is_the_aggregation_matrix(n, m, E, V, weighted, seed):
    """Bipartite, duplicate edges (added), isolated nodes, weights or ones."""
    g = torch.Generator().manual_seed(seed)
    edge_index = torch.stack([torch.randint(0, n, (E,), generator=g), torch.randint(0, m, (E,), generator=g)])
    weight = torch.rand(E, generator=g, dtype=torch.float64) if weighted else None
    graph = Graph(edge_index, (n, m), edge_weight=weight)
    A = VectorSparse.from_graph(graph, V, dtype=torch.float64)
    assert A.shape == (m, n)
    torch.testing.assert_close(A.to_dense(), graph.to_dense(torch.float64))


def test_from_mask_per_head():
    from fusegnn.attention import masks

    mask = masks.causal(9)
    A = VectorSparse.from_mask(mask, 4)
    assert torch.equal(A.to_dense().bool(), mask.dense()) and A.dtype == torch.float32


def test_builders_bad_input():
    with pytest.raises(ValueError, match="shape must be a pair of ints"):
        VectorSparse(torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, 2), (2, 2, 2))
    with pytest.raises(ValueError, match="shape must be a pair of ints"):
        VectorSparse(torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, 2), None)
    with pytest.raises(ValueError, match="shape must be a pair of ints"):
        VectorSparse(torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, 2), (2.5, 2))
    import numpy as np

    A = VectorSparse(torch.tensor([0, 1]), torch.tensor([0]), torch.ones(1, 2), (np.int64(2), 2))
    assert A.shape == (2, 2) and all(type(s) is int for s in A.shape)
    graph = Graph(torch.tensor([[0], [1]]), 2)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        VectorSparse.from_graph(graph, 2, dtype="float32")
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        VectorSparse.from_graph(graph, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="graph must be a fusegnn.sparse.Graph"):
        VectorSparse.from_graph(torch.zeros(2, 2), 2)
    with pytest.raises(TypeError, match="mask must be a fusegnn.attention.Mask"):
        VectorSparse.from_mask(torch.zeros(2, 2), 2)
    with pytest.raises(TypeError, match="matrix must be floating point"):
        VectorSparse.from_dense(torch.eye(4, dtype=torch.long), 2)
    for bad in (True, 2.0, "2", 32):
        with pytest.raises(ValueError, match="V must be one of"):
            VectorSparse.from_dense(torch.eye(4), bad)
    for bad in (-0.1, 1.0, float("nan"), True, "0.5", None):
        with pytest.raises(ValueError, match="sparsity must be a number"):
            VectorSparse.prune(torch.eye(4), bad, 2)


# ---------------------------------------------------------------------- ops against dense float64


def _op_case(test):
    """The cases of the op tests: ``[M, K]`` patterns (every V, ragged last groups, empty
    and full), a width ``F``, both backends (float64 on the reference)."""
    return settings(max_examples=15)(given(
        M=st.integers(1, 11), K=st.integers(1, 9), F=st.integers(1, 6), V=st.sampled_from([2, 4, 8, 16]),
        density=st.sampled_from([0.0, 0.3, 1.0]), backend=st.sampled_from(["reference", "triton"]),
        seed=st.integers(0, 2**16),
    )(test))


def _pattern(M, K, V, density, backend, seed):
    """``(dtype, A, generator)`` of an op case."""
    dtype = torch.float64 if backend == "reference" else torch.float32
    A = VectorSparse.from_dense(_dense(M, K, density, seed, dtype).to(DEVICE), V)
    return dtype, A, torch.Generator().manual_seed(seed + 1)


@_op_case
def test_vspmm_matches_dense_forward_and_backward(M, K, F, V, density, backend, seed):
    dtype, A, g = _pattern(M, K, V, density, backend, seed)
    N = F
    # garbage in the padding rows of a partial last group must not leak into the products
    values = torch.randn(A.values.shape, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    b = torch.randn(K, N, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    bt = torch.randn(M, N, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    v0, b0, bt0 = values.detach().clone(), b.detach().clone(), bt.detach().clone()
    out = vspmm(A.with_values(values), b, backend=backend)
    out_t = vspmm(A.with_values(values).T, bt, backend=backend)
    go = torch.randn(out.shape, generator=g, dtype=dtype).to(DEVICE)
    go_t = torch.randn(out_t.shape, generator=g, dtype=dtype).to(DEVICE)
    (out * go).sum().add((out_t * go_t).sum()).backward()
    v64 = values.detach().double().requires_grad_()
    b64, bt64 = b.detach().double().requires_grad_(), bt.detach().double().requires_grad_()
    D = A.with_values(v64).to_dense()
    ref, ref_t = D @ b64, D.t() @ bt64
    (ref * go.double()).sum().add((ref_t * go_t.double()).sum()).backward()
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(out_t.double(), ref_t, **tol)
    torch.testing.assert_close(b.grad.double(), b64.grad, **tol)
    torch.testing.assert_close(bt.grad.double(), bt64.grad, **tol)
    torch.testing.assert_close(values.grad.double(), v64.grad, **tol)
    assert torch.equal(values.detach(), v0) and torch.equal(b.detach(), b0) and torch.equal(bt.detach(), bt0)


@_op_case
def test_vsddmm_matches_dense_forward_and_backward(M, K, F, V, density, backend, seed):
    dtype, A, g = _pattern(M, K, V, density, backend, seed)
    x = torch.randn(M, F, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    y = torch.randn(K, F, generator=g, dtype=dtype).to(DEVICE).requires_grad_()
    s = vsddmm(x, y, A, backend=backend)
    assert s.shape == A.values.shape and s.dtype == dtype
    gs = torch.randn(s.shape, generator=g, dtype=dtype).to(DEVICE)
    s.backward(gs)
    x64, y64 = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    mask = A.mask().double()
    S = (x64 @ y64.t()) * mask
    Gd = A.with_values(gs.double()).to_dense()  # padding rows of gs are dropped
    (S * Gd).sum().backward()
    tol = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(A.with_values(s.detach()).to_dense().double(), S.detach(), **tol)
    # padding rows of a partial last group are 0
    rows = A.vector_groups()[:, None] * V + torch.arange(V, device=DEVICE)
    assert not bool(s.detach()[rows >= M].any())
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(y.grad.double(), y64.grad, **tol)


# ---------------------------------------------------------------------- Graph.reorder


def _fake_pymetis(calls):
    """A stand-in for pymetis (not installed here): records its input and assigns node
    ``i`` to part ``(7 * i) % nparts`` (parts interleaved, so the order changes)."""
    import types

    def part_graph(nparts, xadj, adjncy):
        calls.append((nparts, list(xadj), list(adjncy)))
        n = len(xadj) - 1
        return 0, [(7 * i) % nparts for i in range(n)]

    return types.SimpleNamespace(part_graph=part_graph)


def _layers(F_in):
    from fusegnn.layers import GATConv, GCNConv, SAGEConv

    torch.manual_seed(0)
    return [GCNConv(F_in, 3), SAGEConv(F_in, 3), GATConv(F_in, 2, heads=2)]


@settings(max_examples=12)
@given(n=st.integers(1, 14), E=st.integers(0, 40), method=st.sampled_from(["rcm", "degree", "metis"]),
       weighted=st.booleans(), int32=st.booleans(), seed=st.integers(0, 2**16))
def test_reorder_relabels_every_layer(n, E, method, weighted, int32, seed, monkeypatch_module):
    """A layer on the reordered graph with x[perm], un-permuted, is the layer on the
    original graph (isolated nodes, one node, duplicate edges, self-loops, weights)."""
    calls = []
    monkeypatch_module.setitem(__import__("sys").modules, "pymetis", _fake_pymetis(calls))
    g = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, n, (2, E), generator=g)
    if int32:
        edge_index = edge_index.int()
    weight = torch.rand(E, generator=g) + 0.5 if weighted else None
    graph = Graph(edge_index, n, edge_weight=weight)
    ei_before = graph.edge_index.clone()
    new, perm = graph.reorder(method, **({"parts": 3} if method == "metis" else {}))
    assert isinstance(new, Graph) and perm.dtype == torch.int64 and perm.device == graph.device
    assert torch.equal(torch.sort(perm).values, torch.arange(n))
    assert new.num_nodes == n and new.num_edges == E and new.edge_index.dtype == graph.edge_index.dtype
    assert torch.equal(graph.edge_index, ei_before)  # the input graph is left alone
    if weighted:
        assert torch.equal(new.edge_weight, weight)  # same edge order, same weights
    if method == "metis":
        nparts, xadj, adjncy = calls[-1]
        assert nparts == min(3, n) and len(xadj) == n + 1
        for i in range(n):  # symmetric, no self-loops
            for j in adjncy[xadj[i]:xadj[i + 1]]:
                assert j != i and i in adjncy[xadj[j]:xadj[j + 1]]
        membership = torch.tensor([(7 * i) % nparts for i in range(n)])
        assert bool((membership[perm][1:] >= membership[perm][:-1]).all())  # ordered by part
    x = torch.randn(n, 4, generator=g)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(n)
    for layer in _layers(4):
        out = layer(x, graph)
        out_new = layer(x[perm], new)
        torch.testing.assert_close(out_new[inverse], out, rtol=1e-5, atol=1e-5)
    A, B = VectorSparse.from_graph(graph, 4), VectorSparse.from_graph(new, 4)
    torch.testing.assert_close(B.to_dense(), A.to_dense()[perm][:, perm])


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("method", ["rcm", "degree", "metis"])
def test_reorder_empty_graph(method, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pymetis", _fake_pymetis([]))
    graph = Graph(torch.zeros(2, 0, dtype=torch.long), 0)
    new, perm = graph.reorder(method)
    assert new.num_nodes == 0 and new.num_edges == 0 and perm.shape == (0,) and perm.dtype == torch.int64


def test_reorder_bad_input(monkeypatch):
    graph = Graph(torch.tensor([[0, 1], [1, 2]]), 3)
    monkeypatch.setitem(__import__("sys").modules, "pymetis", None)  # not installed
    with pytest.raises(ImportError, match="method='metis' needs pymetis"):
        graph.reorder("metis")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="parts must be a positive int"):
            graph.reorder("metis", parts=bad)
        with pytest.raises(ValueError, match="parts must be a positive int"):
            graph.reorder("rcm", parts=bad)
    for bad in (None, "RCM", ["rcm"]):
        with pytest.raises(ValueError, match="method must be one of"):
            graph.reorder(bad)
    with pytest.raises(TypeError, match="part"):
        graph.reorder("rcm", part=3)


def test_to_takes_a_dtype_like_tensor_to():
    A = VectorSparse.from_dense(_dense(5, 4, 0.5, 0, torch.float32), 2)
    for B in (A.to(torch.float64), A.to(dtype=torch.float64), A.to("cpu", torch.float64)):
        assert B.dtype == torch.float64 and B.device == A.device and torch.equal(B.to_dense(), A.to_dense().double())
    assert A.dtype == torch.float32  # a copy
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        A.to("cpu", torch.int32)
    with pytest.raises(TypeError, match="dtype must be a floating torch.dtype"):
        A.to(dtype="float64")


def test_metis_graph_keeps_an_edge_duplicated_256_times():
    """The symmetric graph handed to METIS counts duplicates in int32: 256 copies of an edge
    are one edge of weight 256 (an int8 count wrapped to 0 and dropped it)."""
    from fusegnn.sparse.reorder import _symmetric_csr

    src = torch.tensor([0] * 256 + [1])
    dst = torch.tensor([1] * 256 + [2])
    adj = _symmetric_csr(src, dst, 3)
    adj.eliminate_zeros()
    assert adj[0, 1] == 256 and adj[1, 0] == 256 and adj[1, 2] == 1


@pytest.mark.parametrize("sparsity, groups_x_cols, keep", [(0.3, 5, 4), (0.5, 5, 2), (0.9, 10, 1), (0.7, 10, 3)])
def test_prune_count_is_exact_on_the_decimal(sparsity, groups_x_cols, keep):
    """The kept count is round((1 - s) G K) on the decimal ``s`` as written: (1 - 0.3) * 5
    is 3.5 (kept 4, half to even), not float's 3.4999... (kept 3)."""
    w = torch.randn(2, groups_x_cols, generator=torch.Generator().manual_seed(0))
    assert VectorSparse.prune(w, sparsity, 2).values.shape[0] == keep
