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
    launch_config,
)
from tests.attention_masks import dense_masks, make_layout  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


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


def _check(q, k, v, g, mask, layout, *, scale=None, atol=2e-5, grads=True):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = block_sparse_attention(q, k, v, layout, scale)
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


# (mask name, L_q, L_k, B, H, D, BM, BN, per_head)
CASES = [
    ("causal", 17, 17, 1, 1, 32, 16, 16, False),
    ("causal", 40, 40, 2, 1, 32, 16, 16, False),
    ("window", 64, 64, 1, 2, 32, 16, 16, False),
    ("random_blocks", 40, 40, 1, 1, 32, 16, 16, False),
    ("random", 33, 33, 1, 1, 32, 16, 16, False),
    ("empty_rows", 40, 40, 1, 1, 32, 16, 16, False),
    ("bigbird", 64, 64, 1, 1, 32, 16, 16, False),
    ("random", 40, 40, 1, 2, 32, 16, 16, True),
    ("window", 40, 17, 1, 1, 32, 16, 16, False),  # L_q != L_k
    ("causal", 40, 40, 1, 1, 32, 16, 32, False),  # BM != BN
    ("causal", 33, 33, 1, 1, 64, 16, 16, False),  # D = 64
    ("random", 20, 20, 1, 1, 24, 16, 16, False),  # D padded to 32
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-B{c[3]}H{c[4]}D{c[5]}-{c[6]}x{c[7]}{'-perhead' if c[8] else ''}")
def test_matches_dense_reference(case):
    name, L_q, L_k, B, H, D, BM, BN, per_head = case
    mask = dense_masks(name, L_q, L_k, heads=H if per_head else 1, seed=3)
    layout = make_layout(mask, BM, BN, DEVICE)
    assert layout.num_heads == (H if per_head else 1)
    (q, k, v), g = _inputs(B, H, L_q, L_k, D, seed=hash(case) % 1000)
    out = _check(q, k, v, g, mask if per_head else mask[0], layout)
    empty = ~mask.any(-1)  # [Hl, L_q]
    if empty.any():
        assert (out[:, empty.expand(H, L_q)] == 0).all()


def test_fully_empty_layout_gives_zeros_and_zero_grads():
    mask = torch.zeros(1, 20, 20, dtype=torch.bool)
    layout = make_layout(mask, 16, 16, DEVICE)
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
    mask = dense_masks("random", 32, 32, seed=5)
    mask[0, 3] = False
    layout = make_layout(mask, 16, 16, DEVICE)
    (q, k, v), g = _inputs(1, 1, 32, 32, 32, seed=2)
    out, lse = block_sparse_attention_lse(q, k, v, layout)
    assert (out[0, 0, 3] == 0).all() and math.isinf(lse[0, 0, 3].item())
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(32)
    ref_lse = torch.logsumexp(s.masked_fill(~mask.to(DEVICE), float("-inf")), -1)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=1e-5, rtol=1e-5)
    _check(q, k, v, g, mask[0], layout)


def test_custom_scale_and_strided_inputs():
    """q, k, v as transposed views of [B, L, H, D] tensors (what the layers pass)."""
    mask = dense_masks("window", 40, 40, seed=0)
    layout = make_layout(mask, 16, 16, DEVICE)
    gen = torch.Generator().manual_seed(4)
    base = [torch.randn(2, 40, 2, 32, generator=gen).to(DEVICE) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in base)
    assert not q.is_contiguous()
    g = torch.randn(2, 2, 40, 32, generator=gen).to(DEVICE)
    _check(q, k, v, g, mask[0], layout, scale=0.3)


def test_backward_is_deterministic():
    mask = dense_masks("bigbird", 48, 48, seed=1)
    layout = make_layout(mask, 16, 16, DEVICE)
    (q, k, v), g = _inputs(1, 1, 48, 48, 32, seed=7)
    grads = []
    for _ in range(2):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        block_sparse_attention(qq, kk, vv, layout).backward(g)
        grads.append((qq.grad, kk.grad, vv.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_forward(dtype):
    mask = dense_masks("causal", 40, 40, seed=0)
    layout = make_layout(mask, 16, 16, DEVICE)
    (q, k, v), _ = _inputs(1, 1, 40, 40, 32, seed=8, dtype=dtype)
    out = block_sparse_attention(q, k, v, layout)
    assert out.dtype == dtype
    ref = reference(q, k, v, mask[0])
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_bad_inputs():
    mask = dense_masks("causal", 32, 32, seed=0)
    layout = make_layout(mask, 16, 16, DEVICE)
    (q, k, v), _ = _inputs(1, 2, 32, 32, 32, seed=0)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        block_sparse_attention(q.double(), k.double(), v.double(), layout)
    with pytest.raises(TypeError, match="share a dtype"):
        block_sparse_attention(q, k.half(), v, layout)
    with pytest.raises(ValueError, match=r"q must be \[B, H, L, D\]"):
        block_sparse_attention(q[0], k, v, layout)
    with pytest.raises(ValueError, match="layout is for"):
        block_sparse_attention(q[:, :, :16], k, v, layout)
    with pytest.raises(ValueError, match="head dim"):
        block_sparse_attention(q, k[..., :16], v, layout)
    with pytest.raises(TypeError, match="layout must be a BlockLayout"):
        block_sparse_attention(q, k, v, mask)
    three = make_layout(torch.ones(3, 32, 32, dtype=torch.bool), 16, 16, DEVICE)
    with pytest.raises(ValueError, match="3 heads"):
        block_sparse_attention(q, k, v, three)


def test_launch_config_table():
    assert launch_config(64, 64, 64).fwd_warps == 4
    assert launch_config(128, 64, 64).fwd_warps == 8
    assert launch_config(16, 16, 32).fwd_warps == 2
    assert launch_config(128, 128, 128).fwd_stages == 2


# ------------------------------------------------------------------------------ GPU


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [32, 64, 128])
@pytest.mark.parametrize("name,L,BM,BN", [("bigbird", 1000, 64, 64), ("causal", 777, 128, 64), ("random", 513, 64, 32)])
def test_gpu_vs_sdpa(dtype, D, name, L, BM, BN):
    import torch.nn.functional as F

    mask = dense_masks(name, L, L, seed=0)[0]
    mask[7] = False  # an empty row
    layout = make_layout(mask[None], BM, BN, DEVICE)
    (q, k, v), g = _inputs(2, 3, L, L, D, seed=1, dtype=dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = block_sparse_attention(q, k, v, layout)
    out.backward(g)
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    dev_mask = mask.to(DEVICE)
    ref = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=dev_mask).masked_fill(~dev_mask.any(-1)[:, None], 0.0)
    ref.backward(g.float())
    tol = {torch.float16: 2e-2, torch.bfloat16: 6e-2, torch.float32: 5e-3}[dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad.float(), b.grad, atol=tol * 4, rtol=tol * 4)
