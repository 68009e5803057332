"""The dense path of ``sparse_attention`` (PyTorch's SDPA) and the ``auto`` rule that
chooses between it and the sparse paths.

* ``aggregation="dense"`` against the float64 masked reference
  (:func:`~fusegnn.attention.sparse_attention.masked_attention_reference`), outputs and
  gradients, for every mask kind, odd and rectangular ``L``, ``D_v != D``, shared and
  per-head masks, masks and prebuilt layouts; ``gradcheck`` of each SDPA variant;
* rows with no allowed key give zeros (never NaN) and no gradient, and SDPA itself never
  sees a fully masked row;
* :meth:`Mask.structure` (full / causal / general) from the definition -- positive and
  negative cases, independent of the block size, without materialising ``L x L`` -- and
  that the dense path calls SDPA with ``is_causal=True`` / no mask / a boolean mask
  accordingly;
* the auto rule (:func:`auto_attention_rule`, what ``explain_attention`` runs on CUDA),
  re-derived here from the cost model's definition and the layout's statistics over a
  grid of masks, lengths, batch x heads, head dims and modes; the decisions that follow
  from the calibrated constants for the benchmark's cases; the rule's limits (dense bool
  mask size cap, element path, constants pushed to extremes).

CPU only (the rule is evaluated for CUDA sizes on the CPU); one GPU test checks that
``explain_attention`` on CUDA is this rule.
"""

from __future__ import annotations

import importlib
from dataclasses import replace

import pytest
import torch

from fusegnn.attention import masks as M
from fusegnn.attention.block_layout import BlockLayout
from fusegnn.attention import cost_model as CM
from fusegnn.attention.cost_model import (
    COST_MODELS,
    DENSE_VARIANTS,
    ELEMENT_MAX_FILL,
    predict_attention_ms,
)
from fusegnn.attention.sparse_attention import (
    AttentionDecision,
    auto_attention_rule,
    explain_attention,
    masked_attention_reference,
    sparse_attention,
)

from tests.attention_cases import mask_cases, qkv, with_empty_rows  # noqa: E402

SA = importlib.import_module("fusegnn.attention.sparse_attention")  # the module (the package re-exports the function)
CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.usefixtures("one_thread")


def check_against_reference(mask, L_q, L_k, *, H=3, D=5, D_v=4, seed=0, scale=0.7):
    q, k, v = qkv(2, H, L_q, L_k, D, D_v, seed)
    allowed = (mask.to_mask() if isinstance(mask, BlockLayout) else mask).dense()
    out = sparse_attention(q, k, v, mask, scale=scale, aggregation="dense")
    expect = masked_attention_reference(q, k, v, allowed, scale)
    assert out.shape == (2, H, L_q, D_v) and out.dtype == torch.float64
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-12)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expect, (q, k, v), grad)
    for name, g, w in zip("qkv", got, want):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"grad {name}: {m}")
    return out


# ----------------------------------------------------------------------------- the dense path
@pytest.mark.parametrize("L", [1, 13, 21])
def test_dense_path_matches_reference(L):
    for name, mask in mask_cases(L).items():
        check_against_reference(mask, L, L)


def test_dense_path_rectangular_layout_and_per_head_dense():
    L_q, L_k = 11, 19
    check_against_reference(with_empty_rows(L_q, L_k, 3), L_q, L_k)
    gen = torch.Generator().manual_seed(9)
    check_against_reference(M.from_dense(torch.rand(3, L_q, L_k, generator=gen) < 0.4), L_q, L_k)
    check_against_reference(M.from_dense(torch.ones(L_q, L_k, dtype=torch.bool)), L_q, L_k)  # full, rectangular
    check_against_reference(M.from_dense(torch.ones(L_q, L_k, dtype=torch.bool).tril()), L_q, L_k)  # not "causal"
    L = 37
    for mask in (M.bigbird(L, 2, 2, 8, 0.3, 1), M.causal(L), M.stack_heads([M.causal(L), M.global_tokens(L, 3), M.dilated(L, 2, 2)])):
        layout = BlockLayout.from_mask(mask, 16, 32)
        out = check_against_reference(layout, L, L)
        q, k, v = qkv(2, 3, L, L, 5, 4)
        torch.testing.assert_close(out, sparse_attention(q, k, v, mask, scale=0.7, aggregation="dense"))


