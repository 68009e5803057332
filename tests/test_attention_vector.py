"""``sparse_attention(..., aggregation="vector")``: the row-window kernel of
``fusegnn.kernels.vector_attention`` against a float64 dense masked softmax, outputs and
gradients of ``q``, ``k``, ``v``, through Triton's CPU interpreter (on the GPU when there
is one; this module sets ``TRITON_INTERPRET=1`` before any kernel module is imported).

Sizes are tiny (the interpreter is slow): odd and rectangular lengths, empty rows, a row
attending every key, random 1-5 % masks, causal structure, shared and per-head masks,
batch and heads, ``D_v != D``, every window size and a few ``BLOCK_N``; the structure (both
directions) against the mask; the pure-PyTorch reference; float16 / bfloat16 with loose
tolerances; bad input. ``-k gpu`` selects the CUDA checks (skipped without CUDA), at the
lengths of the issue (L = 4096 and 16384, 1-5 % random masks).
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402

pytest.importorskip("triton")

from fusegnn.attention import masks as M  # noqa: E402
from fusegnn.attention.block_layout import BlockLayout  # noqa: E402
from fusegnn.attention.sparse_attention import (  # noqa: E402
    ATTENTION_AGGREGATIONS,
    explain_attention,
    sparse_attention,
)
from fusegnn.attention.vector_windows import vector_sizes, vector_structure  # noqa: E402
from fusegnn.kernels.vector_attention import (  # noqa: E402
    build_structure,
    structure_dense,
    vector_attention_reference,
    vector_sparse_attention,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- helpers
def oracle(q, k, v, allowed, scale):
    """Dense masked softmax attention in float64, written independently of fusegnn (rows
    with no allowed key give zeros)."""
    q, k, v = q.double(), k.double(), v.double()
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed.to(q.device), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    empty = ~allowed.to(q.device).any(-1, keepdim=True)
    return torch.where(empty, torch.zeros_like(p), p) @ v


def inputs(B, H, L_q, L_k, D, D_v, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, H, L_q, D), (B, H, L_k, D), (B, H, L_k, D_v), (B, H, L_q, D_v)]
    q, k, v, g = (torch.randn(s, generator=gen).to(DEVICE, dtype) for s in shapes)
    return q, k, v, g


def random_mask(L_q, L_k, density, seed, heads=None):
    gen = torch.Generator().manual_seed(seed)
    shape = (L_q, L_k) if heads is None else (heads, L_q, L_k)
    return torch.rand(shape, generator=gen) < density


def check(mask, *, B=2, H=2, D=16, D_v=16, scale=0.7, block_size=None, dtype=torch.float32, tol=2e-5, seed=0,
          need=(True, True, True)):
    """The vector path against the float64 oracle: output and the gradients asked for."""
    L_q, L_k = mask.L_q, mask.L_k
    q, k, v, g = inputs(B, H, L_q, L_k, D, D_v, seed, dtype)
    q, k, v = (t.requires_grad_(n) for t, n in zip((q, k, v), need))
    out = sparse_attention(q, k, v, mask, scale=scale, aggregation="vector", block_size=block_size)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    allowed = (mask.to_mask() if isinstance(mask, BlockLayout) else mask).dense()
    ref = oracle(qd, kd, vd, allowed, scale)
    assert out.shape == (B, H, L_q, D_v) and out.dtype == dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    out.backward(g)
    ref.backward(g.double())
    for name, a, b, n in (("dq", q, qd, need[0]), ("dk", k, kd, need[1]), ("dv", v, vd, need[2])):
        if not n:
            assert a.grad is None, name
            continue
        assert torch.isfinite(a.grad).all(), name
        torch.testing.assert_close(a.grad.double(), b.grad, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")
    return out, q, k, v


# ----------------------------------------------------------------------------- the structure
@pytest.mark.parametrize("W", [16, 32, 64])
def test_structure_encodes_the_mask_both_ways(W):
    masks = [
        M.from_dense(random_mask(37, 29, 0.1, 1)),
        M.stack_heads([M.causal(45), M.dilated(45, 2, 3), M.from_dense(random_mask(45, 45, 0.04, 2))]),
        M.bigbird(50, 2, 1, 8, 0.2, 3),
    ]
    for mask in masks:
        st = vector_structure(mask, W, DEVICE)
        dense = mask.dense()
        dense = dense.unsqueeze(0) if dense.dim() == 2 else dense
        assert torch.equal(structure_dense(st).cpu(), dense)
        assert torch.equal(structure_dense(st, transposed=True).cpu(), dense)
        assert st.nnz == int(dense.sum())
        assert st.rows.bits.dtype == (torch.int64 if W == 64 else torch.int32)
        assert vector_structure(mask, W, DEVICE) is st  # cached on the mask
        # each window's compacted columns are sorted and unique
        ptr, idx = st.rows.ptr.long().cpu(), st.rows.idx.long().cpu()
        for g in range(ptr.numel() - 1):
            cols = idx[ptr[g]:ptr[g + 1]]
            assert bool((cols[1:] > cols[:-1]).all())


def test_structure_counts_duplicate_elements_once():
    head = torch.zeros(5, dtype=torch.int64)
    query = torch.tensor([3, 3, 0, 20, 20])
    key = torch.tensor([1, 1, 1, 4, 4])
    st = build_structure(head, query, key, 21, 6, 1, 16)
    expect = torch.zeros(1, 21, 6, dtype=torch.bool)
    expect[0, [3, 0, 20], [1, 1, 4]] = True
    assert torch.equal(structure_dense(st), expect)
    assert torch.equal(structure_dense(st, transposed=True), expect)
    assert st.rows.idx.tolist() == [1, 4] and st.rows.bits.tolist() == [(1 << 3) | 1, 1 << 4]
    assert st.nnz == 3  # the repeated elements count once


def test_bit_63_of_a_64_window():
    # query 63 of window 0 sets the sign bit of the int64 word
    st = build_structure(torch.zeros(2, dtype=torch.int64), torch.tensor([63, 0]), torch.tensor([2, 2]), 64, 3, 1, 64)
    assert st.rows.bits.tolist() == [-(2**63) + 1]
    out, *_ = check(M.from_graph(torch.tensor([[2, 2, 0], [63, 0, 10]]), 64, 3), B=1, H=1, block_size=64)
    assert torch.equal(out[0, 0, 1], torch.zeros_like(out[0, 0, 1]))


# ----------------------------------------------------------------------------- against the oracle
@pytest.mark.parametrize("density", [0.01, 0.03, 0.05])
def test_random_sparse_masks(density):
    L = 97  # odd: ragged last window
    mask = M.from_dense(random_mask(L, L, density, int(density * 100)))
    check(mask, block_size=(16, 16))


@pytest.mark.parametrize("block_size", [16, (32, 16), (64, 32), None])
def test_window_sizes(block_size):
    check(M.from_dense(random_mask(45, 45, 0.08, 7)), B=1, H=2, block_size=block_size)


def test_empty_rows_and_a_row_attending_everything():
    L = 41
    dense = random_mask(L, L, 0.05, 3)
    dense[9] = True  # a row attending every key
    dense[:, 30] = True  # a key every row attends, but the empty ones below
    dense[[0, 5, 17, 40]] = False  # empty rows (also the last, ragged window's)
    dense[20:36] = False  # a whole empty window (W = 16)
    out, q, *_ = check(M.from_dense(dense), block_size=(16, 16))
    for rows in ([0, 5, 17, 40], list(range(20, 36))):
        assert torch.equal(out[:, :, rows], torch.zeros_like(out[:, :, rows]))
        assert torch.equal(q.grad[:, :, rows], torch.zeros_like(q.grad[:, :, rows]))


def test_all_empty_mask():
    out, q, k, v = check(M.from_dense(torch.zeros(19, 23, dtype=torch.bool)), B=1, H=1)
    assert not out.any() and not q.grad.any() and not k.grad.any() and not v.grad.any()


def test_causal_structure():
    L = 50
    check(M.causal(L) & M.from_dense(random_mask(L, L, 0.1, 5)), block_size=(16, 32))
    check(M.causal(L), B=1, H=1, block_size=(32, 16))


def test_rectangular_per_head_and_value_dim():
    L_q, L_k = 23, 40
    per_head = M.from_dense(random_mask(L_q, L_k, 0.08, 9, heads=3))
    check(per_head, B=2, H=3, D=24, D_v=8, block_size=(16, 16))
    shared = M.from_dense(random_mask(L_q, L_k, 0.08, 10))
    check(shared, B=3, H=2, D=8, D_v=20, scale=-0.4, block_size=(16, 16))


def test_mask_catalogue_and_layout_input():
    L = 33
    for mask in (M.bigbird(L, 1, 1, 4, 0.2, 0), M.dilated(L, 2, 3), M.global_tokens(L, 2),
                 M.stack_heads([M.causal(L), M.sliding_window(L, 1)])):
        check(mask, B=1, H=2, block_size=(16, 16))
    check(BlockLayout.from_mask(M.longformer(L, 1, 2), 16, 16), B=1, H=1)


def test_only_key_value_gradients():
    check(M.from_dense(random_mask(30, 30, 0.1, 2)), B=1, H=2, need=(False, True, True))
    check(M.from_dense(random_mask(30, 30, 0.1, 3)), B=1, H=2, need=(True, False, False))


def test_kernel_matches_its_reference():
    mask = M.stack_heads([M.from_dense(random_mask(29, 29, 0.1, s)) for s in range(2)])
    st = vector_structure(mask, 16, DEVICE)
    q, k, v, _ = inputs(2, 2, 29, 29, 16, 16, 4)
    out = vector_sparse_attention(q, k, v, st, 0.3, block_n=16)
    torch.testing.assert_close(out, vector_attention_reference(q, k, v, st, 0.3), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    tol = 2e-2 if dtype == torch.float16 else 8e-2
    check(M.from_dense(random_mask(40, 40, 0.1, 6)), B=1, H=2, block_size=(16, 16), dtype=dtype, tol=tol)


def test_inputs_untouched_and_default_scale():
    mask = M.from_dense(random_mask(20, 20, 0.2, 1))
    q, k, v, _ = inputs(1, 2, 20, 20, 16, 16, 2)
    copies = [t.clone() for t in (q, k, v)]
    a = sparse_attention(q, k, v, mask, aggregation="vector")
    b = sparse_attention(q, k, v, mask, aggregation="vector", scale=1 / math.sqrt(16))
    assert torch.equal(a, b)
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t, c)


@pytest.mark.parametrize("block_size", [None, (32, 16)])
def test_compiled_matches_eager(block_size):
    """Under ``torch.compile(fullgraph=True)`` the vector path is the
    ``fusegnn::vector_attention`` custom op (the decision outside the trace)."""
    torch._dynamo.reset()
    mask = M.stack_heads([M.from_dense(random_mask(40, 40, 0.1, s)) for s in range(2)])
    q, k, v, g = inputs(1, 2, 40, 40, 16, 16, 5)
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def attend(q, k, v):
        return sparse_attention(q, k, v, mask, aggregation="vector", block_size=block_size)

    out = torch.compile(attend, backend="aot_eager", fullgraph=True)(q, k, v)
    ref = attend(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- dispatch and errors
def test_decision_and_auto():
    """``aggregation="vector"`` is the vector path as asked; ``"auto"`` weighs it by the
    cost model (``tests/test_attention_dense.py``): at 40 tokens dense SDPA's fixed cost
    is lower (and off CUDA auto is the reference)."""
    assert "vector" in ATTENTION_AGGREGATIONS
    mask = M.from_dense(random_mask(40, 40, 0.02, 1))
    q = torch.randn(1, 2, 40, 16, device=DEVICE)
    d = explain_attention(q, mask, aggregation="vector", block_size=32)
    assert (d.name, d.vector_sizes, d.label) == ("vector", (32, 64), "vector W32 x 64")
    assert explain_attention(q, mask, aggregation="auto").name in ("reference", "dense")
    assert vector_sizes(None) == (16, 64) and vector_sizes((64, 128)) == (64, 128)


def test_block_size_int_and_pair_are_cached_apart():
    mask = M.from_dense(random_mask(20, 20, 0.2, 4))
    q, k, v, _ = inputs(1, 1, 20, 20, 16, 16, 3)
    a = sparse_attention(q, k, v, mask, aggregation="vector", block_size=32)
    b = sparse_attention(q, k, v, mask, aggregation="vector", block_size=(32, 32))
    torch.testing.assert_close(a, b)
    decisions = [key for key in mask._cache if isinstance(key[1], tuple) and key[1][:2] == ("decision", "vector")]
    assert {key[1][2] for key in decisions} == {(32, 64), (32, 32)}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(block_size=8), ValueError, "block_size"),
        (dict(block_size=128), ValueError, "block_size"),
        (dict(block_size=(16, 256)), ValueError, "block_size"),
        (dict(block_size=(16, 48)), ValueError, "block_size"),
        (dict(block_size=(16, 32, 2)), ValueError, "block_size"),
        (dict(block_size=16.0), TypeError, "block_size"),
        (dict(nm=(2, 4)), ValueError, "nm="),
    ],
)
def test_bad_arguments(kwargs, error, match):
    mask = M.causal(20)
    q, k, v, _ = inputs(1, 1, 20, 20, 16, 16, 0)
    with pytest.raises(error, match=match):
        sparse_attention(q, k, v, mask, aggregation="vector", **kwargs)


def test_bad_inputs():
    mask = M.causal(20)
    q, k, v, _ = inputs(1, 1, 20, 20, 16, 16, 0)
    with pytest.raises(TypeError, match="mask"):
        sparse_attention(q, k, v, torch.ones(20, 20, dtype=torch.bool), aggregation="vector")
    with pytest.raises(TypeError, match="q: aggregation='vector'"):
        sparse_attention(q.double(), k.double(), v.double(), mask, aggregation="vector")
    st = vector_structure(mask, 16, DEVICE)
    with pytest.raises(TypeError, match="structure"):
        vector_sparse_attention(q, k, v, mask)
    with pytest.raises(ValueError, match="structure is for"):
        vector_sparse_attention(q[:, :, :10], k, v, st)
    with pytest.raises(ValueError, match="heads"):
        vector_sparse_attention(*(t.expand(1, 2, 20, 16) for t in (q, k, v)),
                                vector_structure(M.stack_heads([mask] * 3), 16, DEVICE))
    with pytest.raises(ValueError, match="block_size"):
        vector_sparse_attention(q, k, v, st, block_n=12)


# ----------------------------------------------------------------------------- GPU (lead: pytest -k gpu)
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("L", [4096, 16384])
@pytest.mark.parametrize("density", [0.01, 0.05])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_vector_gpu_issue_sizes(L, density, dtype):
    """The issue's masks on the GPU: the vector path against the float32 reference path
    (same device), output and gradients, with every W."""
    gen = torch.Generator(device="cuda").manual_seed(L)
    dense = torch.rand(L, L, generator=gen, device="cuda") < density
    dense[::97] = False  # some empty rows
    mask = M.from_dense(dense)
    B, H, D = 1, 2, 64
    q, k, v, g = (torch.randn(B, H, L, D, device="cuda", generator=gen) for _ in range(4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = sparse_attention(*ref_in, mask, aggregation="element")  # float32 element path (no L x L tensor)
    ref.backward(g)
    for W in (16, 32, 64):
        got_in = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = sparse_attention(*got_in, mask, aggregation="vector", block_size=W)
        out.backward(g.to(dtype))
        tol = 1e-2 if dtype == torch.float16 else 4e-2  # relative Frobenius error
        for name, a, b in (("out", out, ref),) + tuple(zip(("dq", "dk", "dv"), (t.grad for t in got_in),
                                                          (t.grad for t in ref_in))):
            assert torch.isfinite(a).all(), (W, name)
            err = (a.float() - b).norm() / b.norm().clamp_min(1e-30)
            assert err < tol, (W, name, float(err))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_vector_gpu_auto_takes_the_vector_path_on_a_scattered_mask():
    """On CUDA, ``"auto"`` on a 1 %-dense random mask at the calibration's sizes (B=4, H=12,
    D=64, bf16, training) is the vector path: the same outputs and gradients as asking for
    it, bit for bit, reading the structure the rule built (cached on the mask), eager and
    compiled."""
    L, B, H, D = 4096, 4, 12, 64
    gen = torch.Generator(device="cuda").manual_seed(7)
    dense = torch.rand(L, L, generator=gen, device="cuda") < 0.01
    dense.diagonal().fill_(True)
    mask = M.from_dense(dense)
    q, k, v, g = (torch.randn(B, H, L, D, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    decision = explain_attention(leaves[0], mask)
    assert decision.name == "vector" and decision.vector_sizes == (16, 64), decision.reason
    outs = {}
    for aggregation in ("auto", "vector"):
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = sparse_attention(*ins, mask, aggregation=aggregation)
        out.backward(g)
        outs[aggregation] = (out, *(t.grad for t in ins))
    for a, b in zip(outs["auto"], outs["vector"]):
        assert torch.equal(a, b)
    assert vector_structure(mask, 16, q.device, keep=False) is vector_structure(mask, 16, q.device, keep=False)
    # compiled, auto takes the same path with the sizes it decided (the custom op on the same kernels)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q_, k_, v_: sparse_attention(q_, k_, v_, mask), backend="aot_eager", fullgraph=True)
    ins = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*ins)
    out.backward(g)
    for a, b in zip((out, *(t.grad for t in ins)), outs["vector"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_vector_gpu_fp32_small_against_oracle():
    """float32 (IEEE and TF32) on the GPU against the float64 oracle."""
    mask = M.from_dense(random_mask(300, 257, 0.03, 1, heads=2))
    check(mask, B=2, H=2, D=64, D_v=32, block_size=(32, 64), tol=1e-4)
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        check(mask, B=2, H=2, D=64, D_v=32, block_size=(32, 64), tol=3e-2, seed=1)
    finally:
        torch.set_float32_matmul_precision(prev)


# ----------------------------------------------------------------------------- review fixes
def test_build_structure_rejects_bad_elements():
    """An index out of range used to land silently in another window (key 25 of L_k = 20
    became key 5 of the next window) and the kernels would read outside k / v."""
    z = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"key must lie in \[0, 20\)"):
        build_structure(z, z, z + 25, 20, 20, 1)
    with pytest.raises(ValueError, match=r"query must lie in \[0, 20\)"):
        build_structure(z, z - 1, z, 20, 20, 1)
    with pytest.raises(ValueError, match=r"head must lie in \[0, 2\)"):
        build_structure(z + 2, z, z, 20, 20, 2)
    with pytest.raises(TypeError, match="query must be an integer tensor"):
        build_structure(z, z.float() + 0.5, z, 20, 20, 1)
    with pytest.raises(TypeError, match="key must be a torch.Tensor"):
        build_structure(z, z, [0], 20, 20, 1)
    with pytest.raises(ValueError, match="one entry per allowed element, got 1, 1, 2"):
        build_structure(z, z, torch.zeros(2, dtype=torch.int64), 20, 20, 1)
    with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
        build_structure(z, z, z, 20, 20, 0)
    with pytest.raises(ValueError, match="L_k must be an int >= 0"):
        build_structure(z, z, z, 20, 20.0, 1)
    # int32 indices and empty element lists are fine
    st = build_structure(z.int(), z.int(), z.int() + 19, 20, 20, 1)
    assert structure_dense(st)[0, 0].nonzero().flatten().tolist() == [19]
    empty = build_structure(z[:0], z[:0], z[:0], 20, 20, 1)
    assert empty.nnz == 0 and not bool(structure_dense(empty).any())


def test_zero_head_dim_needs_an_explicit_scale():
    mask = M.causal(20)
    q, k, v, _ = inputs(1, 1, 20, 20, 16, 16, 0)
    with pytest.raises(ValueError, match="q: head dim D is 0"):
        sparse_attention(q[..., :0], k[..., :0], v, mask, aggregation="vector")
    with pytest.raises(ValueError, match="q: head dim D is 0"):
        vector_sparse_attention(q[..., :0], k[..., :0], v, vector_structure(mask, 16, DEVICE))
    # with a scale, D = 0 is well defined: every score is 0, a uniform average over the allowed keys
    out = sparse_attention(q[..., :0], k[..., :0], v, mask, scale=1.0, aggregation="vector")
    expect = torch.cumsum(v.double(), 2) / torch.arange(1, 21, dtype=torch.float64, device=v.device).view(1, 1, -1, 1)
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)


def test_vector_path_keeps_no_element_graph_on_the_mask():
    """The structure is cached on the mask; the nnz-sized element graph it is built from
    is not (10^8 elements at L = 16384, 8 heads, 5 %)."""
    mask = M.from_dense(random_mask(40, 40, 0.05, 7, heads=2))
    q, k, v, _ = inputs(1, 2, 40, 40, 16, 16, 0)
    sparse_attention(q, k, v, mask, aggregation="vector")
    keys = list(mask._cache)
    assert not any(isinstance(key, tuple) and key[0] == "graph" for key in keys), keys
    st = vector_structure(mask, 16, DEVICE)
    assert torch.equal(structure_dense(st).cpu(), mask.dense())
    # the triples it is built from: every allowed element once, as to_graph has them
    h, qq, kk = mask.allowed_elements(device=DEVICE)
    dense = torch.zeros(2, 40, 40, dtype=torch.bool)
    dense[h.cpu(), qq.cpu(), kk.cpu()] = True
    assert torch.equal(dense, mask.dense()) and h.numel() == int(mask.dense().sum())
    graph = mask.to_graph(device=DEVICE)
    assert graph.num_edges == h.numel()


def test_one_token_and_empty_lengths():
    one = M.from_dense(torch.ones(1, 1, dtype=torch.bool))
    check(one, B=1, H=1)
    # L_q = 0 through the kernel entry point: nothing to launch, an empty result and gradients
    st = build_structure(*(torch.zeros(0, dtype=torch.int64, device=DEVICE),) * 3, 0, 5, 1)
    q = torch.randn(1, 1, 0, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 1, 5, 16, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 1, 5, 16, device=DEVICE, requires_grad=True)
    out = vector_sparse_attention(q, k, v, st)
    assert out.shape == (1, 1, 0, 16)
    out.sum().backward()
    assert not bool(k.grad.any()) and not bool(v.grad.any())


@settings(max_examples=30, deadline=None)
@given(
    L_q=hst.integers(1, 70), L_k=hst.integers(1, 70), heads=hst.integers(1, 3),
    density=hst.sampled_from([0.0, 0.02, 0.1, 0.5, 1.0]), W=hst.sampled_from([16, 32, 64]),
    dup=hst.integers(0, 5), seed=hst.integers(0, 2**16),
)
def test_property_structure_decodes_to_the_mask(L_q, L_k, heads, density, W, dup, seed):
    """Random small masks, given as shuffled element triples with ``dup`` repeats: both
    directions of the structure decode to exactly the mask; every window's compacted
    list is sorted and unique; ``nnz`` counts distinct elements."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(heads, L_q, L_k, generator=gen) < density
    h, qq, kk = allowed.nonzero(as_tuple=True)
    if h.numel():
        extra = torch.randint(0, h.numel(), (dup,), generator=gen)
        order = torch.randperm(h.numel() + dup, generator=gen)
        h, qq, kk = (torch.cat([t, t[extra]])[order] for t in (h, qq, kk))
    st = build_structure(h, qq, kk, L_q, L_k, heads, W)
    assert torch.equal(structure_dense(st), allowed)
    assert torch.equal(structure_dense(st, transposed=True), allowed)
    assert st.nnz == int(allowed.sum())  # distinct elements: repeats count once
    for index, members in ((st.rows, L_k), (st.cols, L_q)):
        ptr, idx = index.ptr.long(), index.idx.long()
        assert ptr[0] == 0 and ptr[-1] == idx.numel() and bool((ptr[1:] >= ptr[:-1]).all())
        assert bool(((idx >= 0) & (idx < members)).all())
        for g in range(ptr.numel() - 1):
            seg = idx[ptr[g]:ptr[g + 1]]
            assert bool((seg[1:] > seg[:-1]).all())
        assert index.bits.dtype == (torch.int64 if W == 64 else torch.int32)
        assert bool((index.bits != 0).all())  # no entry without an element
    # and through a Mask: the vector path's builder gives the same structure
    mask = M.from_dense(allowed if heads > 1 else allowed[0])
    built = vector_structure(mask, W, torch.device("cpu"))
    assert torch.equal(structure_dense(built), allowed)
    assert torch.equal(structure_dense(built, transposed=True), allowed)
