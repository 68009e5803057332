"""The dispatch rule as documented in fusegnn.sparse.dispatch: thresholds, contexts, records."""

import math

import pytest
import torch

from fusegnn.sparse import Graph, dispatch


def _ring_graph(num_nodes: int, degree: int) -> Graph:
    """Each node receives ``degree`` edges from its successors: every average degree is ``degree``."""
    dst = torch.arange(num_nodes).repeat_interleave(degree)
    src = (dst + torch.arange(1, degree + 1).repeat(num_nodes)) % num_nodes
    return Graph(torch.stack([src, dst]), (num_nodes, num_nodes))


@pytest.mark.parametrize("op", ["", "gat", "gatv2"])
def test_gar_threshold_is_the_measured_value_at_every_table_width(op):
    points = dispatch.ATTENTION_GAR_CROSSOVER.get(op, dispatch.GAR_CROSSOVER)
    for width, degree in points:
        assert dispatch.gar_min_avg_degree(width, op) == degree


@pytest.mark.parametrize("op", ["", "gat", "gatv2"])
def test_gar_threshold_is_held_outside_the_table_and_monotone_between(op):
    points = dispatch.ATTENTION_GAR_CROSSOVER.get(op, dispatch.GAR_CROSSOVER)
    (w_first, d_first), (w_last, d_last) = points[0], points[-1]
    assert dispatch.gar_min_avg_degree(1, op) == d_first
    assert dispatch.gar_min_avg_degree(max(w_first - 1, 1), op) == d_first
    assert dispatch.gar_min_avg_degree(w_last + 1, op) == d_last
    assert dispatch.gar_min_avg_degree(10 * w_last, op) == d_last
    for (w0, d0), (w1, d1) in zip(points, points[1:]):
        mid = round(math.sqrt(w0 * w1))
        expected = math.exp(math.log(d0) + math.log(mid / w0) / math.log(w1 / w0) * math.log(d1 / d0))
        assert dispatch.gar_min_avg_degree(mid, op) == pytest.approx(expected)
        assert min(d0, d1) <= dispatch.gar_min_avg_degree(mid, op) <= max(d0, d1)


def test_gar_threshold_for_an_unknown_width():
    assert dispatch.gar_min_avg_degree(None) == dispatch.GAR_MIN_AVG_DEGREE
    for op, points in dispatch.ATTENTION_GAR_CROSSOVER.items():
        assert dispatch.gar_min_avg_degree(None, op) == max(d for _, d in points)


def test_degree_exactly_at_a_table_threshold_takes_gar():
    """"GAR when the degree is at least the threshold": GATv2 at 16 columns, degree exactly 10
    (the table's point) is GAR (it was GAS: the threshold came out as 10.000000000000002)."""
    graph = _ring_graph(40, 10)
    assert dispatch.smaller_side_degree(graph) == 10.0
    threshold = dispatch.gar_min_avg_degree(16, "gatv2")
    assert dispatch.smaller_side_degree(graph) >= threshold
    below = _ring_graph(40, 9)
    assert dispatch.smaller_side_degree(below) < threshold
