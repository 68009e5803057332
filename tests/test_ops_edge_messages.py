"""``edge_aggregate`` (per-edge messages ``w * act(x_src + e)``) and bipartite graphs.

* the reference against a loop oracle written from the formula (float64);
* GAR's fused pass (which GAS hands this op to) against the reference, forward and every
  gradient, with sum / mean / max, with and without ``x`` / ``edge_attr`` / weights / ReLU,
  per-head weights, widths that are not powers of two, several feature blocks and a hub
  row split over short segments;
* bad input errors naming the argument; inputs never modified;
* ``spmm`` (sum / mean / max), ``sddmm``, ``edge_softmax`` and ``edge_aggregate`` on
  bipartite graphs with more and with fewer sources than targets, on GAS and GAR;
* ``torch.compile(fullgraph=True)`` (``aot_eager``) of a function calling
  ``edge_aggregate`` and ``spmm(reduce="max")``, and ``opcheck`` of the new custom op.

Without CUDA the kernels run through Triton's CPU interpreter (tiny graphs).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch._dynamo  # noqa: E402

from fusegnn.sparse import Graph, dispatch, edge_aggregate, edge_softmax, reference, reference_grads, sddmm, spmm  # noqa: E402
from tests.graphs import random_graph, random_weights  # noqa: E402
from tests.op_cases import (  # noqa: E402
    DEVICE, F64, PATHS, aligned_width, hub_graph, owns_its_storage, randn, record_edge_aggregate_launches,
    short_segments,
)

triton = pytest.importorskip("triton")

from fusegnn.kernels import edge_aggregate as fused_ea  # noqa: E402
from fusegnn.kernels import spmm as fused  # noqa: E402
from fusegnn.kernels.spmm_gar import GarConfig  # noqa: E402

CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _short_segments():
    with short_segments():
        yield


def _inputs(graph, heads, feat, *, use_x=True, use_e=True, weight="e", seed=0):
    trail = (feat,) if heads is None else (heads, feat)
    x = randn(graph.num_src_nodes, *trail, seed=seed) if use_x else None
    e = randn(graph.num_edges, *trail, seed=seed + 1) if use_e else None
    w = None
    if weight == "e":
        w = random_weights(graph.num_edges, seed + 2, positive=False).to(DEVICE)
    elif weight == "eh":
        w = random_weights(graph.num_edges, seed + 2, heads=heads, positive=False).to(DEVICE)
    return x, e, w


def _loops(graph, x, e, w, activation, reduce):
    """The formula, edge by edge in Python floats: per target and column, the sum / mean /
    max (first maximum in edge order) of ``w * act(x_src + e)``; 0 without edges."""
    src, dst = graph.src.tolist(), graph.dst.tolist()
    like = x if x is not None else e
    cols = like[0].numel() if like.size(0) else 1
    heads = 1 if (w is None or w.dim() == 1) else w.size(1)
    feat = cols // heads
    x2 = x.reshape(x.size(0), -1).tolist() if x is not None else None
    e2 = e.reshape(e.size(0), -1).tolist() if e is not None else None
    w2 = w.reshape(w.size(0), -1).tolist() if w is not None else None
    out = torch.zeros(graph.num_dst_nodes, cols, dtype=F64)
    for i in range(graph.num_dst_nodes):
        edges = [k for k, d in enumerate(dst) if d == i]
        for c in range(cols):
            values = []
            for k in edges:
                z = (x2[src[k]][c] if x2 is not None else 0.0) + (e2[k][c] if e2 is not None else 0.0)
                if activation == "relu":
                    z = max(z, 0.0)
                values.append(z * (w2[k][c // feat if heads > 1 else 0] if w2 is not None else 1.0))
            if values:
                out[i, c] = {"sum": sum(values), "mean": sum(values) / len(values), "max": max(values)}[reduce]
    return out.reshape((graph.num_dst_nodes,) + tuple(like.shape[1:])).to(DEVICE)


# ------------------------------------------------------------------ the reference
CASES = [
    dict(heads=None, feat=3, use_x=True, use_e=True, weight=None, activation="relu"),  # GINE
    dict(heads=2, feat=3, use_x=True, use_e=True, weight="eh", activation=None),  # TransformerConv + edges
    dict(heads=None, feat=5, use_x=False, use_e=True, weight="e", activation=None),  # given messages
    dict(heads=2, feat=1, use_x=True, use_e=False, weight="e", activation="relu"),
    dict(heads=None, feat=7, use_x=True, use_e=True, weight="e", activation="relu"),
]
IDS = ["gine", "transformer", "edge-only", "x-only-relu", "F7-weighted-relu"]


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_equals_loops(case, reduce):
    graph = hub_graph(n=9, e=40, seed=2, hub=12)
    x, e, w = _inputs(graph, case["heads"], case["feat"], use_x=case["use_x"], use_e=case["use_e"],
                      weight=case["weight"], seed=3)
    out = edge_aggregate(graph, x, e, edge_weight=w, activation=case["activation"], reduce=reduce,
                         aggregation="reference")
    torch.testing.assert_close(out, _loops(graph, x, e, w, case["activation"], reduce), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_gradcheck_through_the_reference(reduce):
    graph = hub_graph(n=6, e=16, seed=4, hub=5)
    x, e, w = _inputs(graph, 2, 2, weight="eh", seed=5)
    x, e, w = (t.requires_grad_() for t in (x, e, w))
    assert torch.autograd.gradcheck(
        lambda x, e, w: edge_aggregate(graph, x, e, edge_weight=w, activation="relu", reduce=reduce,
                                       aggregation="reference"),
        (x, e, w),
    )


@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
def test_reference_closed_form_backward_equals_autograd(reduce):
    graph = hub_graph(n=9, e=40, seed=6, hub=12)
    x, e, w = _inputs(graph, 2, 3, weight="eh", seed=7)
    x, e, w = (t.requires_grad_() for t in (x, e, w))
    out = reference.edge_aggregate(graph, x, e, w, "relu", reduce)
    grad = torch.randn_like(out)
    want = torch.autograd.grad(out, [x, e, w], grad)
    got = reference_grads.edge_aggregate_backward(
        graph, grad, x.detach(), e.detach(), w.detach(), "relu", reduce, True, True, True
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ fused against the reference
def _check(graph, x, e, w, activation, reduce, path, tol=None):
    tol = tol or dict(rtol=1e-12, atol=1e-12)
    given = [t for t in (x, e, w) if t is not None]
    fused_in = [t.clone().requires_grad_() for t in given]
    ref_in = [t.clone().requires_grad_() for t in given]

    def call(inputs, aggregation):
        it = iter(inputs)
        xs, es, ws = (next(it) if t is not None else None for t in (x, e, w))
        return edge_aggregate(graph, xs, es, edge_weight=ws, activation=activation, reduce=reduce,
                              aggregation=aggregation)

    out = call(fused_in, path)
    assert dispatch.last_backend() == "gar"
    ref = call(ref_in, "reference")
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, **tol)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, fused_in, grad), torch.autograd.grad(ref, ref_in, grad)):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fused_matches_reference(case, reduce, path):
    graph = hub_graph()
    x, e, w = _inputs(graph, case["heads"], case["feat"], use_x=case["use_x"], use_e=case["use_e"],
                      weight=case["weight"], seed=case["feat"])
    _check(graph, x, e, w, case["activation"], reduce, path)


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize(
    "config",
    [GarConfig(block_e=4, block_f=2, seg_len=3), GarConfig(block_e=2, block_f=16, seg_len=5)],
    ids=["several-feature-blocks", "one-block"],
)
def test_fused_launch_variants(config, reduce):
    """Weight gradients summed over several feature blocks, many split rows, int64 offsets."""
    graph = hub_graph(seed=8)
    x, e, w = _inputs(graph, 2, 5, weight="eh", seed=9)
    with fused.tuning(gar=config):
        _check(graph, x, e, w, "relu", reduce, "gar")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused_ea, "INT64_OFFSETS_FROM", 0)
            _check(graph, x, e, w, "relu", reduce, "gar")


def test_fused_partial_gradients_and_float32():
    """Only some inputs require grad; fp32 in, fp32 out, within fp32 rounding."""
    graph = hub_graph(seed=10)
    x, e, w = _inputs(graph, None, 6, weight="e", seed=11)
    xs = x.clone().requires_grad_()
    out = edge_aggregate(graph, xs, e, edge_weight=w, activation="relu", aggregation="gar")
    xr = x.clone().requires_grad_()
    ref = edge_aggregate(graph, xr, e, edge_weight=w, activation="relu", aggregation="reference")
    grad = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(out, xs, grad)[0], torch.autograd.grad(ref, xr, grad)[0])
    _check(graph, x.float(), e.float(), w.float(), "relu", "sum", "gar", tol=dict(rtol=1e-5, atol=1e-5))


def test_plain_backward_recomputes_the_argmax():
    """The compiled op's backward has no saved argmax: it recomputes it, same gradients."""
    graph = hub_graph(seed=12)
    x, e, w = _inputs(graph, 2, 3, weight="eh", seed=13)
    grad = randn(graph.num_dst_nodes, 2, 3, seed=14)
    _, argmax = fused_ea.edge_aggregate_forward(graph, x, e, w, "relu", "max")
    kept = fused_ea.edge_aggregate_backward(graph, grad, x, e, w, "relu", "max", argmax, True, True, True)
    again = fused_ea.edge_aggregate_backward(graph, grad, x, e, w, "relu", "max", None, True, True, True)
    want = reference_grads.edge_aggregate_backward(graph, grad, x, e, w, "relu", "max", True, True, True)
    for a, b, c in zip(kept, again, want):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("heads, feat, weight", [(None, 41, None), (2, 20, "eh"), (2, 9, "e")],
                         ids=["F41", "H2xF20-perhead", "H2xF9-shared"])
