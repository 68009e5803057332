"""Drop-in parity with PyTorch Geometric, layer by layer (float64, CPU, reference aggregation).

For each layer, PyG's and fusegnn's are built with the SAME constructor arguments, PyG's
parameters randomised and copied into fusegnn's by name (:mod:`tests.pyg_compare`: both
must have exactly the same parameters and buffers), and the outputs and the gradients of
every float input and parameter compared to ``1e-10``, over the constructor options PyG
documents and the input forms PyG takes: an ``edge_index``, a :class:`fusegnn.Graph`
(fusegnn's side; PyG gets the ``edge_index``), a ``torch.sparse`` ``adj_t`` (COO and CSR,
to both), a bipartite pair ``(x_src, x_dst)`` with ``N_src != N_dst`` (with and without
``size=``), ``(x_src, None)`` where PyG allows it and ``return_attention_weights``. The
graphs have isolated nodes, self-loops, duplicate edges and a hub (:func:`tests.graphs.random_graph`).

Also: seeded ``reset_parameters`` draws the same values as PyG's, and arguments PyG
rejects with an error are rejected here too.

What differs on purpose (each documented in the layer's docstring) is asserted as such:

* ``GCNConv(improved=True)`` without edge weights: fusegnn's self-loops weigh 2
  (:math:`A + 2I`, the documented formula); PyG 2.8's ``gcn_norm`` gives them weight 1
  unless weights are passed, so PyG is called with explicit all-ones weights there.
* GCN-normalised layers on a ``torch.sparse`` ``adj_t``: fusegnn adds the *remaining*
  self-loops as for an ``edge_index``; PyG adds :math:`I` to every node of a sparse
  input. They agree on graphs without self-loops, which those cases use.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from fusegnn import Graph
from fusegnn.layers import (
    APPNP,
    GATConv,
    GATv2Conv,
    GCNConv,
    GINConv,
    GINEConv,
    GraphConv,
    SAGEConv,
    SGConv,
    TransformerConv,
)
from tests.graphs import random_graph, random_weights
from tests.pyg_compare import assert_same_as_pyg, layer_pair, pyg_nn, randn, requires_pyg

pytestmark = [pytest.mark.usefixtures("one_thread"), requires_pyg]

F64 = torch.float64
N, E = 10, 32  # square graphs
N_SRC, N_DST, E_BIP = 9, 6, 26  # bipartite graphs


def _square(seed: int = 1, self_loops: bool = True) -> torch.Tensor:
    return random_graph(N, E, seed=seed, hub_degree=6, self_loops=self_loops)


def _bipartite(seed: int = 3) -> torch.Tensor:
    return random_graph(N_SRC, E_BIP, seed=seed, num_dst_nodes=N_DST, hub_degree=5)


def _adj_t(ei: torch.Tensor, shape: tuple[int, int], layout: str, weight: torch.Tensor | None = None):
    """PyG's ``adj_t`` (rows are targets) of ``ei``: COO (coalesced: duplicates summed) or CSR."""
    values = weight if weight is not None else torch.ones(ei.size(1), dtype=F64)
    adj = torch.sparse_coo_tensor(ei.flip(0), values, (shape[1], shape[0])).coalesce()
    return adj if layout == "coo" else adj.to_sparse_csr()


def _graph_input(form: str, ei: torch.Tensor, shape: tuple[int, int]):
    """``(ours, theirs)``: the graph argument of each layer for one input form."""
    if form == "edge_index":
        return ei, ei
    if form == "graph":
        return Graph(ei, shape if shape[0] != shape[1] else shape[0]), ei
    adj = _adj_t(ei, shape, form)
    return adj, adj


def _ids(cases):
    return [",".join(f"{k}={v}" for k, v in c.items()) or "default" for c in cases]


def _assert_weighted_form(ours, theirs, x, ei, w, form: str) -> None:
    """A GCN-style layer given the graph ``ei`` with edge weights ``w`` in one input form:
    ``edge_weight`` with an ``edge_index`` / a :class:`Graph`, the values of a sparse ``adj_t``."""
    if form in ("coo", "csr"):
        assert_same_as_pyg(ours, theirs, x, _adj_t(ei, (N, N), form, w))
    else:
        g, _ = _graph_input(form, ei, (N, N))
        assert_same_as_pyg(ours, theirs, x, g, w, pyg_args=(x, ei, w))


SQUARE_FORMS = ["edge_index", "graph", "coo", "csr"]


def _assert_forms(ours, theirs, x, ei, shape, forms, *rest, **kw):
    for form in forms:
        g_ours, g_theirs = _graph_input(form, ei, shape)
        assert_same_as_pyg(ours, theirs, x, g_ours, *rest, pyg_args=(x, g_theirs, *rest), **kw)


