"""The vector-sparse kernels' dense fallback (:func:`fusegnn.kernels.vector_spmm.dense_is_cheaper`):
where a densified GEMM beats the sparse kernel, ``vspmm`` / ``vspmm_t`` / ``vsddmm``
compute the same product densely. The rule's size floor is lowered here so small
matrices take the dense branch; the results are checked against the pure-PyTorch
references and against the sparse kernels (``allow_dense=False``)."""

from __future__ import annotations

import pytest
import torch

from fusegnn.kernels import vector_spmm as kern
from fusegnn.layers import VectorSparseLinear
from fusegnn.sparse import VectorSparse, prefers_dense

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def dense_for_small(monkeypatch):
    """Every matrix at least 1 element large may run densified."""
    monkeypatch.setattr(kern, "DENSE_MIN_ELEMENTS", 1)


def _matrix(M: int, K: int, V: int, density: float, seed: int) -> VectorSparse:
    g = torch.Generator().manual_seed(seed)
    d = torch.randn(M, K, generator=g) * (torch.rand(M, K, generator=g) < density)
    d[V : 2 * V] = 0  # an empty row group
    return VectorSparse.from_dense(d, V).to(DEVICE)


def test_rule():
    """Dense where stored values per element exceed reuse / DENSE_LOADS_PER_MAC, inside the size window."""
    rows, cols = 4096, 4096
    at = rows * cols * 8 // kern.DENSE_LOADS_PER_MAC  # the break-even count for reuse 8
    assert kern.dense_is_cheaper(at + 1, rows, cols, 8) and not kern.dense_is_cheaper(at, rows, cols, 8)
    assert kern.dense_is_cheaper(at // 8 + 1, rows, cols, 1)
    assert not kern.dense_is_cheaper(rows * cols, 16, 16, 1)  # below the size floor: the kernels
    big = kern.DENSE_MAX_ELEMENTS + 1
    assert not kern.dense_is_cheaper(big, big, 1, 1)  # a graph-sized matrix is never densified


@pytest.mark.parametrize("V", [4, 8, 16])
def test_dense_branch_matches_reference_and_kernels(V, dense_for_small):
    M, K, N, F = 3 * V + 5, 29, 13, 11  # a partial last group, odd widths
    A = _matrix(M, K, V, 0.4, V)
    idx = A.index()
    assert kern.dense_is_cheaper(A.values.numel(), M, K, V)
    g = torch.Generator().manual_seed(2)
    b, bt = torch.randn(K, N, generator=g).to(DEVICE), torch.randn(M, N, generator=g).to(DEVICE)
    x, y = torch.randn(M, F, generator=g).to(DEVICE), torch.randn(K, F, generator=g).to(DEVICE)
    vals, ptr, col = A.values, idx.row_ptr, idx.col_idx
    pairs = [
        (lambda dense: kern.vspmm(vals, col, ptr, b, M, allow_dense=dense), kern.vspmm_reference(vals, col, ptr, b, M)),
        (lambda dense: kern.vspmm_t(vals, idx.t_ptr, idx.t_vec, idx.t_group, bt, M, allow_dense=dense),
         kern.vspmm_t_reference(vals, col, ptr, bt, K)),
        (lambda dense: kern.vsddmm(x, y, col, ptr, V, idx.max_vectors, allow_dense=dense),
         kern.vsddmm_reference(x, y, col, ptr, V)),
    ]
    for run, reference in pairs:
        dense_out, kernel_out = run(True), run(False)
        assert dense_out.shape == reference.shape and dense_out.dtype == reference.dtype
        torch.testing.assert_close(dense_out, reference, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dense_out, kernel_out, rtol=1e-4, atol=1e-4)


def test_layer_gradients_through_the_dense_branch(dense_for_small):
    """A VectorSparseLinear whose products all run densified: outputs and gradients equal
    the masked dense linear's (float32 against float64)."""
    torch.manual_seed(0)
    layer = VectorSparseLinear(24, 40, 0.5, V=8).to(DEVICE)
    assert prefers_dense(layer.pattern()) and not prefers_dense(layer.pattern(), backend="triton")
    x = torch.randn(5, 7, 24, device=DEVICE, requires_grad=True)
    out = layer(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    w = layer.dense_weight().detach().double().requires_grad_()
    xd = x.detach().double().requires_grad_()
    ref = torch.nn.functional.linear(xd, w, layer.bias.detach().double())
    ref.backward(grad.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-4, atol=1e-4)
    mask = layer.pattern().mask()
    stored = layer.pattern().with_values(layer.values.grad).to_dense().double()
    torch.testing.assert_close(stored, w.grad * mask, rtol=1e-4, atol=1e-4)


def test_prefers_dense_rule_and_bad_input(dense_for_small):
    A = _matrix(40, 24, 8, 0.5, 0)
    assert prefers_dense(A)
    assert not prefers_dense(A, backend="reference") and not prefers_dense(A, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        prefers_dense(A, backend="cuda")
    with pytest.raises(TypeError, match="a must be a VectorSparse"):
        prefers_dense(A.to_dense())


def test_layer_sparse_and_dense_paths_agree(monkeypatch):
    """The same layer through the kernels and through F.linear on the densified weight."""
    torch.manual_seed(1)
    layer = VectorSparseLinear(24, 40, 0.5, V=8).to(DEVICE)
    x = torch.randn(6, 24, device=DEVICE)
    sparse = layer(x)
    assert not prefers_dense(layer.pattern())  # 960 entries: below the size floor
    monkeypatch.setattr(kern, "DENSE_MIN_ELEMENTS", 1)
    torch.testing.assert_close(layer(x), sparse, rtol=1e-5, atol=1e-5)


def test_only_auto_takes_the_dense_branch(dense_for_small, monkeypatch):
    """``backend="triton"`` always runs the sparse kernels (forward and backward); ``"auto"``
    may hand the product to the dense GEMM."""
    from fusegnn.sparse import vsddmm, vspmm

    A = _matrix(40, 24, 8, 0.5, 3)
    g = torch.Generator().manual_seed(4)
    values = A.values.clone().requires_grad_()
    b = torch.randn(24, 5, generator=g).to(DEVICE).requires_grad_()
    x, y = torch.randn(40, 6, generator=g).to(DEVICE), torch.randn(24, 6, generator=g).to(DEVICE)

    def refuse(*args, **kwargs):
        raise AssertionError("the dense branch ran")

    monkeypatch.setattr(kern, "densify_vectors", refuse)
    Av = A.with_values(values)
    out = vspmm(Av, b, backend="triton") + vspmm(Av.T, torch.randn(40, 5, generator=g).to(DEVICE), backend="triton").sum()
    out.sum().backward()
    vsddmm(x, y, A, backend="triton")
    with pytest.raises(AssertionError, match="dense branch"):
        vspmm(Av, b, backend="auto")


def test_to_dense_adds_a_vector_stored_twice_like_the_products():
    """Two vectors at one (row group, column) add up in ``to_dense`` as in ``vspmm``; the
    gradient reaches both; the last, partial group is cut at ``M`` rows."""
    from fusegnn.kernels.vector_layout import vector_groups

    row_ptr = torch.tensor([0, 2, 3], device=DEVICE)
    col_idx = torch.tensor([1, 1, 0], device=DEVICE)
    values = torch.arange(1.0, 13.0, device=DEVICE).view(3, 4).requires_grad_()
    A = VectorSparse(row_ptr, col_idx, values, (6, 3))
    assert vector_groups(row_ptr, 3).tolist() == [0, 0, 1]
    dense = A.to_dense()
    expected = torch.zeros(8, 3, device=DEVICE)
    expected[0:4, 1] = values[0].detach() + values[1].detach()
    expected[4:8, 0] = values[2].detach()
    torch.testing.assert_close(dense, expected[:6])
    b = torch.randn(3, 2, device=DEVICE)
    torch.testing.assert_close(kern.vspmm_reference(values.detach(), col_idx, row_ptr, b, 6), dense.detach() @ b)
    dense.sum().backward()
    assert torch.equal(values.grad, torch.tensor([[1.0] * 4, [1.0] * 4, [1.0, 1.0, 0.0, 0.0]], device=DEVICE))
