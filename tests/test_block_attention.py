"""Fused block-sparse attention (``fusegnn.kernels.block_attention``) against a dense
masked softmax in float64, outputs and gradients, through Triton's CPU interpreter (on
the GPU when there is one).

Without CUDA this module sets ``TRITON_INTERPRET=1`` before the kernel module is
imported. The interpreter is slow, so sizes are tiny (L = 17 .. 64, tiles of 16): odd
lengths (ragged last block row and column), causal, window, random-block and dense
random masks, rows with no allowed key, a fully empty layout, per-head and shared
layouts, L_q != L_k, non-square tiles, strided inputs, head dims 32 / 64 / 24 (padded).
GPU tests (skipped without CUDA) compare larger cases with SDPA given the dense mask.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from fusegnn.kernels.block_attention import (  # noqa: E402
    block_sparse_attention,
    block_sparse_attention_lse,
    LaunchConfig,
    launch_config,
)
from fusegnn.attention.block_layout import BlockLayout  # noqa: E402
from fusegnn.attention.masks import (  # noqa: E402
    bigbird,
    causal,
    dilated,
    from_dense,
    from_graph,
    global_tokens,
    longformer,
    random_blocks,
    sliding_window,
    stack_heads,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
def _rand_bool(*shape, p, seed):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) < p


def _empty_rows(L_q, L_k):
    """Causal with rows 0, 7 and 20..31 emptied (at L_q >= 32 a whole empty block row)."""
    m = torch.ones(L_q, L_k, dtype=torch.bool).tril()
    m[[0, 7]] = False
    m[20:32] = False
    return from_dense(m)


def _graph_mask(L_q, L_k):
    gen = torch.Generator().manual_seed(11)
    E = 3 * L_q
    ei = torch.stack([torch.randint(0, L_k, (E,), generator=gen), torch.randint(0, L_q, (E,), generator=gen)])
    return from_graph(ei, L_q, L_k)


#: name -> (L_q, L_k) -> Mask; square masks ignore L_k
MASKS = {
    "causal": lambda L, _: causal(L),
    "window": lambda L, _: sliding_window(L, 5),
    "dilated": lambda L, _: dilated(L, 3, 2),
    "global": lambda L, _: global_tokens(L, 3),
    "random_blocks": lambda L, _: random_blocks(L, 16, 0.4, seed=1),
    "longformer": lambda L, _: longformer(L, 4, 2),
    "bigbird": lambda L, _: bigbird(L, 3, 4, 16, 0.15, seed=0),
    "combined": lambda L, _: (causal(L) & sliding_window(L, 9)) | global_tokens(L, 2),
    "random": lambda Lq, Lk: from_dense(_rand_bool(Lq, Lk, p=0.3, seed=3)),
    "empty_rows": _empty_rows,
    "graph": _graph_mask,
    "per_head_stack": lambda L, _: stack_heads([causal(L), sliding_window(L, 4)]),
    "per_head_dense": lambda Lq, Lk: from_dense(_rand_bool(2, Lq, Lk, p=0.3, seed=4)),
}


def make(name, L_q, L_k, BM=16, BN=16):
    """``(dense bool mask [L_q, L_k] or [H, L_q, L_k], BlockLayout on DEVICE)``."""
    mask = MASKS[name](L_q, L_k)
    return mask.dense(), BlockLayout.from_mask(mask, BM, BN, DEVICE)


def reference(q, k, v, mask, scale=None):
    """Dense masked softmax in float64; rows with no allowed key give 0.
    ``mask`` is ``[L_q, L_k]`` or ``[H, L_q, L_k]``."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask.to(q.device), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def _inputs(B, H, L_q, L_k, D, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L_q, D, generator=gen)
    k = torch.randn(B, H, L_k, D, generator=gen)
    v = torch.randn(B, H, L_k, D, generator=gen)
    g = torch.randn(B, H, L_q, D, generator=gen)
    return [t.to(DEVICE, dtype) for t in (q, k, v)], g.to(DEVICE, dtype)


def _check(q, k, v, g, mask, layout, *, scale=None, atol=2e-5, grads=True, launch=None):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = block_sparse_attention(q, k, v, layout, scale, launch=launch)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(qd, kd, vd, mask, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)
    if grads:
        out.backward(g)
        ref.backward(g.double())
        for name, a, b in (("dq", q, qd), ("dk", k, kd), ("dv", v, vd)):
            assert torch.isfinite(a.grad).all(), name
            torch.testing.assert_close(a.grad.double(), b.grad, atol=atol, rtol=atol, msg=name)
    return out


