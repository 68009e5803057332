"""Forward and backward semantics of the graph attention layers (``GATConv``, ``GATv2Conv``,
``TransformerConv``) against PyG 2.8, on the reference path AND the fused paths
(``aggregation="gar"`` / ``"gas"``: Triton kernels, through the interpreter on a CPU).

Each case builds PyG's layer and ours with the same arguments, copies PyG's (randomised)
parameters into ours (:func:`tests.pyg_compare.layer_pair`) and compares the outputs
(``return_attention_weights``: the returned ``edge_index`` / sparse matrix exactly, alpha
to ``1e-10``) and the gradients of every float input and parameter in float64
(:func:`tests.pyg_compare.assert_same_as_pyg`). The graphs hold self-loops, duplicate
edges, zero-in-degree targets, a source without outgoing edges and a hub.

Beyond ``tests/test_pyg_parity.py`` (reference path only): the fused paths over the same
matrix of options, ``edge_attr`` given as ``[E]``, every ``fill_value`` form (a number, a
0-d / ``[D]`` / ``[1, D]`` tensor, each reduction), int32 and non-contiguous
``edge_index`` (a transposed ``[E, 2]`` buffer), expanded / transposed ``edge_attr``,
empty graphs and a single node, a hub wider than one kernel block, and a layer called
again on the same :class:`~fusegnn.Graph` with new edge features (caches).

Where PyG is itself wrong or refuses, the case says so and compares with what PyG
computes for the equivalent input:

* PyG's ``TransformerConv`` with an int32 ``edge_index`` gives wrong input gradients
  (its ``softmax`` backward), so PyG gets the int64 ``edge_index`` there.
* PyG's ``GATConv`` / ``GATv2Conv`` refuse edge features with ``add_self_loops`` on a
  ``torch.sparse`` input (an ``AssertionError`` in ``remove_self_loops``); fusegnn adds
  the loops (documented: the self-loop handling follows the graph's edges), checked here
  against PyG on the equivalent ``edge_index`` (the coalesced matrix's entries).
"""

from __future__ import annotations

import pytest
import torch

from fusegnn import Graph
from fusegnn.layers import GATConv, GATv2Conv, TransformerConv
from tests.graphs import random_graph
from tests.pyg_compare import assert_same_as_pyg, layer_pair, on_device, pyg_nn, randn, requires_pyg

pytestmark = [pytest.mark.usefixtures("one_thread"), requires_pyg]

F64 = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # of the fused paths (the reference runs on the CPU)
LAYERS = {"GATConv": GATConv, "GATv2Conv": GATv2Conv, "TransformerConv": TransformerConv}
GAT_FAMILY = ["GATConv", "GATv2Conv"]
N = 7  # square graphs: 20 edges with self-loops, duplicates, a hub of 4, isolated nodes
N_SRC, N_DST = 6, 4  # bipartite graphs


def _square():
    return random_graph(N, 20, seed=3, hub_degree=4)


def _bipartite():
    return random_graph(N_SRC, 14, seed=4, num_dst_nodes=N_DST)


def _adj_t(ei: torch.Tensor, shape: tuple[int, int], layout: str) -> torch.Tensor:
    """PyG's ``adj_t`` of ``ei`` (rows are targets), coalesced (duplicates summed)."""
    adj = torch.sparse_coo_tensor(ei.flip(0), torch.ones(ei.size(1), dtype=F64), (shape[1], shape[0])).coalesce()
    return adj if layout == "coo" else adj.to_sparse_csr()


def _empty() -> torch.Tensor:
    return torch.empty(2, 0, dtype=torch.long)


def _compare(name: str, agg: str, args: tuple, kwargs: dict, inputs: tuple, pyg_inputs: tuple | None = None,
             **call) -> None:
    ours, theirs = layer_pair(LAYERS[name], getattr(pyg_nn, name), *args, **kwargs)
    ours.aggregation = agg
    ours.eval(), theirs.eval()  # dropout (when set) has no effect in eval mode
    device = _device(agg)
    ours, theirs, inputs, pyg_inputs = on_device((ours, theirs, inputs, pyg_inputs), device)
    assert_same_as_pyg(ours, theirs, *inputs, pyg_args=pyg_inputs, pyg_kwargs=None if pyg_inputs is None else call,
                       **call)


def _device(agg: str) -> str:
    """Where a case runs: the fused paths on the GPU where there is one (on a CPU, through
    Triton's interpreter), the reference on the CPU."""
    return "cpu" if agg == "reference" else DEVICE