# ============================================================================ GCNConv
GCN_CASES = [
    {}, {"improved": True}, {"add_self_loops": False}, {"add_self_loops": True}, {"normalize": False},
    {"normalize": False, "add_self_loops": False}, {"bias": False}, {"cached": True},
    {"improved": True, "add_self_loops": False},
]


def _unique_loops(ei: torch.Tensor) -> torch.Tensor:
    """``ei`` with its duplicated self-loops dropped (see :func:`test_gcn_duplicate_self_loop_weights`)."""
    loop = ei[0] == ei[1]
    keep = ~loop
    seen = set()
    for k in torch.nonzero(loop).flatten().tolist():
        node = int(ei[0, k])
        if node not in seen:
            seen.add(node)
            keep[k] = True
    return ei[:, keep]


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("channels", [(5, 3), (3, 6)], ids=["narrow", "widen"])
@pytest.mark.parametrize("opts", GCN_CASES, ids=_ids(GCN_CASES))
def test_gcn(opts, channels, weighted):
    loopless = _square(self_loops=False)  # see the module docstring (sparse adj_t)
    with_loops = _unique_loops(_square(seed=5))
    x = randn(N, channels[0], seed=3)
    loops_added = opts.get("add_self_loops", opts.get("normalize", True))
    for ei in (loopless, with_loops):
        w = random_weights(ei.size(1), seed=2).to(F64) if weighted else None
        if w is None and opts.get("improved") and loops_added:
            # A + 2I with or without weights (PyG 2.8 only with them: module docstring)
            ones = torch.ones(ei.size(1), dtype=F64)
            ours, _ = layer_pair(GCNConv, pyg_nn.GCNConv, *channels, **opts)
            torch.testing.assert_close(ours(x, ei), ours(x, ei, ones), rtol=0, atol=0)
            w = ones
        forms = SQUARE_FORMS if ei is loopless else ["edge_index", "graph"]
        for form in forms:  # a fresh pair each time: cached=True keeps the first call's graph
            ours, theirs = layer_pair(GCNConv, pyg_nn.GCNConv, *channels, **opts)
            _assert_weighted_form(ours, theirs, x, ei, w, form)
            # a second call on another graph (cached: the first one's normalised graph)
            other = _square(seed=6, self_loops=False)
            w_other = random_weights(other.size(1), seed=8).to(F64)
            assert_same_as_pyg(ours, theirs, randn(N, channels[0], seed=9), other, w_other)


def test_gcn_duplicate_self_loop_weights():
    """Duplicated self-loops ``i -> i`` with other weights: the last one's weight is used
    (as by PyG). Its gradient is the true one: zero for the loops whose weight is
    unused; PyG's (an ``index_put`` over the duplicates) gives each of them the
    gradient of the one it used."""
    ei = _square(seed=5)
    dst_loops = [k for k in range(ei.size(1)) if ei[0, k] == ei[1, k]]
    node = int(ei[0, dst_loops[0]])
    same = [k for k in dst_loops if int(ei[0, k]) == node]
    assert len(same) >= 2  # the graph has a duplicated self-loop
    ours, theirs = layer_pair(GCNConv, pyg_nn.GCNConv, 5, 3)
    x = randn(N, 5, seed=3)
    w = random_weights(ei.size(1), seed=2).to(F64).requires_grad_()
    out = ours(x, ei, w)
    torch.testing.assert_close(out, theirs(x, ei, w), rtol=1e-10, atol=1e-10)
    (grad,) = torch.autograd.grad(out.sum(), w)
    (grad_pyg,) = torch.autograd.grad(theirs(x, ei, w).sum(), w)
    shadowed = same[:-1]
    assert not grad[shadowed].any()
    torch.testing.assert_close(grad_pyg[shadowed], grad_pyg[same[-1]].expand(len(shadowed)))
    others = [k for k in range(ei.size(1)) if k not in shadowed]
    torch.testing.assert_close(grad[others], grad_pyg[others], rtol=1e-10, atol=1e-10)
    with torch.no_grad():  # the shadowed weights do not change the output: zero is the derivative
        w2 = w.detach().clone()
        w2[shadowed] += 1.0
        torch.testing.assert_close(ours(x, ei, w2), out, rtol=0, atol=0)


def test_gcn_normalize_false_rejects_self_loops_as_pyg():
    """PyG: ``add_self_loops`` defaults to ``normalize`` and ``add_self_loops=True`` without
    ``normalize`` is an error (the loops would silently not be added)."""
    with pytest.raises(ValueError):
        pyg_nn.GCNConv(4, 3, normalize=False, add_self_loops=True)
    with pytest.raises(ValueError, match="add_self_loops"):
        GCNConv(4, 3, normalize=False, add_self_loops=True)
    for kw in ({}, {"normalize": False}, {"add_self_loops": False}, {"normalize": False, "add_self_loops": False}):
        assert GCNConv(4, 3, **kw).add_self_loops == pyg_nn.GCNConv(4, 3, **kw).add_self_loops, kw


