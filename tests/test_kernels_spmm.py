"""Fused SpMM kernels (GAS, GAR) against the reference, through Triton's CPU interpreter.

Without CUDA, this module sets ``TRITON_INTERPRET=1`` before any kernel module is
imported, so every kernel runs on the CPU (slowly: graphs here are tiny). With CUDA the
same tests run on the GPU, and the ``gpu``-marked ones add larger graphs.

Every case compares outputs and the gradients of ``x`` and of the edge weights with
:func:`fusegnn.sparse.reference.spmm` in float64 (tight tolerances), on random graphs
with isolated nodes, self-loops, duplicate edges and a hub row that the GAR work list
splits into several segments.
"""

from __future__ import annotations

import os
from typing import Callable

import torch
from torch import Tensor

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import fusegnn  # noqa: E402,F401
from fusegnn.sparse import Graph, dispatch, reference, spmm  # noqa: E402
from fusegnn.sparse import kernel_backends as backends  # noqa: E402
from fusegnn.kernels import spmm as fused  # noqa: E402
from fusegnn.kernels import _triton as triton_helpers  # noqa: E402
from fusegnn.kernels import spmm_gar, spmm_gas  # noqa: E402
from fusegnn.kernels.partition import build_plan, plan_for  # noqa: E402
from fusegnn.kernels.spmm_gar import gar_config  # noqa: E402
from tests.graphs import random_graph, random_weights  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
PATHS = ("gas", "gar")
SEG_LEN = 32  # short GAR segments, so the hub row (and a few others) are split


@pytest.fixture(autouse=True)
def _short_segments():
    with fused.tuning(gar=lambda feat, es, dot: gar_config(feat, es, dot=dot)._replace(seg_len=SEG_LEN)):
        yield


def _graph(num_nodes=24, num_edges=400, seed=1, hub=300, dtype=torch.int64, **kw) -> Graph:
    ei = random_graph(num_nodes, num_edges, seed, hub_degree=hub, dtype=dtype, **kw)
    return Graph(ei.to(DEVICE), num_nodes)


def _inputs(graph: Graph, heads: int | None, feat: int, weight: str | None, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shape = (graph.num_src_nodes, feat) if heads is None else (graph.num_src_nodes, heads, feat)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)
    w = None
    if weight == "e":
        w = random_weights(graph.num_edges, seed + 1, positive=False).to(DEVICE, dtype)
    elif weight == "eh":
        w = random_weights(graph.num_edges, seed + 1, heads=heads, positive=False).to(DEVICE, dtype)
    return x, w


def _check(graph, x, w, path, reduce="sum", rtol=1e-12, atol=1e-12):
    """Forward and every gradient of ``path`` against the reference (same dtype)."""
    xs = x.clone().requires_grad_()
    ws = w.clone().requires_grad_() if w is not None else None
    out = spmm(graph, xs, ws, reduce, aggregation=path)
    assert dispatch.last_backend() == path
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_() if w is not None else None
    ref = reference.spmm(graph, xr, wr, reduce)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
    grad = torch.randn_like(ref)
    inputs = [xs] + ([ws] if ws is not None else [])
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, [xr] + ([wr] if wr is not None else []), grad)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


# ------------------------------------------------------------------ values and gradients
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "heads, feat, weight, index_dtype",
    [
        (None, 1, None, torch.int64),
        (None, 3, "e", torch.int32),
        (None, 16, "e", torch.int64),
        (8, 3, "eh", torch.int32),
        (8, 2, "e", torch.int64),
        (1, 5, "eh", torch.int64),
    ],
    ids=["F1-unweighted", "F3-int32", "F16", "H8-perhead-int32", "H8-shared", "H1-perhead"],
)
def test_matches_reference(path, heads, feat, weight, index_dtype):
    graph = _graph(dtype=index_dtype)
    x, w = _inputs(graph, heads, feat, weight, seed=feat)
    _check(graph, x, w, path)