@pytest.mark.parametrize("edges", [False, True], ids=["x-only", "with-edge-rows"])
def test_unaligned_widths(heads, feat, weight, reduce, path, edges, monkeypatch):
    """Without edge rows (``spmm(reduce="max")``'s form) a head wider than 16 columns and
    not a multiple of 16 runs at the next multiple (zero columns appended, then sliced
    off): forward and backward kernels see 16-element aligned rows of ``x``, the output
    (gradient) and the argmax -- per head with ``[E, H]`` weights, over the flattened
    ``H F`` columns with ``[E]`` ones (2 x 9 = 18 -> 32). With edge rows (GINE's messages)
    every tensor runs as it comes (padding the ``[E, C]`` rows did not pay). Either way the
    values and the ``x`` / edge-row / weight gradients are the reference's, GAS hands the op
    to GAR, the backward keeps the caller's tensors (no padded copy) and nothing returned
    holds padded storage."""
    forward, backward = record_edge_aggregate_launches(monkeypatch)
    graph = hub_graph(n=9, e=40, seed=24, hub=14)  # isolated targets, duplicates, a hub over short segments
    x, e, w = _inputs(graph, heads, feat, use_e=edges, weight=weight, seed=25)
    activation = "relu" if edges else None
    before = [t.clone() for t in (x, e, w) if t is not None]
    _check(graph, x, e, w, activation, reduce, path)
    assert all(torch.equal(a, b) for a, b in zip(before, [t for t in (x, e, w) if t is not None]))

    per_head = feat if weight == "eh" else feat * (heads or 1)
    run = per_head if edges else aligned_width(per_head)
    row = run * (heads if weight == "eh" else 1)
    assert forward.seen and backward.seen
    # (num_feat, row_stride, width of x, width of the edge rows) at every launch
    if edges:
        assert all(seen == (run, row, row, row) for seen in forward.seen + backward.seen), (forward.seen, backward.seen)
    else:
        assert all(seen[:3] == (run, row, row) for seen in forward.seen + backward.seen), (forward.seen, backward.seen)

    xs = x.clone().requires_grad_()
    es = e.clone().requires_grad_() if e is not None else None
    ws = w.clone().requires_grad_() if w is not None else None
    out = fused_ea.EdgeAggregate.apply(xs, es, ws, graph, activation, reduce)  # kept: its node holds the saved tensors
    saved = out.grad_fn.saved_tensors
    assert saved[0].data_ptr() == xs.data_ptr()
    if es is not None:
        assert saved[1].data_ptr() == es.data_ptr()
    if reduce == "max":  # the argmax is kept unpadded
        assert saved[3].shape == out.shape and owns_its_storage(saved[3])
    grads = torch.autograd.grad(out, [t for t in (xs, es, ws) if t is not None], torch.ones_like(out))
    assert owns_its_storage(out) and all(owns_its_storage(g) for g in grads)
    if reduce == "max":  # the compiled op's backward recomputes the argmax, at the same width
        kept = fused_ea.edge_aggregate_backward(graph, torch.ones_like(out), x, e, w, activation, "max",
                                                saved[3], True, e is not None, True)
        again = fused_ea.edge_aggregate_backward(graph, torch.ones_like(out), x, e, w, activation, "max",
                                                 None, True, e is not None, True)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(kept, again))