# ============================================================================ GATConv / GATv2Conv
_ATTENTION_CASES = [
    dict(heads=h, concat=c, add_self_loops=loops)
    for h, c, loops in itertools.product([1, 3], [True, False], [True, False])
] + [
    dict(heads=2, negative_slope=0.5),
    dict(heads=2, bias=False),
    dict(heads=2, residual=True),
    dict(heads=2, concat=False, residual=True),
    dict(heads=2, edge_dim=3),
    dict(heads=2, edge_dim=3, add_self_loops=False),
    dict(heads=2, edge_dim=3, fill_value=0.5),
    dict(heads=2, edge_dim=3, fill_value="add"),
    dict(heads=2, edge_dim=3, fill_value="max"),
    dict(heads=2, edge_dim=3, fill_value="min"),
    dict(heads=2, edge_dim=3, fill_value="mul"),
    dict(heads=2, edge_dim=1),
]
GAT_FAMILY = {"GATConv": (GATConv, _ATTENTION_CASES),
              "GATv2Conv": (GATv2Conv, _ATTENTION_CASES + [dict(heads=2, share_weights=True)])}
GAT_FAMILY_CASES = [(name, o) for name, (_, cases) in GAT_FAMILY.items() for o in cases]
GAT_FAMILY_IDS = [f"{name}-{i}" for name, (_, cases) in GAT_FAMILY.items() for i in _ids(cases)]


def _edge_attr(num_edges: int, edge_dim: int | None, seed: int = 7):
    if edge_dim is None:
        return None
    attr = randn(num_edges, edge_dim, seed=seed)
    return attr.view(-1) if edge_dim == 1 else attr  # PyG's [E] form of edge_dim=1


def _assert_square_attention(ours, theirs, in_channels: int, edge_dim: int | None):
    """An attention layer on the square graph: ``edge_index`` (with and without
    ``return_attention_weights``) and :class:`Graph`. Returns ``(ei, x, edge_attr)``."""
    ei = _square()
    x = randn(N, in_channels, seed=3)
    attr = _edge_attr(ei.size(1), edge_dim)
    assert_same_as_pyg(ours, theirs, x, ei, attr)
    assert_same_as_pyg(ours, theirs, x, ei, attr, return_attention_weights=True)
    assert_same_as_pyg(ours, theirs, x, Graph(ei, N), attr, pyg_args=(x, ei, attr))
    return ei, x, attr


@pytest.mark.parametrize("channels", [(5, 3), (3, 6)], ids=["narrow", "widen"])
@pytest.mark.parametrize("name, opts", GAT_FAMILY_CASES, ids=GAT_FAMILY_IDS)
def test_gat_family_square(name, opts, channels):
    ours, theirs = layer_pair(GAT_FAMILY[name][0], getattr(pyg_nn, name), *channels, **opts)
    ei, x, attr = _assert_square_attention(ours, theirs, channels[0], opts.get("edge_dim"))


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize(
    "name, opts", [c for c in GAT_FAMILY_CASES if "edge_dim" not in c[1]],
    ids=[i for c, i in zip(GAT_FAMILY_CASES, GAT_FAMILY_IDS) if "edge_dim" not in c[1]],
)
def test_gat_family_sparse_adjacency(name, opts, layout):
    ours, theirs = layer_pair(GAT_FAMILY[name][0], getattr(pyg_nn, name), 5, 3, **opts)
    adj = _adj_t(_square(), (N, N), layout)
    assert_same_as_pyg(ours, theirs, randn(N, 5, seed=3), adj)


GAT_PAIR_CASES = [
    dict(heads=2), dict(heads=2, add_self_loops=False), dict(heads=2, concat=False),
    dict(heads=2, residual=True), dict(heads=2, edge_dim=3), dict(heads=2, edge_dim=3, add_self_loops=False),
    dict(heads=2, edge_dim=3, fill_value=0.5),
]


def _bipartite_inputs(in_channels, edge_dim: int | None):
    """``(ei, x_src, x_dst, edge_attr)`` of the bipartite graph for a layer built with
    ``in_channels`` (``x_src`` 5 wide, ``x_dst`` of the target width)."""
    ei = _bipartite()
    in_dst = in_channels if isinstance(in_channels, int) else in_channels[1]
    return ei, randn(N_SRC, 5, seed=1), randn(N_DST, in_dst, seed=2), _edge_attr(ei.size(1), edge_dim)


