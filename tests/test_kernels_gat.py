"""Fused GAT attention kernels against the reference composition, through Triton's CPU
interpreter (on the GPU when there is one).

Without CUDA this module sets ``TRITON_INTERPRET=1`` before any kernel module is
imported. Every case compares the output, the returned coefficients and the gradients of
``h``, ``score_src``, ``score_dst`` (and through ``alpha``) with
``sddmm -> leaky_relu -> edge_softmax -> dropout -> spmm`` of the reference backend in
float64, on random graphs with isolated nodes, self-loops, duplicate edges and a hub row
of hundreds of edges that a short ``chunk`` splits into several work items.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from fusegnn.kernels import gat_fused  # noqa: E402
from fusegnn.kernels._edge_utils import chunk_schedule  # noqa: E402
from fusegnn.kernels.gat_fused import dropout_keep_mask, fused_gat_attention  # noqa: E402
from fusegnn.layers import GATConv  # noqa: E402
from fusegnn.sparse import Graph, dispatch, edge_softmax, sddmm, spmm  # noqa: E402
from fusegnn.sparse.gat import gat_attention  # noqa: E402
from tests.graphs import random_graph  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
SLOPE = 0.2
SHORT_CHUNK = 48  # splits the hub row (in-degree 200) and nothing else but a few rows


def _graph(num_nodes=20, num_edges=280, seed=1, hub=200, dtype=torch.int64, **kw) -> Graph:
    ei = random_graph(num_nodes, num_edges, seed, hub_degree=hub, dtype=dtype, **kw)
    n = num_nodes if kw.get("num_dst_nodes") is None else (num_nodes, kw["num_dst_nodes"])
    return Graph(ei.to(DEVICE), n)


def _inputs(graph: Graph, heads: int, channels: int, seed: int, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(graph.num_src_nodes, heads, channels, generator=gen, dtype=torch.float64)
    s = torch.randn(graph.num_src_nodes, heads, generator=gen, dtype=torch.float64)
    t = torch.randn(graph.num_dst_nodes, heads, generator=gen, dtype=torch.float64)
    return tuple(v.to(DEVICE, dtype).requires_grad_() for v in (h, s, t))


def _reference(graph, h, s, t, keep=None, p=0.0):
    """The unfused composition, with an explicit keep mask for dropout."""
    scores = F.leaky_relu(sddmm(graph, s, t, "add", aggregation="reference"), SLOPE)
    alpha = edge_softmax(graph, scores, aggregation="reference")
    if keep is not None:
        alpha = alpha * keep.to(alpha.dtype) / (1.0 - p)
    return spmm(graph, h, alpha, aggregation="reference"), alpha


def _compare(graph, heads, channels, *, variant="gar", chunk=SHORT_CHUNK, p=0.0, seed=7,
             dtype=torch.float64, atol=1e-11, rtol=1e-10, grad_alpha=True):
    h, s, t = _inputs(graph, heads, channels, seed=3, dtype=dtype)
    out, alpha = fused_gat_attention(
        graph, h, s, t, SLOPE, p, seed=seed, return_alpha=True, aggregation=variant, chunk=chunk
    )
    keep = dropout_keep_mask(graph.num_edges, heads, p, seed, DEVICE) if p > 0 else None
    hr, sr, tr = (v.detach().double().requires_grad_() for v in (h, s, t))
    ref_out, ref_alpha = _reference(graph, hr, sr, tr, keep, p)
    assert out.shape == ref_out.shape and out.dtype == h.dtype
    assert alpha.shape == ref_alpha.shape and alpha.dtype == s.dtype
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(alpha.double(), ref_alpha, atol=atol, rtol=rtol)
    gen = torch.Generator().manual_seed(11)
    g_out = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    g_alpha = torch.randn(ref_alpha.shape, generator=gen, dtype=torch.float64).to(DEVICE)
    loss = (out.double() * g_out).sum() + ((alpha.double() * g_alpha).sum() if grad_alpha else 0)
    ref_loss = (ref_out * g_out).sum() + ((ref_alpha * g_alpha).sum() if grad_alpha else 0)
    got = torch.autograd.grad(loss, (h, s, t))
    want = torch.autograd.grad(ref_loss, (hr, sr, tr))
    for name, a, b in zip(("h", "score_src", "score_dst"), got, want):
        assert a.dtype == dtype and torch.isfinite(a).all(), name
        torch.testing.assert_close(a.double(), b, atol=atol * 10, rtol=rtol * 10, msg=lambda m: f"grad {name}: {m}")
    return out, alpha, got


# ------------------------------------------------------------------ outputs and gradients
@pytest.mark.parametrize(
    "heads,channels,variant,chunk",
    [
        (1, 1, "gar", SHORT_CHUNK),
        (1, 3, "gas", SHORT_CHUNK),
        (1, 16, "gar", SHORT_CHUNK),
        (1, 16, "gas", 2048),
        (8, 7, "gar", SHORT_CHUNK),
        (8, 7, "gas", SHORT_CHUNK),
        (8, 3, "gar", 2048),
        (1, 19, "gar", SHORT_CHUNK),  # padded to 32 channels inside (padded_channels)
        (2, 20, "gas", SHORT_CHUNK),
    ],
)
def test_matches_reference(heads, channels, variant, chunk):
    _compare(_graph(), heads, channels, variant=variant, chunk=chunk)


def test_padded_channels():
    assert [gat_fused.padded_channels(c) for c in (1, 3, 7, 16, 19, 32, 41, 48, 100, 130)] == [
        1, 3, 7, 16, 32, 32, 48, 48, 112, 144,
    ]


def test_hub_row_is_split_into_items():
    graph = _graph()
    sched = chunk_schedule(graph.csr.ptr, SHORT_CHUNK)
    assert sched is not None and sched.split_groups.numel() >= 1
    hub = int(torch.argmax(graph.in_degree))
    assert hub in sched.split_groups.tolist()
    # every edge position is covered exactly once by the items
    ptr = graph.csr.ptr.cpu()
    covered = torch.zeros(graph.num_edges, dtype=torch.int64)
    for g, start in zip(sched.item_group.tolist(), sched.item_start.tolist()):
        end = min(start + SHORT_CHUNK, int(ptr[g + 1]))
        covered[start:end] += 1
    assert bool((covered == 1).all())
    assert chunk_schedule(graph.csr.ptr, 10_000) is None


@pytest.mark.parametrize("variant,heads,channels,p", [("gar", 8, 3, 0.4), ("gas", 1, 16, 0.25)])
def test_dropout_grads_follow_the_forward_mask(variant, heads, channels, p):
    # p > 0: the backward regenerates the forward's mask (grads equal the reference's
    # with that same explicit mask), the hub row split in both passes.
    _compare(_graph(), heads, channels, variant=variant, p=p, seed=123)


def test_dropout_mask_is_deterministic_and_unbiased():
    graph = _graph()
    h, s, t = _inputs(graph, 2, 3, seed=1)
    a1 = fused_gat_attention(graph, h, s, t, SLOPE, 0.5, seed=9, return_alpha=True)[1]
    a2 = fused_gat_attention(graph, h, s, t, SLOPE, 0.5, seed=9, return_alpha=True)[1]
    a3 = fused_gat_attention(graph, h, s, t, SLOPE, 0.5, seed=10, return_alpha=True)[1]
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)
    keep = dropout_keep_mask(graph.num_edges, 2, 0.5, 9, DEVICE)
    assert torch.equal(a1 != 0, keep)
    # the keep rate of a large stream is 1 - p within a few standard deviations, and the
    # mask differs between heads of the same edge
    for p in (0.1, 0.6):
        big = dropout_keep_mask(16_384, 2, p, 3, DEVICE).double()
        sd = (p * (1 - p) / big.numel()) ** 0.5
        assert abs(big.mean().item() - (1 - p)) < 5 * sd
        assert (big[:, 0] != big[:, 1]).any()
    # E[out_i] = the output without dropout (E[M / (1 - p)] = 1): 48 targets with the
    # same four sources and the same scores are 48 draws of one row's output (their edges
    # have different ids, so independent masks), all in one launch.
    rows = 48
    src = torch.arange(4).repeat(rows)
    dst = torch.arange(rows).repeat_interleave(4)
    star = Graph(torch.stack([src, dst]).to(DEVICE), (4, rows))
    gen = torch.Generator().manual_seed(4)
    hs = torch.randn(4, 1, 2, generator=gen, dtype=torch.float64).to(DEVICE)
    ss = torch.randn(4, 1, generator=gen, dtype=torch.float64).to(DEVICE)
    ts = torch.zeros(rows, 1, dtype=torch.float64, device=DEVICE)
    outs = fused_gat_attention(star, hs, ss, ts, SLOPE, 0.3, seed=2)[0]
    ref = _reference(star, hs, ss, ts)[0][0]
    spread = outs.std(dim=0) / rows**0.5
    assert bool(((outs.mean(dim=0) - ref).abs() <= 4 * spread).all())
    assert bool((outs.std(dim=0) > 0).all())


def test_gradcheck_with_dropout():
    graph = Graph(torch.tensor([[0, 1, 2, 2, 3, 0, 1], [1, 1, 0, 3, 3, 3, 0]], device=DEVICE), 5)
    h, s, t = _inputs(graph, 2, 2, seed=8)

    def fn(h, s, t):
        out, alpha = fused_gat_attention(graph, h, s, t, SLOPE, 0.3, seed=17, return_alpha=True, chunk=2)
        return out, alpha

    assert torch.autograd.gradcheck(fn, (h, s, t), eps=1e-6, atol=1e-7, fast_mode=True)


def test_gradient_through_alpha_only_and_no_double_backward():
    graph = _graph(num_nodes=10, num_edges=50, hub=20)
    h, s, t = _inputs(graph, 2, 3, seed=6)
    out, alpha = fused_gat_attention(graph, h, s, t, SLOPE, 0.3, seed=4, return_alpha=True, chunk=8)
    weight = torch.randn(alpha.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(DEVICE)
    got = torch.autograd.grad((alpha * weight).sum(), (h, s, t), allow_unused=True)
    keep = dropout_keep_mask(graph.num_edges, 2, 0.3, 4, DEVICE)
    hr, sr, tr = (v.detach().clone().requires_grad_() for v in (h, s, t))
    want = torch.autograd.grad((_reference(graph, hr, sr, tr, keep, 0.3)[1] * weight).sum(), (hr, sr, tr), allow_unused=True)
    assert got[0] is None or bool((got[0] == 0).all())  # h does not reach alpha
    for a, b in zip(got[1:], want[1:]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    out = fused_gat_attention(graph, h, s, t)[0]
    (gh,) = torch.autograd.grad(out.square().sum(), (h,), create_graph=True)
    with pytest.raises(RuntimeError):
        gh.sum().backward()


def test_isolated_targets_get_zeros_and_no_nan():
    graph = _graph(num_nodes=16, num_edges=40, hub=0)
    assert (graph.in_degree == 0).any()
    out, alpha, grads = _compare(graph, 2, 3, chunk=4)
    empty = graph.in_degree == 0
    assert torch.isfinite(out).all() and bool((out[empty] == 0).all())
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("variant", ["gar", "gas"])
def test_bipartite_and_int32(variant):
    graph = _graph(num_nodes=12, num_edges=90, hub=40, num_dst_nodes=7, dtype=torch.int32)
    assert graph.index_dtype == torch.int32 and graph.is_bipartite
    _compare(graph, 2, 5, variant=variant, chunk=16)


def test_no_edges():
    graph = Graph(torch.empty(2, 0, dtype=torch.int64, device=DEVICE), 4)
    h, s, t = _inputs(graph, 2, 3, seed=0)
    out, alpha = fused_gat_attention(graph, h, s, t, return_alpha=True)
    assert out.shape == (4, 2, 3) and bool((out == 0).all()) and alpha.shape == (0, 2)
    grads = torch.autograd.grad(out.sum(), (h, s, t))
    assert all(bool((g == 0).all()) for g in grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision(dtype):
    # fp32 accumulation: the error is the input rounding, not the accumulation order
    tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-5}[dtype]
    _compare(_graph(seed=3), 8, 3, dtype=dtype, atol=tol, rtol=tol, grad_alpha=False)


def test_gar_backward_is_bitwise_reproducible():
    graph = _graph()
    h, s, t = _inputs(graph, 2, 3, seed=2)
    runs = []
    for _ in range(2):
        out = fused_gat_attention(graph, h, s, t, SLOPE, 0.2, seed=1, aggregation="gar", chunk=SHORT_CHUNK)[0]
        runs.append(torch.autograd.grad(out.square().sum(), (h, s, t)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


# ------------------------------------------------------------------ public op
def test_public_op_dispatch_and_shapes():
    graph = _graph()
    h, s, t = _inputs(graph, 2, 3, seed=5)
    ref, ref_alpha = gat_attention(graph, h, s, t, aggregation="reference", return_alpha=True)
    assert dispatch.last_backend() == "reference"
    for path in ("gar", "gas"):
        out, alpha = gat_attention(graph, h, s, t, aggregation=path, return_alpha=True)
        assert dispatch.last_backend() == path
        torch.testing.assert_close(out, ref, atol=1e-11, rtol=1e-10)
        torch.testing.assert_close(alpha, ref_alpha, atol=1e-11, rtol=1e-10)
    auto = gat_attention(graph, h, s, t)
    if not CUDA:
        assert dispatch.last_backend() == "reference"
    torch.testing.assert_close(auto, ref, atol=1e-11, rtol=1e-10)
    # one head as 2-D tensors
    out1, alpha1 = gat_attention(graph, h[:, 0], s[:, 0], t[:, 0], aggregation="gar", return_alpha=True)
    ref1, ref_alpha1 = gat_attention(graph, h[:, 0], s[:, 0], t[:, 0], aggregation="reference", return_alpha=True)
    assert out1.shape == (20, 3) and alpha1.shape == (graph.num_edges,)
    torch.testing.assert_close(out1, ref1, atol=1e-11, rtol=1e-10)
    torch.testing.assert_close(alpha1, ref_alpha1, atol=1e-11, rtol=1e-10)
    # an edge_index works too; inputs are not modified
    before = [v.detach().clone() for v in (h, s, t)]
    gat_attention(graph.edge_index, h, s, t, aggregation="gar")
    assert all(torch.equal(a, b) for a, b in zip(before, (h, s, t)))


def test_public_op_dropout_only_in_training():
    graph = _graph()
    h, s, t = _inputs(graph, 2, 3, seed=5)
    ref = gat_attention(graph, h, s, t, aggregation="reference")
    for path in ("gar", "reference"):
        torch.testing.assert_close(gat_attention(graph, h, s, t, dropout=0.5, aggregation=path), ref)
        torch.manual_seed(0)
        a = gat_attention(graph, h, s, t, dropout=0.5, training=True, aggregation=path, return_alpha=True)[1]
        torch.manual_seed(0)
        b = gat_attention(graph, h, s, t, dropout=0.5, training=True, aggregation=path, return_alpha=True)[1]
        assert bool((a == 0).any())
        if path == "gar" or not a.is_cuda:
            assert torch.equal(a, b)  # same seed: same mask, and gar is atomic-free
        else:  # the reference's index_add uses float atomics on CUDA: same mask, low bits vary
            assert torch.equal(a == 0, b == 0)
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"h": "bad"}, TypeError, "h must be a torch.Tensor"),
        ({"h": torch.zeros(20, 2, 3, dtype=torch.int64)}, TypeError, "h must be a floating"),
        ({"h": torch.zeros(19, 2, 3, dtype=torch.float64)}, ValueError, "h has 19 rows"),
        ({"score_src": torch.zeros(20, 3, dtype=torch.float64)}, ValueError, "one score per head"),
        ({"score_dst": torch.zeros(20, 2, dtype=torch.float32)}, TypeError, "same dtype"),
        ({"score_dst": torch.zeros(20, dtype=torch.float64)}, ValueError, "score_dst must have 2"),
        ({"dropout": 1.0}, ValueError, "dropout must be in"),
        ({"dropout": "x"}, TypeError, "dropout must be a real"),
        ({"negative_slope": None}, TypeError, "negative_slope"),
        ({"training": 1}, TypeError, "training must be a bool"),
        ({"aggregation": "fast"}, ValueError, "aggregation must be one of"),
        ({"return_alpha": "yes"}, TypeError, "return_alpha"),
    ],
)
def test_public_op_rejects_bad_input(kwargs, error, match):
    graph = Graph(random_graph(20, 50, 0), 20)
    args = dict(zip(("h", "score_src", "score_dst"), (v.detach().cpu() for v in _inputs(graph, 2, 3, 0))))
    args.update(kwargs)
    h, s, t = args.pop("h"), args.pop("score_src"), args.pop("score_dst")
    with pytest.raises(error, match=match):
        gat_attention(graph, h, s, t, **args)


# ------------------------------------------------------------------ the layer
def test_gatconv_fused_matches_reference():
    torch.manual_seed(0)
    graph = _graph()
    x = torch.randn(20, 6, dtype=torch.float64, device=DEVICE)
    ref_layer = GATConv(6, 3, heads=2, aggregation="reference").double().to(DEVICE)
    fused_layer = GATConv(6, 3, heads=2, aggregation="gar").double().to(DEVICE)
    fused_layer.load_state_dict(ref_layer.state_dict())
    ref, (ei, ref_alpha) = ref_layer(x, graph, return_attention_weights=True)
    out, (ei2, alpha) = fused_layer(x, graph, return_attention_weights=True)
    assert torch.equal(ei, ei2) and alpha.shape == (ei.size(1), 2)
    torch.testing.assert_close(out, ref, atol=1e-11, rtol=1e-10)
    torch.testing.assert_close(alpha, ref_alpha, atol=1e-11, rtol=1e-10)
    g = torch.randn_like(ref)
    (out * g).sum().backward()
    (ref * g).sum().backward()
    for (name, p1), p2 in zip(fused_layer.named_parameters(), ref_layer.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, atol=1e-10, rtol=1e-9, msg=lambda m: f"{name}: {m}")


def test_config_block_sizes_and_tuning():
    # forward: one warp, 2048 values; backward: one warp and 512 values for one head,
    # four warps and 256 values for several; no more edges than a row needs (but >= 16)
    L = gat_fused.Launch
    assert gat_fused._block_sizes(1, 16, 492.0) == (1, 16, L(128, 1), L(32, 1), L(32, 1))
    assert gat_fused._block_sizes(8, 8, 492.0) == (8, 8, L(32, 1), L(4, 4), L(4, 4))
    assert gat_fused._block_sizes(8, 8, 4.5) == (8, 8, L(16, 1), L(4, 4), L(4, 4))
    assert gat_fused._block_sizes(1, 16, 4.5) == (1, 16, L(16, 1), L(16, 1), L(16, 1))
    assert gat_fused._block_sizes(8, 7, 3.0)[:2] == (8, 8)
    graph = _graph()
    h, s, t = _inputs(graph, 2, 3, seed=1)
    ref = fused_gat_attention(graph, h, s, t)[0]
    with gat_fused.tuning(block_e=4, num_warps=2, chunk=40, col=(8, 1)):
        cfg = gat_fused._Config(graph, h, s.dtype, SLOPE, 0.0, 0, "gar", 40)
        assert (cfg.fwd, cfg.row, cfg.col) == (L(4, 2), L(4, 2), L(8, 1))
        torch.testing.assert_close(fused_gat_attention(graph, h, s, t)[0], ref, atol=1e-12, rtol=1e-12)
    assert gat_fused._TUNING == {}
    with pytest.raises(ValueError, match="power of two"):
        with gat_fused.tuning(block_e=3):
            pass
    with pytest.raises(ValueError, match="row must be a pair"):
        with gat_fused.tuning(row=4):
            pass
    with pytest.raises(ValueError, match=r"fwd\[1\] must be a power of two"):
        with gat_fused.tuning(fwd=(4, 3)):
            pass
    assert gat_fused._TUNING == {}
    with pytest.raises(ValueError, match="chunk must be a positive int"):
        fused_gat_attention(graph, h, s, t, chunk=0)


@pytest.mark.parametrize("variant", ["gar", "gas"])
@pytest.mark.parametrize("heads", [1, 3, 8])
def test_dropout_mask_read_as_bits_equals_the_drawn_one(monkeypatch, variant, heads):
    """Up to MAX_BITS_HEADS heads the passes with tiles below BITS_BELOW_EDGES edges read
    the keep mask as one byte per edge in their CSR / CSC order (drawn once per pass by
    keep_bits_kernel); the others draw it per edge. Both give bitwise the same outputs and gradients (GAT and GATv2), and the
    bytes decode to dropout_keep_mask's rows in that order."""
    from fusegnn.kernels.gatv2_fused import fused_gatv2_attention

    graph = _graph()
    h, s, t = _inputs(graph, heads, 5, seed=3)
    xr = torch.randn(graph.num_dst_nodes, heads, 5, dtype=h.dtype, device=DEVICE, requires_grad=True)
    att = torch.randn(1, heads, 5, dtype=h.dtype, device=DEVICE, requires_grad=True)
    g = torch.randn(graph.num_dst_nodes, heads, 5, dtype=h.dtype, device=DEVICE)

    def run():
        out = fused_gat_attention(graph, h, s, t, SLOPE, 0.4, seed=11, aggregation=variant, chunk=SHORT_CHUNK)[0]
        out2 = fused_gatv2_attention(graph, h, xr, att, None, SLOPE, 0.4, seed=11, aggregation=variant,
                                     chunk=SHORT_CHUNK)
        return (out, out2, *torch.autograd.grad((out * g).sum() + (out2 * g).sum(), (h, s, t, xr, att)))

    monkeypatch.setattr(gat_fused, "BITS_BELOW_EDGES", 1024)  # every pass reads bits
    read = run()
    monkeypatch.setattr(gat_fused, "MAX_BITS_HEADS", 0)  # every pass draws the mask
    drawn = run()
    for k, (a, b) in enumerate(zip(read, drawn)):
        if variant == "gar" or k < 2:
            assert torch.equal(a, b)
        else:  # "gas" adds its gradients with atomics: the order of the sums varies on a GPU
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    keep = dropout_keep_mask(graph.num_edges, heads, 0.4, 11, DEVICE)
    monkeypatch.setattr(gat_fused, "MAX_BITS_HEADS", 8)
    cfg = gat_fused.attention_config(graph, h, s, SLOPE, 0.4, 11, "gar")[0]
    for order in ("csr", "csc"):
        bits, flags = cfg.keep_mask(order, gat_fused.Launch(16, 1), h)
        assert flags == {"HAS_BITS": True, "DRAW": False}
        bits = bits.to(torch.int64)
        decoded = ((bits[:, None] >> torch.arange(heads, device=DEVICE)) & 1).bool()
        comp = graph.csr if order == "csr" else graph.csc
        assert torch.equal(decoded, keep[comp.perm.long()])