@pytest.mark.parametrize("path", ("reference",) + PATHS)
def test_empty_graph_and_untouched_inputs(path):
    graph = Graph(torch.empty(2, 0, dtype=torch.int64, device=DEVICE), 5)
    x = randn(5, 3, seed=15).requires_grad_()
    e = torch.zeros(0, 3, dtype=F64, device=DEVICE, requires_grad=True)
    for reduce in ("sum", "mean", "max"):
        out = edge_aggregate(graph, x, e, activation="relu", reduce=reduce, aggregation=path)
        assert torch.equal(out, torch.zeros(5, 3, dtype=F64, device=DEVICE))
        gx, ge = torch.autograd.grad(out, [x, e], torch.ones_like(out))
        assert torch.equal(gx, torch.zeros_like(x)) and ge.shape == (0, 3)
    graph = hub_graph(seed=16)
    x, e, w = _inputs(graph, None, 4, seed=17)
    before = [t.clone() for t in (x, e, w, graph.edge_index)]
    edge_aggregate(graph, x, e, edge_weight=w, activation="relu", reduce="max", aggregation=path)
    assert all(torch.equal(a, b) for a, b in zip(before, (x, e, w, graph.edge_index)))


def test_graph_weight_and_edge_index_input():
    graph = hub_graph(seed=18)
    x, e, w = _inputs(graph, None, 3, seed=19)
    want = reference.edge_aggregate(graph, x, e, w, "relu", "sum")
    torch.testing.assert_close(edge_aggregate(graph.with_edge_weight(w), x, e, activation="relu"), want)
    torch.testing.assert_close(
        edge_aggregate(graph.edge_index, x, e, edge_weight=w, activation="relu", aggregation="gar"), want
    )