@pytest.mark.parametrize("in_channels", [5, (5, 4)], ids=["shared_lin", "lin_src_dst"])
@pytest.mark.parametrize("opts", GAT_PAIR_CASES, ids=_ids(GAT_PAIR_CASES))
def test_gat_bipartite(opts, in_channels):
    ours, theirs = layer_pair(GATConv, pyg_nn.GATConv, in_channels, 3, **opts)
    ei, xs, xd, attr = _bipartite_inputs(in_channels, opts.get("edge_dim"))
    assert_same_as_pyg(ours, theirs, (xs, xd), ei, attr)
    assert_same_as_pyg(ours, theirs, (xs, xd), ei, attr, size=(N_SRC, N_DST))
    assert_same_as_pyg(ours, theirs, (xs, xd), ei, attr, return_attention_weights=True)
    assert_same_as_pyg(ours, theirs, (xs, None), ei, attr, size=(N_SRC, N_DST))
    assert_same_as_pyg(ours, theirs, (xs, xd), Graph(ei, (N_SRC, N_DST)), attr, pyg_args=((xs, xd), ei, attr))
    if not isinstance(in_channels, int):  # one tensor x through lin_src and lin_dst
        ours2, theirs2 = layer_pair(GATConv, pyg_nn.GATConv, (5, 5), 3, **opts)
        x = randn(N, 5, seed=3)
        sq = _square()
        assert_same_as_pyg(ours2, theirs2, x, sq, _edge_attr(sq.size(1), opts.get("edge_dim")))


# ============================================================================ GATv2Conv (bipartite)
GATV2_PAIR_CASES = [
    dict(heads=2), dict(heads=2, add_self_loops=False), dict(heads=2, share_weights=True),
    dict(heads=2, residual=True), dict(heads=2, edge_dim=3), dict(heads=2, edge_dim=3, fill_value="max"),
]


@pytest.mark.parametrize(
    "opts, in_channels",
    [(o, c) for o in GATV2_PAIR_CASES for c in (5, (5, 4)) if not (o.get("share_weights") and c != 5)],
    ids=[f"{i}-{c}" for i in _ids(GATV2_PAIR_CASES) for c in ("same_width", "two_widths")
         if not ("share_weights" in i and c != "same_width")],
)
def test_gatv2_bipartite(opts, in_channels):  # (share_weights needs one input width)
    ours, theirs = layer_pair(GATv2Conv, pyg_nn.GATv2Conv, in_channels, 3, **opts)
    ei, xs, xd, attr = _bipartite_inputs(in_channels, opts.get("edge_dim"))
    assert_same_as_pyg(ours, theirs, (xs, xd), ei, attr)
    assert_same_as_pyg(ours, theirs, (xs, xd), ei, attr, return_attention_weights=True)
    assert_same_as_pyg(ours, theirs, (xs, xd), Graph(ei, (N_SRC, N_DST)), attr, pyg_args=((xs, xd), ei, attr))


# ============================================================================ SAGEConv
SAGE_CASES = [
    dict(aggr=a, **o) for a in ("mean", "sum", "max", "add")
    for o in ({}, {"normalize": True}, {"root_weight": False}, {"project": True}, {"bias": False})
]


@pytest.mark.parametrize("channels", [(5, 3), (3, 6)], ids=["narrow", "widen"])
@pytest.mark.parametrize("opts", SAGE_CASES, ids=_ids(SAGE_CASES))
def test_sage(opts, channels):
    ours, theirs = layer_pair(SAGEConv, pyg_nn.SAGEConv, *channels, **opts)
    x = randn(N, channels[0], seed=3)
    _assert_forms(ours, theirs, x, _square(), (N, N), SQUARE_FORMS)


@pytest.mark.parametrize("opts", SAGE_CASES, ids=_ids(SAGE_CASES))
def test_sage_bipartite(opts):
    ours, theirs = layer_pair(SAGEConv, pyg_nn.SAGEConv, (5, 4), 3, **opts)
    ei = _bipartite()
    xs, xd = randn(N_SRC, 5, seed=1), randn(N_DST, 4, seed=2)
    _assert_forms(ours, theirs, (xs, xd), ei, (N_SRC, N_DST), SQUARE_FORMS)
    assert_same_as_pyg(ours, theirs, (xs, xd), ei, size=(N_SRC, N_DST))
    assert_same_as_pyg(ours, theirs, (xs, None), ei, size=(N_SRC, N_DST))


# ============================================================================ GINConv / GINEConv
def _mlp(width_in: int, width_out: int, hidden: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(width_in, hidden), nn.ReLU(), nn.Linear(hidden, width_out))


