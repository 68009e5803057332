"""fusegnn.kernels._reductions.column_sum: the column sums the fused layers' backward passes
take (bias and attention-vector gradients), against ``sum(0)`` in float64; on a GPU the
cuBLAS form, its cached ones and a CUDA-graph capture."""

from __future__ import annotations

import pytest
import torch

from fusegnn.kernels import _reductions
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
def test_column_sum_ones_grow_and_are_sliced():
    _reductions._ones_cache.clear()
    column_sum(torch.ones(10, 2, device="cuda"))
    held = _reductions._ones_cache[(torch.device("cuda", torch.cuda.current_device()), torch.float32)]
    assert held.numel() == 10
    column_sum(torch.ones(4, 2, device="cuda"))  # a slice of the held vector
    assert _reductions._ones_cache[(held.device, torch.float32)] is held
    assert torch.equal(column_sum(torch.ones(25, 2, device="cuda")), torch.full((2,), 25.0, device="cuda"))
    assert _reductions._ones_cache[(held.device, torch.float32)].numel() == 25


@needs_cuda
def test_column_sum_in_a_cuda_graph():
    _reductions._ones_cache.clear()
    matrix = torch.randn(300, 5, device="cuda")
    column_sum(matrix)  # warm-up outside the capture keeps the ones
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph):
            out = column_sum(matrix)
            bigger = column_sum(torch.ones(600, 5, device="cuda"))  # ones made inside: not kept
    torch.cuda.current_stream().wait_stream(stream)
    matrix.copy_(torch.randn(300, 5, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, matrix.sum(0))
    assert torch.equal(bigger, torch.full((5,), 600.0, device="cuda"))
    assert _reductions._ones_cache[(matrix.device, torch.float32)].numel() == 300