# ------------------------------------------------------------------ bad input
def test_bad_input_errors_name_the_argument():
    graph = hub_graph(n=6, e=20, seed=20, hub=0)
    x, e, w = _inputs(graph, None, 3, seed=21)
    cases = [
        (dict(), ValueError, "x or edge_attr"),
        (dict(x=x, edge_attr=e[:-1]), ValueError, "edge_attr has 19 rows"),
        (dict(x=x, edge_attr=e[:, :2]), ValueError, "edge_attr must have x's trailing shape"),
        (dict(x=x, edge_attr=e.float()), ValueError, "edge_attr must have x's trailing shape and dtype"),
        (dict(x=x, edge_attr=e.long()), TypeError, "edge_attr must be a floating"),
        (dict(x=x, edge_attr=e[:, 0]), ValueError, r"edge_attr must be \[E, F\]"),
        (dict(x=x, edge_attr=[[1.0]]), TypeError, "edge_attr must be a torch.Tensor"),
        (dict(x=x[:-1]), ValueError, "x has 5 rows"),
        (dict(x=x, activation="gelu"), ValueError, "activation must be one of"),
        (dict(x=x, reduce="min"), ValueError, "reduce must be one of"),
        (dict(x=x, edge_weight=w[:-1]), ValueError, "edge_weight must have shape"),
        (dict(x=x, edge_weight=torch.ones(20, 2, dtype=F64, device=DEVICE)), ValueError, "one weight per head"),
        (dict(x=x, aggregation="fast"), ValueError, "aggregation must be one of"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match):
            edge_aggregate(graph, **kwargs)


# ------------------------------------------------------------------ bipartite graphs
BIPARTITE = [(11, 5), (5, 11)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sizes", BIPARTITE, ids=["more-sources", "more-targets"])
def test_bipartite_spmm(sizes, path):
    n_src, n_dst = sizes
    graph = hub_graph(n=n_src, e=70, seed=22, hub=30, num_dst=n_dst)
    assert graph.num_src_nodes == n_src and graph.num_dst_nodes == n_dst
    x = randn(n_src, 2, 3, seed=23)
    w = random_weights(graph.num_edges, 24, heads=2, positive=False).to(DEVICE)
    for reduce in ("sum", "mean", "max"):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = spmm(graph, xs, ws, reduce, aggregation=path)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = reference.spmm(graph, xr, wr, reduce)
        assert out.shape == (n_dst, 2, 3)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        grad = torch.randn_like(ref)
        for a, b in zip(torch.autograd.grad(out, [xs, ws], grad), torch.autograd.grad(ref, [xr, wr], grad)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sizes", BIPARTITE, ids=["more-sources", "more-targets"])
def test_bipartite_sddmm_and_edge_softmax(sizes, path):
    n_src, n_dst = sizes
    graph = hub_graph(n=n_src, e=70, seed=25, hub=30, num_dst=n_dst)
    for op, shape in (("dot", (2, 3)), ("add", (2,)), ("mul", (5,))):
        a, b = randn(n_src, *shape, seed=26), randn(n_dst, *shape, seed=27)
        fa, fb = a.clone().requires_grad_(), b.clone().requires_grad_()
        ra, rb = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = sddmm(graph, fa, fb, op, aggregation=path)
        ref = reference.sddmm(graph, ra, rb, op)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        grad = torch.randn_like(ref)
        for g1, g2 in zip(torch.autograd.grad(out, [fa, fb], grad), torch.autograd.grad(ref, [ra, rb], grad)):
            torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-12)
    scores = randn(graph.num_edges, 2, seed=28)
    fs, rs = scores.clone().requires_grad_(), scores.clone().requires_grad_()
    alpha = edge_softmax(graph, fs, aggregation=path)
    ref = reference.edge_softmax(graph, rs)
    torch.testing.assert_close(alpha, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(alpha, fs, grad)[0], torch.autograd.grad(ref, rs, grad)[0],
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sizes", BIPARTITE, ids=["more-sources", "more-targets"])
def test_bipartite_edge_aggregate(sizes, path):
    n_src, n_dst = sizes
    graph = hub_graph(n=n_src, e=70, seed=29, hub=30, num_dst=n_dst)
    x, e, w = _inputs(graph, 2, 3, weight="eh", seed=30)
    for reduce in ("sum", "mean", "max"):
        _check(graph, x, e, w, "relu", reduce, path)
    torch.testing.assert_close(
        edge_aggregate(graph, x, e, edge_weight=w, activation="relu", reduce="max", aggregation="reference"),
        _loops(graph, x, e, w, "relu", "max"),
    )


# ------------------------------------------------------------------ torch.compile
def _compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("aggregation", ["reference", pytest.param("gar", marks=pytest.mark.skipif(
    CUDA, reason="CPU tensors run the kernels only through the interpreter"))])
def test_compiled_edge_aggregate_and_max(aggregation):
    torch._dynamo.reset()
    graph = Graph(random_graph(14, 48, seed=31, hub_degree=6), 14)
    x = randn(14, 2, 3, seed=32).cpu().requires_grad_()
    e = randn(48, 2, 3, seed=33).cpu().requires_grad_()
    w = random_weights(48, 34, heads=2, positive=False).requires_grad_()

    def fn(x, e, w, graph):
        return (
            edge_aggregate(graph, x, e, activation="relu", aggregation=aggregation),
            edge_aggregate(graph, x, e, edge_weight=w, reduce="max", aggregation=aggregation),
            edge_aggregate(graph, None, e, edge_weight=w, reduce="mean", aggregation=aggregation),
            spmm(graph, x, w, reduce="max", aggregation=aggregation),
        )

    try:
        compiled = _compiled(fn)(x, e, w, graph)
        eager = fn(x, e, w, graph)
        gen = torch.Generator().manual_seed(0)
        proj = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in eager]
        for a, b in zip(compiled, eager):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        loss_c = sum((o * p).sum() for o, p in zip(compiled, proj))
        loss_e = sum((o * p).sum() for o, p in zip(eager, proj))
        for a, b in zip(torch.autograd.grad(loss_c, [x, e, w]), torch.autograd.grad(loss_e, [x, e, w])):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    finally:
        torch._dynamo.reset()


def test_opcheck_edge_aggregate():
    graph = Graph(random_graph(10, 30, seed=35, hub_degree=5), 10)
    x = randn(10, 2, 3, seed=36).cpu().requires_grad_()
    e = randn(30, 2, 3, seed=37).cpu().requires_grad_()
    w = random_weights(30, 38, heads=2, positive=False).requires_grad_()
    ops = torch.ops.fusegnn
    base = (graph.uid, None, 10, 10, 30, "")
    cases = [
        (ops.edge_aggregate.default, base + (x, e, w, "relu", "sum", "auto")),
        (ops.edge_aggregate.default, base + (None, e, None, "", "max", "auto")),
        (ops.edge_aggregate.default, base + (x, None, w, "", "mean", "auto")),
        (ops.edge_aggregate_backward.default,
         base + (torch.ones(10, 2, 3, dtype=F64), x.detach(), e.detach(), w.detach(), True, True, True, "relu",
                 "max", "auto")),
    ]
    for op, args in cases:
        result = torch.library.opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), result
