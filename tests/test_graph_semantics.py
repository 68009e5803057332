"""Semantics of :class:`fusegnn.sparse.Graph` and of the graph processing of
:mod:`fusegnn.sparse.processing`, checked as a demanding user would: hypothesis over small
random graphs (isolated nodes, duplicates, self-loops, a hub, bipartite, int32 ids, empty
graphs, weighted or not, weights requiring grad), PyG's utilities as the float64 CPU
oracle where fuseGNN mirrors them, and bad input that must name the argument.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fusegnn.kernels.partition import build_plan, plan_for
from fusegnn.sparse import Graph
from fusegnn.sparse import processing as P
from fusegnn.sparse.graph import as_graph

pyg_utils = pytest.importorskip("torch_geometric.utils")
from torch_geometric.nn.conv.gcn_conv import gcn_norm as pyg_gcn_norm  # noqa: E402

F64 = torch.float64


# ----------------------------------------------------------------------------- strategies
@st.composite
def graphs(draw, *, square: bool = True, weighted: bool | None = None, allow_empty: bool = True):
    """``(edge_index, num_nodes, weight)`` of a small random graph with the nasty cases."""
    n_src = draw(st.integers(0 if allow_empty else 1, 7))
    n_dst = n_src if square else draw(st.integers(0 if allow_empty else 1, 7))
    pairs = []
    if n_src and n_dst:
        pairs = draw(st.lists(st.tuples(st.integers(0, n_src - 1), st.integers(0, n_dst - 1)), max_size=18))
        if draw(st.booleans()):  # a hub target
            hub = draw(st.integers(0, n_dst - 1))
            pairs += [(j % n_src, hub) for j in range(draw(st.integers(0, 9)))]
        if pairs and draw(st.booleans()):  # duplicates
            pairs += draw(st.lists(st.sampled_from(pairs), max_size=4))
        if square and draw(st.booleans()):  # (duplicated) self-loops
            loops = draw(st.lists(st.integers(0, n_src - 1), max_size=4))
            pairs += [(i, i) for i in loops]
        pairs = draw(st.permutations(pairs))
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    edge_index = torch.tensor(pairs, dtype=dtype).reshape(-1, 2).t().contiguous()
    has_weight = draw(st.booleans()) if weighted is None else weighted
    weight = None
    if has_weight:
        seed = draw(st.integers(0, 2**16))
        gen = torch.Generator().manual_seed(seed)
        weight = torch.rand(edge_index.size(1), generator=gen, dtype=F64) + 0.1
    num_nodes = n_src if square else (n_src, n_dst)
    return edge_index, num_nodes, weight


def _snapshot(*tensors):
    return [None if t is None else t.detach().clone() for t in tensors]


def _unchanged(before, *tensors):
    for old, new in zip(before, tensors):
        assert (old is None) == (new is None)
        if old is not None:
            assert torch.equal(old, new), "an input was modified in place"


# ----------------------------------------------------------------------------- Graph basics
@given(graphs(square=False))
def test_csr_and_csc_sort_stably_and_round_trip(case):
    edge_index, num_nodes, weight = case
    before = _snapshot(edge_index, weight)
    graph = Graph(edge_index, num_nodes, weight)
    n_src, n_dst = graph.num_src_nodes, graph.num_dst_nodes
    for fmt, group, other, groups in ((graph.csr, graph.dst, graph.src, n_dst), (graph.csc, graph.src, graph.dst, n_src)):
        ptr, index, perm = fmt
        assert ptr.dtype == torch.int64 and perm.dtype == torch.int64 and ptr.numel() == groups + 1
        assert int(ptr[0]) == 0 and int(ptr[-1]) == graph.num_edges
        # perm is a permutation that stably sorts by the group endpoint
        assert torch.equal(torch.sort(perm).values, torch.arange(graph.num_edges))
        expected = torch.sort(group.long(), stable=True).indices
        assert torch.equal(perm, expected)
        assert torch.equal(index.long(), other.long()[perm])
        assert index.dtype == edge_index.dtype
        # ptr delimits the groups
        grouped = group.long()[perm]
        for g in range(groups):
            assert bool((grouped[int(ptr[g]):int(ptr[g + 1])] == g).all())
        # round trip back to COO
        coo_group = torch.repeat_interleave(torch.arange(groups), ptr[1:] - ptr[:-1])
        restored = torch.empty_like(group.long())
        restored[perm] = coo_group
        assert torch.equal(restored, group.long())
    _unchanged(before, edge_index, weight)


@given(graphs(square=False))
def test_degrees_count_duplicates_like_pyg(case):
    edge_index, num_nodes, weight = case
    graph = Graph(edge_index, num_nodes, weight)
    n_src, n_dst = graph.num_src_nodes, graph.num_dst_nodes
    assert torch.equal(graph.in_degree, pyg_utils.degree(edge_index[1].long(), n_dst, dtype=torch.int64))
    assert torch.equal(graph.out_degree, pyg_utils.degree(edge_index[0].long(), n_src, dtype=torch.int64))
    assert graph.in_degree.dtype == torch.int64 and graph.out_degree.dtype == torch.int64
    # the CSR's group sizes are the degrees, whichever is built first
    fresh = Graph(edge_index, num_nodes, weight)
    csr, csc = fresh.csr, fresh.csc
    assert torch.equal(csr.ptr[1:] - csr.ptr[:-1], graph.in_degree)
    assert torch.equal(fresh.in_degree, graph.in_degree) and torch.equal(fresh.out_degree, graph.out_degree)


@given(graphs(square=False))
def test_reversed_and_dense(case):
    edge_index, num_nodes, weight = case
    graph = Graph(edge_index, num_nodes, weight)
    rev = graph.reversed()
    assert (rev.num_src_nodes, rev.num_dst_nodes) == (graph.num_dst_nodes, graph.num_src_nodes)
    assert torch.equal(rev.edge_index, edge_index.flip(0)) and rev.index_dtype == edge_index.dtype
    assert rev.edge_weight is graph.edge_weight
    torch.testing.assert_close(rev.to_dense(F64), graph.to_dense(F64).t())
    assert torch.equal(rev.csr.perm, graph.csc.perm) and torch.equal(rev.csc.perm, graph.csr.perm)
    assert torch.equal(rev.reversed().edge_index, edge_index)


def test_with_edge_weight_does_not_share_weight_dependent_caches():
    graph = Graph(torch.tensor([[0, 1, 2], [1, 2, 0]]), 3, torch.tensor([1.0, 2.0, 3.0], dtype=F64))
    csr = graph.csr
    normed = P.gcn_normalized(graph)
    rev = graph.reversed()
    other = graph.with_edge_weight(torch.tensor([5.0, 5.0, 5.0], dtype=F64))
    assert other.csr is csr  # structure shared
    assert torch.equal(other.reversed().edge_weight, other.edge_weight)
    assert rev.edge_weight is graph.edge_weight
    expected = pyg_gcn_norm(graph.edge_index, other.edge_weight, 3)[1]
    torch.testing.assert_close(P.gcn_normalized(other).edge_weight, expected)
    assert P.gcn_normalized(graph) is normed


# ----------------------------------------------------------------------------- processing vs PyG
@given(graphs())
def test_remove_self_loops_like_pyg(case):
    edge_index, n, weight = case
    before = _snapshot(edge_index, weight)
    out = P.remove_self_loops(Graph(edge_index, n, weight))
    ref_index, ref_weight = pyg_utils.remove_self_loops(edge_index, weight)
    assert torch.equal(out.edge_index, ref_index) and out.index_dtype == edge_index.dtype
    assert out.num_nodes == n
    if weight is None:
        assert out.edge_weight is None
    else:
        assert torch.equal(out.edge_weight, ref_weight)
    _unchanged(before, edge_index, weight)


@given(graphs(), st.sampled_from([1.0, 2.0, 0.5, 0.0]))
def test_add_self_loops_like_pyg(case, fill):
    edge_index, n, weight = case
    before = _snapshot(edge_index, weight)
    out = P.add_self_loops(Graph(edge_index, n, weight), fill_value=fill)
    ref_index, ref_weight = pyg_utils.add_self_loops(edge_index, weight, fill_value=fill, num_nodes=n)
    assert torch.equal(out.edge_index, ref_index) and out.index_dtype == edge_index.dtype
    if weight is None:
        assert out.edge_weight is None
    else:
        assert torch.equal(out.edge_weight, ref_weight)
    _unchanged(before, edge_index, weight)


@given(graphs(), st.sampled_from([1.0, 2.0, 0.5]))
def test_add_remaining_self_loops_like_pyg(case, fill):
    edge_index, n, weight = case
    before = _snapshot(edge_index, weight)
    out = P.add_remaining_self_loops(Graph(edge_index, n, weight), fill_value=fill)
    ones = torch.ones(edge_index.size(1), dtype=F64)
    ref_index, ref_weight = pyg_utils.add_remaining_self_loops(
        edge_index, weight if weight is not None else ones, fill_value=fill, num_nodes=n
    )
    assert torch.equal(out.edge_index, ref_index) and out.index_dtype == edge_index.dtype
    torch.testing.assert_close(out.edge_weight.to(F64), ref_weight, rtol=0, atol=0)
    if weight is not None:
        assert out.edge_weight.dtype == weight.dtype
    _unchanged(before, edge_index, weight)


@given(graphs(), st.booleans(), st.booleans())
def test_gcn_norm_like_pyg(case, improved, add_loops):
    edge_index, n, weight = case
    before = _snapshot(edge_index, weight)
    graph = Graph(edge_index, n, weight)
    out = P.gcn_norm(graph, improved=improved, add_self_loops=add_loops, dtype=F64)
    # PyG gives an unweighted graph's loops weight 1 even when improved (fusegnn: 2, the
    # documented 2I; see tests/test_pyg_parity.py), so PyG gets explicit ones
    ones = torch.ones(edge_index.size(1), dtype=F64)
    ref_index, ref_weight = pyg_gcn_norm(
        edge_index.long(), weight if weight is not None else ones, n, improved=improved,
        add_self_loops=add_loops, dtype=F64,
    )
    assert torch.equal(out.edge_index.long(), ref_index)
    torch.testing.assert_close(out.edge_weight, ref_weight, rtol=1e-12, atol=1e-12)
    cached = P.gcn_normalized(graph, improved=improved, add_self_loops=add_loops, dtype=F64)
    torch.testing.assert_close(cached.edge_weight, ref_weight, rtol=1e-12, atol=1e-12)
    _unchanged(before, edge_index, weight)


@given(graphs(weighted=True), st.booleans())
def test_gcn_norm_gradient_like_pyg(case, add_loops):
    edge_index, n, weight = case
    ours = weight.clone().requires_grad_()
    theirs = weight.clone().requires_grad_()
    out = P.gcn_norm(Graph(edge_index, n, ours), add_self_loops=add_loops)
    ref = pyg_gcn_norm(edge_index.long(), theirs, n, add_self_loops=add_loops)[1]
    gen = torch.Generator().manual_seed(0)
    probe = torch.randn(ref.shape, generator=gen, dtype=F64)
    (out.edge_weight * probe).sum().backward()
    (ref * probe).sum().backward()
    loops = edge_index[0][edge_index[0] == edge_index[1]]
    if loops.unique().numel() == loops.numel():
        # (PyG's loop_attr[i] = w assignment sends gradient to every duplicated self-loop,
        # though only the last one's weight is kept; fusegnn's goes to the kept one only)
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-10)
    assert torch.equal(ours.detach(), weight)
    torch.autograd.gradcheck(
        lambda w: P.gcn_norm(Graph(edge_index, n, w), add_self_loops=add_loops).edge_weight,
        (weight.clone().requires_grad_(),),
    )


# ----------------------------------------------------------------------------- bad input
_EI = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 2]])


@pytest.mark.parametrize("length", [3, 7])
@pytest.mark.parametrize(
    "call",
    [
        lambda g, w: P.gcn_norm(g, w, fused=False),
        lambda g, w: P.gcn_norm(g, w, fused=False, add_self_loops=False),
        lambda g, w: P.gcn_norm(g, w, fused=False, improved=True),
        lambda g, w: P.add_remaining_self_loops(g, 1.0, w),
    ],
    ids=["gcn_norm", "gcn_norm_no_loops", "gcn_norm_improved", "add_remaining_self_loops"],
)
def test_explicit_edge_weight_of_wrong_length_is_refused(call, length):
    """A weight per edge: 7 weights for 4 edges used to be silently cut to the first 4
    (gcn_norm / add_remaining_self_loops gathered them by position), 3 an IndexError
    ("index out of range in self") that named nothing."""
    graph = Graph(_EI, 3)
    with pytest.raises(ValueError, match=r"edge_weight.*E = 4"):
        call(graph, torch.ones(length, dtype=F64))


def test_explicit_edge_weight_on_another_device_or_of_int_dtype_is_refused():
    graph = Graph(_EI, 3)
    with pytest.raises(TypeError, match="edge_weight must be a floating tensor"):
        P.add_remaining_self_loops(graph, 1.0, torch.ones(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="edge_weight is on meta"):
        P.add_remaining_self_loops(graph, 1.0, torch.ones(4, device="meta"))


_FILLS = ["add", "sum", "mean", "min", "max", "mul", "tensor", None]


def _fill(name, heads):
    if name == "tensor":
        return torch.arange(1.0, heads + 1, dtype=F64) if heads else torch.tensor(2.5, dtype=F64)
    return name


@given(graphs(weighted=True), st.sampled_from(_FILLS), st.sampled_from([0, 2]))
def test_self_loop_fill_values_like_pyg(case, fill_name, heads):
    """PyG's fill values (a tensor, or a reduction of the incoming weights) for both
    self-loop functions; they used to be a TypeError of ``Tensor.new_full`` (a string) or
    a shape error (a per-head tensor for [E, H] weights)."""
    edge_index, n, weight = case
    if heads:
        weight = torch.stack([weight * (h + 1) for h in range(heads)], dim=1)
    fill = _fill(fill_name, heads)
    before = _snapshot(edge_index, weight)
    graph = Graph(edge_index, n, weight)
    out = P.add_self_loops(graph, fill_value=fill)
    ref = pyg_utils.add_self_loops(edge_index, weight, fill_value=fill, num_nodes=n)
    assert torch.equal(out.edge_index, ref[0])
    torch.testing.assert_close(out.edge_weight, ref[1], rtol=1e-12, atol=1e-12)
    out = P.add_remaining_self_loops(graph, fill_value=fill)
    ref = pyg_utils.add_remaining_self_loops(edge_index, weight, fill_value=fill, num_nodes=n)
    assert torch.equal(out.edge_index, ref[0])
    torch.testing.assert_close(out.edge_weight, ref[1], rtol=1e-12, atol=1e-12)
    _unchanged(before, edge_index, weight)


def test_bad_fill_value_names_it():
    graph = Graph(_EI, 3, torch.ones(4, dtype=F64))
    for fn in (P.add_self_loops, P.add_remaining_self_loops):
        with pytest.raises(ValueError, match="fill_value"):
            fn(graph, fill_value="median")
        with pytest.raises(TypeError, match="fill_value"):
            fn(graph, fill_value=True)


# ----------------------------------------------------------------------------- fused norm, plans
@given(graphs(allow_empty=True), st.booleans(), st.booleans())
def test_fused_gcn_norm_like_pyg(case, improved, add_loops):
    pytest.importorskip("triton")
    edge_index, n, weight = case
    before = _snapshot(edge_index, weight)
    # the kernels run on CUDA where there is one (the CPU needs the interpreter, which conftest sets only without)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    on = (lambda t: t.to(device) if t is not None else None)
    out = P.gcn_norm(Graph(on(edge_index), n, on(weight)), improved=improved, add_self_loops=add_loops,
                     dtype=F64, fused=True)
    ones = torch.ones(edge_index.size(1), dtype=F64)
    ref_index, ref_weight = pyg_gcn_norm(edge_index.long(), weight if weight is not None else ones, n,
                                         improved=improved, add_self_loops=add_loops, dtype=F64)
    assert torch.equal(out.edge_index.long().cpu(), ref_index)
    torch.testing.assert_close(out.edge_weight.cpu(), ref_weight, rtol=1e-12, atol=1e-12)
    _unchanged(before, edge_index, weight)


@given(graphs(square=False), st.integers(1, 5))
def test_segment_plans_cover_every_edge_once_in_order(case, seg_len):
    edge_index, num_nodes, weight = case
    graph = Graph(edge_index, num_nodes, weight)
    for order, fmt, groups in (("csr", graph.csr, graph.num_dst_nodes), ("csc", graph.csc, graph.num_src_nodes)):
        plan = plan_for(graph, order, seg_len)
        assert plan is plan_for(graph, order, seg_len)
        ptr = fmt.ptr
        rows, starts, ends = plan.seg_row.long(), plan.seg_start.long(), plan.seg_end.long()
        # every row has at least one segment; segments tile each row in order, none longer than seg_len
        covered = torch.zeros(graph.num_edges, dtype=torch.int64)
        expected_slots, slot = [], 0
        for r in range(groups):
            mine = torch.nonzero(rows == r).flatten()
            assert mine.numel() == max(1, -(-int(ptr[r + 1] - ptr[r]) // seg_len))
            assert int(starts[mine[0]]) == int(ptr[r]) and int(ends[mine[-1]]) == int(ptr[r + 1])
            assert bool((starts[mine[1:]] == ends[mine[:-1]]).all())
            assert bool((ends[mine] - starts[mine] <= seg_len).all())
            for s in mine.tolist():
                covered[int(starts[s]):int(ends[s])] += 1
            if mine.numel() > 1:
                expected_slots.append(r)
                assert plan.seg_slot[mine].tolist() == list(range(slot, slot + mine.numel()))
                slot += mine.numel()
            else:
                assert int(plan.seg_slot[mine[0]]) == -1
        assert bool((covered == 1).all())
        assert plan.split_rows.tolist() == expected_slots and plan.num_slots == slot
        assert torch.equal(plan.index.long(), fmt.index.long()) and torch.equal(plan.perm.long(), fmt.perm)
        sizes = plan.slot_ptr[1:] - plan.slot_ptr[:-1]
        assert plan.max_row_slots == (int(sizes.max()) if sizes.numel() else 0)


def test_build_plan_refuses_a_segment_length_below_one():
    graph = Graph(_EI, 3)
    with pytest.raises(ValueError, match="seg_len"):
        build_plan(graph.csr, 0, 3)


def test_gcn_normalized_follows_weights_changed_in_place():
    """The graph holds the caller's weight tensor: spmm reads its new values after an
    in-place change, and the cached normalisation used to stay that of the old ones
    (expected [0.2500, ...] for weights 10x, got the stale 1x normalisation)."""
    weight = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    graph = Graph(torch.tensor([[0, 1, 2], [1, 2, 0]]), 3, weight)
    first = P.gcn_normalized(graph)
    assert P.gcn_normalized(graph) is first  # cached while the weights stay
    weight.mul_(10)
    expected = pyg_gcn_norm(graph.edge_index, weight, 3)[1]
    torch.testing.assert_close(P.gcn_normalized(graph).edge_weight, expected)
    assert not torch.allclose(first.edge_weight, expected)
    with torch.inference_mode():
        inference = Graph(graph.edge_index, 3, torch.ones(3, dtype=F64))
        assert P.gcn_normalized(inference) is P.gcn_normalized(inference)


@given(graphs(square=False, weighted=True))
def test_from_sparse_and_to_dense_round_trip(case):
    edge_index, num_nodes, weight = case
    graph = Graph(edge_index, num_nodes, weight)
    dense = graph.to_dense(F64)
    for adj in (dense.to_sparse(), dense.to_sparse_csr()):
        back = Graph.from_sparse(adj)
        assert (back.num_src_nodes, back.num_dst_nodes) == (graph.num_src_nodes, graph.num_dst_nodes)
        torch.testing.assert_close(back.to_dense(F64), dense)
        flipped = Graph.from_sparse(adj, transpose=True)
        torch.testing.assert_close(flipped.to_dense(F64), dense.t())


@pytest.mark.parametrize(
    "make, error, pattern",
    [
        (lambda: Graph(_EI.t()), ValueError, "edge_index must have shape"),
        (lambda: Graph(_EI.float()), TypeError, "edge_index must hold int32 or int64"),
        (lambda: Graph(torch.tensor([[0, -1], [1, 1]])), IndexError, "negative source node id"),
        (lambda: Graph(_EI, 2), IndexError, "source node id 2 but num_nodes"),
        (lambda: Graph(_EI, (3, 2)), IndexError, "target node id 2 but num_nodes"),
        (lambda: Graph(_EI, 3, torch.ones(5)), ValueError, "edge_weight must have shape"),
        (lambda: Graph(_EI, 3, torch.ones(4, dtype=torch.int64)), TypeError, "edge_weight must be a floating"),
        (lambda: Graph(_EI, -1), ValueError, "num_nodes must be >= 0"),
        (lambda: Graph(_EI, 3.0), TypeError, "num_nodes must be an int"),
        (lambda: Graph(_EI, (3,)), ValueError, "num_nodes must be an int or a pair"),
        (lambda: as_graph([[0, 1], [1, 0]], name="edge_index"), TypeError, "edge_index must be"),
    ],
)
def test_bad_graph_input_names_the_argument(make, error, pattern):
    with pytest.raises(error, match=pattern):
        make()