GIN_CASES = [dict(eps=0.0), dict(eps=0.3), dict(eps=-0.2, train_eps=True), dict(train_eps=True)]


@pytest.mark.parametrize("hidden", [3, 7], ids=["narrowing_mlp", "widening_mlp"])
@pytest.mark.parametrize("opts", GIN_CASES, ids=_ids(GIN_CASES))
def test_gin(opts, hidden):
    torch.manual_seed(0)
    ours, theirs = layer_pair(GINConv, pyg_nn.GINConv, _mlp(5, 3, hidden), **opts)
    _assert_forms(ours, theirs, randn(N, 5, seed=3), _square(), (N, N), SQUARE_FORMS)
    ei = _bipartite()
    xs, xd = randn(N_SRC, 5, seed=1), randn(N_DST, 5, seed=2)
    _assert_forms(ours, theirs, (xs, xd), ei, (N_SRC, N_DST), SQUARE_FORMS)
    assert_same_as_pyg(ours, theirs, (xs, None), ei, size=(N_SRC, N_DST))
    assert_same_as_pyg(ours, theirs, (xs, xd), ei, size=(N_SRC, N_DST))


@pytest.mark.parametrize("edge_dim", [None, 2, 7], ids=["no_edge_dim", "edge_dim2", "edge_dim7"])
@pytest.mark.parametrize("opts", GIN_CASES, ids=_ids(GIN_CASES))
def test_gine(opts, edge_dim):
    ours, theirs = layer_pair(GINEConv, pyg_nn.GINEConv, _mlp(5, 3), edge_dim=edge_dim, **opts)
    ei = _square()
    attr = randn(ei.size(1), edge_dim or 5, seed=7)
    x = randn(N, 5, seed=3)
    assert_same_as_pyg(ours, theirs, x, ei, attr)
    assert_same_as_pyg(ours, theirs, x, Graph(ei, N), attr, pyg_args=(x, ei, attr))
    bi = _bipartite()
    battr = randn(bi.size(1), edge_dim or 5, seed=8)
    xs, xd = randn(N_SRC, 5, seed=1), randn(N_DST, 5, seed=2)
    assert_same_as_pyg(ours, theirs, (xs, xd), bi, battr)
    assert_same_as_pyg(ours, theirs, (xs, None), bi, battr, size=(N_SRC, N_DST))


# ============================================================================ GraphConv
GRAPH_CONV_CASES = [dict(aggr=a, bias=b) for a in ("add", "sum", "mean", "max") for b in (True, False)]


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("channels", [(5, 3), (3, 6)], ids=["narrow", "widen"])
@pytest.mark.parametrize("opts", GRAPH_CONV_CASES, ids=_ids(GRAPH_CONV_CASES))
def test_graph_conv(opts, channels, weighted):
    ours, theirs = layer_pair(GraphConv, pyg_nn.GraphConv, *channels, **opts)
    ei = _square()
    w = random_weights(ei.size(1), seed=2).to(F64) if weighted else None
    x = randn(N, channels[0], seed=3)
    for form in ("edge_index", "graph"):
        g, _ = _graph_input(form, ei, (N, N))
        assert_same_as_pyg(ours, theirs, x, g, w, pyg_args=(x, ei, w))
    for layout in ("coo", "csr"):
        adj = _adj_t(ei, (N, N), layout, w)
        assert_same_as_pyg(ours, theirs, x, adj)
    bi = _bipartite()
    bw = random_weights(bi.size(1), seed=5).to(F64) if weighted else None
    ours2, theirs2 = layer_pair(GraphConv, pyg_nn.GraphConv, (channels[0], 4), channels[1], **opts)
    xs, xd = randn(N_SRC, channels[0], seed=1), randn(N_DST, 4, seed=2)
    assert_same_as_pyg(ours2, theirs2, (xs, xd), bi, bw)
    assert_same_as_pyg(ours2, theirs2, (xs, xd), bi, bw, size=(N_SRC, N_DST))
    assert_same_as_pyg(ours2, theirs2, (xs, None), bi, bw, size=(N_SRC, N_DST))


# ============================================================================ SGConv / APPNP
SGC_CASES = [
    dict(K=k, **o) for k in (0, 1, 3)
    for o in ({}, {"add_self_loops": False}, {"bias": False}, {"cached": True})
]


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("channels", [(5, 3), (3, 6)], ids=["narrow", "widen"])
@pytest.mark.parametrize("opts", SGC_CASES, ids=_ids(SGC_CASES))
def test_sgc(opts, channels, weighted):
    ei = _square(self_loops=False)  # see the module docstring (sparse adj_t)
    w = random_weights(ei.size(1), seed=2).to(F64) if weighted else None
    x = randn(N, channels[0], seed=3)
    for form in SQUARE_FORMS:  # a fresh pair each time: cached=True keeps the first call's
        ours, theirs = layer_pair(SGConv, pyg_nn.SGConv, *channels, **opts)
        _assert_weighted_form(ours, theirs, x, ei, w, form)
        # a second call (cached: the first call's propagation, detached)
        other = randn(N, channels[0], seed=9)
        assert_same_as_pyg(ours, theirs, other, _square(seed=5))


