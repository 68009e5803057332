"""The thin eager path: fused epilogues, one autograd node per layer, cached decisions and
the binder-free launch of every kernel.

* ``spmm(..., bias=b)`` equals ``spmm(...) + b`` on every backend (fused GAS / GAR through
  the interpreter), values and gradients of ``x``, the edge weights and ``b``, in float64
  on a graph with isolated nodes, a hub, self-loops and duplicates;
* :func:`fusegnn.sparse.gat_layer` (scores from the attention vectors, attention, head
  concatenation or mean, bias) equals its reference composition, forward and gradients,
  at widths that are not a power of two (padded inside the fused op), with and without
  dropout (the fused op against the fused attention with the same seed);
* the layers take that path and still match the reference layers;
* the dispatch decision is made once per graph and input kind and still follows the
  deterministic switch;
* :func:`fusegnn.kernels._launch.spec_key` separates every case Triton specialises on.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from fusegnn.kernels import _launch  # noqa: E402
from fusegnn.kernels.gat_fused import fused_gat_attention  # noqa: E402
from fusegnn.layers import GATConv, GCNConv  # noqa: E402
from fusegnn.sparse import Graph, dispatch, gat_layer, spmm  # noqa: E402
from tests.graphs import random_graph  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FUSED = ("gas", "gar")


def _graph(num_nodes: int = 24, num_edges: int = 150, seed: int = 3) -> Graph:
    ei = random_graph(num_nodes, num_edges, seed, hub_degree=60)
    return Graph(ei.to(DEVICE), num_nodes)


def _rand(*shape, seed: int, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()


def _grads(out: torch.Tensor, inputs, seed: int = 9):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out)
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


# ----------------------------------------------------------------------------- spmm + bias
@pytest.mark.parametrize("aggregation", FUSED)
@pytest.mark.parametrize("shape", [(13,), (3, 5)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_spmm_bias_epilogue_matches_the_reference(aggregation, shape, weighted, reduce):
    graph = _graph()
    x = _rand(graph.num_nodes, *shape, seed=1)
    bias = _rand(*shape, seed=2)
    w = _rand(graph.num_edges, seed=4) if weighted else None
    inputs = [t for t in (x, w, bias) if t is not None]
    out = spmm(graph, x, w, reduce, bias=bias, aggregation=aggregation)
    ref = spmm(graph, x, w, reduce, aggregation="reference") + bias
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for got, want in zip(_grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_spmm_bias_gradcheck_gas():
    graph = _graph(10, 40)
    x = _rand(10, 3, seed=5)
    bias = _rand(3, seed=6)
    assert torch.autograd.gradcheck(lambda a, b: spmm(graph, a, bias=b, aggregation="gas"), (x, bias))


@pytest.mark.parametrize(
    "bias, message",
    [
        (torch.zeros(4), "bias must have shape"),
        (torch.zeros(5, 1), "bias must have shape"),
        (torch.zeros(5, dtype=torch.int64), "floating"),
        ([0.0] * 5, "torch.Tensor"),
    ],
)
def test_spmm_bad_bias_names_it(bias, message):
    graph = _graph(6, 12)
    x = torch.zeros(6, 5, device=DEVICE)
    if isinstance(bias, torch.Tensor):
        bias = bias.to(DEVICE)
    with pytest.raises((ValueError, TypeError), match=message):
        spmm(graph, x, bias=bias)


def test_spmm_bias_leaves_inputs_alone():
    graph = _graph()
    x = _rand(graph.num_nodes, 6, seed=1).detach()
    bias = _rand(6, seed=2).detach()
    before = (x.clone(), bias.clone())
    for aggregation in FUSED:
        spmm(graph, x, bias=bias, aggregation=aggregation)
    torch.testing.assert_close((x, bias), before, rtol=0, atol=0)


# ----------------------------------------------------------------------------- GAT layer op
def _gat_reference(graph, h, att_src, att_dst, bias, concat):
    return gat_layer(graph, h, att_src, att_dst, bias, concat=concat, aggregation="reference")


@pytest.mark.parametrize("aggregation", FUSED)
@pytest.mark.parametrize("heads, channels, concat", [(1, 7, True), (3, 20, True), (2, 5, False), (1, 16, False)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gat_layer_fused_matches_reference(aggregation, heads, channels, concat, with_bias):
    graph = _graph()
    h = _rand(graph.num_nodes, heads, channels, seed=1)
    att_src = _rand(1, heads, channels, seed=2)
    att_dst = _rand(1, heads, channels, seed=3)
    bias = _rand(heads * channels if concat else channels, seed=4) if with_bias else None
    inputs = [t for t in (h, att_src, att_dst, bias) if t is not None]
    out = gat_layer(graph, h, att_src, att_dst, bias, concat=concat, aggregation=aggregation)
    ref = _gat_reference(graph, h, att_src, att_dst, bias, concat)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    for got, want in zip(_grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("aggregation", FUSED)
def test_gat_layer_dropout_is_the_fused_attention_with_the_same_seed(aggregation):
    graph = _graph()
    h = _rand(graph.num_nodes, 2, 6, seed=1)
    att_src, att_dst = _rand(1, 2, 6, seed=2), _rand(1, 2, 6, seed=3)
    torch.manual_seed(123)
    out = gat_layer(graph, h, att_src, att_dst, concat=True, dropout=0.5, training=True, aggregation=aggregation)
    torch.manual_seed(123)
    s, t = (h * att_src).sum(-1), (h * att_dst).sum(-1)
    ref, _ = fused_gat_attention(graph, h, s, t, 0.2, 0.5, aggregation=aggregation)
    ref = ref.reshape(graph.num_nodes, -1)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    inputs = (h, att_src, att_dst)
    for got, want in zip(_grads(out, inputs), _grads(ref, inputs)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_gat_layer_empty_graph_gives_bias_rows():
    graph = Graph(torch.zeros(2, 0, dtype=torch.int64, device=DEVICE), 4)
    h = _rand(4, 2, 3, seed=1)
    bias = _rand(6, seed=2)
    att = _rand(1, 2, 3, seed=3)
    for aggregation in FUSED:
        out = gat_layer(graph, h, att, att, bias, aggregation=aggregation)
        torch.testing.assert_close(out, bias.expand(4, 6))
        (gh,) = torch.autograd.grad(out.sum(), (h,))
        assert torch.count_nonzero(gh) == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(att_src=torch.zeros(1, 2, 4)), "att_src must be"),
        (dict(bias=torch.zeros(5)), "bias must be"),
        (dict(dropout=1.0), "dropout"),
    ],
)
def test_gat_layer_bad_input_names_it(kwargs, message):
    graph = _graph(6, 12)
    args = dict(h=torch.zeros(6, 2, 3), att_src=torch.zeros(1, 2, 3), att_dst=torch.zeros(1, 2, 3), bias=None)
    args.update(kwargs)
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    dropout = args.pop("dropout", 0.0)
    with pytest.raises(ValueError, match=message):
        gat_layer(graph, args["h"], args["att_src"], args["att_dst"], args["bias"], dropout=dropout)


# ----------------------------------------------------------------------------- the layers
@pytest.mark.parametrize("aggregation", FUSED)
def test_layers_on_the_thin_path_match_the_reference_layers(aggregation):
    graph = _graph()
    x = _rand(graph.num_nodes, 11, seed=1)
    for make in (
        lambda agg: GCNConv(11, 6, aggregation=agg),
        lambda agg: GATConv(11, 5, heads=3, aggregation=agg),
        lambda agg: GATConv(11, 5, heads=2, concat=False, aggregation=agg),
    ):
        torch.manual_seed(0)
        fused = make(aggregation).to(DEVICE, torch.float64)
        torch.manual_seed(0)
        ref = make("reference").to(DEVICE, torch.float64)
        with torch.no_grad():
            for p in ref.parameters():
                p.uniform_(-0.5, 0.5)
        fused.load_state_dict(ref.state_dict())
        out, want = fused(x, graph), ref(x, graph)
        torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-10)
        params_f, params_r = [x, *fused.parameters()], [x, *ref.parameters()]
        for got, exp in zip(_grads(out, params_f), _grads(want, params_r)):
            torch.testing.assert_close(got, exp, rtol=1e-9, atol=1e-10)


# ----------------------------------------------------------------------------- dispatch memo
def test_dispatch_decision_is_made_once_per_graph_and_input_kind(monkeypatch):
    graph = _graph()
    x = torch.randn(graph.num_nodes, 4, device=DEVICE, dtype=torch.float64)
    calls = []
    real = dispatch.explain

    def counting(*args, **kwargs):
        calls.append(kwargs.get("aggregation"))
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "explain", counting)
    for _ in range(3):
        spmm(graph, x, aggregation="gar")
    assert calls == ["gar"]
    assert dispatch.last_decision().name == "gar"
    spmm(graph, x.float(), aggregation="gar")  # another dtype: decided again
    assert len(calls) == 2
    with dispatch.deterministic():
        spmm(graph, x, aggregation="auto")
    assert dispatch.last_decision().name in ("gar", "reference")
    assert len(calls) == 3


def test_explicit_gas_still_refuses_in_deterministic_mode_after_a_cached_call():
    graph = _graph()
    x = torch.randn(graph.num_nodes, 4, device=DEVICE, dtype=torch.float64)
    spmm(graph, x, aggregation="gas")
    with dispatch.deterministic(), pytest.raises(RuntimeError, match="deterministic"):
        spmm(graph, x, aggregation="gas")


# ----------------------------------------------------------------------------- launch key
def test_spec_key_separates_what_triton_specialises_on():
    base = torch.zeros(8, dtype=torch.float32)
    key = _launch.spec_key
    assert key([base]) != key([base.double()])
    assert key([base]) != key([base[1:]])  # 4-byte offset: not 16-byte aligned
    assert key([base]) == key([torch.zeros(3, dtype=torch.float32)])
    assert key([1]) != key([2]) and key([16]) != key([17]) and key([32]) == key([48])
    assert key([2**31 - 16]) != key([2**31 + 16])  # int32 and int64 arguments
    assert key([16]) != key([2**32])  # 64-bit integers are another specialisation
    assert key([True]) != key([False]) and key([0.5]) == key([1.5])
    assert key([None]) != key([0])


# ----------------------------------------------------------------------------- prepared spmm
def test_prepared_spmm_agrees_and_rechecks_what_changed():
    graph = _graph()
    x = torch.randn(graph.num_nodes, 4, device=DEVICE, dtype=torch.float64)
    first = spmm(graph, x, aggregation="gas")
    again = spmm(graph, x * 2, aggregation="gas")  # prepared: same kind of call
    torch.testing.assert_close(again, first * 2)
    assert dispatch.last_decision().name == "gas"
    prepared = graph.cached("prepared_spmm", dict)
    assert len(prepared) == 1
    with pytest.raises(ValueError, match="rows but the graph needs"):
        spmm(graph, x[:-1], aggregation="gas")
    with pytest.raises(ValueError, match="edge_weight"):
        spmm(graph, x, torch.ones(graph.num_edges + 1, device=DEVICE, dtype=torch.float64), aggregation="gas")
    with pytest.raises(ValueError, match="bias"):
        spmm(graph, x, bias=torch.zeros(5, device=DEVICE, dtype=torch.float64), aggregation="gas")
    spmm(graph, x, reduce="max", aggregation="gas")  # handed to GAR's fused max, and says so
    assert dispatch.last_decision().name == "gar"
    spmm(graph, x, reduce="max", aggregation="gas")
    assert dispatch.last_decision().name == "gar"
    torch.testing.assert_close(
        spmm(graph, x, reduce="max", aggregation="gas"), spmm(graph, x, reduce="max", aggregation="reference")
    )


# ----------------------------------------------------------------------------- host-bound regime
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@gpu
def test_small_eager_spmm_takes_the_reference_and_a_capture_takes_the_kernels():
    graph = _graph()
    x = torch.randn(graph.num_nodes, 16, device="cuda")
    eager = spmm(graph, x)
    assert dispatch.last_decision().name == "reference" and "host-bound" in dispatch.last_decision().reason
    with dispatch.for_capture():
        fused = spmm(graph, x)
        assert dispatch.last_decision().name in FUSED
    # float32 sums of up to 60 terms (the hub) in two orders: atomics against index_add's
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    static_out = None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph_ = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph_, stream=stream):
        static_out = spmm(graph, x)  # first fused use of this graph, inside the capture
    graph_.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, eager, rtol=1e-5, atol=1e-5)
    big = Graph(torch.randint(0, 4096, (2, 1 << 19), device="cuda"), 4096)
    spmm(big, torch.randn(4096, 64, device="cuda", requires_grad=True))
    assert dispatch.last_decision().name in FUSED  # 2^19 edges x 64 columns: past the host-bound size
    assert big.num_edges * 64 >= dispatch.HOST_BOUND_WORK  # (of an op with a backward)


def test_host_bound_work_by_grad_mode_and_backward():
    """The larger bound is for an op of a training step that records no backward only:
    evaluation and the hops inside an autograd function keep HOST_BOUND_WORK."""
    assert dispatch.host_bound_work(records_backward=False) == dispatch.HOST_BOUND_FORWARD_WORK
    assert dispatch.host_bound_work(records_backward=True) == dispatch.HOST_BOUND_WORK
    with torch.no_grad():
        assert dispatch.host_bound_work(records_backward=False) == dispatch.HOST_BOUND_WORK
    graph = _graph()
    x = torch.randn(graph.num_nodes, 4, device=graph.device)
    # the CPU, or any aggregation but auto, is never host-bound
    assert not dispatch.takes_host_bound_reference(graph.to("cpu"), x.cpu(), "auto", records_backward=False)
    assert not dispatch.takes_host_bound_reference(graph, x, "gar", records_backward=False)


@gpu
def test_forward_only_spmm_has_the_larger_host_bound():
    """Between HOST_BOUND_WORK and HOST_BOUND_FORWARD_WORK edge-columns an eager spmm takes
    the reference only when it records no backward; the prepared call and the decision
    memo tell the two apart (the same shapes, with and without a gradient)."""
    n, e, width = 4096, 1 << 18, 128  # 2^25 edge-columns
    assert dispatch.HOST_BOUND_WORK <= e * width < dispatch.HOST_BOUND_FORWARD_WORK
    graph = Graph(torch.randint(0, n, (2, e), device="cuda"), n)
    x = torch.randn(n, width, device="cuda")
    plain = spmm(graph, x)
    assert dispatch.last_decision().name == "reference" and "no backward" in dispatch.last_decision().reason
    x_grad = x.clone().requires_grad_()
    out = spmm(graph, x_grad)
    assert dispatch.last_decision().name in FUSED
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-4)
    with torch.no_grad():  # evaluation: no backward, but no host-bound step to hide a wide reference in
        spmm(graph, x_grad)
    assert dispatch.last_decision().name in FUSED
    spmm(graph, x)
    assert dispatch.last_decision().name == "reference"
    w = torch.rand(e, device="cuda", requires_grad=True)  # learnt edge weights: a backward
    spmm(graph, x, w)
    assert dispatch.last_decision().name in FUSED
    spmm(graph, x, w.detach())
    assert dispatch.last_decision().name == "reference"


@gpu
def test_graphed_gcn_step_records_the_fused_kernels():
    import fusegnn
    from fusegnn.models import GCN

    graph = _graph()
    x = torch.randn(graph.num_nodes, 12, device="cuda")
    y = torch.randint(0, 3, (graph.num_nodes,), device="cuda")
    model = GCN(12, 8, 3, dropout=0.0).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, capturable=True)
    seen = []

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x, graph), y)
        seen.append(dispatch.last_decision().name)
        loss.backward()
        optimizer.step()
        return loss

    graphed = fusegnn.graphed_step(step, optimizer, warmup=2)
    losses = [float(graphed(x, y)) for _ in range(6)]
    assert graphed.captured and set(seen) <= set(FUSED)
    assert losses[-1] < losses[0]
