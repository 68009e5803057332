"""``torch.compile`` of the sparse ops and the example models (:mod:`fusegnn.sparse.library`).

On the CPU, with ``backend="aot_eager"`` (Dynamo + AOTAutograd, no code generation) and
``fullgraph=True``, so any graph break fails the test:

* the GCN and GAT models of :mod:`fusegnn.models` (eval mode, so outputs compare) give
  the eager outputs and gradients on the reference path and, through Triton's CPU
  interpreter, with ``aggregation="gas"`` / ``"gar"`` forced; a training-mode run trains;
* the ops themselves (``spmm`` with weights that require grad, ``sddmm``,
  ``edge_softmax``, ``gat_attention``), forward and backward, against eager;
* ``torch._dynamo.explain`` counts zero graph breaks; a second graph recompiles once and
  a third reuses the code (the graph handle becomes a symbolic integer);
* ``torch.library.opcheck`` on every custom op.

GPU tests (skipped without CUDA): the default inductor backend, fullgraph, GCN and GAT on
a 2000-node random graph, forward and backward against eager.

Dynamo's caches are reset around every test.
"""

from __future__ import annotations

import copy
import gc
import os

import torch

if not torch.cuda.is_available():  # fused kernels run through Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch._dynamo  # noqa: E402
import torch._dynamo.testing  # noqa: E402

from fusegnn.layers import GATConv, GCNConv  # noqa: E402
from fusegnn.models import GAT, GCN  # noqa: E402
from fusegnn.sparse import Graph, edge_softmax, gat_attention, sddmm, spmm  # noqa: E402
from fusegnn.sparse import library  # noqa: E402
from fusegnn.sparse.dispatch import last_backend  # noqa: E402
from fusegnn.sparse.graph import graph_by_uid  # noqa: E402
from tests.graphs import random_graph  # noqa: E402

CUDA = torch.cuda.is_available()
F64 = torch.float64
ops = torch.ops.fusegnn

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is a test dependency
    HAVE_TRITON = False

# CPU tensors run the fused kernels only through Triton's interpreter, i.e. without CUDA;
# with a GPU the inductor tests at the end run them on CUDA instead
needs_triton = pytest.mark.skipif(
    not HAVE_TRITON or CUDA,
    reason="fused kernels on CPU tensors need Triton's interpreter (no CUDA); the GPU tests cover CUDA",
)
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graph(n: int = 14, e: int = 48, seed: int = 1, **kw) -> Graph:
    """Isolated nodes, self-loops, duplicates, a small hub: the cases that break sparse code."""
    return Graph(random_graph(n, e, seed=seed, hub_degree=6, **kw), n)


def _rand(*shape, seed: int, dtype=F64, requires_grad: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(requires_grad)


def _compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def _grads(outputs, inputs):
    """Gradients of a fixed random projection of ``outputs`` (every output element matters)."""
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    gen = torch.Generator().manual_seed(123)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)).sum() for o in outputs)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def _assert_same(compiled_out, eager_out, inputs, **tol):
    c = compiled_out if isinstance(compiled_out, (tuple, list)) else (compiled_out,)
    e = eager_out if isinstance(eager_out, (tuple, list)) else (eager_out,)
    assert len(c) == len(e)
    for a, b in zip(c, e):
        torch.testing.assert_close(a, b, **tol)
    for a, b in zip(_grads(c, inputs), _grads(e, inputs)):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, **tol)


def _tol(aggregation: str) -> dict:
    # fused kernels sum in another order than the reference: float64 rounding only
    return {} if aggregation == "reference" else dict(rtol=1e-10, atol=1e-12)


AGGREGATIONS = [
    "auto",  # the reference on the CPU
    pytest.param("gas", marks=needs_triton),
    pytest.param("gar", marks=needs_triton),
]


