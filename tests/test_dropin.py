"""Drop-in inputs of the layers (``GCNConv``, ``GATConv``): every graph form PyG users
pass, lazy ``in_channels=-1``, and clear errors for the rest.

* An ``edge_index``, a :class:`fusegnn.Graph`, a ``torch.sparse`` COO / CSR adjacency in
  PyG's ``adj_t`` orientation (rows are targets) and a networkx graph give the same output
  (fp64 on the CPU, reference aggregation, a random graph with isolated nodes,
  self-loops and duplicates). A sparse matrix holds each entry once, so it is compared
  with the edge list it stores (duplicates summed); a networkx multigraph keeps them.
* GCNConv takes a weighted adjacency's values (a networkx graph's ``"weight"``) as edge
  weights, as PyG's ``GCNConv(x, adj_t)`` does; GATConv ignores them.
* A sparse adjacency is converted once per tensor (and again after an in-place change);
  the cache lets go of it with the tensor.
* Under ``torch.compile`` (``aot_eager``, ``fullgraph``): a :class:`Graph` built from the
  adjacency gives the eager output; a networkx graph is a clear ``TypeError`` (Dynamo
  itself refuses sparse tensors as inputs).
* ``in_channels=-1`` initialises at the first forward (Glorot), like PyG's lazy layers;
  ``in_channels <= 0`` otherwise is a ``ValueError``; ``x`` of another dtype than the
  layer is a ``TypeError`` naming both.
"""

from __future__ import annotations

import gc
import math
import weakref

import networkx as nx
import pytest
import torch
import torch._dynamo

import fusegnn.sparse.graph as graph_module
from fusegnn import Graph
from fusegnn.layers import GATConv, GCNConv
from fusegnn.sparse import library, spmm
from tests.graphs import random_graph

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
N, E = 12, 40


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _edges():
    """A random directed graph (isolated nodes, self-loops, duplicates) and weights that
    float32 holds exactly (networkx weights are read as float32)."""
    ei = random_graph(N, E, seed=3, hub_degree=5)
    gen = torch.Generator().manual_seed(4)
    w = torch.randint(1, 9, (E,), generator=gen).to(F64) / 4
    return ei, w