APPNP_CASES = [
    dict(K=k, alpha=a, **o) for k, a in ((0, 0.1), (1, 0.1), (4, 0.3))
    for o in ({}, {"normalize": False}, {"add_self_loops": False}, {"cached": True},
              {"normalize": False, "add_self_loops": False})
]


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("opts", APPNP_CASES, ids=_ids(APPNP_CASES))
def test_appnp(opts, weighted):
    ei = _square(self_loops=False)
    w = random_weights(ei.size(1), seed=2).to(F64) if weighted else None
    x = randn(N, 5, seed=3)
    opts = dict(opts)
    K, alpha = opts.pop("K"), opts.pop("alpha")
    for form in SQUARE_FORMS:
        ours, theirs = APPNP(K, alpha, aggregation="reference", **opts), pyg_nn.APPNP(K, alpha, **opts)
        _assert_weighted_form(ours, theirs, x, ei, w, form)
        assert_same_as_pyg(ours, theirs, randn(N, 5, seed=9), _square(seed=5))


# ============================================================================ TransformerConv
TRANSFORMER_CASES = [
    dict(heads=h, concat=c) for h, c in itertools.product([1, 3], [True, False])
] + [
    dict(heads=2, beta=True), dict(heads=2, concat=False, beta=True), dict(heads=2, root_weight=False),
    dict(heads=2, root_weight=False, beta=True), dict(heads=2, bias=False), dict(heads=2, edge_dim=3),
    dict(heads=2, edge_dim=7, beta=True), dict(heads=2, concat=False, edge_dim=3),
]


@pytest.mark.parametrize("channels", [(5, 3), (3, 6)], ids=["narrow", "widen"])
@pytest.mark.parametrize("opts", TRANSFORMER_CASES, ids=_ids(TRANSFORMER_CASES))
def test_transformer(opts, channels):
    ours, theirs = layer_pair(TransformerConv, pyg_nn.TransformerConv, *channels, **opts)
    ei, x, attr = _assert_square_attention(ours, theirs, channels[0], opts.get("edge_dim"))
    if attr is None:
        for layout in ("coo", "csr"):
            adj = _adj_t(ei, (N, N), layout)
            assert_same_as_pyg(ours, theirs, x, adj)
    ours2, theirs2 = layer_pair(TransformerConv, pyg_nn.TransformerConv, (channels[0], 4), channels[1], **opts)
    bi = _bipartite()
    xs, xd = randn(N_SRC, channels[0], seed=1), randn(N_DST, 4, seed=2)
    battr = _edge_attr(bi.size(1), opts.get("edge_dim"))
    assert_same_as_pyg(ours2, theirs2, (xs, xd), bi, battr)
    assert_same_as_pyg(ours2, theirs2, (xs, xd), bi, battr, return_attention_weights=True)


# ============================================================================ reset_parameters
RESET_CASES = {
    "gcn": lambda m: m.GCNConv(5, 3),
    "gat": lambda m: m.GATConv(5, 3, heads=2, edge_dim=2, residual=True),
    "gat_pair": lambda m: m.GATConv((5, 4), 3, heads=2),
    "gatv2": lambda m: m.GATv2Conv(5, 3, heads=2, edge_dim=2, residual=True),
    "gatv2_shared": lambda m: m.GATv2Conv(5, 3, heads=2, share_weights=True),
    "sage": lambda m: m.SAGEConv(5, 3, project=True),
    "sage_pair": lambda m: m.SAGEConv((5, 4), 3, bias=False),
    "gin": lambda m: m.GINConv(_mlp(5, 3), eps=0.2, train_eps=True),
    "gine": lambda m: m.GINEConv(_mlp(5, 3), eps=0.2, edge_dim=2),
    "graph_conv": lambda m: m.GraphConv((5, 4), 3),
    "sgc": lambda m: m.SGConv(5, 3, K=2),
    "transformer": lambda m: m.TransformerConv(5, 3, heads=2, edge_dim=2, beta=True),
}


