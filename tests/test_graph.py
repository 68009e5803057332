"""The Graph container: construction paths, derived formats, caching, conversions."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from fusegnn.sparse import CompressedEdges, Graph, spmm
from tests.graphs import dense_matrix, nasty_specs, random_graph, random_weights

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none here)")

SPECS = nasty_specs()


def _loop_degrees(edge_index: torch.Tensor, n_src: int, n_dst: int):
    indeg, outdeg = [0] * n_dst, [0] * n_src
    for s, d in edge_index.t().tolist():
        outdeg[s] += 1
        indeg[d] += 1
    return torch.tensor(indeg), torch.tensor(outdeg)


# ---------------------------------------------------------------------------- construction
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_edge_index_dtypes_are_kept(dtype):
    ei = random_graph(9, 30, seed=1, dtype=dtype)
    g = Graph(ei, 9)
    assert g.index_dtype == dtype
    assert g.edge_index is ei  # no copy
    assert torch.equal(g.src, ei[0]) and torch.equal(g.dst, ei[1])
    assert g.num_edges == 30 and g.num_nodes == 9
    assert not g.is_bipartite
    assert g.edge_weight is None
    # derived formats work for int32 ids too
    assert g.in_degree.dtype == torch.int64
    assert torch.equal(g.src[g.csr.perm], g.csr.index)


def test_num_nodes_inferred_given_and_bipartite():
    ei = torch.tensor([[0, 3, 1], [2, 0, 3]])
    assert Graph(ei).num_nodes == 4  # max id + 1
    g = Graph(ei, 10)  # trailing isolated nodes only exist if given
    assert g.num_nodes == 10 and g.num_src_nodes == 10 and g.num_dst_nodes == 10
    assert Graph(ei, torch.tensor(6)).num_nodes == 6
    import numpy as np

    assert Graph(ei, np.int64(5)).num_nodes == 5

    bi = Graph(torch.tensor([[0, 4, 2], [1, 0, 1]]), (5, 2))
    assert bi.is_bipartite and bi.num_src_nodes == 5 and bi.num_dst_nodes == 2
    assert bi.in_degree.tolist() == [1, 2]
    assert bi.out_degree.tolist() == [1, 0, 1, 0, 1]
    assert bi.csr.ptr.numel() == 3 and bi.csc.ptr.numel() == 6
    assert bi.to_dense().shape == (2, 5)
    with pytest.raises(ValueError, match="bipartite"):
        bi.num_nodes
    assert Graph(ei, [4, 4]).num_nodes == 4  # a square pair is not bipartite
    assert "num_nodes=(5, 2)" in repr(bi) and "num_edges=3" in repr(bi)


def test_edge_weight_is_stored():
    ei = random_graph(9, 30, seed=1)
    w = random_weights(30, seed=0)
    g = Graph(ei, 9, w)
    assert g.edge_weight is w
    assert "weighted" in repr(g)
    wh = random_weights(30, seed=0, heads=3)
    assert Graph(ei, 9, wh).edge_weight.shape == (30, 3)


# ---------------------------------------------------------------------------- torch.sparse
def _random_sparse_matrix(n_rows: int, n_cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    dense = torch.randn(n_rows, n_cols, generator=gen, dtype=torch.float64)
    dense[torch.rand(n_rows, n_cols, generator=gen) < 0.6] = 0.0
    dense[1] = 0.0  # an empty row: a target with no edge
    return dense


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("shape", [(7, 7), (5, 8), (8, 5)])
def test_from_sparse_reads_an_aggregation_matrix(layout, shape):
    dense = _random_sparse_matrix(*shape, seed=sum(shape))
    adj = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    g = Graph.from_sparse(adj)
    assert g.num_dst_nodes == shape[0] and g.num_src_nodes == shape[1]
    assert g.is_bipartite == (shape[0] != shape[1])
    assert g.num_edges == int((dense != 0).sum())
    # A[i, j] is the edge j -> i with weight A[i, j]
    for e, (s, d) in enumerate(g.edge_index.t().tolist()):
        assert g.edge_weight[e] == dense[d, s]
    x = torch.randn(shape[1], 3, dtype=torch.float64)
    torch.testing.assert_close(spmm(g, x), dense @ x)
    torch.testing.assert_close(g.to_dense(torch.float64), dense)


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_from_sparse_transpose_reads_rows_as_sources(layout):
    dense = _random_sparse_matrix(6, 4, seed=3)
    adj = dense.to_sparse() if layout == "coo" else dense.to_sparse_csr()
    g = Graph.from_sparse(adj, transpose=True)
    assert g.num_src_nodes == 6 and g.num_dst_nodes == 4
    x = torch.randn(6, 2, dtype=torch.float64)
    torch.testing.assert_close(spmm(g, x), dense.t() @ x)


def test_from_sparse_uncoalesced_coo_sums_repeats_and_int_values_give_no_weight():
    idx = torch.tensor([[0, 2, 0, 1], [1, 0, 1, 1]])
    adj = torch.sparse_coo_tensor(idx, torch.tensor([1.0, 2.0, 3.0, 4.0]), (3, 3), check_invariants=True)
    g = Graph.from_sparse(adj)
    torch.testing.assert_close(g.to_dense(), adj.to_dense())
    assert g.num_edges == 3  # coalesced: the two (0, 1) entries are one edge of weight 4
    pattern = torch.sparse_coo_tensor(idx, torch.ones(4, dtype=torch.int64), (3, 3), check_invariants=True)
    assert Graph.from_sparse(pattern).edge_weight is None


# ---------------------------------------------------------------------------- networkx
def test_from_networkx_directed():
    nxg = nx.DiGraph()
    nxg.add_nodes_from(["a", "b", "c", "d"])  # "d" isolated
    nxg.add_edges_from([("a", "b"), ("b", "c"), ("c", "c"), ("c", "a")])
    g = Graph.from_networkx(nxg)
    assert g.num_nodes == 4 and g.edge_weight is None
    assert sorted(map(tuple, g.edge_index.t().tolist())) == [(0, 1), (1, 2), (2, 0), (2, 2)]
    assert g.in_degree.tolist() == [1, 1, 2, 0]


def test_from_networkx_undirected_gives_both_directions_and_one_self_loop():
    nxg = nx.Graph()
    nxg.add_nodes_from(range(4))
    nxg.add_edges_from([(0, 1), (1, 2), (2, 2)])
    g = Graph.from_networkx(nxg)
    assert sorted(map(tuple, g.edge_index.t().tolist())) == [(0, 1), (1, 0), (1, 2), (2, 1), (2, 2)]
    torch.testing.assert_close(g.to_dense(), g.to_dense().t())


def test_from_networkx_weighted():
    nxg = nx.DiGraph()
    nxg.add_edge(0, 1, w=2.5)
    nxg.add_edge(1, 2)  # no weight attribute: counts as 1.0
    nxg.add_edge(2, 0, w=-1.0)
    g = Graph.from_networkx(nxg, weight="w", device="cpu")
    assert g.edge_weight.dtype == torch.float32
    expected = torch.zeros(3, 3)
    expected[1, 0], expected[2, 1], expected[0, 2] = 2.5, 1.0, -1.0
    torch.testing.assert_close(g.to_dense(), expected)
    und = Graph.from_networkx(nxg.to_undirected(), weight="w")
    torch.testing.assert_close(und.to_dense(), und.to_dense().t())


def test_from_networkx_multigraph_keeps_parallel_edges():
    nxg = nx.MultiDiGraph()
    nxg.add_edge(0, 1, w=1.0)
    nxg.add_edge(0, 1, w=2.0)
    nxg.add_edge(1, 1, w=0.5)
    g = Graph.from_networkx(nxg, weight="w")
    assert g.num_edges == 3 and g.in_degree.tolist() == [0, 3]
    assert g.to_dense()[1].tolist() == [3.0, 0.5]


def test_from_networkx_empty_graph():
    nxg = nx.empty_graph(3)
    g = Graph.from_networkx(nxg)
    assert g.num_nodes == 3 and g.num_edges == 0
    assert g.in_degree.tolist() == [0, 0, 0]


# ---------------------------------------------------------------------------- degrees, csr, csc
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_degrees(spec):
    ei = spec.build()
    g = Graph(ei, spec.num_nodes)
    indeg, outdeg = _loop_degrees(ei, spec.num_nodes, spec.num_nodes)
    assert torch.equal(g.in_degree, indeg) and torch.equal(g.out_degree, outdeg)
    assert g.in_degree.dtype == torch.int64 and g.out_degree.dtype == torch.int64
    assert g.avg_degree == pytest.approx(spec.num_edges / spec.num_nodes)


def _check_compressed(comp: CompressedEdges, group: torch.Tensor, other: torch.Tensor, n_groups: int):
    E = group.numel()
    assert comp.ptr.dtype == torch.int64 and comp.perm.dtype == torch.int64
    assert comp.ptr.shape == (n_groups + 1,) and comp.index.shape == (E,) and comp.perm.shape == (E,)
    assert comp.ptr[0] == 0 and comp.ptr[-1] == E
    assert sorted(comp.perm.tolist()) == list(range(E))  # a permutation
    assert torch.equal(other[comp.perm], comp.index)
    ptr = comp.ptr.tolist()
    for g_id in range(n_groups):
        lo, hi = ptr[g_id], ptr[g_id + 1]
        members = comp.perm[lo:hi].tolist()
        # exactly the edges of this group, in their COO order (stable)
        assert members == [e for e in range(E) if int(group[e]) == g_id]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_csr_and_csc(spec, dtype):
    ei = spec.build(dtype)
    g = Graph(ei, spec.num_nodes)
    _check_compressed(g.csr, g.dst, g.src, spec.num_nodes)
    _check_compressed(g.csc, g.src, g.dst, spec.num_nodes)
    assert g.csr.index.dtype == dtype
    assert torch.equal(g.csr.ptr[1:] - g.csr.ptr[:-1], g.in_degree)
    assert torch.equal(g.csc.ptr[1:] - g.csc.ptr[:-1], g.out_degree)


def test_csr_bipartite():
    ei = random_graph(7, 25, seed=5, num_dst_nodes=4)
    g = Graph(ei, (7, 4))
    _check_compressed(g.csr, g.dst, g.src, 4)
    _check_compressed(g.csc, g.src, g.dst, 7)


# ---------------------------------------------------------------------------- caching
def test_derived_formats_are_cached(nasty_graph):
    g = nasty_graph
    for name in ("in_degree", "out_degree", "csr", "csc"):
        assert getattr(g, name) is getattr(g, name), name
    calls = []

    def compute():
        calls.append(1)
        return torch.ones(3)

    first = g.cached("thing", compute)
    assert g.cached("thing", compute) is first and len(calls) == 1


def test_with_edge_weight_shares_the_structural_cache(nasty_graph):
    g = nasty_graph
    csr, csc, indeg = g.csr, g.csc, g.in_degree
    g.cached("user_thing", lambda: torch.zeros(1))
    w = random_weights(g.num_edges, seed=1)
    g2 = g.with_edge_weight(w)
    assert g2 is not g and g2.edge_weight is w and g.edge_weight is None
    assert g2.edge_index is g.edge_index
    assert g2.csr is csr and g2.csc is csc and g2.in_degree is indeg
    # user entries (e.g. a normalised copy) depend on the weights: not shared
    sentinel = torch.ones(1)
    assert g2.cached("user_thing", lambda: sentinel) is sentinel
    assert g2.with_edge_weight(None).edge_weight is None
    # formats computed on the copy later do not leak back into an unrelated graph
    g3 = Graph(g.edge_index, g.num_nodes).with_edge_weight(w)
    assert g3.out_degree is g3.out_degree


# ---------------------------------------------------------------------------- to / to_dense
def test_to_same_device_is_identity_and_meta_moves_everything(nasty_graph):
    g = nasty_graph.with_edge_weight(random_weights(nasty_graph.num_edges, seed=2))
    assert g.to("cpu") is g and g.to(torch.device("cpu")) is g
    m = g.to("meta")
    assert m.device.type == "meta" and m.edge_weight.device.type == "meta"
    assert m.num_nodes == g.num_nodes and m.num_edges == g.num_edges
    assert m.index_dtype == g.index_dtype


@requires_cuda
def test_to_cuda_and_formats_stay_on_device(nasty_graph):
    g = nasty_graph.with_edge_weight(random_weights(nasty_graph.num_edges, seed=2))
    gc = g.to("cuda")
    assert gc.device.type == "cuda" and gc.edge_weight.device.type == "cuda"
    for t in (gc.in_degree, gc.out_degree, *gc.csr, *gc.csc):
        assert t.device.type == "cuda"
    assert torch.equal(gc.csr.perm.cpu(), g.csr.perm)
    assert torch.equal(gc.csc.ptr.cpu(), g.csc.ptr)
    assert gc.to("cpu").device.type == "cpu"


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("weighted", [False, True])
def test_to_dense_sums_duplicates(spec, weighted):
    ei = spec.build()
    w = random_weights(spec.num_edges, seed=spec.seed, positive=False) if weighted else None
    g = Graph(ei, spec.num_nodes, w)
    expected = dense_matrix(ei, spec.num_nodes, edge_weight=w)
    torch.testing.assert_close(g.to_dense(torch.float64), expected)
    assert g.to_dense().dtype == torch.float32


def test_formats_are_computed_on_the_graph_device(nasty_graph):
    g = nasty_graph
    for t in (g.in_degree, g.out_degree, *g.csr, *g.csc, g.to_dense()):
        assert t.device == g.device


# ---------------------------------------------------------------------------- empty graph
def test_empty_graph():
    e = Graph(torch.empty(2, 0, dtype=torch.int64))
    assert e.num_nodes == 0 and e.num_edges == 0 and e.avg_degree == 0.0
    assert e.csr.ptr.tolist() == [0]
    g = Graph(torch.empty(2, 0, dtype=torch.int32), 5)
    assert g.num_nodes == 5 and g.avg_degree == 0.0
    assert g.in_degree.tolist() == [0] * 5 and g.out_degree.tolist() == [0] * 5
    assert g.csr.ptr.tolist() == [0] * 6 and g.csc.ptr.tolist() == [0] * 6
    assert g.csr.index.numel() == 0 and g.csr.perm.numel() == 0
    assert torch.equal(g.to_dense(), torch.zeros(5, 5))
    x = torch.randn(5, 3)
    assert torch.equal(spmm(g, x), torch.zeros(5, 3))


def test_avg_degree():
    g = Graph(random_graph(10, 37, seed=0), 10)
    assert g.avg_degree == pytest.approx(3.7)
    assert Graph(random_graph(6, 12, seed=0, num_dst_nodes=3), (6, 3)).avg_degree == pytest.approx(4.0)


def test_with_edge_weight_shares_structural_caches_only():
    """Structure-only caches (work lists, self-loop graphs) survive re-weighting; caches
    that may depend on the weights do not."""
    graph = Graph(torch.tensor([[0, 1, 2, 2], [1, 2, 0, 1]]), 3)
    plan = graph.cached("plan", lambda: object(), structural=True)
    weighted = graph.cached("weighted", lambda: object())
    reweighted = graph.with_edge_weight(torch.rand(4))
    assert reweighted.cached("plan", lambda: object(), structural=True) is plan
    assert reweighted.cached("weighted", lambda: object()) is not weighted


def test_reversed_transposes_keeps_weights_and_is_cached():
    edge_index = torch.tensor([[0, 0, 2, 1], [1, 0, 1, 1]])
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0])
    graph = Graph(edge_index, (3, 2), weight)
    rev = graph.reversed()
    assert torch.equal(rev.edge_index, edge_index.flip(0))
    assert (rev.num_src_nodes, rev.num_dst_nodes) == (2, 3)
    assert torch.equal(rev.edge_weight, weight)
    assert torch.equal(rev.to_dense(), graph.to_dense().t())
    assert graph.reversed() is rev
    # the structure is shared with re-weighted copies, the weights are each graph's own
    other = graph.with_edge_weight(weight * 2)
    assert torch.equal(other.reversed().edge_weight, weight * 2)
    assert other.reversed().edge_index is graph.with_edge_weight(None).reversed().edge_index
    assert Graph(edge_index, (3, 2)).reversed().edge_weight is None
