"""The public sparse ops called as a demanding user would, against the float64 reference.

Hypothesis draws small graphs with what breaks sparse code (zero-degree nodes, a hub
row, self-loops, duplicate edges, bipartite shapes, int32 / int64 ids, no edge at all)
and inputs of odd widths, 2-D and 3-D, contiguous or not; every aggregation that runs on
this machine (the fused ones through Triton's interpreter without CUDA) must give the
reference's values and gradients, and leave every input as it was. The plain tests pin
behaviours the fuzzing found wanting (each names what went wrong before).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fusegnn.sparse import (  # noqa: E402
    Graph,
    available_backends,
    edge_aggregate,
    edge_softmax,
    propagate,
    reference,
    sddmm,
    spmm,
)

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SPMM_PATHS = tuple(a for a in ("reference", "gas", "gar", "window") if a in available_backends())
EDGE_PATHS = tuple(a for a in SPMM_PATHS if a != "window")
FUZZ = settings(max_examples=25)


# ----------------------------------------------------------------------------- inputs
@st.composite
def graphs(draw, square: bool = False) -> Graph:
    """A small graph: maybe bipartite, maybe empty, with a hub, self-loops, duplicates."""
    num_src = draw(st.integers(0, 7))
    num_dst = num_src if square or draw(st.booleans()) else draw(st.integers(0, 7))
    edges = []
    if num_src and num_dst:
        ids = st.tuples(st.integers(0, num_src - 1), st.integers(0, num_dst - 1))
        edges = draw(st.lists(ids, max_size=14))
        if edges and draw(st.booleans()):
            edges += edges[: draw(st.integers(1, len(edges)))]  # duplicates
        if draw(st.booleans()):  # a hub target
            edges += [(draw(st.integers(0, num_src - 1)), 0) for _ in range(draw(st.integers(8, 40)))]
        if num_src == num_dst and draw(st.booleans()):
            edges += [(k, k) for k in range(0, num_src, 2)]  # self-loops
        edges = draw(st.permutations(edges))
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    ei = torch.tensor(edges, dtype=dtype).reshape(-1, 2).t().contiguous()
    return Graph(ei.to(DEVICE), (num_src, num_dst) if num_src != num_dst else num_src)


def _features(draw, rows: int, trailing: tuple[int, ...], seed: int) -> torch.Tensor:
    """float64 ``[rows, *trailing]``, laid out contiguously or as a transposed / sliced view."""
    gen = torch.Generator().manual_seed(seed)
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced"]))
    if layout == "transposed":
        t = torch.randn(trailing[::-1] + (rows,), generator=gen, dtype=torch.float64)
        t = t.permute(*range(t.dim() - 1, -1, -1))
    elif layout == "sliced":
        t = torch.randn((rows,) + trailing[:-1] + (2 * trailing[-1],), generator=gen, dtype=torch.float64)
        t = t[..., ::2]
    else:
        t = torch.randn((rows,) + trailing, generator=gen, dtype=torch.float64)
    return t.to(DEVICE)


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` as a leaf that needs a gradient, keeping its layout (strides)."""
    return None if t is None else t.detach().requires_grad_()


def _same(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, what
        return
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=what)


def _unchanged(before: list, after: list) -> None:
    for k, (b, a) in enumerate(zip(before, after)):
        if b is not None:
            assert torch.equal(b, a.detach()), f"input {k} was modified in place"


def _compare(run, ref, tensors: list) -> None:
    """``run(*leaves)`` against ``ref(*leaves)``: values, then the gradients of a random
    linear functional of the output; and the inputs (and the graph's edges) untouched."""
    before = [None if t is None else t.detach().clone() for t in tensors]
    mine = [_leaf(t) for t in tensors]
    theirs = [_leaf(t) for t in tensors]
    out = run(*mine)
    want = ref(*theirs)
    _same(out, want, "forward")
    _unchanged(before, mine)
    gen = torch.Generator().manual_seed(7)
    probe = torch.randn(want.shape, generator=gen, dtype=want.dtype).to(DEVICE)
    grads = [t for t in mine if t is not None]
    if grads and out.requires_grad:
        got = torch.autograd.grad((out * probe).sum(), grads, allow_unused=True)
        exp = torch.autograd.grad((want * probe).sum(), [t for t in theirs if t is not None], allow_unused=True)
        for k, (g, e) in enumerate(zip(got, exp)):
            _same(g if g is not None else (None if e is None else torch.zeros_like(e)), e, f"gradient {k}")
    _unchanged(before, mine)