def test_empty_rows_are_zero_and_sdpa_never_sees_them(monkeypatch):
    calls = []
    sdpa = SA.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append(attn_mask)
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(SA.F, "scaled_dot_product_attention", spy)
    for mask in (with_empty_rows(17, 17, 5), M.stack_heads([with_empty_rows(17, 17, 6, every=3), M.causal(17)])):
        q, k, v = qkv(1, 2, 17, 17, 4)
        out = sparse_attention(q, k, v, mask, aggregation="dense")
        empty = ~mask.dense().any(-1).expand(2, 17)  # [H, L]
        assert empty.any()
        assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
        assert calls[-1] is not None and bool(calls[-1].any(-1).all())  # no fully masked row in SDPA
        out.sum().backward()
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()
        assert torch.equal(q.grad[:, empty], torch.zeros_like(q.grad[:, empty]))
    # all keys masked everywhere: zeros, zero gradients
    nothing = M.causal(9) & M.from_dense(torch.zeros(9, 9, dtype=torch.bool))
    q, k, v = qkv(1, 1, 9, 9, 4)
    out = sparse_attention(q, k, v, nothing, aggregation="dense")
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t.grad)) for t in (q, k, v))


@pytest.mark.parametrize(
    "mask",
    [
        M.causal(6),
        M.sliding_window(6, 9),
        M.from_dense(torch.tensor([[1, 0, 0, 1, 0, 0], [0] * 6, [1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 1], [1] * 6, [0, 0, 0, 0, 0, 1]], dtype=torch.bool)),
        M.stack_heads([M.causal(6), M.sliding_window(6, 1)]),
    ],
    ids=["causal", "no_mask", "bool_mask_empty_row", "per_head"],
)
def test_gradcheck(mask):
    q, k, v = qkv(1, 2, 6, 6, 3, 2, seed=4)

    def fn(q, k, v):
        return sparse_attention(q, k, v, mask, aggregation="dense")

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_low_precision_and_strided_inputs():
    mask = M.longformer(40, 3, 2)
    q, k, v = qkv(2, 2, 40, 40, 8)
    expect = masked_attention_reference(q, k, v, mask.dense(), 8**-0.5).detach()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        # [B, L, H, D] tensors viewed as [B, H, L, D] (what the layers pass)
        args = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).to(dtype) for t in (q, k, v)]
        assert not args[0].is_contiguous()
        out = sparse_attention(*args, mask, aggregation="dense")
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expect, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- structure
POSITIVE_CAUSAL = {
    "causal": lambda L: M.causal(L),
    "tril_dense": lambda L: M.from_dense(torch.ones(L, L, dtype=torch.bool).tril()),
    "causal_and_full_window": lambda L: M.causal(L) & M.sliding_window(L, L - 1),
    "causal_or_nothing": lambda L: M.causal(L) | M.from_dense(torch.zeros(L, L, dtype=torch.bool)),
    "per_head_causal": lambda L: M.stack_heads([M.causal(L), M.from_dense(torch.ones(L, L, dtype=torch.bool).tril())]),
    "layout_of_causal": lambda L: BlockLayout.from_mask(M.causal(L), 16, 32).to_mask(),
}
NEGATIVE_CAUSAL = {
    "causal_window": lambda L: M.causal(L) & M.sliding_window(L, 5),  # windowed causal is not plain causal
    "causal_window_wide": lambda L: M.causal(L) & M.sliding_window(L, L - 2),  # one element off
    "tril_emptied_row": lambda L: M.from_dense(torch.ones(L, L, dtype=torch.bool).tril().index_fill_(0, torch.tensor([L // 2]), False)),
    "strict_tril": lambda L: M.from_dense(torch.ones(L, L, dtype=torch.bool).tril(-1)),
    "anti_causal": lambda L: M.from_dense(torch.ones(L, L, dtype=torch.bool).triu()),
    "causal_plus_global": lambda L: M.causal(L) | M.global_tokens(L, 2),
    "per_head_mixed": lambda L: M.stack_heads([M.causal(L), M.sliding_window(L, 3)]),
    "window": lambda L: M.sliding_window(L, 3),
}
FULL = {
    "window_covering": lambda L: M.sliding_window(L, L - 1),
    "global_all": lambda L: M.global_tokens(L, L),
    "dense_ones": lambda L: M.from_dense(torch.ones(L, L, dtype=torch.bool)),
    "causal_or_anticausal": lambda L: M.causal(L) | M.from_dense(torch.ones(L, L, dtype=torch.bool).triu()),
}


@pytest.mark.parametrize("L", [9, 17, 64, 100])
@pytest.mark.parametrize("block_size", [(16, 16), (16, 64), (64, 32)])
def test_structure(L, block_size):
    for name, make in POSITIVE_CAUSAL.items():
        assert make(L).structure(block_size=block_size) == "causal", name
    for name, make in NEGATIVE_CAUSAL.items():
        assert make(L).structure(block_size=block_size) == "general", name
    for name, make in FULL.items():
        assert make(L).structure(block_size=block_size) == "full", name
    assert M.causal(1).structure() == "full"  # 1 x 1: k <= q allows everything
    assert M.causal(2).structure() == "causal" and (M.causal(2) & M.sliding_window(2, 0)).structure() == "general"
    assert M.from_dense(torch.ones(3, 5, dtype=torch.bool).tril()).structure() == "general"  # L_q != L_k
    assert M.from_dense(torch.ones(3, 5, dtype=torch.bool)).structure() == "full"


def test_structure_never_materialises_the_mask(monkeypatch):
    def refuse(self, device=None):
        raise AssertionError("structure() must not build the dense L x L mask")

    monkeypatch.setattr(M.Mask, "dense", refuse)
    L = 8192
    assert (M.causal(L) & M.sliding_window(L, L)).structure() == "causal"
    assert (M.causal(L) & M.sliding_window(L, 256)).structure() == "general"
    assert M.longformer(L, 256, 64).structure() == "general"
    assert (M.sliding_window(L, 10) | M.global_tokens(L, L)).structure() == "full"


def test_dense_variants_call_sdpa_accordingly(monkeypatch):
    calls = []
    sdpa = SA.F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        calls.append((attn_mask, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(SA.F, "scaled_dot_product_attention", spy)
    L = 21
    q, k, v = qkv(1, 2, L, L, 4)
    expected = {
        "causal": (M.causal(L) & M.sliding_window(L, L), "causal"),
        "no mask": (M.global_tokens(L, L), "no mask"),
        "bool mask": (M.causal(L) & M.sliding_window(L, 4), "bool mask"),
    }
    assert set(expected) == set(DENSE_VARIANTS)
    for variant, (mask, _) in expected.items():
        decision = explain_attention(q, mask, aggregation="dense")
        assert isinstance(decision, AttentionDecision)
        assert decision.name == "dense" and decision.dense_variant == variant
        assert decision.label == f"dense sdpa ({variant})" and variant in decision.reason
        sparse_attention(q, k, v, mask, aggregation="dense")
        attn_mask, is_causal = calls[-1]
        assert is_causal == (variant == "causal")
        assert (attn_mask is None) == (variant != "bool mask")
        if attn_mask is not None:
            assert attn_mask.dtype == torch.bool


def test_bool_mask_is_cached_on_the_mask():
    mask = M.sliding_window(33, 3)
    q, k, v = qkv(1, 1, 33, 33, 4)
    sparse_attention(q, k, v, mask, aggregation="dense")
    first = SA._sdpa_bool_mask(mask, q.device)
    assert SA._sdpa_bool_mask(mask, q.device)[0] is first[0]


# ----------------------------------------------------------------------------- the auto rule
def expected_decision(mask, B, H, D, backward, block_size=None):
    """The auto rule re-derived from its definition (module docstring of
    sparse_attention) and the layout's statistics."""
    split = mask.dilation_split()
    dilation, inner = split if split is not None else (1, mask)  # a split mask: its base, d times
    bs = block_size or SA.default_block_size(inner.L_q, inner.L_k)
    layout = BlockLayout.from_mask(inner, *bs)
    model = COST_MODELS["fwdbwd" if backward else "fwd"]
    pairs_per_head = B * H // layout.num_heads * dilation
    d = D / 64
    allowed = layout.density * layout.num_heads * inner.L_q * inner.L_k
    fill = allowed / (layout.nnzb * bs[0] * bs[1]) if layout.nnzb else 1.0
    if fill < ELEMENT_MAX_FILL:
        sparse, sparse_ms = "element", model.element_overhead_ms + model.element_ms_per_edge * d * allowed * pairs_per_head
    else:
        sparse = "block"
        sparse_ms = model.block_overhead_ms + model.block_ms_per_block * d * bs[0] * bs[1] / 4096 * layout.nnzb * pairs_per_head
    dense = mask.dense()
    dense3 = dense if dense.dim() == 3 else dense.unsqueeze(0)
    if fill < CM.VECTOR_MAX_FILL:  # the vector path: W-query windows x the keys any of their rows attends
        W = 16
        rows = torch.zeros(dense3.size(0), -(-mask.L_q // W) * W, mask.L_k, dtype=torch.bool)
        rows[:, : mask.L_q] = dense3
        entries = int(rows.view(dense3.size(0), -1, W, mask.L_k).any(dim=2).sum())
        vector_ms = model.vector_overhead_ms + model.vector_ms_per_entry * d * entries * (B * H // dense3.size(0))
        if vector_ms < sparse_ms:
            sparse, sparse_ms = "vector", vector_ms
    if bool(dense3.all()):
        variant, factor = "no mask", 1.0
    elif mask.L_q == mask.L_k and torch.equal(dense3, torch.ones_like(dense3).tril().expand_as(dense3)) and mask.L_q > 1:
        variant, factor = "causal", CM.DENSE_CAUSAL_FACTOR
    else:
        variant, factor = "bool mask", CM.DENSE_MASK_FACTOR
        if layout.num_heads * mask.L_q * mask.L_k > CM.DENSE_MASK_MAX_ELEMENTS:
            return sparse, None, sparse_ms, None
    dense_ms = model.dense_overhead_ms + model.dense_ms_per_element * factor * d * B * H * mask.L_q * mask.L_k
    if dense_ms < sparse_ms:
        return "dense", variant, sparse_ms, dense_ms
    return sparse, variant, sparse_ms, dense_ms


RULE_MASKS = {
    "causal": lambda L: M.causal(L),
    "window": lambda L: M.sliding_window(L, L // 8),
    "window_narrow": lambda L: M.sliding_window(L, 8),
    "longformer": lambda L: M.longformer(L, L // 8, 16),
    "bigbird": lambda L: M.bigbird(L, L // 16, 16, 64, 0.05, 0),
    "full": lambda L: M.global_tokens(L, L),
    "causal_window": lambda L: M.causal(L) & M.sliding_window(L, L // 4),
    "dilated": lambda L: M.dilated(L, L // 16, 2),  # split: its window's layout, twice
    "causal_dilated": lambda L: M.dilated(L, L // 8, 4) & M.causal(L),
    "per_head": lambda L: M.stack_heads([M.causal(L), M.sliding_window(L, 16)]),
    "graph": lambda L: M.from_graph(torch.stack([torch.arange(L).roll(7), torch.arange(L)]), L),  # fill < 0.01
}


@pytest.mark.parametrize("L", [256, 1024, 2048])
@pytest.mark.parametrize("B,H,D", [(1, 2, 32), (4, 12, 64), (16, 16, 128)])
@pytest.mark.parametrize("backward", [False, True])
def test_auto_rule_is_the_cost_model(L, B, H, D, backward):
    for name, make in RULE_MASKS.items():
        mask = make(L)
        H_ = mask.num_heads if mask.num_heads > 1 else H
        got = auto_attention_rule(mask, batch=B, heads=H_, head_dim=D, backward=backward)
        name_, variant, sparse_ms, dense_ms = expected_decision(mask, B, H_, D, backward)
        assert got.name == name_, (name, got.reason)
        predicted = dict(got.predicted_ms)
        if got.name != "dense":
            assert predicted[got.label] == pytest.approx(sparse_ms, rel=1e-9)
        else:
            assert got.dense_variant == variant and got.label == f"dense sdpa ({variant})"
            assert predicted[got.label] == pytest.approx(dense_ms, rel=1e-9)
            assert min(predicted.values()) == predicted[got.label]
        if dense_ms is not None:
            assert predicted[f"dense sdpa ({variant})"] == pytest.approx(dense_ms, rel=1e-9)
        assert "predicted" in got.reason or "not considered" in got.reason


def test_calibrated_decisions_for_the_benchmark_cases():
    """What the calibrated constants predict for the attention suite (B=4, H=12, D=64,
    training): every causal case dense with is_causal; at L=1024 the sparse kernels'
    fixed cost dominates and dense SDPA with the boolean mask wins, except on the dilated
    window, which runs as a plain window over its two sub-sequences (half the blocks); at
    L=4096 and 16384 the block kernel wins on the windowed masks. Each expectation is
    re-derived from the cost model (expected_decision) and must agree with the rule."""
    from benchmarks.attention import GPU_SIZES, build_mask

    for L in (1024, 4096):
        for name in ("window", "bigbird", "causal", "longformer", "dilated"):
            mask = build_mask(name, L, GPU_SIZES)
            got = auto_attention_rule(mask, batch=4, heads=12, head_dim=64, backward=True)
            assert got.name == expected_decision(mask, 4, 12, 64, True)[0], (name, L, got.reason)
            if name == "causal":
                assert got.label == "dense sdpa (causal)"
            elif name == "dilated":
                assert got.label == "block 64x64 dilation 2", got.reason
            elif L == 1024:
                assert got.label == "dense sdpa (bool mask)", got.reason
            else:
                assert got.label == "block 64x64", got.reason
    long_causal = auto_attention_rule(M.causal(16384), batch=4, heads=12, head_dim=64, backward=True)
    assert long_causal.label == "dense sdpa (causal)"
    long_window = auto_attention_rule(build_mask("window", 16384, GPU_SIZES), batch=4, heads=12, head_dim=64, backward=True)
    assert long_window.label == "block 64x64" and "not considered" in long_window.reason  # 16384^2 > the cap


def test_rule_limits(monkeypatch):
    L = 1024
    mask = M.sliding_window(L, 128)
    rule = lambda m=mask, **kw: auto_attention_rule(m, batch=4, heads=12, head_dim=64, backward=True, **kw)  # noqa: E731
    # the size cap on the boolean mask
    monkeypatch.setattr(CM, "DENSE_MASK_MAX_ELEMENTS", L * L - 1)
    capped = rule()
    assert capped.name == "block" and "not considered" in capped.reason
    assert [label for label, _ in capped.predicted_ms] == ["block 64x64"]
    monkeypatch.setattr(CM, "DENSE_MASK_MAX_ELEMENTS", L * L)
    assert "not considered" not in rule().reason
    # push the constants to the extremes: the decision follows the predicted costs
    base = COST_MODELS["fwdbwd"]
    cheap_block = replace(base, block_overhead_ms=0.0, block_ms_per_block=1e-12)
    monkeypatch.setitem(COST_MODELS, "fwdbwd", cheap_block)
    assert rule().name == "block" and rule(M.causal(L)).name == "block"
    assert rule(M.global_tokens(L, L)).name == "block"  # full mask, block kernel for free
    dear_block = replace(base, block_overhead_ms=1e3, block_ms_per_block=1.0)
    monkeypatch.setitem(COST_MODELS, "fwdbwd", dear_block)
    full = rule(M.global_tokens(L, L))
    assert full.label == "dense sdpa (no mask)"
    assert rule().label == "dense sdpa (bool mask)"
    # the element path: chosen by fill, then compared with dense by its own cost
    graph = RULE_MASKS["graph"](L)
    monkeypatch.setitem(COST_MODELS, "fwdbwd", base)
    sparse = rule(graph)
    assert sparse.name in ("element", "vector", "dense")
    assert dict(sparse.predicted_ms).keys() == {"element", "vector W16 x 64", "dense sdpa (bool mask)"}
    cheap_element = replace(base, element_overhead_ms=0.0, element_ms_per_edge=1e-12)
    monkeypatch.setitem(COST_MODELS, "fwdbwd", cheap_element)
    assert rule(graph).name == "element" and "fill" in rule(graph).reason
    assert rule(graph, element_allowed=False).name in ("block", "vector", "dense")
    # the vector path: weighed below VECTOR_MAX_FILL (a mask, not a prebuilt layout), then by its cost
    cheap_vector = replace(base, vector_overhead_ms=0.0, vector_ms_per_entry=1e-12)
    monkeypatch.setitem(COST_MODELS, "fwdbwd", cheap_vector)
    picked = rule(graph)
    assert picked.name == "vector" and picked.vector_sizes == (16, 64) and "predicted faster" in picked.reason
    assert rule(graph, vector_allowed=False).name in ("element", "dense")
    assert "vector W16 x 64" not in dict(rule(mask).predicted_ms)  # the window fills its blocks: not weighed
    layout = BlockLayout.from_mask(graph, 64, 64)
    assert rule(layout).name != "vector" and "vector W16 x 64" not in dict(rule(layout).predicted_ms)
    monkeypatch.setattr(CM, "VECTOR_MAX_FILL", 0.0)
    assert rule(graph).name != "vector"


def _random_mask(L, density, seed):
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(L, L, generator=gen) < density
    allowed.diagonal().fill_(True)
    return M.from_dense(allowed)


def test_auto_picks_the_vector_path_for_scattered_masks_and_keeps_its_structure_only_then():
    """The calibrated constants on the vector suite's masks (B=4, H=12, D=64, training):
    a 1 %-dense random mask at L=4096 takes the vector path (H200: 1.5 ms against 3.3 for
    blocks and 2.9 for dense SDPA with the mask), and the structure the rule counted is the
    one the path then reads; at 5 % it does not (predicted: blocks 2.94 ms, dense SDPA 3.01,
    vector 4.8; measured 3.3 / 2.9 / 4.4), and the structure it counted is not kept."""
    from fusegnn.attention.vector_windows import vector_structure

    cpu = torch.device("cpu")
    scattered = _random_mask(4096, 0.01, 0)
    got = auto_attention_rule(scattered, batch=4, heads=12, head_dim=64, backward=True)
    assert got.name == expected_decision(scattered, 4, 12, 64, True)[0] == "vector", got.reason
    assert got.vector_sizes == (16, 64) and got.label == "vector W16 x 64"
    assert vector_structure(scattered, 16, cpu, keep=False) is vector_structure(scattered, 16, cpu, keep=False)
    denser = _random_mask(4096, 0.05, 1)
    got = auto_attention_rule(denser, batch=4, heads=12, head_dim=64, backward=True)
    assert got.name == expected_decision(denser, 4, 12, 64, True)[0] != "vector", got.reason
    assert "vector W16 x 64" in dict(got.predicted_ms)  # weighed ...
    assert vector_structure(denser, 16, cpu, keep=False) is not vector_structure(denser, 16, cpu, keep=False)  # ... not kept


def test_auto_counts_the_vector_structure_once_and_survives_one_it_cannot_build(monkeypatch):
    """The entry count is cached on the mask: a second decision (another shape or mode)
    builds no structure; a structure that cannot be built (too many entries for int32
    indices, out of memory) leaves the vector path out, with the reason, instead of failing."""
    import fusegnn.kernels.vector_attention as VA

    builds = []
    real = VA.build_structure
    monkeypatch.setattr(VA, "build_structure", lambda *a, **kw: builds.append(1) or real(*a, **kw))
    mask = _random_mask(2048, 0.05, 2)
    first = auto_attention_rule(mask, batch=4, heads=12, head_dim=64, backward=True)
    second = auto_attention_rule(mask, batch=2, heads=8, head_dim=64, backward=False)
    assert len(builds) == 1 and "vector W16 x 64" in dict(first.predicted_ms) and "vector W16 x 64" in dict(second.predicted_ms)

    def too_large(*args, **kwargs):
        raise ValueError("too many compacted entries for int32 indices")

    monkeypatch.setattr(VA, "build_structure", too_large)
    fresh = _random_mask(2048, 0.01, 3)
    got = auto_attention_rule(fresh, batch=4, heads=12, head_dim=64, backward=True)
    assert got.name in ("block", "dense") and "vector path not weighed (ValueError" in got.reason
    assert "vector W16 x 64" not in dict(got.predicted_ms)


def test_auto_leaves_out_the_vector_path_when_one_window_holds_most_of_its_work():
    """A global token (a query attending every key, a key every query attends) is one
    window of L entries among windows of a few: one long program, which the summed-work
    model does not see (measured slower than blocks), so the path is not weighed. A
    narrow window's windows are even: weighed."""
    L = 8192
    skewed = auto_attention_rule(M.global_tokens(L, 1), batch=4, heads=12, head_dim=64, backward=True)
    assert "busiest window" in skewed.reason and "vector W16 x 64" not in dict(skewed.predicted_ms)
    assert skewed.name != "vector"
    even = auto_attention_rule(M.sliding_window(L, 4), batch=4, heads=12, head_dim=64, backward=True)
    assert "vector W16 x 64" in dict(even.predicted_ms)
    assert SA._window_skew(vector_structure_of(M.sliding_window(L, 4))) < CM.VECTOR_MAX_WINDOW_SKEW
    assert SA._window_skew(vector_structure_of(M.global_tokens(L, 1))) > 100


def vector_structure_of(mask):
    from fusegnn.attention.vector_windows import vector_structure

    return vector_structure(mask, 16, torch.device("cpu"), keep=False)


def test_compiled_decision_carries_the_vector_sizes():
    """What a compiled call reads: the vector path's (W, BLOCK_N) as asked, zeros elsewhere."""
    mask = _random_mask(64, 0.05, 4)
    asked = SA.compiled_decision(mask.handle, (1, 2, 64, 16), torch.float32, "cpu", "vector", 32, 128, True)
    assert asked[0] == "vector" and asked[-2:] == (32, 128)
    auto = SA.compiled_decision(mask.handle, (1, 2, 64, 16), torch.float32, "cpu", "auto", 0, 0, True)
    assert auto[0] == "reference" and auto[-2:] == (0, 0)


def test_predict_attention_ms_definition():
    m = COST_MODELS["fwd"]
    assert predict_attention_ms("dense", 1e6, head_dim=64, backward=False) == pytest.approx(
        m.dense_overhead_ms + m.dense_ms_per_element * 1e6)
    assert predict_attention_ms("dense", 1e6, head_dim=128, backward=False, dense_variant="causal") == pytest.approx(
        m.dense_overhead_ms + m.dense_ms_per_element * 2e6 * CM.DENSE_CAUSAL_FACTOR)
    assert predict_attention_ms("block", 10, head_dim=64, backward=False, block_size=(128, 64)) == pytest.approx(
        m.block_overhead_ms + m.block_ms_per_block * 20)
    b = COST_MODELS["fwdbwd"]
    assert predict_attention_ms("element", 100, head_dim=32, backward=True) == pytest.approx(
        b.element_overhead_ms + b.element_ms_per_edge * 50)
    assert predict_attention_ms("vector", 100, head_dim=128, backward=True, window=32) == pytest.approx(
        b.vector_overhead_ms + b.vector_ms_per_entry * 400)
    # forward + backward costs more than the forward alone, for every path
    for path, kw in (("dense", {}), ("block", {}), ("element", {}), ("vector", {})):
        assert predict_attention_ms(path, 1e5, head_dim=64, backward=True, **kw) > predict_attention_ms(path, 1e5, head_dim=64, backward=False, **kw)
    with pytest.raises(ValueError, match="path must be"):
        predict_attention_ms("sdpa", 1, head_dim=64, backward=True)
    with pytest.raises(ValueError, match="dense_variant must be one of"):
        predict_attention_ms("dense", 1, head_dim=64, backward=True, dense_variant="causal mask")


def test_explain_attention_on_cpu_and_forced_paths():
    q = torch.zeros(2, 3, 40, 16)
    mask = M.causal(40)
    assert explain_attention(q, mask).name == "reference"  # auto off CUDA
    for aggregation in ("reference", "element"):
        assert explain_attention(q, mask, aggregation=aggregation).name == aggregation
    forced = explain_attention(q, mask, aggregation="dense")
    assert (forced.name, forced.dense_variant, forced.label) == ("dense", "causal", "dense sdpa (causal)")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        explain_attention(q, mask, aggregation="sdpa")
    layout = BlockLayout.from_mask(M.sliding_window(40, 3), 16, 16)
    assert explain_attention(q, layout, aggregation="block").label == "block 16x16"
    assert explain_attention(q, layout, aggregation="dense").label == "dense sdpa (bool mask)"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here)")
def test_explain_on_cuda_is_the_rule_and_runs():
    for dtype in (torch.bfloat16, torch.float16):
        for L, mask in ((1024, M.sliding_window(1024, 256)), (4096, M.sliding_window(4096, 256)), (2048, M.causal(2048))):
            q, k, v = (torch.randn(2, 4, L, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
            decision = explain_attention(q, mask)
            expected = auto_attention_rule(mask, batch=2, heads=4, head_dim=64, backward=True)
            assert decision.label == expected.label
            out = sparse_attention(q, k, v, mask)
            ref = masked_attention_reference(*(t.detach().float() for t in (q, k, v)), mask.dense("cuda"), 64**-0.5)
            torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
            out.float().sum().backward()
            assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # the dense path on the GPU with empty rows and a per-head mask
    mask = M.stack_heads([with_empty_rows(300, 300, 1), M.causal(300)])
    q, k, v = (torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = sparse_attention(q, k, v, mask, aggregation="dense")
    ref = masked_attention_reference(q.float(), k.float(), v.float(), mask.dense("cuda"), 64**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