@pytest.mark.parametrize("name", list(RESET_CASES))
def test_reset_parameters_draws_what_pyg_draws(name):
    """The same seed before ``reset_parameters`` gives PyG's values: the same
    initialisation (distribution, bounds and order), up to the rounding of the bound
    (``nn.Linear``'s Kaiming bound and PyG's are the same number computed in another order)."""
    import fusegnn.layers as ours_module

    ours, theirs = RESET_CASES[name](ours_module).double(), RESET_CASES[name](pyg_nn).double()
    torch.manual_seed(123)
    ours.reset_parameters()
    torch.manual_seed(123)
    theirs.reset_parameters()
    mine, want = ours.state_dict(), theirs.state_dict()
    assert sorted(mine) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(mine[key], value, rtol=1e-13, atol=1e-15, msg=lambda m: f"{key}: {m}")


# ============================================================================ return_attention_weights
ATTENTION_LAYERS = {
    "gat": (GATConv, "GATConv"), "gatv2": (GATv2Conv, "GATv2Conv"), "transformer": (TransformerConv, "TransformerConv"),
}


@pytest.mark.parametrize("flag", [None, False, True, 0, 1])
@pytest.mark.parametrize("name", list(ATTENTION_LAYERS))
def test_return_attention_weights_flag(name, flag):
    """What each PyG layer returns for each value of the flag: GAT and GATv2 test its
    truth, TransformerConv whether it is a bool (``False`` returns the pair too)."""
    ours_cls, pyg_name = ATTENTION_LAYERS[name]
    ours, theirs = layer_pair(ours_cls, getattr(pyg_nn, pyg_name), 5, 3, heads=2)
    ei, x = _square(), randn(N, 5, seed=3)
    got, want = ours(x, ei, return_attention_weights=flag), theirs(x, ei, return_attention_weights=flag)
    assert type(got) is type(want)
    assert_same_as_pyg(ours, theirs, x, ei, return_attention_weights=flag)


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("add_self_loops", [True, False], ids=["loops", "no_loops"])
@pytest.mark.parametrize("name", list(ATTENTION_LAYERS))
def test_attention_weights_of_a_sparse_adjacency(name, add_self_loops, layout):
    """On a ``torch.sparse`` ``adj_t``, PyG's GAT / GATv2 return the processed matrix with
    alpha as its values (and alpha in its row-major order); TransformerConv the input
    matrix itself. Compared entry by entry (indices exactly), with gradients through both."""
    ours_cls, pyg_name = ATTENTION_LAYERS[name]
    opts = dict(heads=2) if name == "transformer" else dict(heads=2, add_self_loops=add_self_loops)
    ours, theirs = layer_pair(ours_cls, getattr(pyg_nn, pyg_name), 5, 3, **opts)
    adj = _adj_t(_square(), (N, N), layout)
    x = randn(N, 5, seed=3)
    _, (matrix, alpha) = assert_same_as_pyg(ours, theirs, x, adj, return_attention_weights=True)
    if name != "transformer":
        torch.testing.assert_close(matrix.values(), alpha, rtol=0, atol=0)
    else:
        assert matrix is adj


# ============================================================================ more inputs
def _all_layers():
    """``name -> (build(module, in_channels), needs_edge_attr, takes_pair)`` for every layer."""
    return {
        "gcn": (lambda m, c: m.GCNConv(c, 3), False, False),
        "gat": (lambda m, c: m.GATConv(c, 3, heads=2, dropout=0.5), False, True),
        "gat_edges": (lambda m, c: m.GATConv(c, 3, heads=2, edge_dim=2, residual=True), True, True),
        "gatv2": (lambda m, c: m.GATv2Conv(c, 3, heads=2, dropout=0.5, residual=True), False, True),
        "gatv2_edges": (lambda m, c: m.GATv2Conv(c, 3, heads=2, edge_dim=2), True, True),
        "sage": (lambda m, c: m.SAGEConv(c, 3), False, True),
        "sage_max": (lambda m, c: m.SAGEConv(c, 3, aggr="max"), False, True),
        "graph_conv": (lambda m, c: m.GraphConv(c, 3, aggr="mean"), False, True),
        "sgc": (lambda m, c: m.SGConv(c, 3, K=2), False, False),
        "transformer": (lambda m, c: m.TransformerConv(c, 3, heads=2, beta=True, dropout=0.5), False, True),
        "transformer_edges": (lambda m, c: m.TransformerConv(c, 3, heads=2, edge_dim=2), True, True),
    }


def _built_pair(name: str, in_channels):
    import fusegnn.layers as ours_module

    build = _all_layers()[name][0]
    torch.manual_seed(0)
    theirs = build(pyg_nn, in_channels).double().eval()  # eval: dropout off
    ours = build(ours_module, in_channels).double().eval()
    return ours, theirs


def _randomise_and_copy(ours, theirs) -> None:
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    ours.load_state_dict(theirs.state_dict(), strict=True)