# ----------------------------------------------------------------------------- fuzzing
@pytest.mark.parametrize("aggregation", SPMM_PATHS)
@FUZZ
@given(data=st.data())
def test_spmm_matches_reference(aggregation, data):
    graph = data.draw(graphs())
    edge_index = graph.edge_index.clone()
    heads = data.draw(st.sampled_from([None, 1, 3]))
    feat = data.draw(st.sampled_from([1, 3, 5]))
    trailing = (feat,) if heads is None else (heads, feat)
    x = _features(data.draw, graph.num_src_nodes, trailing, seed=1)
    kinds = ["none", "edge"] + (["head"] if heads is not None else [])
    kind = data.draw(st.sampled_from(kinds))
    gen = torch.Generator().manual_seed(2)
    w = None
    if kind == "edge":
        w = torch.rand(graph.num_edges, generator=gen, dtype=torch.float64).to(DEVICE) + 0.5
    elif kind == "head":
        w = torch.rand(graph.num_edges, heads, generator=gen, dtype=torch.float64).to(DEVICE) + 0.5
    bias = torch.randn(trailing, generator=gen, dtype=torch.float64).to(DEVICE) if data.draw(st.booleans()) else None
    reduce = data.draw(st.sampled_from(["sum", "mean", "max"]))

    _compare(
        lambda x, w, b: spmm(graph, x, w, reduce, bias=b, aggregation=aggregation),
        lambda x, w, b: reference.spmm(graph, x, w, reduce, b),
        [x, w, bias],
    )
    assert torch.equal(graph.edge_index, edge_index)