# ----------------------------------------------------------------------------- inputs
def _inputs(key: str):
    """``(ours, theirs or None)``: the positional inputs of one case."""
    x, ei = randn(N, 5, seed=1), _square()
    ea, ea1 = randn(20, 3, seed=2), randn(20, seed=2)
    xs, xd, eib, eab = randn(N_SRC, 5, seed=5), randn(N_DST, 4, seed=6), _bipartite(), randn(14, 3, seed=7)
    table = {
        "x": ((x, ei), None),
        "x_ea": ((x, ei, ea), None),
        "x_ea1": ((x, ei, ea1), None),
        "narrow": ((x[:, :2], ei), None),
        "narrow_ea": ((x[:, :2], ei, ea), None),
        "int32": ((x, ei.int()), (x, ei)),
        "int32_ea": ((x, ei.int(), ea), (x, ei, ea)),
        # a transposed [E, 2] buffer: rows of stride 2
        "noncontig": ((x, torch.stack([ei[0], ei[1]], 1).t(), ea.t().contiguous().t()), (x, ei, ea)),
        "expanded_ea": ((x, ei, randn(1, 3, seed=8).expand(20, 3)), None),
        "empty": ((x, _empty()), None),
        "empty_ea": ((x, _empty(), torch.empty(0, 3, dtype=F64)), None),
        "one_node": ((x[:1], _empty()), None),
        "graph_ea": ((x, Graph(ei, N), ea), (x, ei, ea)),
        "bip": (((xs, xd), eib), None),
        "bip_ea": (((xs, xd), eib, eab), None),
        "bip_narrow_ea": (((xs[:, :2], xd), eib, eab), None),
        "bip_int32_ea": (((xs, xd), eib.int(), eab), ((xs, xd), eib, eab)),
        "bip_empty": (((xs, xd), _empty()), None),
        "bip_src_only": (((xs, None), eib), None),
    }
    for layout in ("coo", "csr"):
        table[f"{layout}"] = ((x, _adj_t(ei, (N, N), layout)), None)
        table[f"bip_{layout}"] = (((xs, xd), _adj_t(eib, (N_SRC, N_DST), layout)), None)
    return table[key]


