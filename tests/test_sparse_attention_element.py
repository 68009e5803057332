"""``sparse_attention``: the reference and element-level paths, dispatch and validation.

Both paths are compared in float64 with an independent dense masked softmax (PyTorch's
``softmax`` over ``-inf``-filled scores, rows with no allowed key set to zero), outputs
and gradients of ``q``, ``k``, ``v``, for every mask type, odd ``L``, rectangular
``L_q x L_k``, ``D_v != D``, empty rows, shared and per-head masks, masks and prebuilt
layouts; ``gradcheck`` on tiny cases. The element path's inner ``sddmm`` /
``edge_softmax`` / ``spmm`` also run through the fused ``gas`` / ``gar`` Triton kernels
(through Triton's CPU interpreter when there is no GPU: this module sets
``TRITON_INTERPRET=1`` before any kernel module is imported), the same kernels GAT uses.
"""

from __future__ import annotations

import math
import os
import sys

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fusegnn.sparse import available_backends  # noqa: E402
from fusegnn.attention import masks as M  # noqa: E402
from fusegnn.attention.block_layout import BlockLayout  # noqa: E402
from fusegnn.attention.sparse_attention import (  # noqa: E402
    default_block_size,
    explain_attention,
    sparse_attention,
)
from tests.attention_cases import mask_cases, qkv, with_empty_rows  # noqa: E402

CUDA = torch.cuda.is_available()


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- oracle
def oracle(q, k, v, allowed, scale):
    """Dense masked softmax attention, written independently of fusegnn."""
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    empty = ~allowed.any(-1, keepdim=True)  # all keys masked: softmax gives NaN
    p = torch.where(empty, torch.zeros_like(p), p)
    return p @ v


def _check_against_oracle(mask, L_q, L_k, aggregation, *, H=3, D=5, D_v=4, seed=0, **kw):
    q, k, v = qkv(2, H, L_q, L_k, D, D_v, seed)
    scale = 0.7
    allowed = (mask.to_mask() if isinstance(mask, BlockLayout) else mask).dense()
    out = sparse_attention(q, k, v, mask, scale=scale, aggregation=aggregation, **kw)
    expect = oracle(q, k, v, allowed, scale)
    assert out.shape == (2, H, L_q, D_v)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-12)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expect, (q, k, v), grad)
    for name, g, w in zip("qkv", got, want):
        assert not torch.isnan(g).any(), name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"grad {name}: {m}")
    return out


# ----------------------------------------------------------------------------- paths
@pytest.mark.parametrize("aggregation", ["element", "reference"])
@pytest.mark.parametrize("L", [1, 13, 21])
def test_paths_match_dense_oracle(aggregation, L):
    for name, mask in mask_cases(L).items():
        _check_against_oracle(mask, L, L, aggregation)


@pytest.mark.parametrize("aggregation", ["element", "reference"])
def test_empty_rows_are_zero(aggregation):
    mask = with_empty_rows(17, 17, 5)
    q, k, v = qkv(1, 2, 17, 17, 4)
    out = sparse_attention(q, k, v, mask, aggregation=aggregation)
    assert torch.equal(out[:, :, ::4], torch.zeros_like(out[:, :, ::4]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :, ::4], torch.zeros_like(q.grad[:, :, ::4]))


@pytest.mark.parametrize("aggregation", ["element", "reference"])
def test_rectangular_and_per_head_dense(aggregation):
    L_q, L_k = 11, 19
    _check_against_oracle(with_empty_rows(L_q, L_k, 3), L_q, L_k, aggregation)
    gen = torch.Generator().manual_seed(9)
    per_head = M.from_dense(torch.rand(3, L_q, L_k, generator=gen) < 0.4)
    _check_against_oracle(per_head, L_q, L_k, aggregation)
    graph = M.from_graph(torch.stack([torch.randint(0, L_k, (30,), generator=gen), torch.randint(0, L_q, (30,), generator=gen)]), L_q, L_k)
    _check_against_oracle(graph, L_q, L_k, aggregation)


@pytest.mark.parametrize("aggregation", ["element", "reference"])
def test_layout_input(aggregation):
    L = 37
    for mask in (M.bigbird(L, 2, 2, 8, 0.3, 1), M.stack_heads([M.causal(L), M.global_tokens(L, 3), M.dilated(L, 2, 2)])):
        layout = BlockLayout.from_mask(mask, 16, 32)
        out = _check_against_oracle(layout, L, L, aggregation)
        q, k, v = qkv(2, 3, L, L, 5, 4)
        torch.testing.assert_close(out, sparse_attention(q, k, v, mask, scale=0.7, aggregation=aggregation))