@pytest.mark.parametrize("aggregation", EDGE_PATHS)
@FUZZ
@given(data=st.data())
def test_sddmm_and_edge_softmax_match_reference(aggregation, data):
    graph = data.draw(graphs())
    op = data.draw(st.sampled_from(["dot", "add", "sub", "mul"]))
    trailing = data.draw(st.sampled_from([(3,), (2, 3), (1, 5)]))
    a = _features(data.draw, graph.num_src_nodes, trailing, seed=3)
    b = _features(data.draw, graph.num_dst_nodes, trailing, seed=4)
    _compare(
        lambda a, b: sddmm(graph, a, b, op, aggregation=aggregation),
        lambda a, b: reference.sddmm(graph, a, b, op),
        [a, b],
    )
    heads = data.draw(st.sampled_from([None, 1, 2]))
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn((graph.num_edges,) if heads is None else (graph.num_edges, heads), generator=gen,
                         dtype=torch.float64).to(DEVICE)
    if graph.num_edges and data.draw(st.booleans()):
        scores[: graph.num_edges // 2] = float("-inf")  # masked edges, maybe whole targets
    _compare(
        lambda s: edge_softmax(graph, s, aggregation=aggregation),
        lambda s: reference.edge_softmax(graph, s),
        [scores],
    )


@pytest.mark.parametrize("aggregation", EDGE_PATHS)
@FUZZ
@given(data=st.data())
def test_edge_aggregate_matches_reference(aggregation, data):
    graph = data.draw(graphs())
    heads = data.draw(st.sampled_from([None, 2]))
    trailing = (3,) if heads is None else (heads, 3)
    x = _features(data.draw, graph.num_src_nodes, trailing, seed=6) if data.draw(st.booleans()) else None
    e = _features(data.draw, graph.num_edges, trailing, seed=7) if x is None or data.draw(st.booleans()) else None
    gen = torch.Generator().manual_seed(8)
    shape = (graph.num_edges,) if heads is None or data.draw(st.booleans()) else (graph.num_edges, heads)
    w = torch.rand(shape, generator=gen, dtype=torch.float64).to(DEVICE) if data.draw(st.booleans()) else None
    activation = data.draw(st.sampled_from([None, "relu"]))
    reduce = data.draw(st.sampled_from(["sum", "mean", "max"]))
    _compare(
        lambda x, e, w: edge_aggregate(graph, x, e, edge_weight=w, activation=activation, reduce=reduce,
                                       aggregation=aggregation),
        lambda x, e, w: reference.edge_aggregate(graph, x, e, w, activation, reduce),
        [x, e, w],
    )


@pytest.mark.parametrize("aggregation", SPMM_PATHS)
@FUZZ
@given(data=st.data())
def test_propagate_matches_repeated_reference(aggregation, data):
    graph = data.draw(graphs(square=True))
    x = _features(data.draw, graph.num_src_nodes, (3,), seed=9)
    K = data.draw(st.integers(0, 3))
    alpha = data.draw(st.sampled_from([0.0, 0.25]))

    def repeated(x):
        out = x
        for _ in range(K):
            out = (1 - alpha) * reference.spmm(graph, out) + alpha * x
        return out

    _compare(lambda x: propagate(graph, x, K, alpha, aggregation=aggregation), repeated, [x])


# ----------------------------------------------------------------------------- pinned cases
EDGES = torch.tensor([[0, 1, 2, 2, 3, 0, 0, 4], [1, 2, 0, 0, 3, 3, 1, 1]])


@pytest.mark.parametrize("aggregation", SPMM_PATHS)
def test_graph_first_processed_under_inference_mode_trains_afterwards(aggregation):
    """Formats and normalisations a graph caches are normal tensors even when its first
    use ran under ``torch.inference_mode()``: before, the GCN normalisation cached there
    was an inference tensor, and a later training step failed ("Inference tensors cannot
    be saved for backward"; on the fused paths already the inference call: "Inference
    tensors do not track version counter")."""
    from fusegnn.sparse.processing import gcn_normalized

    graph = Graph(EDGES.to(DEVICE), 6)
    x = torch.randn(6, 3, dtype=torch.float64, device=DEVICE)
    with torch.inference_mode():
        normalized = gcn_normalized(graph)
        spmm(normalized, x, aggregation=aggregation)
    assert not normalized.edge_weight.is_inference()
    assert not normalized.csr.perm.is_inference()
    leaf = x.clone().requires_grad_()
    spmm(normalized, leaf, aggregation=aggregation).sum().backward()
    want = x.clone().requires_grad_()
    reference.spmm(normalized, want, normalized.edge_weight).sum().backward()
    torch.testing.assert_close(leaf.grad, want.grad)


@pytest.mark.parametrize("aggregation", SPMM_PATHS)
def test_spmm_of_inference_mode_weights(aggregation):
    """Weights made under ``torch.inference_mode()`` (no version counter) aggregate as
    others do; the row windows scatter their tiles afresh instead of memoising them
    (before: "Inference tensors do not track version counter")."""
    graph = Graph(EDGES.to(DEVICE), 6)
    with torch.inference_mode():
        x = torch.randn(6, 3, dtype=torch.float64, device=DEVICE)
        w = torch.rand(8, dtype=torch.float64, device=DEVICE)
        first = spmm(graph, x, w, aggregation=aggregation)
        torch.testing.assert_close(first, reference.spmm(graph, x, w))
        w.mul_(2.0)  # an in-place change the memo could not see
        torch.testing.assert_close(spmm(graph, x, w, aggregation=aggregation), reference.spmm(graph, x, w))


@pytest.mark.parametrize("aggregation", SPMM_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spmm_bias_of_a_single_target_is_not_overwritten(aggregation, dtype):
    """A graph with one target node (a readout into one node, a one-query attention row):
    the bias is added, not accumulated into. Before, GAS's accumulator started as the bias
    expanded to one row, which for one row is the bias itself: the call overwrote the bias
    (a layer's parameter) with its output and returned a tensor aliasing it."""
    graph = Graph(torch.tensor([[0, 1, 2, 1], [0, 0, 0, 0]], device=DEVICE), (3, 1))
    x = torch.randn(3, 4, dtype=dtype, device=DEVICE)
    bias = torch.randn(4, dtype=dtype, device=DEVICE, requires_grad=True)
    before = bias.detach().clone()
    out = spmm(graph, x, bias=bias, aggregation=aggregation)
    assert torch.equal(bias.detach(), before)
    assert out.data_ptr() != bias.data_ptr()
    torch.testing.assert_close(out, reference.spmm(graph, x, None, "sum", before))
    out.sum().backward()
    torch.testing.assert_close(bias.grad, torch.ones_like(before))


@pytest.mark.parametrize("aggregation", EDGE_PATHS)
@pytest.mark.parametrize("num_nodes", [0, 4])
@pytest.mark.parametrize("shape", [(0,), (0, 2)])
def test_edge_softmax_of_an_edgeless_graph(aggregation, num_nodes, shape):
    """No edge, nothing to normalise: an empty result and an empty gradient. Before, the
    fused paths failed on per-head scores with "IndexError: index 0 is out of bounds for
    dimension 0 with size 0" (the launcher read the first score row)."""
    graph = Graph(torch.empty(2, 0, dtype=torch.int64, device=DEVICE), num_nodes)
    scores = torch.randn(shape, dtype=torch.float64, device=DEVICE, requires_grad=True)
    alpha = edge_softmax(graph, scores, aggregation=aggregation)
    assert alpha.shape == scores.shape
    alpha.sum().backward()
    assert scores.grad.shape == scores.shape


@pytest.mark.parametrize("aggregation", SPMM_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spmm_of_a_graph_without_nodes(aggregation, dtype):
    """A graph of no nodes gives ``[0, F]`` and an empty gradient. Before, the row windows
    failed on float64 with "cannot reshape tensor of 0 elements into shape [0, -1]"."""
    graph = Graph(torch.empty(2, 0, dtype=torch.int64, device=DEVICE), 0)
    x = torch.randn(0, 3, dtype=dtype, device=DEVICE, requires_grad=True)
    out = spmm(graph, x, aggregation=aggregation)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert x.grad.shape == (0, 3)


def _penalty_ops(graph: Graph, aggregation: str):
    """Ops whose weight / first input gets a gradient penalty, by name."""
    return {
        "spmm": lambda x, w: spmm(graph, x, w, aggregation=aggregation),
        "sddmm": lambda x, w: sddmm(graph, x * w[: graph.num_src_nodes, None], x, "dot", aggregation=aggregation),
        "edge_softmax": lambda x, w: edge_softmax(graph, w * x[graph.src.long(), 0], aggregation=aggregation),
    }


@pytest.mark.parametrize("op", ["spmm", "sddmm", "edge_softmax"])
@pytest.mark.parametrize("aggregation", [a for a in EDGE_PATHS if a != "reference"])
def test_a_gradient_penalty_through_a_fused_op_raises(op, aggregation):
    """A gradient penalty (``create_graph=True``, then a backward through the gradients)
    needs second derivatives, which the fused backwards do not have: a clear
    ``RuntimeError`` that names the way out, never the penalty's gradient silently dropped
    (before: the weight's gradient 1.25 where the reference gives 1.96 for spmm). A plain
    backward, and ``create_graph=True`` whose gradients are not differentiated again,
    work as before; the reference path takes the second derivative."""
    graph = Graph(EDGES.to(DEVICE), 6)
    gen = torch.Generator().manual_seed(7)
    x0 = torch.randn(6, 3, dtype=torch.float64, generator=gen).to(DEVICE)
    w0 = torch.rand(8, dtype=torch.float64, generator=gen).to(DEVICE)

    def penalised(agg):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = _penalty_ops(graph, agg)[op](x, w)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out, gx, x, w

    out, gx, x, w = penalised("reference")
    ((gx ** 2).sum() + out.sum()).backward()
    want = w.grad.clone()

    out, gx, x, w = penalised(aggregation)
    with pytest.raises(RuntimeError, match="differentiable once"):
        ((gx ** 2).sum() + out.sum()).backward()
    out, gx, x, w = penalised(aggregation)
    gx.mul_(2.0)  # the gradients stay tensors the caller may change in place (no view)
    out.sum().backward()  # the gradients built with create_graph, not differentiated again
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    _penalty_ops(graph, aggregation)[op](x, w).sum().backward()  # a plain backward
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    _penalty_ops(graph, "reference")[op](xr, wr).sum().backward()
    torch.testing.assert_close(w.grad, wr.grad)
    assert want.abs().sum() > 0
