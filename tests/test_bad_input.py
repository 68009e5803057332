"""Bad input raises a clear ValueError / TypeError / IndexError naming the argument.

Never a crash deep inside torch, never a silent result. Device mismatches are produced
with the ``meta`` device on CPU-only machines (and checked to fail before any
computation runs); a real CUDA variant runs where a GPU exists.
"""

from __future__ import annotations

import networkx as nx
import pytest
import torch

import fusegnn.sparse.ops as ops_module
from fusegnn.layers import GATConv, GCNConv
from fusegnn.sparse import (
    Graph,
    available_backends,
    edge_softmax,
    gcn_norm,
    resolve_aggregation,
    sddmm,
    spmm,
)
from tests.graphs import random_graph

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")

N, E = 8, 20


@pytest.fixture
def ei():
    return random_graph(N, E, seed=0)


@pytest.fixture
def graph(ei):
    return Graph(ei, N)


@pytest.fixture
def no_compute(monkeypatch):
    """Fail the test if an op gets as far as choosing a backend."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the op reached dispatch: the bad input was not caught first")

    monkeypatch.setattr(ops_module, "resolve_aggregation", forbidden)


LAYERS = [
    pytest.param(lambda: GCNConv(4, 3), id="GCNConv"),
    pytest.param(lambda: GATConv(4, 3, heads=2), id="GATConv"),
]


# ---------------------------------------------------------------------------- Graph
def test_graph_edge_index_type_dtype_shape():
    with pytest.raises(TypeError, match="edge_index must be a torch.Tensor"):
        Graph([[0, 1], [1, 0]])
    with pytest.raises(TypeError, match="edge_index must hold int32 or int64"):
        Graph(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    with pytest.raises(TypeError, match="edge_index must hold int32 or int64"):
        Graph(torch.tensor([[0, 1], [1, 0]], dtype=torch.int16))
    with pytest.raises(ValueError, match=r"edge_index must have shape \[2, E\]"):
        Graph(torch.tensor([[0, 1], [1, 0], [0, 0]]))
    with pytest.raises(ValueError, match=r"edge_index must have shape \[2, E\]"):
        Graph(torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="edge_index must be a dense"):
        Graph(torch.tensor([[0, 1], [1, 0]]).to_sparse())


def test_graph_node_ids_out_of_range_or_negative():
    with pytest.raises(IndexError, match="edge_index has a negative source node id"):
        Graph(torch.tensor([[0, -1], [1, 0]]), 3)
    with pytest.raises(IndexError, match="edge_index has a negative target node id"):
        Graph(torch.tensor([[0, 1], [1, -2]]))
    with pytest.raises(IndexError, match=r"edge_index has target node id 5 .* \(ids must be < 5\)"):
        Graph(torch.tensor([[0, 1], [1, 5]]), 5)
    with pytest.raises(IndexError, match="edge_index has source node id 3"):
        Graph(torch.tensor([[3, 1], [1, 0]], dtype=torch.int32), (3, 4))
    with pytest.raises(IndexError, match="edge_index has target node id 2"):
        Graph(torch.tensor([[3, 1], [1, 2]]), (4, 2))


def test_graph_num_nodes():
    ei = torch.tensor([[0, 1], [1, 0]])
    with pytest.raises(ValueError, match="num_nodes must be >= 0"):
        Graph(ei, -1)
    with pytest.raises(TypeError, match="num_nodes must be an int"):
        Graph(ei, 2.0)
    with pytest.raises(TypeError, match="num_nodes must be an int"):
        Graph(ei, True)
    with pytest.raises(ValueError, match="num_nodes must be an int or a pair"):
        Graph(ei, (2, 2, 2))
    with pytest.raises(ValueError, match="num_nodes must be a single integer"):
        Graph(ei, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="num_nodes must be given .* meta"):
        Graph(ei.to("meta"))


def test_graph_edge_weight(ei):
    with pytest.raises(ValueError, match=rf"edge_weight must have shape \[E\] or \[E, H\] with E = {E}"):
        Graph(ei, N, torch.ones(E + 1))
    with pytest.raises(ValueError, match="edge_weight must have shape"):
        Graph(ei, N, torch.ones(E, 2, 2))
    with pytest.raises(TypeError, match="edge_weight must be a floating tensor"):
        Graph(ei, N, torch.ones(E, dtype=torch.int64))
    with pytest.raises(TypeError, match="edge_weight must be a torch.Tensor"):
        Graph(ei, N, [1.0] * E)
    with pytest.raises(ValueError, match="edge_weight is on meta but the graph is on cpu"):
        Graph(ei, N, torch.ones(E, device="meta"))
    g = Graph(ei, N)
    with pytest.raises(ValueError, match="edge_weight must have shape"):
        g.with_edge_weight(torch.ones(E - 1))
    with pytest.raises(ValueError, match="to_dense needs a 1-D edge_weight"):
        g.with_edge_weight(torch.ones(E, 2)).to_dense()


def test_graph_from_sparse_and_networkx_bad_input():
    with pytest.raises(TypeError, match="adj must be a torch.sparse COO or CSR"):
        Graph.from_sparse(torch.eye(3))
    with pytest.raises(TypeError, match="adj must be a torch.sparse COO or CSR"):
        Graph.from_sparse(torch.eye(3).to_sparse_csc())
    with pytest.raises(ValueError, match="adj must be a 2-D sparse matrix"):
        Graph.from_sparse(torch.ones(2, 2, 2).to_sparse())
    with pytest.raises(TypeError, match="nx_graph must be a networkx graph"):
        Graph.from_networkx({0: [1]})
    assert Graph.from_networkx(nx.path_graph(3)).num_edges == 4  # the good path still works


def test_bipartite_graph_has_no_num_nodes():
    g = Graph(torch.tensor([[0, 2], [1, 0]]), (3, 2))
    with pytest.raises(ValueError, match="bipartite"):
        g.num_nodes
    with pytest.raises(ValueError, match="gcn_norm needs a square graph"):
        gcn_norm(g)


# ---------------------------------------------------------------------------- spmm
def test_spmm_bad_strings(graph):
    x = torch.randn(N, 3)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        spmm(graph, x, aggregation="fast")
    with pytest.raises(ValueError, match="reduce must be one of"):
        spmm(graph, x, reduce="min")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        resolve_aggregation("GAS", graph, x)


@pytest.mark.parametrize("name", ["gas", "gar"])
def test_unavailable_backend_is_an_error_not_a_fallback(graph, name):
    x = torch.randn(N, 3)
    spmm(graph, x, aggregation="reference")  # kernel backends register on first dispatch
    if name not in available_backends():
        with pytest.raises(NotImplementedError, match=f"aggregation='{name}' is not available"):
            spmm(graph, x, aggregation=name)
        return
    try:
        out = spmm(graph, x, aggregation=name)
    except ValueError as err:  # registered but not for CPU tensors
        assert f"aggregation='{name}' cannot run on these inputs" in str(err)
    else:  # it runs here, so it must agree with the oracle
        torch.testing.assert_close(out, spmm(graph, x, aggregation="reference"), rtol=1e-4, atol=1e-4)


def test_spmm_bad_x(graph, ei, no_compute):
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        spmm(graph, [[1.0]] * N)
    with pytest.raises(TypeError, match="x must be a floating tensor"):
        spmm(graph, torch.ones(N, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="x has 7 rows but the graph needs 8"):
        spmm(graph, torch.randn(N - 1, 3))
    with pytest.raises(ValueError, match="x must have 2 or 3 dimensions"):
        spmm(graph, torch.randn(N))
    with pytest.raises(ValueError, match="x must have 2 or 3 dimensions"):
        spmm(graph, torch.randn(N, 2, 2, 2))
    # a bare edge_index with ids beyond x's rows
    with pytest.raises(IndexError, match="edge_index has .* node id"):
        spmm(ei, torch.randn(N - 3, 3))
    with pytest.raises(TypeError, match="graph must be a fusegnn.sparse.Graph or an edge_index"):
        spmm(ei.tolist(), torch.randn(N, 3))


def test_spmm_bad_edge_weight(graph, no_compute):
    x2, x3 = torch.randn(N, 3), torch.randn(N, 2, 3)
    with pytest.raises(ValueError, match=rf"edge_weight must have shape \[E\] or \[E, H\] with E = {E}"):
        spmm(graph, x2, torch.ones(E - 1))
    with pytest.raises(ValueError, match="edge_weight of shape .* x must then be"):
        spmm(graph, x2, torch.ones(E, 2))
    with pytest.raises(ValueError, match="edge_weight of shape .*H=3"):
        spmm(graph, x3, torch.ones(E, 3))
    with pytest.raises(TypeError, match="edge_weight must be a floating tensor"):
        spmm(graph, x2, torch.ones(E, dtype=torch.int32))
    with pytest.raises(ValueError, match="edge_weight must have shape"):
        spmm(graph, x2, torch.ones(E, 2, 1))


def test_spmm_devices_meta(graph, ei, no_compute):
    with pytest.raises(ValueError, match="x is on meta but the graph is on cpu"):
        spmm(graph, torch.randn(N, 3, device="meta"))
    with pytest.raises(ValueError, match="x is on meta but the graph is on cpu"):
        spmm(ei, torch.randn(N, 3, device="meta"))
    with pytest.raises(ValueError, match="edge_weight is on meta but the graph is on cpu"):
        spmm(graph, torch.randn(N, 3), torch.ones(E, device="meta"))
    meta_graph = Graph(ei.to("meta"), N)
    with pytest.raises(ValueError, match="x is on cpu but the graph is on meta"):
        spmm(meta_graph, torch.randn(N, 3))


# ---------------------------------------------------------------------------- sddmm
def test_sddmm_bad_input(graph, no_compute):
    a, b = torch.randn(N, 4), torch.randn(N, 4)
    with pytest.raises(ValueError, match="op must be one of"):
        sddmm(graph, a, b, "div")
    with pytest.raises(ValueError, match="a and b must have the same trailing shape"):
        sddmm(graph, a, torch.randn(N, 5))
    with pytest.raises(TypeError, match="a and b must have the same dtype"):
        sddmm(graph, a, b.double())
    with pytest.raises(ValueError, match="b has 7 rows"):
        sddmm(graph, a, torch.randn(N - 1, 4))
    with pytest.raises(ValueError, match="a has 9 rows"):
        sddmm(graph, torch.randn(N + 1, 4), b)
    with pytest.raises(ValueError, match="op='dot' needs a feature axis"):
        sddmm(graph, torch.randn(N), torch.randn(N), "dot")
    with pytest.raises(TypeError, match="a must be a floating tensor"):
        sddmm(graph, a.long(), b)
    with pytest.raises(TypeError, match="b must be a torch.Tensor"):
        sddmm(graph, a, None)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        sddmm(graph, "a", b)
    with pytest.raises(ValueError, match="b is on meta"):
        sddmm(graph, a, b.to("meta"))


# ---------------------------------------------------------------------------- edge_softmax
def test_edge_softmax_bad_input(graph, no_compute):
    with pytest.raises(ValueError, match=f"scores has {E + 1} rows but the graph needs {E}"):
        edge_softmax(graph, torch.randn(E + 1))
    with pytest.raises(TypeError, match="scores must be a floating tensor"):
        edge_softmax(graph, torch.ones(E, dtype=torch.int64))
    with pytest.raises(ValueError, match="scores must have 1 or 2 dimensions"):
        edge_softmax(graph, torch.randn(E, 2, 2))
    with pytest.raises(TypeError, match="scores must be a torch.Tensor"):
        edge_softmax(graph, [0.0] * E)
    with pytest.raises(ValueError, match="scores is on meta"):
        edge_softmax(graph, torch.randn(E, device="meta"))


def test_sddmm_and_edge_softmax_bad_aggregation(graph):
    a = torch.randn(N, 4)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        sddmm(graph, a, a, aggregation="")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        edge_softmax(graph, torch.randn(E), aggregation="auto ")


# ---------------------------------------------------------------------------- layers
@pytest.mark.parametrize("make", LAYERS)
def test_layer_feature_width_and_x(make, ei):
    layer = make()
    name = type(layer).__name__
    with pytest.raises(ValueError, match=f"{name}: x has 5 features .* in_channels=4"):
        layer(torch.randn(N, 5), ei)
    with pytest.raises(TypeError, match=f"{name}: x must be a floating tensor"):
        layer(torch.ones(N, 4, dtype=torch.int64), ei)
    with pytest.raises(ValueError, match=rf"{name}: x must have shape \[num_nodes, in_channels\]"):
        layer(torch.randn(N, 2, 4), ei)
    with pytest.raises(TypeError, match=f"{name}: x must be a torch.Tensor"):
        layer(None, ei)


@pytest.mark.parametrize("make", LAYERS)
def test_layer_bad_edge_index(make, ei):
    layer = make()
    name = type(layer).__name__
    x = torch.randn(N, 4)
    with pytest.raises(TypeError, match=f"{name}: edge_index must hold int32 or int64"):
        layer(x, ei.float())
    bad = ei.clone()
    bad[1, 3] = N
    with pytest.raises(IndexError, match=f"{name}: edge_index has target node id {N}"):
        layer(x, bad)
    bad = ei.clone()
    bad[0, 0] = -1
    with pytest.raises(IndexError, match=f"{name}: edge_index has a negative source node id"):
        layer(x, bad)
    with pytest.raises(ValueError, match=f"{name}: edge_index must have shape"):
        layer(x, ei[:1])
    with pytest.raises(TypeError, match=f"{name}: edge_index must be"):
        layer(x, ei.tolist())
    with pytest.raises(ValueError, match=f"{name}: the graph has 9 x 9 nodes but x has {N} rows"):
        layer(x, Graph(ei, N + 1))
    assert ei.min() >= 0 and ei.max() < N  # the fixture itself was not modified


@pytest.mark.parametrize("make", LAYERS)
def test_layer_devices_meta(make, ei, graph):
    layer = make()
    name = type(layer).__name__
    with pytest.raises(ValueError, match=f"{name}: x is on meta but the graph is on cpu"):
        layer(torch.randn(N, 4, device="meta"), ei)
    with pytest.raises(ValueError, match=f"{name}: x is on meta but the graph is on cpu"):
        layer(torch.randn(N, 4, device="meta"), graph)
    with pytest.raises(ValueError, match=f"{name}: x is on cpu but the graph is on meta"):
        layer(torch.randn(N, 4), Graph(ei.to("meta"), N))


def test_gcn_bad_edge_weight(ei):
    layer = GCNConv(4, 3)
    x = torch.randn(N, 4)
    with pytest.raises(ValueError, match=rf"edge_weight must have shape \[E\] or \[E, H\] with E = {E}"):
        layer(x, ei, torch.ones(E + 2))
    with pytest.raises(ValueError, match=r"edge_weight must have one weight per edge \(\[E\]\)"):
        layer(x, ei, torch.ones(E, 2))
    with pytest.raises(ValueError, match="edge_weight of shape"):
        GCNConv(4, 3, normalize=False)(x, ei, torch.ones(E, 2))
    with pytest.raises(TypeError, match="edge_weight must be a floating tensor"):
        layer(x, ei, torch.ones(E, dtype=torch.int64))
    with pytest.raises(ValueError, match="edge_weight is on meta"):
        layer(x, ei, torch.ones(E, device="meta"))


def test_layer_constructor_arguments():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        GCNConv(4, 3, aggregation="fused")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        GATConv(4, 3, aggregation="GAR")
    with pytest.raises(ValueError, match="heads must be >= 1"):
        GATConv(4, 3, heads=0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        GATConv(4, 3, dropout=1.0)


# ---------------------------------------------------------------------------- real CUDA
@requires_cuda
def test_cuda_device_mismatch(ei, graph):
    cuda_x = torch.randn(N, 3, device="cuda")
    with pytest.raises(ValueError, match="x is on cuda:0 but the graph is on cpu"):
        spmm(graph, cuda_x)
    with pytest.raises(ValueError, match="x is on cpu but the graph is on cuda"):
        spmm(graph.to("cuda"), torch.randn(N, 3))
    with pytest.raises(ValueError, match="edge_weight is on cuda:0 but the graph is on cpu"):
        spmm(graph, torch.randn(N, 3), torch.ones(E, device="cuda"))
    with pytest.raises(ValueError, match="scores is on cuda:0"):
        edge_softmax(graph, torch.randn(E, device="cuda"))
    with pytest.raises(ValueError, match="GCNConv: x is on cpu but the graph is on cuda"):
        GCNConv(3, 2)(torch.randn(N, 3), ei.cuda())
    with pytest.raises(ValueError, match="GATConv: x is on cuda:0 but the graph is on cpu"):
        GATConv(3, 2).cuda()(cuda_x, graph)