@pytest.mark.parametrize("path", PATHS)
def test_odd_wide_features(path):
    """F = 602 spans several feature blocks (and the widest fused weight gradient)."""
    graph = _graph(num_nodes=6, num_edges=40, seed=3, hub=20)
    x, w = _inputs(graph, None, 602, "e", seed=5)
    _check(graph, x, w, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "heads, feat, weight, with_bias",
    [(None, 41, None, True), (None, 41, "e", False), (3, 20, "eh", True), (2, 9, "e", True)],
    ids=["F41-bias", "F41-weighted", "H3xF20-perhead", "H2xF9-shared"],
)
def test_unaligned_widths_run_padded(path, heads, feat, weight, with_bias, monkeypatch):
    """On GAR a head wider than 16 columns and not a multiple of 16 runs at the next
    multiple (zero columns appended, then sliced off): the kernels see 16-element aligned
    rows, and the values, the feature / weight / bias gradients are the reference's -- per
    head with ``[E, H]`` weights, over the flattened ``H F`` columns with ``[E]`` ones
    (2 x 9 = 18 -> 32). GAS runs the widths as they come."""
    seen = []
    kernel = spmm_gar.gar_reduce if path == "gar" else spmm_gas.gas_scatter
    name = "gar_reduce" if path == "gar" else "gas_scatter"  # as fusegnn.kernels.spmm calls them
    def record(*args, **kwargs):
        rows = args[1] if path == "gar" else args[0]  # gar_reduce(plan, a, ...), gas_scatter(a, ...)
        seen.append(rows.size(1))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(fused, name, record)
    graph = _graph(num_nodes=9, num_edges=50, seed=8, hub=20)
    x, w = _inputs(graph, heads, feat, weight, seed=9)
    if not with_bias:
        _check(graph, x, w, path)
        if w is not None:  # the backward keeps x as it came (it pads a copy itself), not a padded copy
            function = fused.GARSpmm if path == "gar" else fused.GASSpmm  # its own node: saved_tensors
            # the output held: grad_fn only weakly refers to its node, which dies with a temporary output
            out = function.apply(x, w.clone().requires_grad_(), None, graph)
            saved = [t for t in out.grad_fn.saved_tensors if t is not None]
            assert any(t.data_ptr() == x.data_ptr() for t in saved), [tuple(t.shape) for t in saved]
    else:
        b = torch.randn(x.shape[1:], dtype=x.dtype, generator=torch.Generator().manual_seed(3)).to(DEVICE)
        xs, bs = x.clone().requires_grad_(), b.clone().requires_grad_()
        ws = w.clone().requires_grad_() if w is not None else None
        out = spmm(graph, xs, ws, bias=bs, aggregation=path)
        xr, br = x.clone().requires_grad_(), b.clone().requires_grad_()
        wr = w.clone().requires_grad_() if w is not None else None
        ref = reference.spmm(graph, xr, wr, bias=br)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        grad = torch.randn_like(ref)
        got = torch.autograd.grad(out, [t for t in (xs, ws, bs) if t is not None], grad)
        want = torch.autograd.grad(ref, [t for t in (xr, wr, br) if t is not None], grad)
        for a, e in zip(got, want):
            assert a.shape == e.shape
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
        for t in (out,) + got:  # contiguous, of its own storage: no slice of a padded buffer kept alive
            assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    per_head = feat if weight == "eh" else feat * (heads or 1)
    run = -(-per_head // 16) * 16 if path == "gar" else per_head
    assert seen and all(width == run * (heads if weight == "eh" else 1) for width in seen), seen


@pytest.mark.parametrize("path", PATHS)
def test_zero_heads(path):
    """``[N, 0, F]`` features with ``[E, 0]`` weights (an attention with no heads): empty
    outputs and gradients of the right shapes (the head width divided by zero heads)."""
    graph = _graph(num_nodes=5, num_edges=12, seed=2)
    x = torch.randn(5, 0, 4, dtype=torch.float64, device=DEVICE, requires_grad=True)
    w = torch.randn(graph.num_edges, 0, dtype=torch.float64, device=DEVICE, requires_grad=True)
    out = spmm(graph, x, w, aggregation=path)
    assert out.shape == (5, 0, 4)
    gx, gw = torch.autograd.grad(out.sum(), (x, w))
    assert gx.shape == x.shape and gw.shape == w.shape


@pytest.mark.parametrize("path", PATHS)
def test_wide_heads_take_the_separate_dot_product(path, monkeypatch):
    """Heads wider than the fused weight gradient allows use the edge-parallel dot."""
    monkeypatch.setattr(fused, "MAX_DOT_BLOCK_F", 4)
    graph = _graph(num_nodes=8, num_edges=60, seed=4, hub=30)
    x, w = _inputs(graph, 2, 9, "eh", seed=6)
    _check(graph, x, w, path)


@pytest.mark.parametrize("path", PATHS)
def test_int64_offsets(path, monkeypatch):
    """The int64 index arithmetic (used when N*C or E*H reach 2**31) gives the same result."""
    monkeypatch.setattr(spmm_gas, "INT64_OFFSETS_FROM", 0)
    monkeypatch.setattr(spmm_gar, "INT64_OFFSETS_FROM", 0)
    graph = _graph(num_nodes=12, num_edges=120, seed=7, hub=60, dtype=torch.int32)
    x, w = _inputs(graph, 2, 3, "eh", seed=7)
    _check(graph, x, w, path)
    if path == "gar":  # the prefetching loop and the fused weight gradient, in int64 too
        with fused.tuning(gar=lambda f, es, dot: gar_config(f, es, dot=dot)._replace(seg_len=SEG_LEN, prefetch=True)):
            _check(graph, x, w, path)


@pytest.mark.parametrize("path", PATHS)
def test_bipartite(path):
    ei = random_graph(7, 90, 8, num_dst_nodes=5, hub_degree=40)
    graph = Graph(ei.to(DEVICE), (7, 5))
    x, w = _inputs(graph, None, 4, "e", seed=8)
    _check(graph, x, w, path)


@pytest.mark.parametrize("path", PATHS)
def test_mean(path):
    graph = _graph(num_nodes=10, num_edges=80, seed=9, hub=40)
    x, w = _inputs(graph, None, 3, "e", seed=9)
    _check(graph, x, w, path, reduce="mean")


@pytest.mark.parametrize("path", PATHS)
def test_max_runs_gar_fused(path):
    """reduce='max' runs GAR's fused max on both backends (GAS hands it over and says so)."""
    graph = _graph(num_nodes=10, num_edges=50, seed=10, hub=0)
    x, w = _inputs(graph, None, 3, "e", seed=10)
    out = spmm(graph, x, w, "max", aggregation=path)
    assert dispatch.last_backend() == "gar"
    if path == "gas":
        assert "max" in dispatch.last_decision().reason
    torch.testing.assert_close(out, reference.spmm(graph, x, w, "max"))


@pytest.mark.parametrize("path", PATHS)
def test_graph_weight_is_used(path):
    graph = _graph(num_nodes=10, num_edges=50, seed=11, hub=0)
    x, w = _inputs(graph, None, 3, "e", seed=11)
    weighted = graph.with_edge_weight(w)
    torch.testing.assert_close(spmm(weighted, x, aggregation=path), reference.spmm(graph, x, w))


@pytest.mark.parametrize("path", PATHS)
def test_empty_graphs(path):
    empty = Graph(torch.empty(2, 0, dtype=torch.int64, device=DEVICE), 5)
    x = torch.randn(5, 3, dtype=torch.float64, device=DEVICE, requires_grad=True)
    w = torch.empty(0, dtype=torch.float64, device=DEVICE, requires_grad=True)
    out = spmm(empty, x, w, aggregation=path)
    assert torch.equal(out, torch.zeros(5, 3, dtype=torch.float64, device=DEVICE))
    gx, gw = torch.autograd.grad(out, [x, w], torch.ones_like(out))
    assert torch.equal(gx, torch.zeros_like(x)) and gw.shape == (0,)
    no_nodes = Graph(torch.empty(2, 0, dtype=torch.int64, device=DEVICE), 0)
    assert spmm(no_nodes, x[:0], aggregation=path).shape == (0, 3)


@pytest.mark.parametrize("path", PATHS)
def test_inputs_untouched_and_noncontiguous(path):
    graph = _graph(num_nodes=10, num_edges=60, seed=12, hub=30)
    x_t = torch.randn(4, 10, dtype=torch.float64, device=DEVICE)
    x = x_t.t()  # non-contiguous [10, 4]
    w = random_weights(60, 3).to(DEVICE)
    before = x.clone(), w.clone(), graph.edge_index.clone()
    out = spmm(graph, x, w, aggregation=path)
    torch.testing.assert_close(out, reference.spmm(graph, x, w))
    assert torch.equal(x, before[0]) and torch.equal(w, before[1])
    assert torch.equal(graph.edge_index, before[2])


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward_and_backward(path, dtype):
    """fp16/bf16 in and out, fp32 accumulation: within the input rounding of an fp32 result."""
    graph = _graph(num_nodes=16, num_edges=200, seed=13, hub=120)
    x, w = _inputs(graph, 2, 8, "eh", seed=13, dtype=torch.float32)
    xh = x.to(dtype).requires_grad_()
    wh = w.to(dtype).requires_grad_()
    out = spmm(graph, xh, wh, aggregation=path)
    assert out.dtype == dtype
    x32 = xh.detach().float().requires_grad_()
    w32 = wh.detach().float().requires_grad_()
    ref = reference.spmm(graph, x32, w32)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=3e-3, atol=3e-3)
    torch.testing.assert_close(out.float(), ref, **tol)
    grad = torch.randn_like(ref)
    gx, gw = torch.autograd.grad(out, [xh, wh], grad.to(dtype))
    rx, rw = torch.autograd.grad(ref, [x32, w32], grad.to(dtype).float())
    assert gx.dtype == dtype and gw.dtype == dtype
    torch.testing.assert_close(gx.float(), rx, **tol)
    torch.testing.assert_close(gw.float(), rw, **tol)