@pytest.mark.parametrize("name", list(_all_layers()))
def test_eval_mode_and_empty_graph(name):
    """``eval()`` turns attention dropout off as in PyG; a graph without edges."""
    ours, theirs = _built_pair(name, 5)
    _randomise_and_copy(ours, theirs)
    x = randn(N, 5, seed=3)
    needs_attr = _all_layers()[name][1]
    for ei in (_square(), torch.empty(2, 0, dtype=torch.int64)):
        attr = randn(ei.size(1), 2, seed=7) if needs_attr else None
        assert_same_as_pyg(ours, theirs, x, ei, *((attr,) if needs_attr else ()))


@pytest.mark.parametrize("name", list(_all_layers()))
def test_lazy_in_channels(name):
    """``in_channels=-1`` (and ``(-1, -1)`` where the layer takes a pair): the parameters
    get PyG's shapes at the first forward, and the layers then agree."""
    takes_pair = _all_layers()[name][2]
    needs_attr = _all_layers()[name][1]
    for in_channels in ([-1, (-1, -1)] if takes_pair else [-1]):
        ours, theirs = _built_pair(name, in_channels)
        if isinstance(in_channels, tuple):
            x, ei = (randn(N_SRC, 5, seed=1), randn(N_DST, 4, seed=2)), _bipartite()
        else:
            x, ei = randn(N, 5, seed=3), _square()
        rest = (randn(ei.size(1), 2, seed=7),) if needs_attr else ()
        ours(x, ei, *rest), theirs(x, ei, *rest)  # materialise
        _randomise_and_copy(ours, theirs)  # (load_state_dict checks every shape)
        assert_same_as_pyg(ours, theirs, x, ei, *rest)


@pytest.mark.parametrize("fill_value", [torch.tensor([0.5, -1.0], dtype=F64), -2.0], ids=["tensor", "float"])
@pytest.mark.parametrize("name", ["GATConv", "GATv2Conv"])
def test_gat_fill_values_and_more_targets_than_sources(name, fill_value):
    """Loops ``i -> i`` for ``i < min(N_src, N_dst)`` when targets outnumber sources.
    (A reduction ``fill_value`` such as ``"sum"`` is left out: PyG 2.8 then scatters
    target indices into ``min(N_src, N_dst)`` rows and fails with an IndexError.)"""
    import fusegnn.layers as ours_module

    ours, theirs = layer_pair(getattr(ours_module, name), getattr(pyg_nn, name), (5, 4), 3, heads=2, edge_dim=2,
                              fill_value=fill_value)
    ei = random_graph(N_DST, E_BIP, seed=4, num_dst_nodes=N_SRC, hub_degree=5)  # 6 sources, 9 targets
    xs, xd = randn(N_DST, 5, seed=1), randn(N_SRC, 4, seed=2)
    attr = randn(ei.size(1), 2, seed=7)
    assert_same_as_pyg(ours, theirs, (xs, xd), ei, attr)
    assert_same_as_pyg(ours, theirs, (xs, xd), ei, attr, return_attention_weights=True)
    sq_ours, sq_theirs = layer_pair(getattr(ours_module, name), getattr(pyg_nn, name), 5, 3, heads=2, edge_dim=2,
                                    fill_value=fill_value)
    sq = _square()
    assert_same_as_pyg(sq_ours, sq_theirs, randn(N, 5, seed=3), sq, randn(sq.size(1), 2, seed=7))


# ============================================================================ signatures
LAYER_NAMES = ["GCNConv", "GATConv", "GATv2Conv", "SAGEConv", "GINConv", "GINEConv", "SGConv", "APPNP", "GraphConv",
               "TransformerConv"]


@pytest.mark.parametrize("name", LAYER_NAMES)
def test_signatures_are_pygs(name):
    """Constructor and forward: PyG's parameter names, order and defaults (fusegnn adds
    ``aggregation``), so keyword calls such as ``conv(x=x, edge_index=ei)`` work unchanged."""
    import inspect

    import fusegnn.layers as ours_module

    def params(cls, method):
        return [(p.name, p.default) for p in inspect.signature(getattr(cls, method)).parameters.values()
                if p.kind is not p.VAR_KEYWORD and p.name not in ("self", "aggregation")]

    for method in ("__init__", "forward"):
        assert params(getattr(ours_module, name), method) == params(getattr(pyg_nn, name), method), method


@pytest.mark.parametrize("name", ["GCNConv", "GATConv", "SAGEConv", "GraphConv", "TransformerConv"])
def test_keyword_calls(name):
    import fusegnn.layers as ours_module

    ours, theirs = layer_pair(getattr(ours_module, name), getattr(pyg_nn, name), 5, 3)
    x, ei = randn(N, 5, seed=3), _square()
    assert_same_as_pyg(ours, theirs, x=x, edge_index=ei)