# (mask name, L_q, L_k, B, H, D, BM, BN)
CASES = [
    ("causal", 17, 17, 1, 1, 32, 16, 16),
    ("causal", 40, 40, 2, 1, 32, 16, 16),
    ("window", 64, 64, 1, 2, 32, 16, 16),
    ("dilated", 40, 40, 1, 1, 32, 16, 16),
    ("global", 33, 33, 1, 1, 32, 16, 16),
    ("random_blocks", 40, 40, 1, 1, 32, 16, 16),
    ("longformer", 40, 40, 1, 1, 32, 16, 16),
    ("bigbird", 64, 64, 1, 1, 32, 16, 16),
    ("combined", 40, 40, 1, 1, 32, 16, 16),
    ("random", 33, 33, 1, 1, 32, 16, 16),
    ("empty_rows", 40, 40, 1, 1, 32, 16, 16),
    ("graph", 40, 24, 1, 1, 32, 16, 16),  # L_q != L_k
    ("per_head_stack", 40, 40, 1, 2, 32, 16, 16),
    ("per_head_dense", 24, 40, 2, 2, 32, 16, 16),
    ("window", 40, 40, 1, 1, 32, 16, 32),  # BM != BN
    ("causal", 40, 40, 1, 1, 32, 32, 16),
    ("causal", 33, 33, 1, 1, 64, 16, 16),  # D = 64
    ("random", 20, 20, 1, 1, 24, 16, 16),  # D = 24, padded to 32
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-B{c[3]}H{c[4]}D{c[5]}-{c[6]}x{c[7]}")
def test_matches_dense_reference(case):
    name, L_q, L_k, B, H, D, BM, BN = case
    mask, layout = make(name, L_q, L_k, BM, BN)
    assert layout.num_heads == (H if name.startswith("per_head") else 1)
    (q, k, v), g = _inputs(B, H, L_q, L_k, D, seed=sum(map(ord, str(case))))
    out = _check(q, k, v, g, mask, layout)
    empty = ~mask.any(-1).expand(H, L_q)  # [H, L_q]
    assert (out[:, empty] == 0).all()


def _dilated_dense(d, base_dense, L_q, L_k):
    """``[H?, L_q, L_k]``: token ``i`` may attend to ``j`` iff ``i = j (mod d)`` and the
    base mask allows ``(i // d, j // d)``."""
    q = torch.arange(L_q).view(-1, 1)
    k = torch.arange(L_k).view(1, -1)
    return (q % d == k % d) & base_dense[..., q // d, k // d]


# (base mask name, L_q, L_k, dilation, B, H, D, BM, BN): the base mask is built for
# ceil(L_q / d) x ceil(L_k / d); lengths that are not multiples of d (sub-sequences of
# two lengths), ragged and even last block columns (L_k = d * BN * n: no key mask),
# per-head base layouts, empty rows, L_q != L_k
DILATED_CASES = [
    ("window", 37, 37, 3, 1, 1, 32, 16, 16),
    ("window", 64, 64, 2, 2, 1, 32, 16, 16),  # 64 = 2 * 16 * 2: EVEN_K
    ("causal", 50, 50, 4, 1, 2, 24, 16, 16),
    ("bigbird", 96, 96, 2, 1, 1, 32, 16, 16),
    ("empty_rows", 70, 70, 2, 1, 1, 32, 16, 16),
    ("per_head_stack", 45, 45, 2, 1, 2, 32, 16, 16),
    ("random", 33, 50, 3, 1, 1, 32, 16, 32),
]


@pytest.mark.parametrize("case", DILATED_CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-d{c[3]}")
def test_dilation_matches_dense_reference(case):
    name, L_q, L_k, d, B, H, D, BM, BN = case
    sub_q, sub_k = -(-L_q // d), -(-L_k // d)
    base = MASKS[name](sub_q, sub_k)
    layout = BlockLayout.from_mask(base, BM, BN, DEVICE)
    mask = _dilated_dense(d, base.dense(), L_q, L_k)
    (q, k, v), g = _inputs(B, H, L_q, L_k, D, seed=sum(map(ord, str(case))))
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = block_sparse_attention_lse(q, k, v, layout, dilation=d)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = reference(qd, kd, vd, mask)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    scores = (qd @ kd.transpose(-1, -2)).detach() / math.sqrt(D)
    ref_lse = scores.masked_fill(~mask.to(DEVICE), float("-inf")).logsumexp(-1)
    ref_lse = torch.where(torch.isfinite(ref_lse), ref_lse, torch.full_like(ref_lse, float("inf")))
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)
    out.backward(g)
    ref.backward(g.double())
    for label, a, b in (("dq", q, qd), ("dk", k, kd), ("dv", v, vd)):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=2e-5, rtol=2e-5, msg=label)


def test_band_patterns_replace_loaded_patterns(monkeypatch):
    """Layouts whose partial blocks are all diagonal bands (windows, causal, Longformer at
    a length the blocks divide) mask by ``lo <= i - j <= hi``; the others (a dilated
    window, a ragged last block, a dense random mask) load their patterns. Both give the
    same result, and FUSEGNN_BAND_PATTERNS=0 turns the bands off."""
    from fusegnn.kernels import block_attention as BA

    # the test masks' 2-4 global tokens cut Longformer / BigBird blocks: not bands there;
    # 16 global tokens fill whole 16 x 16 blocks, which are then full
    expect = {"window": True, "causal": True, "longformer": False, "bigbird": False, "dilated": False,
              "random": False, "longformer16": True}
    for name, banded in expect.items():
        if name == "longformer16":
            layout = BlockLayout.from_mask(longformer(64, 5, 16), 16, 16, DEVICE)
        else:
            _, layout = make(name, 64, 64)
        prep = layout.prepared(DEVICE)
        assert prep.all_bands is banded, name
        lo, hi = prep.bands[:, 0].tolist(), prep.bands[:, 1].tolist()
        assert all(a <= b for a, b in zip(lo, hi)), name
    assert make("window", 40, 40)[1].prepared(DEVICE).all_bands is False  # ragged: cut patterns
    (q, k, v), g = _inputs(1, 2, 64, 64, 32, seed=21)
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("FUSEGNN_BAND_PATTERNS", flag)
        mask = longformer(64, 5, 16)
        layout = BlockLayout.from_mask(mask, 16, 16, DEVICE)
        mask = mask.dense()
        assert layout.prepared(DEVICE).all_bands is (flag == "1")
        outs.append(_check(q, k, v, g, mask, layout))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-6)


def test_dilation_bad_inputs():
    layout = BlockLayout.from_mask(sliding_window(20, 3), 16, 16, DEVICE)
    (q, k, v), _ = _inputs(1, 1, 40, 40, 32, seed=0)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="dilation must be an int >= 1"):
            block_sparse_attention(q, k, v, layout, dilation=bad)
    with pytest.raises(ValueError, match=r"with dilation=3 the layout must be for the sub-sequences.*14 x 14"):
        block_sparse_attention(q, k, v, layout, dilation=3)
    with pytest.raises(ValueError, match="layout is for"):
        block_sparse_attention(q, k, v, layout)  # a 20 x 20 layout without dilation
    out = block_sparse_attention(q, k, v, layout, dilation=2)  # ceil(40 / 2) = 20
    torch.testing.assert_close(
        out.double(), reference(q, k, v, _dilated_dense(2, sliding_window(20, 3).dense(), 40, 40)),
        atol=2e-5, rtol=2e-5)