def _model(kind: str, aggregation: str, dropout: float = 0.0, cached: bool = True):
    torch.manual_seed(0)
    if kind == "gcn":
        return GCN(6, 8, 3, dropout=dropout, cached=cached, aggregation=aggregation).double()
    # 6 -> 2 heads x 8 -> 3: the first layer aggregates first (6 < 8, an expanded view of x
    # goes into the op), the second transforms first: both GATConv code paths
    return GAT(6, 8, 3, heads=2, dropout=dropout, aggregation=aggregation).double()


# ------------------------------------------------------------------------------ models
@pytest.mark.parametrize("kind", ["gcn", "gat"])
def test_models_have_no_graph_break(kind):
    model = _model(kind, "auto").eval()
    graph = _graph()
    x = _rand(graph.num_nodes, 6, seed=0)
    explanation = torch._dynamo.explain(model)(x, graph)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    ops_in_graph = {
        str(node.target)
        for g in explanation.graphs
        for node in g.graph.nodes
        if node.op == "call_function"
    }
    expected = "fusegnn.spmm.default" if kind == "gcn" else "fusegnn.gat_attention.default"
    assert expected in ops_in_graph


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("kind", ["gcn", "gat"])
def test_models_match_eager(kind, aggregation):
    model = _model(kind, aggregation).eval()
    graph = _graph()
    x = _rand(graph.num_nodes, 6, seed=0)
    compiled = _compiled(model)
    params = list(model.parameters()) + [x]
    _assert_same(compiled(x, graph), model(x, graph), params, **_tol(aggregation))
    expected = "reference" if aggregation == "auto" else aggregation
    assert last_backend() == expected  # recorded at run time, inside the op


@pytest.mark.parametrize("kind", ["gcn", "gat"])
def test_models_train_compiled(kind):
    """Training mode (dropout on features and, in GAT, on attention): the compiled model
    trains. Dropout masks differ from eager's, so only progress is checked."""
    torch.manual_seed(0)
    graph = _graph(24, 90, seed=3)
    x = _rand(graph.num_nodes, 6, seed=4, requires_grad=False)
    labels = torch.randint(0, 3, (graph.num_nodes,), generator=torch.Generator().manual_seed(5))
    model = _model(kind, "auto", dropout=0.3)

    def eval_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(model(x, graph), labels).item()
        model.train()
        return loss

    before = eval_loss()
    compiled = _compiled(model.train())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(60):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(compiled(x, graph), labels)
        loss.backward()
        assert torch.isfinite(loss)
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        optimizer.step()
    after = eval_loss()
    assert after < 0.85 * before, (before, after)  # eager reaches about the same