@pytest.mark.parametrize("path", PATHS)
def test_float32_relative_error(path):
    graph = _graph(num_nodes=20, num_edges=300, seed=14, hub=200)
    x, w = _inputs(graph, None, 16, "e", seed=14, dtype=torch.float32)
    out = spmm(graph, x, w, aggregation=path)
    ref = reference.spmm(graph, x.double(), w.double())
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.parametrize("path", PATHS)
def test_gradcheck(path):
    graph = _graph(num_nodes=6, num_edges=24, seed=15, hub=10)
    x, w = _inputs(graph, None, 2, "e", seed=15)
    x.requires_grad_()
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: spmm(graph, a, b, aggregation=path), (x, w))


@pytest.mark.parametrize("path", PATHS)
def test_double_backward_raises(path):
    graph = _graph(num_nodes=6, num_edges=24, seed=16, hub=10)
    x, w = _inputs(graph, None, 2, "e", seed=16)
    x.requires_grad_()
    out = spmm(graph, x, w, aggregation=path)
    (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        gx.sum().backward()


@pytest.mark.parametrize(
    "path, override",
    [
        ("gas", dict(gas=spmm_gas.GasConfig(block_e=16, block_f=4, runs=True))),
        ("gas", dict(gas=spmm_gas.GasConfig(block_e=64, block_f=2, runs=False))),
        ("gar", dict(gar=spmm_gar.GarConfig(block_e=8, block_f=4, seg_len=SEG_LEN, hints=True, prefetch=True))),
        ("gar", dict(gar=spmm_gar.GarConfig(block_e=4, block_f=8, seg_len=SEG_LEN, prefetch=True, col_major=False))),
        ("gar", dict(gar=lambda f, es, dot: gar_config(f, es, dot=dot, avg_degree=3.0)._replace(seg_len=SEG_LEN))),
    ],
    ids=["gas-runs", "gas-noruns", "gar-hints-prefetch", "gar-prefetch-rowmajor", "gar-lowdeg"],
)
def test_kernel_variants_on_sorted_coo(path, override):
    """Launch variants on a COO sorted by source (so GAS's backward scatter row comes in
    runs), heads of 5 features with per-head weights."""
    ei = random_graph(20, 300, 23, hub_degree=150)
    ei = ei[:, torch.argsort(ei[0] * 20 + ei[1])]
    graph = Graph(ei.to(DEVICE), 20)
    x, w = _inputs(graph, 2, 5, "eh", seed=23)
    with fused.tuning(**override):
        _check(graph, x, w, path)


@pytest.mark.parametrize("runs_min, expected", [(0.0, [False, True]), (1e9, [False, False])])
def test_gas_uses_runs_when_the_scatter_row_is_sorted(monkeypatch, runs_min, expected):
    ei = random_graph(12, 80, 24)
    ei = ei[:, torch.argsort(ei[0] * 12 + ei[1])]
    graph = Graph(ei.to(DEVICE), 12)
    seen = []
    real = spmm_gas.gas_scatter

    def spy(*args, config=None, **kw):
        seen.append(config.runs)
        return real(*args, config=config, **kw)

    monkeypatch.setattr(fused, "gas_scatter", spy)
    monkeypatch.setattr(fused, "GAS_RUNS_MIN", runs_min)
    x, w = _inputs(graph, None, 3, "e", seed=24)
    _check(graph, x, w, "gas")
    assert seen == expected  # forward scatters into dst (unsorted), backward into src


# ------------------------------------------------------------------ GAR specifics
def test_gar_weight_memo_follows_in_place_changes():
    graph = _graph(num_nodes=10, num_edges=60, seed=17, hub=30)
    x, w = _inputs(graph, None, 3, "e", seed=17)
    first = spmm(graph, x, w, aggregation="gar")
    memo = graph.cached("gar_weight_memo", dict)
    assert "csr" in memo
    again = spmm(graph, x, w, aggregation="gar")
    assert torch.equal(first, again)
    w.mul_(2.0)  # in place: the memo must not serve the old order
    torch.testing.assert_close(spmm(graph, x, w, aggregation="gar"), reference.spmm(graph, x, w))


def _columns_in_reused_memory(num_edges: int) -> tuple[Tensor, Callable[[], Tensor]]:
    """``(first, make_second)``: two weights, each column 0 of an ``[E, 3]`` float64 tensor
    (not contiguous), that take the same memory one after the other with other values
    (call ``make_second`` once nothing holds ``first``). On CUDA the caching allocator
    hands the freed block out again; on the CPU memory that the test owns (a NumPy array)
    plays the allocator."""
    if CUDA:
        first = torch.rand(num_edges, 3, dtype=torch.float64, device=DEVICE)[:, 0]
        address = first.data_ptr()

        def make_second() -> Tensor:
            second = torch.rand(num_edges, 3, dtype=torch.float64, device=DEVICE)[:, 0]
            if second.data_ptr() != address:
                pytest.skip("the caching allocator did not hand the block out again")
            return second

        return first, make_second
    np = pytest.importorskip("numpy")
    memory = np.random.default_rng(0).random((num_edges, 3))

    def make_second() -> Tensor:
        memory[:] = np.random.default_rng(1).random(memory.shape)  # the next tensor's values
        return torch.from_numpy(memory)[:, 0]

    return torch.from_numpy(memory)[:, 0], make_second


def test_gar_weight_memo_survives_a_reused_address():
    """The memo is keyed by the weight's address (with its shape, strides, dtype and
    version) and must keep that memory alive while it holds the key. For a weight that is
    not contiguous it kept only its contiguous copy: once the weight died, the next tensor
    in its memory had the same key and other values, and GAR aggregated the old ones."""
    graph = _graph(num_nodes=10, num_edges=60, seed=17, hub=30)
    x, _ = _inputs(graph, None, 3, "e", seed=17)
    first, make_second = _columns_in_reused_memory(graph.num_edges)
    spmm(graph, x, first, aggregation="gar")
    del first
    second = make_second()
    torch.testing.assert_close(spmm(graph, x, second, aggregation="gar"), reference.spmm(graph, x, second))


def test_gar_plan_is_cached_and_split():
    graph = _graph(num_nodes=24, num_edges=400, seed=1, hub=300)
    plan = plan_for(graph, "csr", SEG_LEN)
    assert plan_for(graph, "csr", SEG_LEN) is plan
    assert plan.num_slots > 0 and plan.max_row_slots >= 300 // SEG_LEN


@pytest.mark.parametrize("seg_len", [1, 3, 8, 1000])
def test_partition_covers_every_edge_once(seg_len):
    counts = torch.tensor([0, 5, 1, 0, 17, 8, 0, 3])
    ptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    compressed = Graph(
        torch.stack([torch.arange(int(ptr[-1])) % 4, torch.repeat_interleave(torch.arange(8), counts)]), 8
    ).csr
    plan = build_plan(compressed, seg_len, num_other=8)
    start, end, row = plan.seg_start.long(), plan.seg_end.long(), plan.seg_row.long()
    assert bool((end - start <= seg_len).all()) and bool((end >= start).all())
    covered = torch.zeros(int(ptr[-1]), dtype=torch.int64)
    for s, e, r in zip(start.tolist(), end.tolist(), row.tolist()):
        assert ptr[r] <= s and e <= ptr[r + 1]
        covered[s:e] += 1
    assert bool((covered == 1).all())
    assert torch.equal(torch.unique(row), torch.arange(8))  # every row, even empty, has a segment
    # split rows own consecutive slots, in segment order
    for k, r in enumerate(plan.split_rows.tolist()):
        slots = plan.seg_slot[row == r].tolist()
        assert slots == list(range(int(plan.slot_ptr[k]), int(plan.slot_ptr[k + 1])))
    single = plan.seg_slot[~torch.isin(row, plan.split_rows.long())]
    assert bool((single == -1).all())


def test_partition_rejects_bad_length():
    with pytest.raises(ValueError, match="seg_len"):
        build_plan(_graph().csr, 0, num_other=24)


# ------------------------------------------------------------------ determinism and dispatch
def test_gar_is_bitwise_deterministic():
    graph = _graph(num_nodes=20, num_edges=400, seed=18, hub=300)
    x, w = _inputs(graph, None, 16, "e", seed=18, dtype=torch.float32)
    results = []
    for _ in range(2):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        with dispatch.deterministic():
            out = spmm(graph, xs, ws, aggregation="gar")
        out.backward(torch.ones_like(out))
        results.append((out.detach(), xs.grad, ws.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_deterministic_mode_refuses_gas():
    graph = _graph(num_nodes=10, num_edges=50, seed=19, hub=0)
    x, _ = _inputs(graph, None, 3, None, seed=19)
    with dispatch.deterministic(), pytest.raises(RuntimeError, match="not deterministic"):
        spmm(graph, x, aggregation="gas")
    prev = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="not deterministic"):
            spmm(graph, x, aggregation="gas")
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.warns(UserWarning, match="not deterministic"):
            out = spmm(graph, x, aggregation="gas")
        torch.testing.assert_close(out, reference.spmm(graph, x))
        assert dispatch.is_deterministic()
    finally:
        torch.use_deterministic_algorithms(prev[0], warn_only=prev[1])
    assert not dispatch.is_deterministic()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spmm(graph, x, aggregation="gas")


def test_auto_takes_the_reference_on_cpu():
    graph = Graph(random_graph(10, 50, 20), 10)
    x = torch.randn(10, 3)
    spmm(graph, x)
    decision = dispatch.last_decision()
    assert decision.name == "reference" and "cpu" in decision.reason
    assert dispatch.explain(graph, x).name == "reference"
    with dispatch.deterministic():
        assert dispatch.explain(graph, x).name == "reference"


def test_backends_registered_and_explained():
    assert {"gas", "gar", "reference"} <= set(dispatch.available_backends())
    graph = _graph(num_nodes=10, num_edges=50, seed=21, hub=0)
    x, _ = _inputs(graph, None, 3, None, seed=21)
    for path in PATHS:
        decision = dispatch.explain(graph, x, aggregation=path)
        assert decision.name == path and path in decision.reason
    with pytest.raises(ValueError, match="cannot run"):
        dispatch.explain(graph, x.to(torch.int64), aggregation="gar")


def test_auto_threshold_follows_the_calibration():
    table = dict(dispatch.GAR_CROSSOVER)
    for width, degree in table.items():
        assert dispatch.gar_min_avg_degree(width) == pytest.approx(degree)
    assert dispatch.gar_min_avg_degree(1) == table[16] and dispatch.gar_min_avg_degree(4096) == table[256]
    between = dispatch.gar_min_avg_degree(32)
    assert table[64] < between < table[16]
    assert dispatch.gar_min_avg_degree(None) == dispatch.GAR_MIN_AVG_DEGREE


def test_attention_layers_take_their_own_crossover():
    gat, gatv2 = (dict(dispatch.ATTENTION_GAR_CROSSOVER[op]) for op in ("gat", "gatv2"))
    for width, degree in gat.items():
        assert dispatch.gar_min_avg_degree(width, "gat") == pytest.approx(degree)
    assert dispatch.gar_min_avg_degree(512, "gat") == gat[64] and dispatch.gar_min_avg_degree(1, "gat") == gat[16]
    for width, degree in gatv2.items():
        assert dispatch.gar_min_avg_degree(width, "gatv2") == pytest.approx(degree)
    assert gatv2[64] < dispatch.gar_min_avg_degree(32, "gatv2") < gatv2[16] < gatv2[4]
    assert dispatch.gar_min_avg_degree(None, "gatv2") == max(gatv2.values())
    assert dispatch.gar_min_avg_degree(64, "sddmm") == dispatch.gar_min_avg_degree(64)  # other ops: spmm's table
    assert gat and dispatch.gar_min_avg_degree(64, "gat") < dispatch.gar_min_avg_degree(64)


def test_the_rule_reads_the_smaller_side_degree():
    """A square graph's average degree; a sampled block's sources (many, about one edge
    each) bound it, where its in-degree is the fan-out."""
    square = Graph(torch.tensor([[0, 1, 2, 0], [1, 2, 0, 0]]), 3)
    assert dispatch.smaller_side_degree(square) == pytest.approx(square.avg_degree)
    block = Graph(torch.stack([torch.arange(100), torch.arange(100) % 4]), (100, 4))
    assert block.avg_degree == 25 and dispatch.smaller_side_degree(block) == 1.0


def test_supports_cpu_only_under_the_interpreter(monkeypatch):
    graph = Graph(random_graph(10, 50, 22), 10)
    x = torch.randn(10, 3)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_helpers, "_triton_interprets", lambda: True)
    assert backends.supports(graph, x)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not backends.supports(graph, x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton_helpers, "_triton_interprets", lambda: False)  # triton imported for the GPU
    assert not backends.supports(graph, x)


def test_fused_path_on_cpu_without_interpreter_names_cuda_and_the_interpreter(monkeypatch):
    graph = Graph(random_graph(10, 50, 22), 10)
    x = torch.randn(10, 3)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for path in PATHS:
        with pytest.raises(ValueError, match=f"aggregation='{path}' cannot run") as info:
            dispatch.explain(graph, x, aggregation=path)
        message = str(info.value)
        assert "CUDA" in message and "TRITON_INTERPRET=1" in message and "'reference' or 'auto'" in message


def test_decisions_taken_collects_the_path_of_each_op():
    graph = _graph(num_nodes=10, num_edges=50, seed=23, hub=0)
    x, _ = _inputs(graph, None, 3, None, seed=23)
    with dispatch.decisions_taken() as outer:
        spmm(graph, x, aggregation="reference")
        with dispatch.decisions_taken() as inner:
            spmm(graph, x, aggregation="gar")
            spmm(graph, x, reduce="max", aggregation="gas")  # handed to GAR's fused max
    assert [d.name for d in inner] == ["gar", "gas", "gar"]
    assert "reduce='max'" in inner[2].reason
    assert [d.name for d in outer] == ["reference", "gar", "gas", "gar"]
    spmm(graph, x, aggregation="gar")  # after the block: not collected
    assert len(outer) == 4 and dispatch.last_decision().name == "gar"


def test_decisions_taken_collects_the_backward_on_every_device():
    """A backward started inside the block is collected: on the CPU the calling thread runs
    it, a CUDA backward runs in the autograd engine's device threads; the logs are
    process-wide, so both reach the block. Other threads' decisions are collected too."""
    import threading

    from fusegnn.sparse.propagate import propagate

    graph = _graph(num_nodes=10, num_edges=50, seed=24, hub=0)
    x, _ = _inputs(graph, None, 3, None, seed=24)
    x.requires_grad_()
    assert dispatch._open_logs == ()
    with dispatch.decisions_taken() as taken:
        propagate(graph, x, 2, aggregation="gar").sum().backward()  # the backward: propagate on A^T
        assert [d.name for d in taken] == ["gar"] * 4  # the forward's two steps and the backward's
        other = threading.Thread(target=lambda: propagate(graph, x.detach(), 1, aggregation="gas"))
        other.start()
        other.join()
    assert [d.name for d in taken] == ["gar"] * 4 + ["gas"]
    assert dispatch._open_logs == ()


def test_register_without_triton(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    assert backends.register() is False


# ------------------------------------------------------------------ larger graphs on a GPU
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _power_law_graph(num_nodes: int, num_edges: int, seed: int) -> Graph:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    weight = torch.exp(1.2 * torch.randn(num_nodes, generator=gen, device="cuda"))
    cdf = torch.cumsum(weight, 0) / weight.sum()
    src = torch.searchsorted(cdf, torch.rand(num_edges, generator=gen, device="cuda")).clamp_(max=num_nodes - 1)
    dst = torch.searchsorted(cdf, torch.rand(num_edges, generator=gen, device="cuda")).clamp_(max=num_nodes - 1)
    return Graph(torch.stack([src, dst]), num_nodes)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("feat, heads", [(16, None), (64, None), (8, 8), (602, None)])
def test_gpu_large_graph(path, feat, heads):
    graph = _power_law_graph(20_000, 400_000, seed=feat)
    x, w = _inputs(graph, heads, feat, "e" if heads is None else "eh", seed=feat, dtype=torch.float32)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = spmm(graph, xs, ws, aggregation=path)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = reference.spmm(graph, x64, w64)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    grad = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, [xs, ws], grad)
    rx, rw = torch.autograd.grad(ref, [x64, w64], grad.double())
    assert ((gx.double() - rx).norm() / rx.norm()).item() < 1e-5
    assert ((gw.double() - rw).norm() / rw.norm()).item() < 1e-5


@gpu
@pytest.mark.gpu
def test_gpu_auto_rule_and_determinism():
    graph = _power_law_graph(5_000, 200_000, seed=1)
    x = torch.randn(5_000, 32, device="cuda")
    assert dispatch.explain(graph, x).name == ("gar" if graph.avg_degree >= dispatch.gar_min_avg_degree(32) else "gas")
    with dispatch.deterministic():
        assert dispatch.explain(graph, x).name == "gar"
        a = spmm(graph, x)
        b = spmm(graph, x)
    assert torch.equal(a, b)


@pytest.mark.parametrize("aggregation", ["gas", "gar", "reference"])
@pytest.mark.parametrize("width", [(3,), (2, 3)], ids=["flat", "heads"])
@pytest.mark.parametrize("sizes", [(4, 0), (0, 4)], ids=["no-targets", "no-sources"])
def test_bias_gradient_with_no_rows(aggregation, width, sizes):
    """A graph with no targets (an empty output) or no sources (the bias alone): the
    gradients of x and the bias (flattening a 0-row tensor used to fail)."""
    num_src, num_dst = sizes
    graph = Graph(torch.empty(2, 0, dtype=torch.long, device=DEVICE), sizes)
    x = torch.randn((num_src, *width), dtype=torch.float64, device=DEVICE, requires_grad=True)
    bias = torch.randn(width, dtype=torch.float64, device=DEVICE, requires_grad=True)
    out = spmm(graph, x, bias=bias, aggregation=aggregation)
    assert out.shape == (num_dst, *width)
    torch.testing.assert_close(out, bias.expand_as(out))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    torch.testing.assert_close(bias.grad, torch.full_like(bias, float(num_dst)))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gat", "gatv2"])
def test_attention_layers_route_by_their_own_crossover(op):
    """On a graph of average degree ~5 at 8 x 8 channels spmm's rule takes GAS; the GAT /
    GATv2 ops take GAR by theirs (every decision a forward and backward record); on a
    sampled-like block (sources with about one edge each, in-degree 20) GAS."""
    from fusegnn.sparse.gat import gat_layer
    from fusegnn.sparse.gatv2 import gatv2_attention
    from fusegnn.sparse.processing import gat_self_loops

    graph = gat_self_loops(Graph(random_graph(2000, 8000, seed=3, device=DEVICE), 2000))
    h = torch.randn(graph.num_nodes, 8, 8, device=DEVICE, requires_grad=True)
    att = torch.randn(1, 8, 8, device=DEVICE, requires_grad=True)
    assert graph.avg_degree < dispatch.gar_min_avg_degree(64)  # spmm's rule: GAS here
    with dispatch.decisions_taken() as taken:
        out = (gat_layer(graph, h, att, att) if op == "gat" else gatv2_attention(graph, h, h, att))
        out.sum().backward()
    assert taken and all(d.name == "gar" and f"{op} GAR threshold" in d.reason for d in taken), taken
    n_src, n_dst = 4000, 200
    block = Graph(torch.stack([torch.randperm(n_src, device=DEVICE), torch.arange(n_src, device=DEVICE) % n_dst]),
                  (n_src, n_dst))
    h_src = torch.randn(n_src, 8, 8, device=DEVICE)
    assert dispatch.explain(block, h_src, op=op).name == "gas"