def test_sparse_attention_runs_dilated_masks_as_sub_sequences():
    """sparse_attention's block path splits a dilated mask (and its intersection with a
    causal one) into sub-sequences: the decision says so, the result is the mask's."""
    from fusegnn.attention.sparse_attention import explain_attention, sparse_attention

    L = 45
    for mask in (dilated(L, 4, 3), dilated(L, 5, 2) & causal(L)):
        (q, k, v), g = _inputs(1, 2, L, L, 32, seed=5)
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        decision = explain_attention(q, mask, aggregation="block", block_size=16)
        d = mask.dilation_split()[0]
        assert decision.dilation == d and decision.label == f"block 16x16 dilation {d}"
        out = sparse_attention(q, k, v, mask, aggregation="block", block_size=16)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = reference(qd, kd, vd, mask.dense())
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
        out.backward(g)
        ref.backward(g.double())
        for a, b in ((q, qd), (k, kd), (v, vd)):
            torch.testing.assert_close(a.grad.double(), b.grad, atol=2e-5, rtol=2e-5)


def test_fully_empty_layout_gives_zeros_and_zero_grads():
    layout = BlockLayout.from_mask(from_dense(torch.zeros(20, 20, dtype=torch.bool)), 16, 16, DEVICE)
    assert layout.col_idx.numel() == 0
    (q, k, v), g = _inputs(1, 2, 20, 20, 32, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = block_sparse_attention_lse(q, k, v, layout)
    assert (out == 0).all() and torch.isinf(lse).all() and (lse > 0).all()
    out.backward(g)
    for t in (q, k, v):
        assert (t.grad == 0).all()


def test_empty_row_inside_partial_block_and_lse():
    """Row 3 has no key; its block row has others that do. LSE is the natural log-sum-exp."""
    dense = _rand_bool(32, 32, p=0.3, seed=5)
    dense[3] = False
    dense[4, 0] = True
    layout = BlockLayout.from_mask(from_dense(dense), 16, 16, DEVICE)
    (q, k, v), g = _inputs(1, 1, 32, 32, 32, seed=2)
    out, lse = block_sparse_attention_lse(q, k, v, layout)
    assert (out[0, 0, 3] == 0).all() and math.isinf(lse[0, 0, 3].item())
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(32)
    ref_lse = torch.logsumexp(s.masked_fill(~dense.to(DEVICE), float("-inf")), -1)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=1e-5, rtol=1e-5)
    _check(q, k, v, g, dense, layout)