# (id, layers, ctor args, ctor kwargs, inputs, call kwargs, run on the fused paths too)
RAW = dict(return_attention_weights=True)
GAT_CASES = [
    ("h1", (5, 3), dict(), "x", RAW, True),
    ("h2_concat_raw", (5, 3), dict(heads=2), "x", RAW, True),
    ("h2_mean", (5, 3), dict(heads=2, concat=False), "x", {}, True),
    ("no_loops_raw", (5, 3), dict(heads=2, add_self_loops=False), "x", RAW, True),
    ("no_loops_mean", (5, 3), dict(heads=2, concat=False, add_self_loops=False), "x", {}, False),
    ("dropout_eval", (5, 3), dict(heads=2, dropout=0.6), "x", {}, False),
    ("residual", (5, 3), dict(heads=2, residual=True), "x", {}, True),
    ("residual_mean_nobias", (5, 3), dict(heads=2, concat=False, residual=True, bias=False, negative_slope=0.5),
     "x", {}, False),
    ("narrow_raw", (2, 4), dict(heads=2), "narrow", RAW, True),
    ("narrow_edges_raw", (2, 4), dict(heads=2, edge_dim=3, fill_value="min"), "narrow_ea", RAW, True),
    ("edge_dim_without_attr", (5, 3), dict(heads=2, edge_dim=3), "x", {}, False),
    ("edges_no_loops_raw", (5, 3), dict(heads=2, edge_dim=3, add_self_loops=False), "x_ea", RAW, True),
    ("fill_float", (5, 3), dict(heads=2, edge_dim=3, fill_value=0.5), "x_ea", {}, False),
    ("fill_int", (5, 3), dict(heads=2, edge_dim=3, fill_value=2), "x_ea", {}, False),
    ("fill_tensor", (5, 3), dict(heads=2, edge_dim=3, fill_value=torch.tensor([0.1, 0.2, -0.3], dtype=F64)),
     "x_ea", RAW, True),
    ("fill_tensor_0d", (5, 3), dict(heads=2, edge_dim=3, fill_value=torch.tensor(0.3, dtype=F64)), "x_ea", {}, False),
    ("fill_tensor_1xD", (5, 3), dict(heads=2, edge_dim=3, fill_value=torch.tensor([[0.1, 0.2, -0.3]], dtype=F64)),
     "x_ea", {}, False),
    *[(f"fill_{r}", (5, 3), dict(heads=2, edge_dim=3, fill_value=r), "x_ea", {}, r in ("mean", "mul"))
      for r in ("mean", "add", "sum", "max", "min", "mul")],
    *[(f"edge_attr_1d_fill_{r}", (5, 3), dict(heads=2, edge_dim=1, fill_value=r), "x_ea1", {}, r == "max")
      for r in ("mean", "add", "max", "min", "mul")],
    ("edge_attr_1d_fill_tensor", (5, 3), dict(heads=2, edge_dim=1, fill_value=torch.tensor([0.7], dtype=F64)),
     "x_ea1", {}, False),
    ("edge_attr_1d_fill_0d", (5, 3), dict(heads=2, edge_dim=1, fill_value=torch.tensor(0.7, dtype=F64)),
     "x_ea1", {}, False),
    ("int32", (5, 3), dict(heads=2), "int32", RAW, True),
    ("int32_edges", (5, 3), dict(heads=2, edge_dim=3, add_self_loops=False), "int32_ea", RAW, True),
    ("noncontig_no_loops", (5, 3), dict(heads=2, edge_dim=3, add_self_loops=False), "noncontig", RAW, True),
    ("noncontig", (5, 3), dict(heads=2, edge_dim=3, fill_value="max"), "noncontig", RAW, True),
    ("expanded_edge_attr", (5, 3), dict(heads=2, edge_dim=3, fill_value="add"), "expanded_ea", {}, False),
    ("empty_raw", (5, 3), dict(heads=2), "empty", RAW, True),
    ("empty_no_loops_raw", (5, 3), dict(heads=2, add_self_loops=False), "empty", RAW, True),
    ("empty_edges", (5, 3), dict(heads=2, edge_dim=3), "empty_ea", {}, True),
    ("one_node_raw", (5, 3), dict(heads=2), "one_node", RAW, False),
    ("graph_input_raw", (5, 3), dict(heads=2, edge_dim=3), "graph_ea", RAW, False),
    ("bipartite_raw", ((5, 4), 3), dict(heads=2), "bip", RAW, True),
    ("bipartite_no_loops_raw", ((5, 4), 3), dict(heads=2, add_self_loops=False), "bip", RAW, True),
    ("bipartite_edges_residual", ((5, 4), 3), dict(heads=2, edge_dim=3, fill_value="max", residual=True),
     "bip_ea", RAW, True),
    ("bipartite_narrow_raw", ((2, 4), 5), dict(heads=2, edge_dim=3, residual=True), "bip_narrow_ea", RAW, True),
    ("bipartite_int32", ((5, 4), 3), dict(heads=2, edge_dim=3), "bip_int32_ea", {}, False),
    ("bipartite_empty_raw", ((5, 4), 3), dict(heads=2), "bip_empty", RAW, False),
    *[(f"sparse_{lo}_raw", (5, 3), dict(heads=2), lo, RAW, lo == "csr") for lo in ("coo", "csr")],
    *[(f"sparse_{lo}_no_loops_raw", (5, 3), dict(heads=2, add_self_loops=False), lo, RAW, False)
      for lo in ("coo", "csr")],
    *[(f"bipartite_sparse_{lo}_raw", ((5, 4), 3), dict(heads=2), f"bip_{lo}", RAW, lo == "coo")
      for lo in ("coo", "csr")],
]
GAT_ONLY_CASES = [  # PyG's GATConv only: (x_src, None) targets without features
    ("src_only_size_raw", ((5, 4), 3), dict(heads=2, add_self_loops=False), "bip_src_only",
     dict(size=(N_SRC, N_DST), return_attention_weights=True), True),
    ("src_only_size_loops_raw", ((5, 4), 3), dict(heads=2), "bip_src_only",
     dict(size=(N_SRC, N_DST), return_attention_weights=True), False),
]
GATV2_ONLY_CASES = [
    ("share_weights_raw", (5, 3), dict(heads=2, share_weights=True), "x", RAW, True),
    ("share_weights_edges_mean", (5, 3), dict(heads=2, concat=False, share_weights=True, edge_dim=3), "x_ea", {}, False),
]
TRANSFORMER_CASES = [
    *[(f"h{h}_concat{c}_beta{b}_root{r}", (5, 3), dict(heads=h, concat=c, beta=b, root_weight=r), "x", {},
       h == 2 and b and c)
      for h, c in ((1, True), (2, True), (2, False)) for b in (False, True) for r in (True, False)],
    ("raw_true", (5, 3), dict(heads=2), "x", RAW, True),
    ("raw_false", (5, 3), dict(heads=2), "x", dict(return_attention_weights=False), False),
    ("dropout_eval", (5, 3), dict(heads=2, dropout=0.6), "x", {}, False),
    ("nobias", (5, 3), dict(heads=2, bias=False, beta=True, concat=False), "x", {}, False),
    ("edges_raw", (5, 3), dict(heads=2, edge_dim=3), "x_ea", RAW, True),
    ("edges_wide", (5, 2), dict(heads=2, edge_dim=3), "x_ea", {}, True),
    ("int32", (5, 3), dict(heads=2, edge_dim=3), "int32_ea", RAW, True),
    ("noncontig", (5, 3), dict(heads=2, edge_dim=3), "noncontig", RAW, True),
    ("expanded_edge_attr", (5, 3), dict(heads=2, edge_dim=3), "expanded_ea", {}, False),
    ("empty_edges_raw", (5, 3), dict(heads=2, edge_dim=3), "empty_ea", RAW, True),
    ("graph_input_raw", (5, 3), dict(heads=2, edge_dim=3), "graph_ea", RAW, False),
    ("bipartite_beta_edges_raw", ((5, 4), 3), dict(heads=2, beta=True, edge_dim=3), "bip_ea", RAW, True),
    *[(f"sparse_{lo}_raw", (5, 3), dict(heads=2), lo, RAW, lo == "coo") for lo in ("coo", "csr")],
]
CASES = ([(name,) + c for name in GAT_FAMILY for c in GAT_CASES] + [("GATConv",) + c for c in GAT_ONLY_CASES]
         + [("GATv2Conv",) + c for c in GATV2_ONLY_CASES] + [("TransformerConv",) + c for c in TRANSFORMER_CASES])
