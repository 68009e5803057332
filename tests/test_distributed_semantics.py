"""fusegnn.distributed's promises on 3 gloo workers (one small spawn): gradients summed
even where a parameter has no ``.grad`` on some workers, and (single process) bad input
refused with errors that name the argument."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fusegnn.distributed import DistGraph, allreduce_gradients, partition_graph
from fusegnn.sparse import Graph
from tests.gloo_workers import spawn_reports, write_report

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD = 3


def _hub_graph() -> Graph:
    """Node 0 receives from every other node; a self-loop on 3; 5 <- 0."""
    return Graph(torch.tensor([[1, 2, 3, 4, 5, 6, 0, 3], [0, 0, 0, 0, 0, 0, 5, 3]]), 7)


def _uneven_gradients(rank: int) -> list:
    """Only rank 0 has a weight gradient; every rank a bias gradient of 1."""
    lin = nn.Linear(2, 2).double()
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    lin.register_parameter("frozen", frozen)
    if rank == 0:
        lin.weight.grad = torch.ones_like(lin.weight)
    lin.bias.grad = torch.ones_like(lin.bias)
    allreduce_gradients(lin)
    return [lin.weight.grad.tolist() if lin.weight.grad is not None else None, lin.bias.grad.tolist(),
            lin.frozen.grad is None]


def _cubic_weights(ids: torch.Tensor, rank: int) -> torch.Tensor:
    return (1.0 + 0.1 * ids + rank).to(torch.float64).unsqueeze(1)


def _double_backward(rank: int) -> list:
    """Gradient and Hessian-vector product of ``sum_r sum_k w_rk * rows_rk**3`` (``rows_r``
    the exchanged rows of worker r) against one process, max abs differences."""
    graph = _hub_graph()
    part = partition_graph(graph, WORLD, "contiguous")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 2, generator=gen, dtype=torch.float64)
    v = torch.randn(7, 2, generator=gen, dtype=torch.float64)
    shares = [DistGraph.build(graph, part, q) for q in range(WORLD)]
    xg = x.clone().requires_grad_()
    f = sum((_cubic_weights(torch.cat([s.owned, s.halo]), q) * xg[torch.cat([s.owned, s.halo])] ** 3).sum()
            for q, s in enumerate(shares))
    (gx,) = torch.autograd.grad(f, xg, create_graph=True)
    (hx,) = torch.autograd.grad((gx * v).sum(), xg)
    dg = shares[rank]
    ids = torch.cat([dg.owned, dg.halo])
    x_own = dg.owned_rows(x).requires_grad_()
    f_own = (_cubic_weights(ids, rank) * dg.graph.source_rows(x_own) ** 3).sum()
    (g_own,) = torch.autograd.grad(f_own, x_own, create_graph=True)
    (h_own,) = torch.autograd.grad((g_own * dg.owned_rows(v)).sum(), x_own)
    return [float((g_own - dg.owned_rows(gx)).abs().max()), float((h_own - dg.owned_rows(hx)).abs().max())]


def _corner_cases() -> dict:
    """GCN on 3 workers against one process (max abs difference): a worker owning no
    node (hand-made partition: node 0, the hub, alone; rank 2 empty), a graph without
    edges; and gather(owned_rows(v)) == v for bool / int / float of rank 1-3."""
    from fusegnn.layers import GCNConv

    graph = _hub_graph()
    x = torch.randn(7, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    report = {}
    cases = {
        "empty_worker": (graph, _hand_partition([0, 1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5, 6], [0, 1, 7, 7])),
        "no_edges": (Graph(torch.empty(2, 0, dtype=torch.int64), 7), None),
    }
    for name, (g, part) in cases.items():
        dg = DistGraph.build(g, part if part is not None else partition_graph(g, WORLD, "contiguous"))
        torch.manual_seed(0)
        layer = GCNConv(3, 2).double()
        with torch.no_grad():
            report[name] = float((dg.gather(layer(dg.owned_rows(x), dg)) - layer(x, g)).abs().max())
    dg = DistGraph.build(graph, partition_graph(graph, WORLD, "contiguous"))
    for dtype in (torch.bool, torch.int32, torch.float64):
        for shape in ((7,), (7, 3), (7, 2, 3)):
            v = (torch.arange(torch.Size(shape).numel()).reshape(shape) % 3).to(dtype)
            report[f"round_trip_{dtype}_{len(shape)}"] = bool(torch.equal(dg.gather(dg.owned_rows(v)), v))
    return report


def _worker(rank: int, world_size: int, init: str, out_dir: str) -> None:
    write_report(rank, world_size, init, out_dir, lambda: {
        "uneven": _uneven_gradients(rank), "double_backward": _double_backward(rank), "corners": _corner_cases(),
    })


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return spawn_reports(_worker, WORLD, tmp_path_factory.mktemp("dist_semantics"))


def test_allreduce_with_a_gradient_on_some_workers_only(reports):
    """The weight has a gradient on rank 0 only: before, rank 0 all-reduced 6 values and
    the others 2 (a collective mismatch: gloo aborted or the bias sum came out wrong);
    now every rank gets weight.grad = 1 (0 + 0 + 1) and bias.grad = 3."""
    for r in reports:
        weight, bias, frozen_none = r["uneven"]
        assert weight == [[1.0, 1.0], [1.0, 1.0]]
        assert bias == [3.0, 3.0]
        assert frozen_none


def test_exchange_double_backward(reports):
    """Second derivatives through the halo exchange (a gradient penalty, a Hessian-vector
    product): the exchange's backward is itself differentiable, its transpose being the
    forward exchange. Before, the backward's collective was invisible to autograd, so the
    Hessian-vector product lost every cross-worker term (off by O(1))."""
    for r in reports:
        grad_err, hvp_err = r["double_backward"]
        assert grad_err <= 1e-12 and hvp_err <= 1e-12, r["double_backward"]


def _hand_partition(parts: list[int], perm: list[int], offsets: list[int]):
    from fusegnn.distributed import Partition

    t = lambda a: torch.tensor(a, dtype=torch.int64)  # noqa: E731
    return Partition(t(parts), t(perm), t(offsets), 0, 1.0, "manual")


def test_bad_input_names_the_argument():
    """Before: AttributeError ('Tensor' object has no attribute 'num_parts'), IndexError
    (0-d tensors), AttributeError ('list' object has no attribute 'size') and an
    IndexError deep in numpy for a partition whose parts run past its offsets."""
    graph = _hub_graph()
    part = partition_graph(graph, 1)
    with pytest.raises(TypeError, match="partition"):
        DistGraph.build(graph, torch.zeros(7, dtype=torch.int64))
    with pytest.raises(ValueError, match="partition.parts"):
        DistGraph.build(graph, _hand_partition([0, 0, 0, 0, 0, 0, 1], list(range(7)), [0, 7]))
    with pytest.raises(ValueError, match="partition.offsets"):
        DistGraph.build(graph, _hand_partition([0] * 7, list(range(7)), [0, 6]))
    with pytest.raises(ValueError, match="partition.perm"):
        DistGraph.build(graph, _hand_partition([0] * 7, [0, 0, 1, 2, 3, 4, 5], [0, 7]))
    with pytest.raises(ValueError, match="partition covers"):
        DistGraph.build(graph, _hand_partition([0] * 4, list(range(4)), [0, 4]))
    dg = DistGraph.build(graph, part)
    for fn, name in ((dg.owned_rows, "values"), (dg.gather, "x_owned")):
        with pytest.raises(ValueError, match=name):
            fn(torch.tensor(1.0))
        with pytest.raises(TypeError, match=name):
            fn([1.0] * 7)
        with pytest.raises(ValueError, match=name):
            fn(torch.zeros(8, 2))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.float64])
@pytest.mark.parametrize("shape", [(7,), (7, 3), (7, 2, 3)])
def test_one_worker_round_trip_any_shape_and_dtype(shape, dtype):
    graph = _hub_graph()
    dg = DistGraph.build(graph, partition_graph(graph, 1))
    values = (torch.arange(torch.Size(shape).numel()).reshape(shape) % 3).to(dtype)
    before = values.clone()
    assert torch.equal(dg.gather(dg.owned_rows(values)), values)
    assert torch.equal(values, before)


def test_halo_rows_of_zero_width_tensors():
    """Two same-dtype tensors share one exchange; one of zero width ([n, 0, 4]) used to
    fail to split back ('cannot reshape tensor of 0 elements into shape [-1, 0, 4]')."""
    from fusegnn.sparse.halo import HaloGraph, with_halo_rows

    halo = HaloGraph(torch.tensor([[2], [0]]), 2, 1, lambda x: torch.cat([x, x[:1]]))
    empty, x = torch.zeros(2, 0, 4), torch.arange(6.0).reshape(2, 3)
    _, empty_rows, x_rows = with_halo_rows(halo, empty, x)
    assert empty_rows.shape == (3, 0, 4)
    assert torch.equal(x_rows, torch.cat([x, x[:1]]))
    with pytest.raises(TypeError, match="edge values"):
        halo.check_owned_rows([1.0, 2.0], "edge values")


def test_graph_without_nodes_has_one_empty_part():
    """partition_graph allows 1 part for 0 nodes (num_parts <= max(N, 1)) but then raised
    'the contiguous partition left part(s) [0] empty'."""
    from fusegnn.sparse import spmm

    graph = Graph(torch.empty(2, 0, dtype=torch.int64), 0)
    part = partition_graph(graph, 1, "contiguous")
    assert part.sizes() == [0] and part.balance == 1.0 and part.edge_cut == 0
    dg = DistGraph.build(graph, part)
    assert dg.gather(spmm(dg, dg.owned_rows(torch.zeros(0, 3)))).shape == (0, 3)
    with pytest.raises(ValueError, match="exceeds"):
        partition_graph(graph, 2)


def test_corner_cases_match_one_process(reports):
    for r in reports:
        for case, value in r["corners"].items():
            assert value is True or value <= 1e-12, (case, value)
