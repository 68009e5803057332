"""``spmm(reduce="max")``: the reference against a loop oracle, and GAR's fused max (which
GAS hands its max to) against the reference, forward, argmax and gradients.

The tie rule everywhere: the lowest COO edge id among the edges that attain a target's
maximum wins, and only that edge's message receives the gradient. Graphs have isolated
targets, self-loops, duplicate edges (exact ties when unweighted) and a hub row longer
than the short GAR segments forced here, so split rows combine partial maxima.

Without CUDA the kernels run through Triton's CPU interpreter (tiny graphs).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fusegnn.sparse import Graph, dispatch, reference, spmm  # noqa: E402
from tests.graphs import random_weights  # noqa: E402
from tests.op_cases import (  # noqa: E402
    DEVICE, F64, PATHS, aligned_width, hub_graph, owns_its_storage, randn, record_edge_aggregate_launches,
    short_segments,
)

triton = pytest.importorskip("triton")

from fusegnn.kernels import edge_aggregate as fused_ea  # noqa: E402
from fusegnn.kernels import spmm as fused  # noqa: E402
from fusegnn.kernels.spmm_gar import GarConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _short_segments():
    with short_segments():
        yield


def _max_loops(graph: Graph, x: torch.Tensor, w: torch.Tensor | None):
    """Per target and column, the largest ``w * x_src`` over the incoming edges, visited in
    COO order with a strictly-greater update (so the lowest edge id wins a tie), and that
    edge's id; 0 and -1 for a target without edges. Plain Python floats."""
    src, dst = graph.src.tolist(), graph.dst.tolist()
    x2 = x.detach().reshape(x.size(0), -1).cpu()
    cols = x2.size(1)
    heads = 1 if (w is None or w.dim() == 1) else w.size(1)
    feat = cols // heads
    out = torch.zeros(graph.num_dst_nodes, cols, dtype=x.dtype)
    arg = torch.full((graph.num_dst_nodes, cols), -1, dtype=torch.int64)
    for i in range(graph.num_dst_nodes):
        for c in range(cols):
            best, best_e = None, -1
            for e, (s, d) in enumerate(zip(src, dst)):
                if d != i:
                    continue
                weight = 1.0 if w is None else float(w.reshape(w.size(0), -1)[e, c // feat if heads > 1 else 0])
                value = weight * float(x2[s, c])
                if best is None or value > best:
                    best, best_e = value, e
            if best is not None:
                out[i, c], arg[i, c] = best, best_e
    return out.reshape((graph.num_dst_nodes,) + tuple(x.shape[1:])), arg.reshape(out.shape[:1] + x.shape[1:])


# ------------------------------------------------------------------ the reference and its tie rule
@pytest.mark.parametrize("heads, feat, weight", [(None, 3, "e"), (None, 5, None), (2, 3, "eh"), (2, 1, "e")])
def test_reference_equals_loops(heads, feat, weight):
    graph = hub_graph(n=9, e=40, seed=2, hub=12)
    x = randn(*((9, feat) if heads is None else (9, heads, feat)), seed=3)
    w = None
    if weight is not None:
        w = random_weights(graph.num_edges, 4, heads=heads if weight == "eh" else None, positive=False).to(DEVICE)
    want, want_arg = _max_loops(graph, x, w)
    messages = x.index_select(0, graph.src) * (reference.per_edge(w, x.index_select(0, graph.src)) if w is not None else 1)
    out, arg = reference.max_and_argmax(graph, messages)
    assert torch.equal(out.cpu(), want) and torch.equal(arg.cpu(), want_arg)
    assert torch.equal(spmm(graph, x, w, "max", aggregation="reference").cpu(), want)


def test_ties_go_to_the_lowest_edge_id_and_so_does_the_gradient():
    # edges 0..3 into node 2: 0->2, 1->2, 0->2 (duplicate of edge 0), 3->2; x[0] == x[1] too
    ei = torch.tensor([[0, 1, 0, 3, 1], [2, 2, 2, 2, 0]], device=DEVICE)
    graph = Graph(ei, 4)
    x = torch.tensor([[1.0, 5.0], [1.0, -2.0], [0.0, 0.0], [-1.0, 5.0]], dtype=F64, device=DEVICE)
    w = torch.ones(5, dtype=F64, device=DEVICE)
    messages = x.index_select(0, graph.src)
    _, arg = reference.max_and_argmax(graph, messages)
    assert arg[2].tolist() == [0, 0]  # column 0: edges 0, 1, 2 tie; column 1: edges 0, 2, 3 tie
    assert arg[1].tolist() == [-1, -1] and arg[0].tolist() == [4, 4]
    for path in ("reference",) + PATHS:
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = spmm(graph, xs, ws, "max", aggregation=path)
        gx, gw = torch.autograd.grad(out, [xs, ws], torch.ones_like(out))
        assert gw.tolist() == [6.0, 0.0, 0.0, 0.0, 1.0 - 2.0], path  # edge 0: 1 + 5; edge 4 from x[1]
        assert gx.tolist() == [[1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0]], path
    _, fused_arg = fused_ea.edge_aggregate_forward(graph, x, None, w, None, "max")
    assert torch.equal(fused_arg.long(), arg)


def test_reference_closed_form_backward_equals_autograd():
    graph = hub_graph(n=9, e=40, seed=5, hub=12)
    x = randn(9, 2, 3, seed=6).requires_grad_()
    w = random_weights(graph.num_edges, 7, heads=2, positive=False).to(DEVICE).requires_grad_()
    out = reference.spmm(graph, x, w, "max")
    grad = torch.randn_like(out)
    want = torch.autograd.grad(out, [x, w], grad)
    got = reference_grads_spmm(graph, grad, x.detach(), w.detach())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def reference_grads_spmm(graph, grad, x, w):
    from fusegnn.sparse import reference_grads

    return reference_grads.spmm_backward(graph, grad, x, w, "max", True, True)


def test_gradcheck_through_the_reference():
    graph = hub_graph(n=6, e=16, seed=8, hub=5)
    x = randn(6, 3, seed=9).requires_grad_()
    w = random_weights(graph.num_edges, 10, positive=False).to(DEVICE).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: spmm(graph, x, w, "max", aggregation="reference"), (x, w))


def test_negative_infinity_and_empty_targets():
    ei = torch.tensor([[0, 1, 2], [1, 1, 0]], device=DEVICE)
    graph = Graph(ei, 3)
    x = torch.tensor([[float("-inf"), 1.0], [float("-inf"), -3.0], [2.0, 2.0]], dtype=F64, device=DEVICE)
    for path in ("reference",) + PATHS:
        out = spmm(graph, x, None, "max", aggregation=path)
        assert out.tolist() == [[2.0, 2.0], [float("-inf"), 1.0], [0.0, 0.0]], path


# ------------------------------------------------------------------ fused against the reference
def _check(graph, x, w, path, bias=None, tol=None):
    xs = x.clone().requires_grad_()
    ws = w.clone().requires_grad_() if w is not None else None
    bs = bias.clone().requires_grad_() if bias is not None else None
    out = spmm(graph, xs, ws, "max", bias=bs, aggregation=path)
    assert dispatch.last_backend() == "gar"
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_() if w is not None else None
    br = bias.clone().requires_grad_() if bias is not None else None
    ref = spmm(graph, xr, wr, "max", bias=br, aggregation="reference")
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if tol is None:
        assert torch.equal(out, ref)  # a maximum of the same products: exact
    else:
        torch.testing.assert_close(out, ref, **tol)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, [t for t in (xs, ws, bs) if t is not None], grad)
    want = torch.autograd.grad(ref, [t for t in (xr, wr, br) if t is not None], grad)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, **(tol or {}))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "heads, feat, weight",
    [(None, 1, None), (None, 7, "e"), (3, 5, "eh"), (2, 3, "e"), (None, 3, None)],
    ids=["F1-unweighted", "F7", "H3-perhead", "H2-shared", "F3-unweighted-ties"],
)
def test_fused_matches_reference(path, heads, feat, weight):
    graph = hub_graph()
    x = randn(*((14, feat) if heads is None else (14, heads, feat)), seed=feat)
    w = None
    if weight is not None:
        w = random_weights(graph.num_edges, feat + 1, heads=heads if weight == "eh" else None, positive=False)
        w = w.to(DEVICE)
    _check(graph, x, w, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("heads, feat, weight", [(None, 41, "e"), (2, 20, "eh"), (2, 9, None)],
                         ids=["F41", "H2xF20-perhead", "H2xF9-unweighted"])
def test_unaligned_widths_run_padded(path, heads, feat, weight, monkeypatch):
    """The max runs a head wider than 16 columns and not a multiple of 16 at the next
    multiple (:mod:`fusegnn.kernels.edge_aggregate`, which GAS hands the max to): its
    kernels see aligned rows; values, argmax and gradients are the reference's; the
    output and gradients hold no padded storage."""
    forward, backward = record_edge_aggregate_launches(monkeypatch)
    graph = hub_graph(n=9, e=40, seed=26, hub=14)
    x = randn(*((9, feat) if heads is None else (9, heads, feat)), seed=27)
    w = None
    if weight is not None:
        w = random_weights(graph.num_edges, 28, heads=heads if weight == "eh" else None, positive=False).to(DEVICE)
    _check(graph, x, w, path)
    per_head = feat if weight == "eh" else feat * (heads or 1)
    row = aligned_width(per_head) * (heads if weight == "eh" else 1)
    assert forward.seen and backward.seen
    assert all(seen[1:3] == (row, row) for seen in forward.seen + backward.seen), (forward.seen, backward.seen)
    out, arg = fused_ea.edge_aggregate_forward(graph, x, None, w, None, "max")
    messages = x.index_select(0, graph.src)
    want, want_arg = reference.max_and_argmax(graph, messages * w.unsqueeze(-1) if w is not None else messages)
    assert torch.equal(out, want) and torch.equal(arg.long(), want_arg)
    xs = x.clone().requires_grad_()
    out = spmm(graph, xs, w, "max", aggregation=path)
    (gx,) = torch.autograd.grad(out, [xs], torch.ones_like(out))
    assert owns_its_storage(out) and owns_its_storage(arg) and owns_its_storage(gx)


@pytest.mark.parametrize("path", PATHS)
def test_fused_argmax_equals_the_reference(path):
    graph = hub_graph(seed=11)
    x = randn(14, 2, 3, seed=12)
    w = random_weights(graph.num_edges, 13, heads=2, positive=False).to(DEVICE)
    out, arg = fused_ea.edge_aggregate_forward(graph, x, None, w, None, "max")
    want, want_arg = reference.max_and_argmax(graph, x.index_select(0, graph.src) * w.unsqueeze(-1))
    assert arg.dtype == torch.int32 and arg.shape == want_arg.shape
    assert torch.equal(out, want) and torch.equal(arg.long(), want_arg)


@pytest.mark.parametrize(
    "config",
    [GarConfig(block_e=4, block_f=2, seg_len=3), GarConfig(block_e=2, block_f=8, seg_len=5)],
    ids=["narrow-blocks", "one-block"],
)
def test_fused_launch_variants(config):
    """Several feature blocks per head and many split rows; also the int64 offsets."""
    graph = hub_graph(seed=14)
    x = randn(14, 2, 5, seed=15)
    w = random_weights(graph.num_edges, 16, heads=2, positive=False).to(DEVICE)
    with fused.tuning(gar=config):
        _check(graph, x, w, "gar")
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused_ea, "INT64_OFFSETS_FROM", 0)
            _check(graph, x, w, "gar")


