"""COO -> CSR / CSC conversion (``Graph.csr`` / ``Graph.csc``): the same result as a
stable int64 argsort, whichever fast path (int32 keys, already-sorted input) is taken."""

from __future__ import annotations

import pytest
import torch

from fusegnn.sparse import Graph
from fusegnn.sparse.graph import _compress, _stable_group_perm
from tests.graphs import random_graph


def _expected(group: torch.Tensor, other: torch.Tensor, num_groups: int):
    perm = torch.argsort(group.long(), stable=True)
    ptr = torch.zeros(num_groups + 1, dtype=torch.int64)
    ptr[1:] = torch.bincount(group.long(), minlength=num_groups).cumsum(0)
    return ptr, other[perm], perm


def _assert_same(compressed, expected):
    ptr, index, perm = expected
    assert compressed.ptr.dtype == torch.int64 and compressed.perm.dtype == torch.int64
    assert torch.equal(compressed.ptr.cpu(), ptr)
    assert torch.equal(compressed.perm.cpu(), perm)
    assert torch.equal(compressed.index.cpu(), index)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_stable_argsort(dtype, seed):
    ei = random_graph(50, 700, seed, hub_degree=200, dtype=dtype)
    g = Graph(ei, 50)
    _assert_same(g.csr, _expected(ei[1], ei[0], 50))
    _assert_same(g.csc, _expected(ei[0], ei[1], 50))
    assert g.csr.index.dtype == dtype


def test_sorted_input_takes_identity_and_is_still_right():
    ei = random_graph(30, 300, 3)
    order = torch.argsort(ei[0] * 30 + ei[1])  # coalesced: sorted by source, then target
    ei = ei[:, order]
    g = Graph(ei, 30)
    assert torch.equal(g.csc.perm, torch.arange(300))
    _assert_same(g.csc, _expected(ei[0], ei[1], 30))
    _assert_same(g.csr, _expected(ei[1], ei[0], 30))


def test_stable_within_groups():
    ei = random_graph(20, 400, 4, hub_degree=100)
    g = Graph(ei, 20)
    for comp in (g.csr, g.csc):
        for r in range(20):
            seg = comp.perm[comp.ptr[r] : comp.ptr[r + 1]]
            assert bool((seg[1:] > seg[:-1]).all())


def test_bipartite_and_degenerate():
    ei = random_graph(9, 80, 5, num_dst_nodes=4)
    g = Graph(ei, (9, 4))
    _assert_same(g.csr, _expected(ei[1], ei[0], 4))
    _assert_same(g.csc, _expected(ei[0], ei[1], 9))
    one = Graph(torch.tensor([[2], [0]]), 3)
    _assert_same(one.csr, _expected(torch.tensor([0]), torch.tensor([2]), 3))
    empty = Graph(torch.empty(2, 0, dtype=torch.int32), 4)
    assert empty.csr.ptr.tolist() == [0] * 5 and empty.csr.perm.dtype == torch.int64
    assert empty.csr.index.dtype == torch.int32 and empty.csc.index.numel() == 0


def test_all_equal_keys_and_descending():
    group = torch.full((50,), 3)
    assert torch.equal(_stable_group_perm(group, 4), torch.arange(50))
    group = torch.arange(50, 0, -1) % 7
    assert torch.equal(_stable_group_perm(group, 7), torch.argsort(group, stable=True))


@pytest.mark.parametrize("first", ["csr", "degrees"])
def test_degrees_and_conversion_agree_in_either_order(first):
    """Converting first caches the degrees read off the sort; degrees first are reused."""
    ei = random_graph(25, 300, 7, hub_degree=80)
    ei = ei[:, torch.argsort(ei[0], stable=True)]  # sources sorted: CSC takes the identity path
    g = Graph(ei, 25)
    if first == "csr":
        g.csr, g.csc  # noqa: B018
    else:
        g.in_degree, g.out_degree  # noqa: B018
    assert torch.equal(g.in_degree, torch.bincount(ei[1], minlength=25))
    assert torch.equal(g.out_degree, torch.bincount(ei[0], minlength=25))
    assert g.in_degree.dtype == torch.int64
    _assert_same(g.csr, _expected(ei[1], ei[0], 25))
    _assert_same(g.csc, _expected(ei[0], ei[1], 25))
    assert g.csc.index.data_ptr() != ei[1].data_ptr()  # a copy, not a view of edge_index


def test_compress_does_not_touch_inputs():
    ei = random_graph(15, 100, 6)
    before = ei.clone()
    counts = torch.bincount(ei[1], minlength=15)
    _compress(ei[1], ei[0], counts)
    assert torch.equal(ei, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gpu_matches_cpu(dtype):
    ei = torch.randint(0, 5000, (2, 300_000), dtype=dtype)
    cpu = Graph(ei, 5000)
    gpu = Graph(ei.cuda(), 5000)
    for a, b in ((cpu.csr, gpu.csr), (cpu.csc, gpu.csc)):
        for x, y in zip(a, b):
            assert torch.equal(x, y.cpu())
