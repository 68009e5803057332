"""The fused GCN normalisation kernels (:mod:`fusegnn.kernels.gcn_norm`) against the
composed PyTorch ops of :func:`fusegnn.sparse.processing.gcn_norm` (float64 oracle),
through the Triton interpreter on the CPU (``conftest`` sets ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import pytest
import torch

from fusegnn.sparse import Graph
from fusegnn.sparse.processing import gcn_norm
from tests.graphs import random_graph

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _graph(seed: int, n: int = 40, e: int = 160, hub: int = 0, weighted: bool = True) -> Graph:
    edge_index = random_graph(n, e, seed=seed, hub_degree=hub, device=DEVICE)
    weight = None
    if weighted:
        gen = torch.Generator().manual_seed(seed)
        weight = (torch.rand(e, generator=gen, dtype=torch.float64) + 0.1).to(DEVICE)
    return Graph(edge_index, n, weight)


def _check(graph: Graph, **kwargs) -> None:
    dtype = kwargs.pop("dtype", torch.float64)
    fused = gcn_norm(graph, fused=True, dtype=dtype, **kwargs)
    composed = gcn_norm(graph.with_edge_weight(
        graph.edge_weight.double() if graph.edge_weight is not None else None
    ), fused=False, dtype=torch.float64, **kwargs)
    assert torch.equal(fused.edge_index, composed.edge_index)
    assert fused.edge_weight.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(fused.edge_weight.double(), composed.edge_weight, rtol=tol, atol=tol)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("improved", [False, True])
def test_fused_matches_composed(seed, weighted, improved):
    _check(_graph(seed, weighted=weighted), improved=improved)


@pytest.mark.parametrize("add_self_loops", [True, False])
def test_hub_row_isolated_nodes_and_no_loops(add_self_loops):
    # a hub of 300 incoming edges (longer than one 256-edge step), isolated nodes
    # (degree 0 without loops: weight 0, never inf / NaN)
    graph = _graph(3, n=60, e=420, hub=300)
    _check(graph, add_self_loops=add_self_loops)
    out = gcn_norm(graph, fused=True, add_self_loops=add_self_loops)
    assert torch.isfinite(out.edge_weight).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_low_precision_outputs(dtype):
    _check(_graph(4), dtype=dtype)


def test_existing_self_loops_keep_their_weight():
    # node 0 has two self-loops (the last one's weight is kept, as in PyG), node 1 one,
    # node 2 none (gets the fill value)
    edge_index = torch.tensor([[0, 0, 1, 2, 0], [0, 1, 1, 0, 0]], device=DEVICE)
    weight = torch.tensor([5.0, 2.0, 3.0, 4.0, 7.0], dtype=torch.float64, device=DEVICE)
    graph = Graph(edge_index, 3, weight)
    _check(graph)
    _check(graph, improved=True)


def test_bitwise_reproducible_and_inputs_untouched():
    graph = _graph(5, hub=100)
    before = graph.edge_weight.clone()
    a = gcn_norm(graph, fused=True).edge_weight
    b = gcn_norm(graph, fused=True).edge_weight
    assert torch.equal(a, b)
    assert torch.equal(graph.edge_weight, before)


def test_reweighting_reuses_the_structure():
    graph = _graph(6)
    first = gcn_norm(graph, fused=True)
    second = gcn_norm(graph.with_edge_weight(graph.edge_weight * 2), fused=True)
    # the loop structure is cached on the graph's structure and shared by the re-weighted
    # copy: one result structure, weights recomputed
    assert first.edge_index.data_ptr() == second.edge_index.data_ptr()
    _check(graph.with_edge_weight(graph.edge_weight * 2))


def test_weights_requiring_grad_take_the_differentiable_path():
    graph = _graph(7)
    weight = graph.edge_weight.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="requires grad"):
        gcn_norm(graph, weight, fused=True)
    out = gcn_norm(graph, weight)  # auto: composed ops, differentiable
    out.edge_weight.sum().backward()
    assert weight.grad is not None and torch.isfinite(weight.grad).all()
    with torch.no_grad():  # no gradient wanted: the kernels may run
        _check(graph.with_edge_weight(weight.detach()))
        gcn_norm(graph, weight, fused=True)


def test_bad_fused_requests_say_why():
    graph = _graph(8)
    with pytest.raises(ValueError, match=r"dtype must be floating"):
        gcn_norm(graph, fused=True, dtype=torch.int64)


def test_auto_choice_on_cpu_is_composed():
    if DEVICE != "cpu":
        pytest.skip("checks the CPU default")
    graph = _graph(9)
    # on the CPU auto takes the composed ops even under the interpreter; same values
    torch.testing.assert_close(gcn_norm(graph).edge_weight, gcn_norm(graph, fused=True).edge_weight,
                               rtol=1e-12, atol=1e-12)