def _x(width: int = 5, seed: int = 5) -> torch.Tensor:
    return torch.randn(N, width, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _adj_t(ei, w, layout=torch.sparse_coo):
    """PyG's ``adj_t``: ``adj_t[i, j]`` is the edge ``j -> i`` (rows are targets)."""
    values = w if w is not None else torch.ones(ei.size(1), dtype=F64)
    adj = torch.sparse_coo_tensor(ei.flip(0), values, (N, N), check_invariants=True)
    return adj if layout == torch.sparse_coo else adj.coalesce().to_sparse_csr()


def _stored_edges(ei, w):
    """The edge list a sparse matrix of these edges stores: duplicates summed, row-major."""
    adj = torch.sparse_coo_tensor(ei.flip(0), w, (N, N), check_invariants=True).coalesce()
    dst, src = adj.indices()
    return torch.stack([src, dst]), adj.values()


def _nx_graph(ei, w=None) -> nx.MultiDiGraph:
    """The same directed multigraph in networkx, nodes 0..N-1 (isolated ones included)."""
    g = nx.MultiDiGraph()
    g.add_nodes_from(range(N))
    for k, (s, d) in enumerate(ei.t().tolist()):
        if w is None:
            g.add_edge(s, d)
        else:
            g.add_edge(s, d, weight=float(w[k]))
    return g


def _gcn(**kw) -> GCNConv:
    torch.manual_seed(0)
    layer = GCNConv(5, 3, aggregation="reference", **kw).double()
    torch.nn.init.normal_(layer.bias)
    return layer


def _gat(**kw) -> GATConv:
    torch.manual_seed(0)
    return GATConv(5, 3, heads=2, aggregation="reference", **kw).double()


# ------------------------------------------------------------------------ input forms
@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("opts", [{}, {"normalize": False}, {"cached": True}], ids=["norm", "no_norm", "cached"])
def test_gcn_sparse_adjacency_equals_edge_index(layout, weighted, opts):
    ei, w = _edges()
    w = w if weighted else torch.ones(E, dtype=F64)
    stored_ei, stored_w = _stored_edges(ei, w)
    x = _x()
    expected = _gcn(**opts)(x, stored_ei, stored_w)
    torch.testing.assert_close(_gcn(**opts)(x, _adj_t(ei, w, layout)), expected)
    if weighted:  # the weights matter: dropping them would give another result
        assert not torch.allclose(_gcn(**opts)(x, stored_ei), expected)


def test_gcn_bool_adjacency_is_unweighted_and_edge_weight_overrides():
    ei, w = _edges()
    stored_ei, stored_w = _stored_edges(ei, w)
    x = _x()
    ones = torch.ones(stored_ei.size(1), dtype=torch.bool)
    adj_bool = torch.sparse_coo_tensor(stored_ei.flip(0), ones, (N, N), check_invariants=True)
    torch.testing.assert_close(_gcn()(x, adj_bool), _gcn()(x, stored_ei))
    # an explicit edge_weight follows the matrix's stored entries (row-major) and wins
    other = stored_w.flip(0).contiguous()
    torch.testing.assert_close(_gcn()(x, _adj_t(ei, w, torch.sparse_csr), other), _gcn()(x, stored_ei, other))


def test_gcn_networkx_equals_edge_index():
    ei, w = _edges()
    x = _x()
    torch.testing.assert_close(_gcn()(x, _nx_graph(ei, w)), _gcn()(x, ei, w))  # "weight" is used
    torch.testing.assert_close(_gcn()(x, _nx_graph(ei)), _gcn()(x, ei))
    # an undirected graph gives both directions of each edge
    und = nx.Graph()
    und.add_nodes_from(range(N))
    und.add_edges_from([(0, 1), (1, 2), (4, 4), (2, 5)])
    both = torch.tensor([[0, 1, 1, 2, 4, 2, 5], [1, 0, 2, 1, 4, 5, 2]])
    torch.testing.assert_close(_gcn()(x, und), _gcn()(x, both))


@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
def test_gat_sparse_and_networkx_equal_edge_index_and_ignore_weights(layout):
    ei, w = _edges()
    stored_ei, _ = _stored_edges(ei, w)
    x = _x()
    torch.testing.assert_close(_gat()(x, _adj_t(ei, w, layout)), _gat()(x, stored_ei))
    torch.testing.assert_close(_gat()(x, _nx_graph(ei, w)), _gat()(x, ei))  # parallel edges kept
    torch.testing.assert_close(_gat()(x, Graph(ei, N)), _gat()(x, ei))
    # return_attention_weights hands back the processed edges of the converted graph, as
    # PyG does for a sparse input: that graph as a sparse [N, N, H] adj_t of the input's
    # layout holding alpha, and alpha in its (row-major) order
    out, (adj_alpha, alpha) = _gat()(x, _adj_t(ei, w, layout), return_attention_weights=True)
    out_ei, (edges_ei, alpha_ei) = _gat()(x, stored_ei, return_attention_weights=True)
    torch.testing.assert_close(out, out_ei)
    assert adj_alpha.layout == layout
    torch.testing.assert_close(adj_alpha.values(), alpha, rtol=0, atol=0)
    dense = torch.zeros(N, N, alpha_ei.size(1), dtype=F64)
    dense[edges_ei[1], edges_ei[0]] = alpha_ei  # the processed edges are unique
    torch.testing.assert_close(adj_alpha.to_dense(), dense)
    assert sorted(alpha.flatten().tolist()) == sorted(alpha_ei.flatten().tolist())


def test_gcn_sparse_adjacency_matches_pyg():
    """What a PyG user passes (``adj_t``, rows are targets, values as weights) gives PyG's
    output; the transposed matrix (rows as sources) would not, on a directed graph.

    Without self-loops: PyG's ``gcn_norm`` adds a self-loop to *every* node of a
    torch.sparse input (``add_self_loops``, summed with an existing diagonal entry) but
    only the missing ones to an ``edge_index`` (``add_remaining_self_loops``); fusegnn
    normalises every input form as it does an ``edge_index``."""
    pyg_nn = pytest.importorskip("torch_geometric.nn")
    ei = random_graph(N, E, seed=3, hub_degree=5, self_loops=False)
    w = torch.randint(1, 9, (E,), generator=torch.Generator().manual_seed(4)).to(F64) / 4
    x = _x()
    ours = _gcn()
    theirs = pyg_nn.GCNConv(5, 3).double()
    with torch.no_grad():
        theirs.lin.weight.copy_(ours.lin.weight)
        theirs.bias.copy_(ours.bias)
    stored_ei, stored_w = _stored_edges(ei, w)
    adj_t = torch.sparse_coo_tensor(stored_ei.flip(0), stored_w, (N, N), check_invariants=True).to_sparse_csr()
    torch.testing.assert_close(ours(x, adj_t), theirs(x, adj_t))
    assert not torch.allclose(ours(x, adj_t.t().to_sparse_csr()), theirs(x, adj_t))


# ------------------------------------------------------------------------ conversion cache
def test_sparse_adjacency_is_converted_once_per_tensor(monkeypatch):
    calls = []
    original = Graph.from_sparse.__func__

    def counting(cls, adj, **kw):
        calls.append(adj)
        return original(cls, adj, **kw)

    monkeypatch.setattr(Graph, "from_sparse", classmethod(counting))
    ei, w = _edges()
    adj = _adj_t(ei, w, torch.sparse_csr)
    x = _x()
    layer = _gcn()
    first = layer(x, adj)
    torch.testing.assert_close(layer(x, adj), first)
    assert len(calls) == 1
    assert graph_module.as_graph(adj) is graph_module.as_graph(adj)
    # an in-place change of the values moves the version counter: converted again
    with torch.no_grad():
        adj.values().mul_(2.0)
    doubled = layer(x, adj)
    assert len(calls) == 2
    stored_ei, stored_w = _stored_edges(ei, w)
    torch.testing.assert_close(doubled, _gcn()(x, stored_ei, 2 * stored_w))
    # the cache holds no reference to the adjacency: it goes, and its entry with it
    key, alive = id(adj), weakref.ref(adj)
    del adj, calls[:]
    gc.collect()
    assert alive() is None
    assert key not in graph_module._SPARSE_GRAPHS


def test_from_sparse_copies_the_values():
    ei, w = _edges()
    adj = _adj_t(ei, w, torch.sparse_csr)
    graph = Graph.from_sparse(adj)
    weights = graph.edge_weight.clone()
    with torch.no_grad():
        adj.values().zero_()
    assert torch.equal(graph.edge_weight, weights)
    alive = weakref.ref(adj)
    del adj
    gc.collect()
    assert alive() is None  # the graph keeps no view of it


def test_sparse_ops_accept_the_new_inputs():
    """The conversion is the op layer's (as_graph), so the ops take the same inputs."""
    ei, w = _edges()
    stored_ei, stored_w = _stored_edges(ei, w)
    x = _x()
    expected = spmm(stored_ei, x, stored_w, aggregation="reference")
    torch.testing.assert_close(spmm(_adj_t(ei, w), x, aggregation="reference"), expected)
    torch.testing.assert_close(
        spmm(_nx_graph(ei, w), x, aggregation="reference"), spmm(ei, x, w, aggregation="reference")
    )
    with pytest.raises(TypeError, match=r"graph must be a fusegnn\.sparse\.Graph .* networkx\.Graph, got tuple"):
        spmm((1, 2), x)


def test_graph_ref_accepts_the_new_inputs_eagerly():
    ei, w = _edges()
    adj = _adj_t(ei, w, torch.sparse_csr)
    ref = library.graph_ref(adj)
    assert ref.uid == graph_module.as_graph(adj).uid and ref.num_src_nodes == N
    ref = library.graph_ref(_nx_graph(ei))
    assert ref.num_edges == E and ref.num_dst_nodes == N


# ------------------------------------------------------------------------ torch.compile
def _compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def test_compiled_gcn_with_a_graph_from_the_adjacency_equals_eager():
    ei, w = _edges()
    adj = _adj_t(ei, w, torch.sparse_csr)
    x = _x()
    layer = _gcn()
    expected = layer(x, adj)
    graph = Graph.from_sparse(adj)  # what the compile error tells the user to do
    torch.testing.assert_close(_compiled(layer)(x, graph), expected)


def test_compile_refuses_sparse_and_networkx_inputs_clearly():
    ei, w = _edges()
    x = _x()
    layer = _gcn()
    with pytest.raises(Exception, match="sparse"):  # Dynamo's own refusal of sparse inputs
        _compiled(layer)(x, _adj_t(ei, w, torch.sparse_csr))
    with pytest.raises(Exception, match=r"Graph\.from_networkx\(G\)"):
        _compiled(layer)(x, _nx_graph(ei, w))
    # without fullgraph the call falls back to eager, which converts the graph
    fallback = torch.compile(layer, backend="aot_eager")(x, _nx_graph(ei, w))
    torch.testing.assert_close(fallback, layer(x, ei, w))


# ------------------------------------------------------------------------ errors
@pytest.mark.parametrize("make", [_gcn, _gat], ids=["GCNConv", "GATConv"])
def test_bad_graph_inputs_name_the_argument_and_the_accepted_types(make):
    layer = make()
    name = type(layer).__name__
    x = _x()
    accepted = r"fusegnn\.sparse\.Graph or an edge_index tensor .* torch\.sparse adjacency .* networkx\.Graph"
    with pytest.raises(TypeError, match=rf"{name}: edge_index must be .*{accepted}, got list"):
        layer(x, [[0, 1], [1, 0]])
    with pytest.raises(TypeError, match=rf"{name}: edge_index must be .*got dict"):
        layer(x, {0: [1]})
    with pytest.raises(TypeError, match=rf"{name}: edge_index: a torch\.sparse adjacency must be COO or CSR"):
        layer(x, torch.eye(N, dtype=F64).to_sparse_csc())
    with pytest.raises(ValueError, match=rf"{name}: the graph has 7 x 7 nodes but x has {N} rows"):
        layer(x, nx.path_graph(7))
    with pytest.raises(ValueError, match=rf"{name}: the graph has 12 x 7 nodes"):
        layer(x, torch.zeros(7, N, dtype=F64).to_sparse())


def test_graph_constructor_names_networkx_unambiguously():
    with pytest.raises(TypeError, match=r"edge_index must be a torch\.Tensor .* got networkx\.classes\.graph\.Graph"):
        Graph(nx.path_graph(3))
    with pytest.raises(TypeError, match="nx_graph must be a networkx graph .* got fusegnn.sparse.graph.Graph"):
        Graph.from_networkx(Graph(torch.tensor([[0], [1]])))


@pytest.mark.parametrize("cls", [GCNConv, GATConv])
def test_in_channels_must_be_positive_or_minus_one(cls):
    for bad in (0, -2):
        with pytest.raises(ValueError, match=rf"{cls.__name__}: in_channels must be positive, or -1 .* got {bad}"):
            cls(bad, 3)
    if cls is GATConv:  # a pair (in_src, in_dst) is PyG's bipartite form: lin_src / lin_dst
        layer = cls((4, 5), 3)
        assert layer.lin is None and layer.lin_src.in_features == 4 and layer.lin_dst.in_features == 5
        with pytest.raises(ValueError, match=rf"{cls.__name__}: in_channels must be positive, or -1 .* got 0"):
            cls((4, 0), 3)
        with pytest.raises(ValueError, match=rf"{cls.__name__}: in_channels must be an int or a pair"):
            cls((4, 5, 6), 3)
        return
    with pytest.raises(TypeError, match=rf"{cls.__name__}: in_channels must be an int .* got tuple"):
        cls((4, 5), 3)


@pytest.mark.parametrize("make", [_gcn, _gat], ids=["GCNConv", "GATConv"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.float16])
def test_x_of_another_dtype_is_a_type_error(make, x_dtype):
    layer = make()
    name = type(layer).__name__
    ei, _ = _edges()
    x = _x().to(x_dtype)
    message = rf"{name}: x has dtype {x_dtype} but the layer's parameters are torch\.float64"
    with pytest.raises(TypeError, match=message):
        layer(x, ei)
    with pytest.raises(Exception, match=rf"x has dtype {x_dtype} but the layer's parameters"):
        _compiled(layer)(x, Graph(ei, N))


def test_dtype_check_leaves_autocast_alone():
    """Under autocast the ops cast: an x of the autocast dtype is no error."""
    ei, _ = _edges()
    layer = GCNConv(5, 3, aggregation="reference")
    x = _x().float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x.bfloat16(), ei)
    assert out.shape == (N, 3)


