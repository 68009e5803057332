"""Self-loop edge features (PyG's ``fill_value``) and the bipartite graph helper of the layers."""

import pytest
import torch

from fusegnn.layers._utils import bipartite_graph_for, node_pair
from fusegnn.sparse import Graph
from fusegnn.sparse.processing import gat_self_loop_edge_attr, gat_self_loops, self_loop_attr


def _graph_with_loops():
    torch.manual_seed(0)
    edge_index = torch.randint(0, 6, (2, 20))
    edge_index[:, 0] = torch.tensor([2, 2])  # a self-loop
    edge_index[:, 1] = torch.tensor([3, 3])
    return Graph(edge_index, 7), torch.randn(20, 4, dtype=torch.float64)  # node 6: no edges


def _loop_attr_by_loops(graph, edge_attr, reduce):
    """Each node's loop feature from a Python loop over its incoming non-loop edges."""
    rows = []
    for node in range(graph.num_nodes):
        incoming = [k for k in range(graph.num_edges)
                    if int(graph.dst[k]) == node and int(graph.src[k]) != node]
        if not incoming:
            rows.append(torch.ones(4, dtype=edge_attr.dtype) if reduce == "mul" else torch.zeros(4, dtype=edge_attr.dtype))
            continue
        feats = edge_attr[incoming]
        rows.append({"add": feats.sum(0), "mean": feats.mean(0), "max": feats.amax(0),
                     "min": feats.amin(0), "mul": feats.prod(0)}[reduce])
    return torch.stack(rows)


@pytest.mark.parametrize("reduce", ["add", "mean", "max", "min", "mul"])
def test_gat_self_loop_edge_attr_reductions(reduce):
    graph, edge_attr = _graph_with_loops()
    out = gat_self_loop_edge_attr(graph, edge_attr, reduce)
    keep = graph.src != graph.dst
    assert out.shape == (int(keep.sum()) + graph.num_nodes, 4)
    assert torch.equal(out[: int(keep.sum())], edge_attr[keep])
    torch.testing.assert_close(out[int(keep.sum()):], _loop_attr_by_loops(graph, edge_attr, reduce))
    assert gat_self_loops(graph).num_edges == out.size(0)


def test_self_loop_attr_constants_and_gradient():
    graph, edge_attr = _graph_with_loops()
    assert torch.equal(self_loop_attr(graph, edge_attr, None), torch.ones(7, 4, dtype=torch.float64))
    assert torch.equal(self_loop_attr(graph, edge_attr, 0.5), torch.full((7, 4), 0.5, dtype=torch.float64))
    vec = torch.arange(4.0)
    assert torch.equal(self_loop_attr(graph, edge_attr, vec), vec.double().expand(7, 4))
    attr = edge_attr.clone().requires_grad_()
    torch.autograd.gradcheck(lambda a: gat_self_loop_edge_attr(graph, a, "mean"), (attr,))
    assert torch.equal(attr, edge_attr)  # not modified in place


def test_self_loop_attr_bad_input():
    graph, edge_attr = _graph_with_loops()
    with pytest.raises(ValueError, match="fill_value"):
        self_loop_attr(graph, edge_attr, "median")
    with pytest.raises(ValueError, match="edge_attr"):
        self_loop_attr(graph, edge_attr[:3], "mean")
    with pytest.raises(ValueError, match="fill_value"):
        self_loop_attr(graph, edge_attr, torch.ones(3))
    with pytest.raises(TypeError, match="fill_value"):
        self_loop_attr(graph, edge_attr, True)


def test_bipartite_graph_for_sizes_and_errors():
    edge_index = torch.tensor([[0, 1, 4], [0, 2, 1]])
    graph = bipartite_graph_for(torch.randn(5, 3), 3, edge_index, "Layer")
    assert (graph.num_src_nodes, graph.num_dst_nodes) == (5, 3)
    assert bipartite_graph_for(torch.randn(5, 3), None, Graph(edge_index, (5, 3)), "Layer").num_dst_nodes == 3
    with pytest.raises(ValueError, match="Layer: the graph has 5 x 3"):
        bipartite_graph_for(torch.randn(4, 3), 3, Graph(edge_index, (5, 3)), "Layer")
    with pytest.raises(IndexError, match="Layer"):
        bipartite_graph_for(torch.randn(5, 3), 2, edge_index, "Layer")
    x = torch.randn(2, 2)
    assert node_pair(x, "L") == (x, x)
    assert node_pair((x, None), "L") == (x, None)
    with pytest.raises(TypeError, match="x_dst"):
        node_pair((x, 3), "L")