@pytest.mark.parametrize("aggregation", ["element", "reference"])
def test_gradcheck(aggregation):
    L = 6
    dense = torch.tensor(
        [
            [1, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 0, 0],  # empty row
            [1, 1, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 1],
            [1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    for mask in (M.from_dense(dense), M.stack_heads([M.from_dense(dense), M.causal(L)])):
        q, k, v = qkv(1, 2, L, L, 3, 2, seed=4)

        def fn(q, k, v, mask=mask):
            return sparse_attention(q, k, v, mask, aggregation=aggregation)

        assert torch.autograd.gradcheck(fn, (q, k, v))


def test_default_scale_and_inputs_untouched():
    mask = M.sliding_window(9, 2)
    q, k, v = qkv(1, 2, 9, 9, 16)
    copies = [t.detach().clone() for t in (q, k, v)]
    a = sparse_attention(q, k, v, mask, aggregation="element")
    b = sparse_attention(q, k, v, mask, scale=1 / math.sqrt(16), aggregation="element")
    torch.testing.assert_close(a, b)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t.detach(), c)


def test_low_precision_reference_and_element():
    mask = M.bigbird(33, 2, 2, 8, 0.3, 0)
    q, k, v = qkv(1, 2, 33, 33, 8)
    expect = oracle(q, k, v, mask.dense(), 8**-0.5)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        args = [t.detach().to(dtype) for t in (q, k, v)]
        for aggregation in ("element", "reference"):
            out = sparse_attention(*args, mask, aggregation=aggregation)
            assert out.dtype == dtype
            torch.testing.assert_close(out.double(), expect.detach(), rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- fused inner ops
@pytest.mark.parametrize("inner", ["gas", "gar"])
def test_element_path_on_fused_kernels(inner):
    pytest.importorskip("triton")
    if inner not in available_backends():
        pytest.skip(f"backend {inner!r} is not registered")
    L = 11
    mask = M.stack_heads([M.bigbird(L, 1, 1, 4, 0.3, 2), with_empty_rows(L, L, 7)])
    device = "cuda" if CUDA else "cpu"
    q, k, v = (t.detach().to(device).requires_grad_() for t in qkv(1, 2, L, L, 4, 3, seed=3))
    out = sparse_attention(q, k, v, mask, aggregation="element", element_aggregation=inner)
    from fusegnn.sparse import dispatch

    assert dispatch.last_decision().name == inner  # the last inner op (spmm) ran the kernel
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expect = sparse_attention(q2, k2, v2, mask, aggregation="element", element_aggregation="reference")
    torch.testing.assert_close(out, expect, rtol=1e-10, atol=1e-12)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype).to(device)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expect, (q2, k2, v2), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)


# ----------------------------------------------------------------------------- dispatch
def test_auto_off_cuda_is_reference():
    q = torch.zeros(1, 1, 8, 4)
    decision = explain_attention(q, M.causal(8))
    assert decision.name == "reference" and "cpu" in decision.reason
    assert explain_attention(q, M.causal(8), aggregation="element").name == "element"


def test_block_path_without_kernel_raises(monkeypatch):
    monkeypatch.setitem(sys.modules, "fusegnn.kernels.block_attention", None)  # import fails
    q, k, v = qkv(1, 1, 8, 8, 4)
    with pytest.raises(NotImplementedError, match="aggregation='block' needs the fused kernel"):
        sparse_attention(q, k, v, M.causal(8), aggregation="block")
    # auto on CPU does not need it
    sparse_attention(q, k, v, M.causal(8))


def test_default_block_size():
    assert default_block_size(4096, 4096) == (64, 64)
    assert default_block_size(5, 17) == (16, 32)
    assert default_block_size(1, 33) == (16, 64)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here)")