# ------------------------------------------------------------------------ lazy in_channels
def _lazy_and_plain(cls, in_channels: int, **kw):
    torch.manual_seed(0)
    lazy = cls(-1, 4, aggregation="reference", **kw).double()
    assert torch.nn.parameter.is_lazy(lazy.lin.weight) and lazy.in_channels == -1
    lazy.reset_parameters()  # before the first forward: leaves the lazy weight alone
    plain = cls(in_channels, 4, aggregation="reference", **kw).double()
    return lazy, plain


@pytest.mark.parametrize("cls,kw", [(GCNConv, {}), (GATConv, {"heads": 2})], ids=["GCNConv", "GATConv"])
@pytest.mark.parametrize("in_channels", [3, 7], ids=["aggregate_first", "transform_first"])
def test_lazy_in_channels(cls, kw, in_channels):
    ei, _ = _edges()
    x = _x(in_channels)
    lazy, plain = _lazy_and_plain(cls, in_channels, **kw)
    out = lazy(x, ei)
    assert lazy.in_channels == in_channels and lazy.lin.weight.shape == plain.lin.weight.shape
    assert lazy.lin.weight.dtype == F64  # the dtype the layer was given before
    bound = math.sqrt(6.0 / sum(lazy.lin.weight.shape))  # Glorot, as the eager layers
    assert lazy.lin.weight.abs().max() <= bound and lazy.lin.weight.std() > bound / 4
    plain.load_state_dict(lazy.state_dict())
    torch.testing.assert_close(plain(x, ei), out)
    # a fresh lazy layer takes the state dict before any forward
    fresh = cls(-1, 4, aggregation="reference", **kw).double()
    fresh.load_state_dict(lazy.state_dict())
    torch.testing.assert_close(fresh(x, ei), out)
    assert fresh.in_channels == in_channels
    # the width is fixed now
    with pytest.raises(ValueError, match=f"x has {in_channels + 1} features .* in_channels={in_channels}"):
        lazy(_x(in_channels + 1), ei)
    # an optimizer created after the first forward trains the materialised weight
    before = lazy.lin.weight.detach().clone()
    opt = torch.optim.SGD(lazy.parameters(), lr=0.1)
    lazy(x, ei).square().sum().backward()
    opt.step()
    assert not torch.equal(lazy.lin.weight, before)
    lazy.reset_parameters()
    assert lazy.lin.weight.abs().max() <= bound


def test_lazy_layer_under_compile():
    ei, _ = _edges()
    x = _x(3)
    layer = GCNConv(-1, 4, aggregation="reference").double()
    with pytest.raises(Exception, match=r"in_channels=-1\) is initialised at its first forward"):
        _compiled(layer)(x, Graph(ei, N))
    torch._dynamo.reset()
    expected = layer(x, ei)  # one eager forward initialises it
    torch.testing.assert_close(_compiled(layer)(x, Graph(ei, N)), expected)