def test_keep_bits_only_for_small_tiles_and_few_heads():
    graph = _graph()
    h, s, _ = _inputs(graph, 2, 4, seed=1)
    L = gat_fused.Launch
    drawn = {"HAS_BITS": False, "DRAW": True}
    cfg = gat_fused.attention_config(graph, h, s, SLOPE, 0.5, 3, "gar")[0]
    arg, flags = cfg.keep_mask("csr", L(gat_fused.BITS_BELOW_EDGES, 1), h)
    assert arg is h and flags == drawn
    bits, flags = cfg.keep_mask("csc", L(gat_fused.BITS_BELOW_EDGES // 2, 1), h)
    assert bits.dtype == torch.uint8 and bits.shape == (graph.num_edges,)
    assert flags == {"HAS_BITS": True, "DRAW": False}
    no_dropout = gat_fused.attention_config(graph, h, s, SLOPE, 0.0, 3, "gar")[0]
    assert no_dropout.keep_mask("csr", L(4, 1), h) == (h, {"HAS_BITS": False, "DRAW": False})
    h9, s9, _ = _inputs(graph, gat_fused.MAX_BITS_HEADS + 1, 2, seed=1)
    arg, flags = gat_fused.attention_config(graph, h9, s9, SLOPE, 0.5, 3, "gar")[0].keep_mask("csr", L(4, 1), h9)
    assert arg is h9 and flags == drawn


@pytest.mark.parametrize("n, heads, channels", [(37, 8, 8), (5, 3, 5), (0, 2, 4), (300, 1, 3), (9, 2, 33)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_node_scores_are_the_two_dot_products(n, heads, channels, dtype):
    """The GAT layer's scores ``<h_n, a_s>``, ``<h_n, a_t>`` per head, one kernel: as the
    broadcast product summed over the channels, in ``h``'s dtype; inputs unchanged."""
    gen = torch.Generator().manual_seed(n * 7 + heads)
    h = torch.randn(n, heads, channels, generator=gen, dtype=dtype).to(DEVICE)
    att_src, att_dst = (torch.randn(1, heads, channels, generator=gen, dtype=dtype).to(DEVICE) for _ in range(2))
    before = h.clone()
    got = gat_fused.node_scores(h, att_src, att_dst, torch.float64 if dtype == torch.float64 else torch.float32)
    want = torch.stack(((h.double() * att_src.double()).sum(-1), (h.double() * att_dst.double()).sum(-1)))
    assert got.shape == (2, n, heads) and got.dtype == dtype
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), want, **tol)
    assert torch.equal(h, before)