def test_auto_on_cuda():
    """On CUDA, auto is the cost-model rule (tests/test_attention_dense.py tests the rule
    itself): short sequences go dense, long windows to the block kernel, very irregular
    long masks to the vector path (on an H200 4x the element path on a 16-keys-per-query
    graph mask at L = 16384), or to the element path when the rule may not weigh the
    vector path; float64 (which the block kernel does not take) to the element path."""
    from fusegnn.attention.sparse_attention import auto_attention_rule

    gen = torch.Generator().manual_seed(0)
    short = torch.zeros(1, 2, 512, 64, device="cuda", dtype=torch.float16)
    graph512 = M.from_graph(torch.stack([torch.arange(512), torch.arange(512).flip(0)]), 512)
    for mask in (M.sliding_window(512, 64), graph512, M.causal(512)):
        expected = auto_attention_rule(mask, batch=1, heads=2, head_dim=64, backward=False)
        assert explain_attention(short, mask).label == expected.label
    assert explain_attention(short, M.causal(512)).label == "dense sdpa (causal)"
    L = 8192
    long = torch.zeros(4, 12, L, 64, device="cuda", dtype=torch.float16)
    assert explain_attention(long, M.sliding_window(L, 64)).label == "block 64x64"
    keys = torch.randint(0, L, (4 * L,), generator=gen)
    graph = M.from_graph(torch.stack([keys, torch.arange(L).repeat_interleave(4)]), L)
    assert explain_attention(long, graph).name == "vector"
    no_vector = auto_attention_rule(graph, batch=4, heads=12, head_dim=64, backward=False, vector_allowed=False,
                                    device="cuda")
    assert no_vector.name == "element", no_vector.reason
    assert explain_attention(long.double(), M.causal(L)).name == "element"  # kernel takes no fp64


# ----------------------------------------------------------------------------- bad input
def test_validation_errors():
    mask = M.causal(8)
    q, k, v = (t.detach() for t in qkv(2, 3, 8, 8, 4))
    with pytest.raises(ValueError, match=r"q must be 4-D"):
        sparse_attention(q[0], k, v, mask)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        sparse_attention(q, k.tolist(), v, mask)
    with pytest.raises(TypeError, match="v must be float16"):
        sparse_attention(q, k, v.long(), mask)
    with pytest.raises(TypeError, match="same dtype"):
        sparse_attention(q, k.float(), v, mask)
    with pytest.raises(ValueError, match="same device"):
        sparse_attention(q, k.to("meta"), v, mask)
    with pytest.raises(ValueError, match="same batch and head sizes"):
        sparse_attention(q, k[:1], v[:1], mask)
    with pytest.raises(ValueError, match="same head dim D"):
        sparse_attention(q, k[..., :3], v, mask)
    with pytest.raises(ValueError, match="k and v must have the same length"):
        sparse_attention(q, k, v[:, :, :5], mask)
    with pytest.raises(ValueError, match=r"the mask is 9 x 9 .* L_q = 8"):
        sparse_attention(q, k, v, M.causal(9))
    with pytest.raises(ValueError, match="the mask has 2 heads but q has H = 3"):
        sparse_attention(q, k, v, M.stack_heads([mask, mask]))
    with pytest.raises(TypeError, match="mask must be a fusegnn.attention.masks.Mask"):
        sparse_attention(q, k, v, mask.dense())
    with pytest.raises(ValueError, match="aggregation must be one of"):
        sparse_attention(q, k, v, mask, aggregation="gar")
    with pytest.raises(ValueError, match="element_aggregation must be one of"):
        sparse_attention(q, k, v, mask, element_aggregation="block")
    with pytest.raises(TypeError, match="scale must be a float"):
        sparse_attention(q, k, v, mask, scale="1")
    with pytest.raises(ValueError, match="BM must be a power of two >= 16"):
        sparse_attention(q, k, v, mask, block_size=24)
    with pytest.raises(ValueError, match="block_size must be an int or a pair"):
        sparse_attention(q, k, v, mask, block_size=(16, 16, 16))


def test_layout_conflicts_for_block_path():
    pytest.importorskip("triton")
    layout = BlockLayout.from_mask(M.causal(8), 16, 16)
    q, k, v = (t.detach().float() for t in qkv(1, 1, 8, 8, 16))
    with pytest.raises(ValueError, match="block_size=\\(32, 32\\) but the layout given is 16 x 16"):
        sparse_attention(q, k, v, layout, aggregation="block", block_size=32)
    with pytest.raises(ValueError, match="the layout is on meta but q is on cpu"):
        sparse_attention(q, k, v, layout.to("meta"), aggregation="block")