@pytest.mark.parametrize("path", PATHS)
def test_bias_float32_and_untouched_inputs(path):
    graph = hub_graph(seed=17)
    x = randn(14, 6, seed=18)
    w = random_weights(graph.num_edges, 19, positive=False).to(DEVICE)
    bias = randn(6, seed=20)
    before = x.clone(), w.clone(), graph.edge_index.clone()
    _check(graph, x, w, path, bias=bias)
    assert torch.equal(x, before[0]) and torch.equal(w, before[1]) and torch.equal(graph.edge_index, before[2])
    _check(graph, x.float(), w.float(), path, tol=dict(rtol=1e-6, atol=1e-6))


@pytest.mark.parametrize("path", PATHS)
def test_emptyhub_graph(path):
    graph = Graph(torch.empty(2, 0, dtype=torch.int64, device=DEVICE), 5)
    x = randn(5, 3, seed=21).requires_grad_()
    out = spmm(graph, x, None, "max", aggregation=path)
    assert torch.equal(out, torch.zeros(5, 3, dtype=F64, device=DEVICE))
    (gx,) = torch.autograd.grad(out, [x], torch.ones_like(out))
    assert torch.equal(gx, torch.zeros_like(x))


def test_gar_max_is_bitwise_deterministic_and_mean_is_fused():
    graph = hub_graph(seed=22)
    x = randn(14, 4, seed=23)
    first = spmm(graph, x, None, "max", aggregation="gar")
    assert torch.equal(first, spmm(graph, x, None, "max", aggregation="gar"))
    for path in PATHS:  # mean: the fused sum over the in-degree, on the path asked for
        xs = x.clone().requires_grad_()
        out = spmm(graph, xs, None, "mean", aggregation=path)
        assert dispatch.last_backend() == path
        xr = x.clone().requires_grad_()
        ref = reference.spmm(graph, xr, None, "mean")
        torch.testing.assert_close(out, ref)
        grad = torch.randn_like(ref)
        torch.testing.assert_close(torch.autograd.grad(out, xs, grad)[0], torch.autograd.grad(ref, xr, grad)[0])
