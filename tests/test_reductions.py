"""fusegnn.kernels._reductions.column_sum: the column sums the fused layers' backward passes
take (bias and attention-vector gradients), against ``sum(0)`` in float64; on a GPU the
cuBLAS form, its cached ones and a CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from fusegnn.kernels._reductions import column_sum

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("rows, cols", [(0, 3), (1, 1), (7, 3), (200, 64), (33, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_column_sum_is_the_sum_over_rows(rows, cols, dtype):
    matrix = torch.randn(rows, cols, dtype=dtype)
    got = column_sum(matrix)
    assert got.shape == (cols,) and got.dtype == dtype
    torch.testing.assert_close(got, matrix.double().sum(0).to(dtype))


def test_column_sum_refuses_other_ranks():
    with pytest.raises(ValueError, match="2-D"):
        column_sum(torch.ones(3))
    with pytest.raises(ValueError, match="2-D"):
        column_sum(torch.ones(2, 3, 4))


def test_column_sum_does_not_modify_its_input():
    matrix = torch.randn(9, 4)
    before = matrix.clone()
    column_sum(matrix)
    assert torch.equal(matrix, before)


@needs_cuda
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.float64, 1e-12),
                                         (torch.bfloat16, 1e-2), (torch.float16, 1e-3)])
@pytest.mark.parametrize("rows, cols", [(19717, 3), (19717, 64), (1000, 128), (5, 7)])
def test_column_sum_on_cuda_matches_float64(dtype, rtol, rows, cols):
    gen = torch.Generator(device="cuda").manual_seed(rows + cols)
    matrix = torch.randn(rows, cols, device="cuda", generator=gen).to(dtype)
    got = column_sum(matrix)
    want = matrix.double().sum(0)
    assert got.dtype == dtype and got.device == matrix.device
    scale = matrix.double().abs().sum(0).max()
    assert float((got.double() - want).abs().max()) <= rtol * float(scale)
    # a strided (transposed-back) input sums the same
    torch.testing.assert_close(column_sum(matrix.t().contiguous().t()), got, rtol=rtol, atol=rtol * float(scale))


@needs_cuda
def test_column_sum_in_a_cuda_graph():
    """Captured, the sums follow the matrix at every replay, and a graph captured earlier
    keeps working after longer sums run (no shared vector it reads at a fixed address)."""
    matrix = torch.randn(300, 5, device="cuda")
    column_sum(matrix)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            out = column_sum(matrix)
    torch.cuda.current_stream().wait_stream(stream)
    column_sum(torch.randn(4096, 5, device="cuda"))  # longer sums after the capture
    junk = [torch.full((300,), 7.0, device="cuda") for _ in range(16)]  # reuse freed blocks
    matrix.copy_(torch.randn(300, 5, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, matrix.sum(0))
    del junk


@needs_cuda
def test_column_sum_under_deterministic_algorithms(monkeypatch):
    """torch.use_deterministic_algorithms(True) (cuBLAS would need CUBLAS_WORKSPACE_CONFIG,
    unset here, and raise): torch's reduction, the same sums."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    matrix = torch.randn(100, 4, device="cuda")
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        got = column_sum(matrix)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    torch.testing.assert_close(got, matrix.sum(0))


def test_column_sum_keeps_torchs_reduction_for_half_inputs():
    """Half inputs: torch's reduction (float32 accumulation), bitwise ``sum(0)`` (on a GPU
    where there is one: there the float32 path would be cuBLAS's)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for dtype in (torch.float16, torch.bfloat16):
        matrix = torch.randn(4096, 3, device=device).to(dtype)
        assert torch.equal(column_sum(matrix), matrix.sum(0))


@pytest.mark.parametrize("n, heads, channels", [(50, 8, 8), (0, 2, 3), (7, 1, 64), (9, 3, 5)])
def test_attention_vector_grads_deterministic_form_matches(n, heads, channels):
    """GAT's attention-vector gradients: the head-diagonal product and the broadcast form
    that runs under torch.use_deterministic_algorithms give the same [2, H, C] sums."""
    from fusegnn.kernels.gat_fused import _attention_vector_grads

    gen = torch.Generator().manual_seed(n + heads)
    grad_src, grad_dst = (torch.randn(n, heads, generator=gen, dtype=torch.float64) for _ in range(2))
    h = torch.randn(n, heads, channels, generator=gen, dtype=torch.float64)
    product = _attention_vector_grads(grad_src, grad_dst, h)
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        broadcast = _attention_vector_grads(grad_src, grad_dst, h)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
    want = (torch.stack((grad_src, grad_dst)).unsqueeze(-1) * h.unsqueeze(0)).sum(1)
    assert product.shape == broadcast.shape == (2, heads, channels)
    torch.testing.assert_close(product, want)
    torch.testing.assert_close(broadcast, want)