def test_custom_scale_and_strided_inputs():
    """q, k, v as transposed views of [B, L, H, D] tensors (what the layers pass)."""
    mask, layout = make("window", 40, 40)
    gen = torch.Generator().manual_seed(4)
    base = [torch.randn(2, 40, 2, 32, generator=gen).to(DEVICE) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    assert not q.is_contiguous()
    g = torch.randn(2, 2, 40, 32, generator=gen).to(DEVICE)
    _check(q, k, v, g, mask, layout, scale=0.3)


@pytest.mark.parametrize("scale", [0.0, -0.7, 2.5])
def test_zero_negative_and_large_scale(scale):
    """scale > 0 takes the row maximum of the unscaled products; scale <= 0 must not.
    float32 rounding of q.k is amplified by |scale|: the tolerance grows with it."""
    mask, layout = make("bigbird", 48, 48)
    (q, k, v), g = _inputs(1, 2, 48, 48, 32, seed=11)
    _check(q, k, v, g, mask, layout, scale=scale, atol=2e-5 * max(1.0, abs(scale) * math.sqrt(32)))


@pytest.mark.parametrize("name", ["window", "bigbird", "empty_rows", "graph"])
@pytest.mark.parametrize("sub_m", [16, 32])
def test_backward_sub_tiles_and_separate_dq_launch(name, sub_m):
    """_bwd_dkdv over each 32-row block in sub-tiles of 16 / 32 rows, _bwd_dq over each
    32-key block in sub-tiles of 16 / 32 keys, launched with its own warps / stages."""
    L_k = 24 if name == "graph" else 40
    mask, layout = make(name, 40, L_k, 32, 32)
    (q, k, v), g = _inputs(1, 2, 40, L_k, 32, seed=12)
    launch = LaunchConfig(4, 2, 4, 1, dq_warps=2, dq_stages=2, dkdv_sub_m=sub_m, dq_sub_n=sub_m,
                          fwd_maxnreg=96, dq_maxnreg=96, dkdv_maxnreg=128)
    _check(q, k, v, g, mask, layout, launch=launch)


def test_backward_is_deterministic_and_inputs_untouched():
    mask, layout = make("bigbird", 48, 48)
    (q, k, v), g = _inputs(1, 1, 48, 48, 32, seed=7)
    copies = [t.clone() for t in (q, k, v, g)]
    grads = []
    for _ in range(2):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        block_sparse_attention(qq, kk, vv, layout).backward(g)
        grads.append((qq.grad, kk.grad, vv.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    for a, b in zip((q, k, v, g), copies):
        assert torch.equal(a, b)


@pytest.mark.parametrize("which", ["q", "v", "kv"])
def test_only_some_inputs_require_grad(which):
    """dq alone (no dK / dV launch; Delta computed inside the dq kernel), or dK / dV
    alone (Delta from the preprocess kernel); the others get no gradient."""
    mask, layout = make("bigbird", 40, 40)
    (q, k, v), g = _inputs(1, 1, 40, 40, 32, seed=13)
    inputs = {name: t.requires_grad_(name in which) for name, t in zip("qkv", (q, k, v))}
    block_sparse_attention(*inputs.values(), layout).backward(g)
    double = {name: t.detach().double().requires_grad_(name in which) for name, t in inputs.items()}
    reference(*double.values(), mask).backward(g.double())
    for name, t in inputs.items():
        if name in which:
            torch.testing.assert_close(t.grad.double(), double[name].grad, atol=2e-5, rtol=2e-5, msg=name)
        else:
            assert t.grad is None, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward(dtype):
    mask, layout = make("causal", 40, 40)
    (q, k, v), _ = _inputs(1, 1, 40, 40, 32, seed=8, dtype=dtype)
    out = block_sparse_attention(q, k, v, layout)
    assert out.dtype == dtype
    ref = reference(q, k, v, mask)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_bad_inputs():
    mask, layout = make("causal", 32, 32)
    (q, k, v), _ = _inputs(1, 2, 32, 32, 32, seed=0)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        block_sparse_attention(q.double(), k.double(), v.double(), layout)
    with pytest.raises(TypeError, match="same dtype"):
        block_sparse_attention(q, k.half(), v, layout)
    with pytest.raises(ValueError, match=r"q must be 4-D \[B, H, L, D\]"):
        block_sparse_attention(q[0], k, v, layout)
    with pytest.raises(ValueError, match="layout is for"):
        block_sparse_attention(q[:, :, :16], k, v, layout)
    with pytest.raises(ValueError, match="head dim"):
        block_sparse_attention(q, k[..., :16], v, layout)
    with pytest.raises(TypeError, match="layout must be a BlockLayout"):
        block_sparse_attention(q, k, v, mask)
    three = BlockLayout.from_mask(from_dense(torch.ones(3, 32, 32, dtype=torch.bool)), 16, 16, DEVICE)
    with pytest.raises(ValueError, match="3 heads"):
        block_sparse_attention(q, k, v, three)


def test_launch_config_table():
    assert launch_config(64, 64, 64).fwd_warps == 4
    assert launch_config(128, 64, 64).fwd_warps == 8
    assert launch_config(16, 16, 32).fwd_warps == 2
    assert launch_config(128, 128, 128).fwd_stages == 2
    tuned = launch_config(64, 64, 64, torch.bfloat16)
    assert tuned.dkdv_maxnreg is not None and tuned.sub_m(64) == 32 and tuned.sub_n(64) == 32
    fp32 = launch_config(64, 64, 64, torch.float32)  # register caps were measured on bf16
    assert (fp32.fwd_maxnreg, fp32.dq_maxnreg, fp32.dkdv_maxnreg) == (None, None, None)
    assert fp32.sub_m(64) == 32 and fp32.dq == tuned.dq


@pytest.mark.parametrize("bad", [
    dict(dq_warps=3), dict(dq_stages=0), dict(dkdv_sub_m=24), dict(dq_sub_n=8), dict(dkdv_maxnreg=300),
    dict(fwd_maxnreg=16), dict(dq_maxnreg=96.0),
])
def test_launch_config_bad_values_name_the_field(bad):
    mask, layout = make("causal", 20, 20)
    (q, k, v), _ = _inputs(1, 1, 20, 20, 32, seed=3)
    field = next(iter(bad))
    with pytest.raises(ValueError, match=f"launch.{field}"):
        block_sparse_attention(q, k, v, layout, launch=LaunchConfig(4, 2, 4, 2, **bad))


# ------------------------------------------------------------------------------ GPU


_GPU_MASKS = {
    "bigbird": (lambda L: bigbird(L, 100, 64, 64, 0.05, seed=0), 1000, 64, 64),
    "causal": (lambda L: causal(L), 777, 128, 64),
    "dilated+global": (lambda L: dilated(L, 20, 3) | global_tokens(L, 5), 513, 64, 32),
    "per_head": (lambda L: stack_heads([sliding_window(L, 40), causal(L), longformer(L, 30, 16)]), 700, 64, 128),
}
# Each layout at two (dtype, head dim) points, each dtype and head dim at least twice:
# every point compiles three kernels, so the full 3 x 3 x 4 product (108 compilations)
# would dominate the GPU test time without testing more code paths.
_GPU_CASES = [
    ("bigbird", torch.bfloat16, 64), ("bigbird", torch.float16, 128),
    ("causal", torch.float32, 64), ("causal", torch.bfloat16, 128),
    ("dilated+global", torch.float16, 32), ("dilated+global", torch.bfloat16, 64),
    ("per_head", torch.bfloat16, 32), ("per_head", torch.float32, 128),
]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,dtype,D", _GPU_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_gpu_vs_sdpa(name, dtype, D):
    import torch.nn.functional as F

    mask_fn, L, BM, BN = _GPU_MASKS[name]
    mask = mask_fn(L)
    layout = BlockLayout.from_mask(mask, BM, BN, DEVICE)
    dense = mask.dense(DEVICE)
    (q, k, v), g = _inputs(2, 3, L, L, D, seed=1, dtype=dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = block_sparse_attention(q, k, v, layout)
    out.backward(g)
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=dense)
    ref.backward(g.float())
    tol = {torch.float16: 2e-2, torch.bfloat16: 6e-2, torch.float32: 5e-3}[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad.float(), b.grad, atol=tol * 4, rtol=tol * 4)


def test_table_launch_falls_back_to_fewer_stages():
    """A table configuration that does not fit in shared memory (Triton raises
    OutOfResources at launch) is retried with fewer stages and remembered; an explicit
    configuration (a tuning sweep) fails as it is."""
    from fusegnn.kernels import block_attention as BA

    class OutOfResources(Exception):
        pass

    class FakeKernel:
        __name__ = "fake_kernel"

        def __init__(self):
            self.calls = []

        def __getitem__(self, grid):
            def run(*args, num_warps, num_stages, **meta):
                self.calls.append(num_stages)
                if num_stages > 1:
                    raise OutOfResources("shared memory")

            return run

    kernel = FakeKernel()
    meta = dict(BM=64, BN=128, BD=128)
    BA._launch(kernel, (1,), (), meta, 8, 3, fallback=True, dtype=torch.float32)
    assert kernel.calls == [3, 2, 1]
    BA._launch(kernel, (1,), (), meta, 8, 3, fallback=True, dtype=torch.float32)
    assert kernel.calls == [3, 2, 1, 1]  # remembered
    with pytest.raises(OutOfResources):
        BA._launch(kernel, (1,), (), meta, 8, 2, fallback=False, dtype=torch.float32)

    class Broken(FakeKernel):
        def __getitem__(self, grid):
            def run(*args, **kw):
                raise ValueError("not a resource problem")

            return run

    with pytest.raises(ValueError, match="not a resource problem"):
        BA._launch(Broken(), (1,), (), meta, 4, 3, fallback=True, dtype=torch.float32)
    BA._STAGES_THAT_FIT.clear()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("L,dtype", [(1000, torch.bfloat16), (2048, torch.float16)])
def test_gpu_dilated_sub_sequences_vs_sdpa(L, dtype):
    """A dilated window and a causal dilated window through sparse_attention's block
    path (two sub-sequences; L = 2048 = 2 * 64 * 16 takes the unmasked-key loads and band
    patterns), and a Longformer mask (band patterns at L = 2048), against SDPA given the
    dense mask."""
    import torch.nn.functional as F

    from fusegnn.attention.sparse_attention import sparse_attention

    for mask in (dilated(L, 128, 2), dilated(L, 100, 2) & causal(L), longformer(L, 100, 64)):
        dense = mask.dense(DEVICE)
        (q, k, v), g = _inputs(2, 3, L, L, 64, seed=2, dtype=dtype)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = sparse_attention(q, k, v, mask, aggregation="block")
        out.backward(g)
        q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=dense)
        ref.backward(g.float())
        tol = 6e-2 if dtype == torch.bfloat16 else 2e-2
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
        for a, b in ((q, q2), (k, k2), (v, v2)):
            torch.testing.assert_close(a.grad.float(), b.grad, atol=tol * 4, rtol=tol * 4)