PARAMS = [pytest.param(c, agg, id=f"{c[0]}-{c[1]}-{agg}")
          for c in CASES for agg in ("reference", "gar", "gas") if agg == "reference" or c[-1]]


@pytest.mark.parametrize("case, agg", PARAMS)
def test_same_as_pyg(case, agg):
    name, _, args, kwargs, key, call, _fused = case
    inputs, pyg_inputs = _inputs(key)
    _compare(name, agg, args, kwargs, inputs, pyg_inputs, **call)


# ----------------------------------------------------------------------------- hubs, repeated calls
@pytest.mark.parametrize("agg", ["reference", "gar", "gas"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_hub_wider_than_a_block(name, agg):
    """One target with 120 incoming edges (several kernel blocks of edges), with edge features."""
    x, ei, ea = randn(90, 4, seed=3), random_graph(90, 200, seed=5, hub_degree=120), randn(200, 2, seed=4)
    _compare(name, agg, (4, 3), dict(heads=2, edge_dim=2), (x, ei, ea), return_attention_weights=True)


@pytest.mark.parametrize("agg", ["reference", "gar"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_repeated_calls_on_one_graph(name, agg):
    """The same layer on the same :class:`Graph` (its processed forms cached) with new edge
    features, then on the same edges in another order: PyG's result each time."""
    kwargs = dict(heads=2, edge_dim=3) | (dict(fill_value="max") if name != "TransformerConv" else {})
    ours, theirs = layer_pair(LAYERS[name], getattr(pyg_nn, name), 5, 3, **kwargs)
    ours.aggregation = agg
    ours.eval(), theirs.eval()
    x, ei, ea = randn(N, 5, seed=1), _square(), randn(20, 3, seed=2)
    ours, theirs, x, ei, ea = on_device((ours, theirs, x, ei, ea), _device(agg))
    graph = Graph(ei, N)
    for edge_attr in (ea, 2 * ea + 1, ea):
        assert_same_as_pyg(ours, theirs, x, graph, edge_attr, pyg_args=(x, ei, edge_attr))
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(0)).to(ei.device)
    assert_same_as_pyg(ours, theirs, x, ei[:, perm], ea[perm], return_attention_weights=True)


def test_noncontiguous_edge_index_is_stored_contiguous():
    """A transposed ``[E, 2]`` buffer as ``edge_index``: the graph keeps a contiguous copy
    (the fused kernels read its rows as flat buffers), a contiguous one is kept as given."""
    ei = _square()
    view = torch.stack([ei[0], ei[1]], 1).t()
    graph = Graph(view, N)
    assert graph.edge_index.is_contiguous() and torch.equal(graph.edge_index, ei)
    assert graph.src.stride() == (1,) and graph.dst.stride() == (1,)
    assert Graph(ei, N).edge_index is ei


# ----------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("name", list(LAYERS))
def test_edge_attr_of_the_wrong_shape_names_it(name):
    """PyG's ``TransformerConv`` fails on a 1-D ``edge_attr`` (a matmul error); ours says
    what it wants. GAT / GATv2 take ``[E]`` for ``edge_dim=1`` (as PyG) and name a width mismatch."""
    layer = LAYERS[name](5, 3, heads=2, edge_dim=2).double()
    x, ei = randn(N, 5, seed=1), _square()
    if name == "TransformerConv":
        with pytest.raises(ValueError, match=r"TransformerConv: edge_attr must have shape \[num_edges, edge_dim\]"):
            layer(x, ei, randn(20, seed=2))
    else:
        with pytest.raises(ValueError, match=rf"{name}: edge_attr .*\b1\b.* 2|{name}: edge_attr must have shape"):
            layer(x, ei, randn(20, seed=2))
    with pytest.raises(ValueError, match=rf"{name}: edge_attr has 19 rows but the graph has 20 edges"):
        layer(x, ei, randn(19, 2, seed=2))
    with pytest.raises(ValueError, match=rf"{name}: edge_attr (has 3 features per edge but the layer takes 2|"
                                         r"must have shape \[num_edges, 2\], got \(20, 3\))"):
        layer(x, ei, randn(20, 3, seed=2))
    with pytest.raises(TypeError, match=rf"{name}: edge_attr .*dtype"):
        layer(x, ei, randn(20, 2, seed=2).float())


@pytest.mark.parametrize("name", list(LAYERS))
def test_edge_attr_without_edge_dim_is_refused(name):
    """PyG's GAT / GATv2 / TransformerConv without ``edge_dim`` ignore or fail on ``edge_attr``
    in different ways; ours refuses it, naming both arguments (documented)."""
    layer = LAYERS[name](5, 3, heads=2).double()
    with pytest.raises(ValueError, match=rf"{name}: edge_attr was given but the layer was built without edge_dim"):
        layer(randn(N, 5, seed=1), _square(), randn(20, 2, seed=2))


def test_transformer_edge_dim_needs_edge_attr():
    """PyG asserts ``edge_attr is not None`` when ``edge_dim`` is set; ours says so."""
    layer = TransformerConv(5, 3, edge_dim=2).double()
    with pytest.raises(ValueError, match=r"TransformerConv: the layer was built with edge_dim=2 and needs edge_attr"):
        layer(randn(N, 5, seed=1), _square())


@pytest.mark.parametrize("name", ["GATv2Conv", "TransformerConv"])
def test_missing_target_features_are_refused(name):
    """``(x_src, None)``: PyG's GATv2Conv / TransformerConv fail inside (``lin_r(None)``);
    ours names ``x_dst`` (documented: the scores / queries read the targets' features)."""
    layer = LAYERS[name]((5, 4), 3).double()
    with pytest.raises(ValueError, match=rf"{name}: x_dst \(x\[1\]\)"):
        layer((randn(N_SRC, 5, seed=5), None), _bipartite())


@pytest.mark.parametrize("name", GAT_FAMILY)
def test_unknown_fill_value_names_it(name):
    layer = LAYERS[name](5, 3, edge_dim=2, fill_value="median").double()
    with pytest.raises(ValueError, match="fill_value"):
        layer(randn(N, 5, seed=1), _square(), randn(20, 2, seed=2))


@pytest.mark.parametrize("name", GAT_FAMILY)
def test_sparse_input_with_edge_features_and_self_loops(name):
    """PyG refuses edge features with ``add_self_loops`` on a ``torch.sparse`` input (an
    ``AssertionError``); ours processes them as for the ``edge_index`` of the matrix's
    entries (row-major: by target, then source), which PyG computes."""
    x, ei = randn(N, 5, seed=1), _square()
    adj = _adj_t(ei, (N, N), "coo")
    ea = randn(adj._nnz(), 3, seed=9)
    ours, theirs = layer_pair(LAYERS[name], getattr(pyg_nn, name), 5, 3, heads=2, edge_dim=3, fill_value="mean")
    ours.eval(), theirs.eval()
    with pytest.raises(AssertionError):
        theirs(x, adj, ea)
    entries = adj.indices().flip(0)  # [source, target] of each stored entry
    out, (adj_out, alpha) = ours(x, adj, ea, return_attention_weights=True)
    expected, (ei_out, alpha_pyg) = theirs(x, entries, ea, return_attention_weights=True)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    # the same coefficients, ours in the processed matrix's row-major order
    order = torch.argsort(ei_out[1] * N + ei_out[0], stable=True)
    assert torch.equal(adj_out.indices(), ei_out[:, order].flip(0))
    torch.testing.assert_close(alpha, alpha_pyg[order], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(adj_out.values(), alpha, rtol=0, atol=0)