def test_gat_dropout_compiled_is_reproducible_and_differentiable():
    """The seed is drawn in the compiled graph from torch's generator: a fixed
    ``torch.manual_seed`` gives the same mask, and gradients are those of that mask."""
    graph = _graph()
    h = _rand(graph.num_nodes, 2, 3, seed=1)
    s = _rand(graph.num_nodes, 2, seed=2)
    t = _rand(graph.num_nodes, 2, seed=3)

    def fn(h, s, t, graph):
        return gat_attention(graph, h, s, t, dropout=0.5, training=True, return_alpha=True)

    compiled = _compiled(fn)
    torch.manual_seed(7)
    out1, alpha1 = compiled(h, s, t, graph)
    torch.manual_seed(7)
    out2, alpha2 = compiled(h, s, t, graph)
    torch.testing.assert_close(out1, out2)
    assert (alpha1 == 0).any() and (alpha1 > 0).any()
    # out is exactly the SpMM of the returned (dropped-out) coefficients
    torch.testing.assert_close(out1, spmm(graph, h, alpha1.detach()), rtol=1e-12, atol=1e-12)
    gh, gs, gt = _grads((out1, alpha1), (h, s, t))
    assert all(torch.isfinite(g).all() for g in (gh, gs, gt))
    # the h gradient of a fixed mask is the transposed SpMM with those coefficients
    torch.manual_seed(7)
    out3, alpha3 = compiled(h, s, t, graph)
    (gh3,) = torch.autograd.grad(out3.sum(), h)
    reverse = Graph(graph.edge_index.flip(0), graph.num_nodes)
    expected = spmm(reverse, torch.ones_like(out3), alpha3.detach())
    torch.testing.assert_close(gh3, expected, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ layers
def test_gcn_weights_that_require_grad():
    """Weights given to forward, stored on the graph, with and without normalisation:
    the compiled layer gives eager's values and weight gradients."""
    graph = _graph()
    x = _rand(graph.num_nodes, 6, seed=0)
    w = (torch.rand(graph.num_edges, dtype=F64, generator=torch.Generator().manual_seed(1)) + 0.1)
    w.requires_grad_()
    for normalize, improved in ((True, False), (True, True), (False, False)):
        torch.manual_seed(0)
        layer = GCNConv(6, 4, normalize=normalize, improved=improved).double()
        compiled = _compiled(layer)
        _assert_same(compiled(x, graph, w), layer(x, graph, w), [x, w, layer.lin.weight])
        weighted = graph.with_edge_weight(w)
        _assert_same(compiled(x, weighted), layer(x, weighted), [x, w, layer.lin.weight])
        torch._dynamo.reset()


def test_gcn_cached_layer_uses_the_eager_cache():
    graph = _graph()
    x = _rand(graph.num_nodes, 6, seed=0)
    torch.manual_seed(0)
    layer = GCNConv(6, 4, cached=True).double()
    eager = layer(x, graph)  # stores the normalised graph on the layer
    other = _graph(seed=9)  # like PyG, a cached layer ignores the graph passed next
    _assert_same(_compiled(layer)(x, other), eager, [x, layer.lin.weight])


def test_gat_attention_weights_compiled():
    """With self-loops the edge count is only known at run time (an unbacked size)."""
    graph = _graph()
    x = _rand(graph.num_nodes, 6, seed=0)
    torch.manual_seed(0)
    layer = GATConv(6, 3, heads=2).double().eval()
    compiled = _compiled(lambda x, g: layer(x, g, return_attention_weights=True))
    out_c, (ei_c, alpha_c) = compiled(x, graph)
    out_e, (ei_e, alpha_e) = layer(x, graph, return_attention_weights=True)
    torch.testing.assert_close(out_c, out_e)
    assert torch.equal(ei_c, ei_e) and ei_c.dtype == ei_e.dtype
    assert ei_c.data_ptr() != ei_e.data_ptr()  # a copy: the graph's tensor is not handed out
    _assert_same((out_c, alpha_c), (out_e, alpha_e), [x, layer.lin.weight, layer.att_src])


def test_models_accept_an_edge_index_tensor():
    """A bare edge_index: each op builds (and validates) the graph when it runs."""
    graph = _graph()
    x = _rand(graph.num_nodes, 6, seed=0)
    for kind in ("gcn", "gat"):
        model = _model(kind, "auto").eval()
        _assert_same(_compiled(model)(x, graph.edge_index), model(x, graph.edge_index), [x])
        torch._dynamo.reset()
    bad = graph.edge_index.clone()
    bad[0, 0] = graph.num_nodes + 3
    model = _model("gcn", "auto").eval()
    with pytest.raises(IndexError, match="source node id"):
        _compiled(model)(x, bad)


@pytest.mark.parametrize("kind", ["gcn", "gat"])
def test_other_graphs_recompile_once_then_reuse(kind):
    """The first compilation specialises the graph's handle and sizes; a second graph
    recompiles with the handle symbolic, a graph of other sizes with the sizes symbolic;
    from then on every graph reuses the code."""
    model = _model(kind, "auto", cached=False).eval()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    sizes = [(14, 48), (14, 48), (20, 60), (25, 90), (14, 48), (31, 70)]
    frames = []
    for seed, (n, e) in enumerate(sizes):
        graph = _graph(n, e, seed=seed)
        x = _rand(n, 6, seed=seed)
        _assert_same(compiled(x, graph), model(x, graph), [x] + list(model.parameters()))
        frames.append(counter.frame_count)
    assert frames == [1, 2, 3, 3, 3, 3]


def test_backward_after_the_graph_is_gone():
    """``model(x, Graph(...))`` with nobody keeping the graph: the backward ops rebuild it
    from the edge list autograd kept (eagerly, the autograd nodes keep the graph)."""
    spec = _graph()
    ei, n = spec.edge_index, spec.num_nodes
    w = torch.rand(spec.num_edges, dtype=F64, generator=torch.Generator().manual_seed(2)) + 0.1
    for kind, weighted in (("gcn", False), ("gcn", True), ("gat", False)):
        model = _model(kind, "auto", cached=False).eval()
        compiled = _compiled(model)
        x = _rand(n, 6, seed=0)
        out = compiled(x, Graph(ei, n, w if weighted else None))
        gc.collect()
        expected = model(x, Graph(ei, n, w if weighted else None))
        params = [x] + list(model.parameters())
        _assert_same(out, expected, params)
        torch._dynamo.reset()


# ------------------------------------------------------------------------------ ops
@pytest.mark.parametrize("aggregation", ["reference", pytest.param("gas", marks=needs_triton),
                                         pytest.param("gar", marks=needs_triton)])
def test_spmm_compiled(aggregation):
    graph = _graph()
    n, e = graph.num_nodes, graph.num_edges
    x = _rand(n, 5, seed=0)
    w = _rand(e, seed=1)
    x3 = _rand(n, 2, 3, seed=2)
    wh = _rand(e, 2, seed=3)

    def fn(x, w, x3, wh, graph):
        return (
            spmm(graph, x, w, aggregation=aggregation),
            spmm(graph, x, w, reduce="mean", aggregation=aggregation),
            spmm(graph, x3, wh, aggregation=aggregation),  # per-head weights
            spmm(graph, x3, w, aggregation=aggregation),  # one weight for every head
            spmm(graph, x, aggregation=aggregation),  # unweighted
        )

    _assert_same(_compiled(fn)(x, w, x3, wh, graph), fn(x, w, x3, wh, graph), [x, w, x3, wh],
                 **_tol(aggregation))


def test_spmm_compiled_max_and_stored_weight():
    graph = _graph()
    x = _rand(graph.num_nodes, 5, seed=0)
    w = _rand(graph.num_edges, seed=1)
    weighted = graph.with_edge_weight(w)

    def fn(x, graph, weighted):
        return spmm(graph, x, w, reduce="max"), spmm(weighted, x)  # the graph's own weights

    _assert_same(_compiled(fn)(x, graph, weighted), fn(x, graph, weighted), [x, w])


@pytest.mark.parametrize("aggregation", ["reference", pytest.param("gar", marks=needs_triton)])
def test_sddmm_and_edge_softmax_compiled(aggregation):
    graph = _graph()
    n = graph.num_nodes
    a = _rand(n, 2, 4, seed=0)
    b = _rand(n, 2, 4, seed=1)
    a1 = _rand(n, 3, seed=2)
    b1 = _rand(n, 3, seed=3)
    masked = torch.zeros(graph.num_edges, 2, dtype=torch.bool)
    masked[::5, 0] = True

    def fn(a, b, a1, b1, graph):
        scores = sddmm(graph, a, b, "dot", aggregation=aggregation)  # [E, 2]
        scores = scores.masked_fill(masked, float("-inf"))
        return (
            edge_softmax(graph, scores, aggregation=aggregation),
            edge_softmax(graph, sddmm(graph, a1, b1, "dot", aggregation=aggregation), aggregation=aggregation),
            sddmm(graph, a1, b1, "add", aggregation=aggregation),
            sddmm(graph, a1, b1, "sub", aggregation=aggregation),
            sddmm(graph, a, b, "mul", aggregation=aggregation),
        )

    _assert_same(_compiled(fn)(a, b, a1, b1, graph), fn(a, b, a1, b1, graph), [a, b, a1, b1],
                 **_tol(aggregation))


@pytest.mark.parametrize("aggregation", ["reference", pytest.param("gas", marks=needs_triton),
                                         pytest.param("gar", marks=needs_triton)])
def test_gat_attention_compiled(aggregation):
    graph = _graph()
    n = graph.num_nodes
    h = _rand(n, 2, 3, seed=0)
    s = _rand(n, 2, seed=1)
    t = _rand(n, 2, seed=2)
    h1, s1, t1 = _rand(n, 20, seed=3), _rand(n, seed=4), _rand(n, seed=5)  # one head, padded width

    def fn(h, s, t, h1, s1, t1, graph):
        out, alpha = gat_attention(graph, h, s, t, return_alpha=True, aggregation=aggregation)
        out1 = gat_attention(graph, h1, s1, t1, negative_slope=0.1, aggregation=aggregation)
        return out, alpha, out1

    _assert_same(_compiled(fn)(h, s, t, h1, s1, t1, graph), fn(h, s, t, h1, s1, t1, graph),
                 [h, s, t, h1, s1, t1], **_tol(aggregation))


def test_ops_compiled_on_an_edge_index_tensor():
    graph = _graph()
    ei = graph.edge_index
    x = _rand(graph.num_nodes, 5, seed=0)
    w = _rand(graph.num_edges, 2, seed=1)

    def fn(x, w, ei):
        scores = sddmm(ei, x, x, "dot")
        return spmm(ei, x, scores), edge_softmax(ei, w)

    _assert_same(_compiled(fn)(x, w, ei), fn(x, w, ei), [x, w])


def test_ops_reject_bad_input_while_tracing():
    """The eager checks run while Dynamo traces: without fullgraph the call falls back to
    eager and raises the eager error; with fullgraph Dynamo reports it."""
    graph = _graph()
    x = _rand(graph.num_nodes + 1, 5, seed=0)
    with pytest.raises(ValueError, match="rows but the graph needs"):
        torch.compile(lambda x, g: spmm(g, x), backend="aot_eager")(x, graph)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        torch.compile(lambda x, g: spmm(g, x, aggregation="fast"), backend="aot_eager")(x[:-1], graph)
    with pytest.raises(Exception, match="rows but the graph needs"):
        _compiled(lambda x, g: spmm(g, x))(x, graph)


# ------------------------------------------------------------------------------ handles
def test_graph_handles():
    graph = _graph()
    assert graph_by_uid(graph.uid) is graph
    others = [graph.with_edge_weight(None), copy.copy(graph), copy.deepcopy(graph), graph.to("cpu")]
    assert graph.to("cpu") is graph
    uids = {g.uid for g in others[:3]} | {graph.uid}
    assert len(uids) == 4
    for other in others[:3]:
        assert graph_by_uid(other.uid) is other
    uid = others[1].uid
    del others
    gc.collect()
    with pytest.raises(LookupError, match="no live fusegnn Graph"):
        graph_by_uid(uid)


def test_graph_ref_checks():
    with pytest.raises(TypeError, match="int32 or int64"):
        library.graph_ref(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"shape \[2, E\]"):
        library.graph_ref(torch.zeros(3, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="Graph or an edge_index"):
        library.graph_ref([[0], [1]])
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        library.gcn_transform(False, True, torch.int64)


# ------------------------------------------------------------------------------ opcheck
def _opcheck_cases():
    graph = _graph()
    keep = graph  # the handle must stay alive while the checks run
    n, e = graph.num_nodes, graph.num_edges
    uid = graph.uid
    x = _rand(n, 5, seed=0)
    w = _rand(e, seed=1)
    w_pos = (w.detach().abs() + 0.1).requires_grad_()  # GCN degrees must stay positive
    x3 = _rand(n, 2, 3, seed=2)
    wh = _rand(e, 2, seed=3)
    a, b = _rand(n, 2, 4, seed=4), _rand(n, 2, 4, seed=5)
    scores = _rand(e, 2, seed=6)
    h, s, t = _rand(n, 2, 3, seed=7), _rand(n, 2, seed=8), _rand(n, 2, seed=9)
    u = _rand(e, 2, seed=12)  # per-edge score addend
    seed = torch.tensor([11])
    base = (uid, None, n, n, e, "")
    gcn = (uid, None, n, n, -1, library.gcn_transform(False, True, F64))
    loops = (uid, None, n, n, -1, library.GAT_SELF_LOOPS)
    bare = (-1, graph.edge_index, n, n, e, "")
    grad = _rand(n, 5, seed=10, requires_grad=False)
    cases = [
        ("spmm", ops.spmm.default, base + (x, w, "sum", "auto")),
        ("spmm mean", ops.spmm.default, base + (x, None, "mean", "auto")),
        ("spmm max", ops.spmm.default, base + (x, w, "max", "auto")),
        ("spmm heads", ops.spmm.default, base + (x3, wh, "sum", "auto")),
        ("spmm edge_index", ops.spmm.default, bare + (x, w, "sum", "auto")),
        ("spmm gcn", ops.spmm.default, gcn + (x, None, "sum", "auto")),
        ("spmm gcn weights", ops.spmm.default, gcn + (x, w_pos, "sum", "auto")),
        ("spmm_backward", ops.spmm_backward.default,
         base + (grad, x.detach(), w.detach(), True, True, "sum", "auto")),
        ("sddmm dot", ops.sddmm.default, base + (a, b, "dot", "auto")),
        ("sddmm mul", ops.sddmm.default, base + (a, b, "mul", "auto")),
        ("sddmm_backward", ops.sddmm_backward.default,
         base + (scores.detach(), a.detach(), b.detach(), "dot", True, False, "auto")),
        ("edge_softmax", ops.edge_softmax.default, base + (scores, "auto")),
        ("edge_softmax_backward", ops.edge_softmax_backward.default,
         base + (scores.detach().softmax(0), scores.detach(), "auto")),
        ("gat", ops.gat_attention.default, base + (h, s, t, None, None, 0.2, 0.0, True, "auto")),
        ("gat loops dropout", ops.gat_attention.default, loops + (h, s, t, None, seed, 0.2, 0.5, False, "auto")),
        ("gat loops alpha", ops.gat_attention.default, loops + (h, s, t, None, seed, 0.2, 0.5, True, "auto")),
        ("gat edge scores", ops.gat_attention.default, base + (h, s, t, u, None, 0.2, 0.0, True, "auto")),
        ("edge_index", ops.edge_index.default, loops + (torch.int64, torch.device("cpu"))),
    ]
    return keep, cases


def test_opcheck_every_op():
    keep, cases = _opcheck_cases()
    for name, op, args in cases:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), (name, result)
    gat_out = ops.gat_attention.default(*cases[13][2])
    out, lse, alpha = (o.detach() for o in gat_out)
    h, s, t = (a.detach() for a in cases[13][2][6:9])
    args = cases[13][2][:6] + (h, s, t, None, None, out, lse, alpha, torch.ones_like(out), torch.ones_like(alpha),
                               0.2, 0.0, "auto")
    result = torch.library.opcheck(ops.gat_attention_backward.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result
    del keep


# ------------------------------------------------------------------------------ one processing route
def test_eager_layers_and_ops_share_one_gcn_normalisation(monkeypatch):
    """The eager GCN layer and the ``fusegnn::spmm`` op's transform normalise through one
    function, cached once on the input graph; weights that require grad are not cached."""
    from fusegnn.sparse.processing import gcn_norm, gcn_normalized, transformed

    graph = _graph()
    normed = gcn_normalized(graph, dtype=F64)
    assert gcn_normalized(graph, dtype=F64) is normed
    torch.testing.assert_close(normed.edge_weight, gcn_norm(graph, dtype=F64).edge_weight)
    g, w = transformed(graph, library.gcn_transform(False, True, F64))
    assert g is normed and w is normed.edge_weight
    fresh = _graph(seed=3)
    layer = GCNConv(4, 3).double()
    eager_out = layer(_rand(fresh.num_nodes, 4, seed=0), fresh)

    def no_second_normalisation(*args, **kwargs):
        raise AssertionError("normalised again")

    # the eager layer's normalisation is the one the op's transform finds on the graph
    monkeypatch.setattr("fusegnn.sparse.processing.gcn_norm", no_second_normalisation)
    transformed(fresh, library.gcn_transform(False, True, F64))
    torch.testing.assert_close(layer(_rand(fresh.num_nodes, 4, seed=0), fresh), eager_out)
    monkeypatch.undo()
    weighted = graph.with_edge_weight(_rand(graph.num_edges, seed=1).abs())
    assert gcn_normalized(weighted) is not gcn_normalized(weighted)
    other = _rand(graph.num_edges, seed=2, requires_grad=False).abs()
    g2, w2 = transformed(graph, library.gcn_transform(False, True, F64), other)
    torch.testing.assert_close(w2, gcn_norm(graph, other, dtype=F64).edge_weight)


# ------------------------------------------------------------------------------ one description per op
def _gather_scaled(og, x, weight, scale):
    """A toy op: per edge ``scale * w_e * x[src_e]`` (``w`` the processed graph's weights)."""
    w = og.weight if og.weight is not None else x.new_ones(og.graph.num_edges)
    return scale * w.unsqueeze(-1) * x.index_select(0, og.graph.src.long())


def _gather_scaled_backward(og, grad, x, weight, need_x, need_weight, scale):
    w = og.weight if og.weight is not None else grad.new_ones(og.graph.num_edges)
    gx = grad.new_zeros(x.shape).index_add(0, og.graph.src.long(), scale * w.unsqueeze(-1) * grad) if need_x else None
    gw = (scale * grad * x.index_select(0, og.graph.src.long())).sum(-1) if need_weight else None
    return gx, gw


@pytest.fixture(scope="module")
def toy_op():
    """``fusegnn::_test_gather_scaled``, registered from one :class:`library.OpSpec`."""
    return library.register_op(library.OpSpec(
        name="_test_gather_scaled",
        inputs="Tensor x, Tensor? weight, float scale",
        outputs=("out",),
        forward=_gather_scaled,
        fake=lambda sizes, x, weight, scale: x.new_empty((sizes.edges(),) + tuple(x.shape[1:])),
        weighted="weight",
        backward_inputs="Tensor grad, Tensor x, Tensor? weight, bool need_x, bool need_weight, float scale",
        differentiable=("x", "weight"),
        backward=_gather_scaled_backward,
        backward_fake=lambda sizes, grad, x, weight, need_x, need_weight, scale: (
            x.new_empty(x.shape) if need_x else None,
            grad.new_empty(grad.shape[:1]) if need_weight else None,
        ),
    ))


def test_register_op_makes_op_backward_and_autograd(toy_op):
    """One OpSpec gives the forward op, the backward op (schemas as described), the fakes
    and the autograd: compiled forward and gradients equal the eager composition, a
    gradient nobody asks for is not computed, and opcheck passes on both ops."""
    assert "Tensor x, Tensor? weight, float scale) -> Tensor" in str(ops._test_gather_scaled.default._schema)
    assert "bool need_weight, float scale) -> (Tensor, Tensor)" in str(
        ops._test_gather_scaled_backward.default._schema
    )
    graph = _graph()
    keep = graph
    n, e = graph.num_nodes, graph.num_edges
    x, w = _rand(n, 3, seed=0), _rand(e, seed=1)
    args = (graph.uid, None, n, n, e, "")

    def eager(x, w):
        return 2.5 * w.unsqueeze(-1) * x[graph.src.long()]

    compiled = _compiled(lambda x, w: toy_op(*args, x, w, 2.5))
    _assert_same(compiled(x, w), eager(x, w), (x, w))
    # only x asks for a gradient: the backward op is told so and returns a placeholder for w
    gx, = torch.autograd.grad(toy_op(*args, x, w.detach(), 2.5).sum(), (x,))
    torch.testing.assert_close(gx, torch.autograd.grad(eager(x, w.detach()).sum(), (x,))[0])
    _, gw = ops._test_gather_scaled_backward(*args, torch.ones(e, 3, dtype=F64), x.detach(), w.detach(),
                                             True, False, 2.5)
    assert gw.shape == (0,)
    for op, op_args in [
        (ops._test_gather_scaled.default, args + (x, w, 2.5)),
        (ops._test_gather_scaled.default, args + (x, None, 0.5)),
        (ops._test_gather_scaled_backward.default,
         args + (torch.ones(e, 3, dtype=F64), x.detach(), w.detach(), True, True, 2.5)),
    ]:
        result = torch.library.opcheck(op, op_args)
        assert all(v == "SUCCESS" for v in result.values()), result
    del keep


# ------------------------------------------------------------------------------ GPU
def _gpu_graph() -> Graph:
    return Graph(random_graph(2000, 24000, seed=0, hub_degree=300, device="cuda"), 2000)


@gpu
@pytest.mark.parametrize("aggregation", ["auto", "gas", "gar"])
@pytest.mark.parametrize("kind", ["gcn", "gat"])
def test_models_inductor_gpu(kind, aggregation):
    """The default inductor backend, fullgraph, forward + backward against eager."""
    graph = _gpu_graph()
    torch.manual_seed(0)
    if kind == "gcn":
        model = GCN(64, 32, 7, aggregation=aggregation)
    else:
        model = GAT(64, 8, 7, heads=4, aggregation=aggregation)
    model = model.cuda().eval()
    x = torch.randn(graph.num_nodes, 64, device="cuda", requires_grad=True)
    compiled = torch.compile(model, fullgraph=True)
    out_c = compiled(x, graph)
    out_e = model(x, graph)
    torch.testing.assert_close(out_c, out_e, rtol=1e-4, atol=1e-5)
    params = list(model.parameters()) + [x]
    for a, b in zip(_grads(out_c, params), _grads(out_e, params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # training mode compiles and runs too (dropout masks differ from eager's)
    model.train()
    loss = compiled(x, graph).square().mean()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@gpu
@pytest.mark.parametrize("aggregation", ["auto", "gas", "gar"])
def test_ops_inductor_gpu(aggregation):
    graph = _gpu_graph()
    n, e = graph.num_nodes, graph.num_edges
    x = torch.randn(n, 4, 16, device="cuda", requires_grad=True)
    w = torch.rand(e, 4, device="cuda", requires_grad=True)
    s = torch.randn(n, 4, device="cuda", requires_grad=True)
    t = torch.randn(n, 4, device="cuda", requires_grad=True)

    agg = dict(aggregation=aggregation)

    def fn(x, w, s, t, graph):
        scores = edge_softmax(graph, sddmm(graph, x, x, "dot", **agg), **agg)
        out, alpha = gat_attention(graph, x, s, t, return_alpha=True, **agg)
        return (
            spmm(graph, x, w, **agg), spmm(graph, x, scores, reduce="mean", **agg), out, alpha,
            sddmm(graph, s, t, "add", **agg),
        )

    compiled = torch.compile(fn, fullgraph=True)
    outs_c, outs_e = compiled(x, w, s, t, graph), fn(x, w, s, t, graph)
    for a, b in zip(outs_c, outs_e):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(_grads(outs_c, [x, w, s, t]), _grads(outs_e, [x, w, s, t])):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert last_backend() in (("gas", "gar") if aggregation == "auto" else (aggregation,))
