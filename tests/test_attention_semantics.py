"""What :func:`fusegnn.attention.sparse_attention` and
:class:`fusegnn.layers.SparseMultiheadAttention` promise, checked from the outside: every
path against a float64 masked softmax written here (independent of the library's own
reference), against ``F.scaled_dot_product_attention`` / ``nn.MultiheadAttention`` where
the API mirrors them, and the argument checks. Tiny shapes: the Triton kernels run in the
interpreter on the CPU (see ``conftest.py``)."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from fusegnn.attention import masks as M
from fusegnn.attention import sparse_attention
from fusegnn.attention import cost_model
from tests.attention_cases import mask_cases

SA = sys.modules["fusegnn.attention.sparse_attention"]  # the module (the package exports the function)

pytestmark = pytest.mark.usefixtures("one_thread")

# CUDA where there is one (the fused kernels need it), else the CPU (Triton's interpreter)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}


def dense_attention64(q, k, v, allowed, scale, keep=None):
    """Softmax over the allowed keys in float64; a row with no allowed key gives zeros.
    ``keep(scores, allowed) -> allowed`` narrows the keys further (N:M)."""
    q, k, v = (t.double() for t in (q, k, v))
    allowed = allowed.to(q.device)
    scores = q @ k.transpose(-1, -2) * scale
    if keep is not None:
        allowed = keep(scores.detach(), allowed)
    scores = scores.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(nan=0.0)  # empty rows: softmax of all -inf
    return p @ v


def qkv(B=1, H=2, L_q=9, L_k=9, D=5, D_v=None, seed=0, dtype=torch.float32, grad=True):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, H, L_q, D), (B, H, L_k, D), (B, H, L_k, D_v or D)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(DEVICE, dtype).requires_grad_(grad) for s in shapes]


def check_against_dense(out, q, k, v, allowed, scale, dtype, keep=None, seed=1):
    """Output and the gradients of ``q``, ``k``, ``v`` (an upstream gradient drawn with
    ``seed``) against :func:`dense_attention64`."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = dense_attention64(*leaves, allowed, scale, keep)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(DEVICE)
    got = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    want = torch.autograd.grad(expected, leaves, grad_out)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol, msg=lambda m: f"d{name}: {m}")


# ----------------------------------------------------------------------------- auto and D_v != D
def _auto_as_on_cuda(monkeypatch):
    """Make ``"auto"`` weigh the fused kernels on the CPU (they run in the interpreter) and
    leave dense SDPA with a boolean mask out, so that a dense window mask goes to the block
    kernel as it does on CUDA."""
    monkeypatch.setattr(SA, "_auto_runs_kernels", lambda device: True)
    monkeypatch.setattr(cost_model, "DENSE_MASK_MAX_ELEMENTS", 0)


@pytest.mark.parametrize("D_v", [3, 5, 8])
def test_auto_never_hands_the_block_kernel_a_value_dim_it_cannot_take(monkeypatch, D_v):
    # The block kernel needs D_v == D; "auto" ran it with D_v != D through its unchecked
    # entry point: [B, H, L_q, D] out (D_v columns expected), v read out of bounds for D_v < D.
    _auto_as_on_cuda(monkeypatch)
    mask = M.sliding_window(24, 6)
    q, k, v = qkv(1, 2, 24, 24, D=5, D_v=D_v)
    decision = SA.explain_attention(q, mask, value_dim=D_v)
    assert decision.name == ("block" if D_v == 5 else "element"), decision
    out = sparse_attention(q, k, v, mask)
    assert out.shape == (1, 2, 24, D_v)
    check_against_dense(out, q, k, v, mask.dense(), 5 ** -0.5, torch.float32)


def test_auto_n_m_with_another_value_dim_runs_the_reference(monkeypatch):
    _auto_as_on_cuda(monkeypatch)
    mask = M.sliding_window(24, 6)
    q, k, v = qkv(1, 2, 24, 24, D=5, D_v=7)
    assert SA.explain_attention(q, mask, nm=(2, 4)).name == "block"  # D_v == D
    assert SA.explain_attention(q, mask, nm=(2, 4), value_dim=7).name == "reference"
    out = sparse_attention(q, k, v, mask, nm=(2, 4))
    assert out.shape == (1, 2, 24, 7)
    expected = SA.masked_attention_reference(q.double(), k.double(), v.double(), mask.dense(DEVICE), 5 ** -0.5, (2, 4))
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)


def test_compiled_auto_decides_with_the_value_dim(monkeypatch):
    _auto_as_on_cuda(monkeypatch)
    mask = M.sliding_window(24, 6)
    decide = lambda D_v: SA.compiled_decision(mask.handle, (1, 2, 24, 5), torch.float32, "cpu", "auto", 0, 0,  # noqa: E731
                                              True, 0, 0, D_v)[0]
    assert (decide(0), decide(5), decide(7)) == ("block", "block", "element")


@pytest.mark.parametrize("compiled", [False, True])
def test_block_path_refuses_what_its_kernel_cannot_take(compiled):
    # Compiled, aggregation="block" ran the block op (which skips the kernel's own input
    # checks) on D_v != D -- a [B, H, L_q, D] result, v read out of bounds -- and on float64.
    mask = M.sliding_window(20, 3)

    def attend(q, k, v):
        return sparse_attention(q, k, v, mask, aggregation="block")

    bad_value, bad_type = ValueError, TypeError
    if compiled:  # fullgraph: Dynamo reports the error it met in the traced checks
        torch._dynamo.reset()
        attend = torch.compile(attend, backend="aot_eager", fullgraph=True)
        bad_value = bad_type = torch._dynamo.exc.Unsupported
    q, k, v = qkv(1, 2, 20, 20, D=8, D_v=5, grad=False)
    with pytest.raises(bad_value, match="D_v = 5"):
        attend(q, k, v)
    with pytest.raises(bad_type, match="float64"):
        attend(*qkv(1, 2, 20, 20, D=8, dtype=torch.float64, grad=False))
    with pytest.raises(ValueError, match="D_v = 5"):
        sparse_attention(q, k, v, mask, aggregation="block", nm=(2, 4))
    q, k, v = qkv(1, 2, 20, 20, D=8)
    check_against_dense(attend(q, k, v), q, k, v, mask.dense(), 8 ** -0.5, torch.float32)


def test_auto_rule_without_the_block_kernel():
    mask = M.sliding_window(256, 32)
    kw = dict(batch=2, heads=4, head_dim=64, backward=True)
    assert SA.auto_attention_rule(mask, **kw).name in ("block", "dense")
    assert SA.auto_attention_rule(mask, block_allowed=False, **kw).name in ("element", "dense")
    with pytest.raises(ValueError, match="block_allowed"):
        SA.auto_attention_rule(mask, block_allowed=False, element_allowed=False, **kw)


# ----------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize("good,bad,match", [
    (dict(scale=1), dict(scale=True), "scale"),
    (dict(nm=(2, 4)), dict(nm=(2.0, 4.0)), "nm"),
    (dict(aggregation="element", block_size=16), dict(aggregation="element", block_size=16.0), "BM"),
    (dict(aggregation="element", block_size=(16, 16)), dict(aggregation="element", block_size=(16.0, True)), "BM"),
])
def test_a_prepared_call_does_not_admit_equal_options_of_another_type(good, bad, match):
    # The prepared-call cache keyed the options by value: after a call with scale=1, a
    # call with scale=True (True == 1) skipped the checks and ran with scale 1.0.
    mask = M.causal(9)
    q, k, v = qkv(grad=False)
    sparse_attention(q, k, v, mask, **good)
    with pytest.raises(TypeError, match=match):
        sparse_attention(q, k, v, mask, **bad)


# ----------------------------------------------------------------------------- grad modes
PATHS = ["reference", "element", "dense", "block", "vector"]


@pytest.mark.parametrize("aggregation", PATHS + ["element-gar"])
@pytest.mark.parametrize("first", ["inference_mode", "no_grad"])
def test_a_mask_first_used_without_autograd_then_trains(aggregation, first):
    # A mask's caches (the element path's graph, block maps, layouts) were built as
    # inference tensors by a first call under torch.inference_mode(); a later training
    # call on the element path then failed: "Inference tensors cannot be saved for backward".
    aggregation, _, inner = aggregation.partition("-")
    options = dict(aggregation=aggregation, element_aggregation=inner or "auto")
    L = 13
    dense = torch.rand(L, L, generator=torch.Generator().manual_seed(0)) < 0.3
    for mask in (M.sliding_window(L, 2) | M.global_tokens(L, 1), M.from_dense(dense)):
        with torch.inference_mode() if first == "inference_mode" else torch.no_grad():
            q, k, v = qkv(1, 2, L, L, 6, grad=False)
            out = sparse_attention(q, k, v, mask, **options)
            torch.testing.assert_close(out.double(), dense_attention64(q, k, v, mask.dense(), 6 ** -0.5),
                                       rtol=2e-5, atol=2e-5)
        q, k, v = qkv(1, 2, L, L, 6, seed=3)
        out = sparse_attention(q, k, v, mask, **options)
        check_against_dense(out, q, k, v, mask.dense(), 6 ** -0.5, torch.float32)


# ----------------------------------------------------------------------------- scale
@pytest.mark.parametrize("aggregation", PATHS)
@pytest.mark.parametrize("scale", [0.0, -0.7, 2.5])
@pytest.mark.parametrize("mask", ["causal", "full", "window"])
def test_scale_overrides_of_any_sign(aggregation, scale, mask):
    # The dense path runs an exactly causal mask as SDPA's is_causal=True; PyTorch's CPU
    # kernel scales after the causal -inf, so scale=0 or < 0 gave NaN rows (0 * -inf).
    L = 11
    mask = {"causal": M.causal(L), "full": M.sliding_window(L, L), "window": M.sliding_window(L, 2)}[mask]
    q, k, v = qkv(1, 2, L, L, 6)
    out = sparse_attention(q, k, v, mask, aggregation=aggregation, scale=scale)
    check_against_dense(out, q, k, v, mask.dense(), scale, torch.float32)


# ----------------------------------------------------------------------------- every path, every mask
def rectangular_masks(L_q, L_k):
    """Element masks over ``L_q x L_k``: empty rows, isolated queries, one per head."""
    gen = torch.Generator().manual_seed(L_q * 100 + L_k)
    scattered = torch.rand(L_q, L_k, generator=gen) < 0.3
    scattered[::4] = False  # empty rows
    edges = torch.randint(0, min(L_q, L_k), (2, 2 * L_q), generator=gen)
    edges = edges[:, edges[1] % 3 != 0]  # queries 0, 3, 6, ... have no key
    return {"dense_empty_rows": M.from_dense(scattered), "graph_isolated": M.from_graph(edges, L_q, L_k),
            "dense_per_head": M.from_dense(torch.rand(3, L_q, L_k, generator=gen) < 0.4)}


def square_masks(L):
    """Every mask kind over ``L x L`` (:func:`tests.attention_cases.mask_cases`, plus a
    dilated causal mask, which runs as sub-sequences on the block path)."""
    return {**mask_cases(L), "dilated_causal": M.dilated(L, 1, 2) & M.causal(L)}


SQUARE = square_masks(13)
RECTANGULAR = rectangular_masks(7, 19)


def _value_dim(aggregation, D):
    return D if aggregation == "block" else D + 3  # the block kernel needs D_v == D


@pytest.mark.parametrize("aggregation", PATHS)
@pytest.mark.parametrize("name", sorted(SQUARE))
def test_every_path_and_mask_is_the_masked_softmax(aggregation, name):
    mask = SQUARE[name]
    q, k, v = qkv(2, 3, 13, 13, D=7, D_v=_value_dim(aggregation, 7), seed=2)
    out = sparse_attention(q, k, v, mask, aggregation=aggregation)
    assert out.shape == (2, 3, 13, v.size(-1)) and out.dtype == q.dtype
    check_against_dense(out, q, k, v, mask.dense(), 7 ** -0.5, torch.float32)


@pytest.mark.parametrize("aggregation", PATHS)
@pytest.mark.parametrize("name", sorted(RECTANGULAR))
def test_rectangular_masks(aggregation, name):
    mask = RECTANGULAR[name]
    q, k, v = qkv(2, 3, 7, 19, D=5, D_v=_value_dim(aggregation, 5), seed=3)
    out = sparse_attention(q, k, v, mask, aggregation=aggregation, scale=0.3)
    check_against_dense(out, q, k, v, mask.dense(), 0.3, torch.float32)


LOW_PRECISION_TOL = {torch.float16: 2e-2, torch.bfloat16: 6e-2}


@pytest.mark.parametrize("aggregation", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", ["causal", "bigbird", "dense_empty_rows", "per_head"])
def test_precisions(aggregation, dtype, name):
    if dtype == torch.float64 and aggregation in ("block", "vector"):
        with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
            sparse_attention(*qkv(1, 3, 13, 13, 8, dtype=dtype), SQUARE[name], aggregation=aggregation)
        return
    mask = SQUARE[name]
    q, k, v = qkv(1, 3, 13, 13, D=24, D_v=_value_dim(aggregation, 24), seed=4, dtype=dtype)
    out = sparse_attention(q, k, v, mask, aggregation=aggregation)
    assert out.dtype == dtype
    if dtype == torch.float64:
        check_against_dense(out, q, k, v, mask.dense(), 24 ** -0.5, dtype)
        return
    tol = LOW_PRECISION_TOL[dtype]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = dense_attention64(*leaves, mask.dense(), 24 ** -0.5)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)
    got = torch.autograd.grad(out, (q, k, v), grad_out.to(dtype))
    want = torch.autograd.grad(expected, leaves, grad_out)
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("aggregation", PATHS)
def test_strided_expanded_and_sequence_first_inputs_are_read_as_given_and_left_alone(aggregation):
    B, H, L, D = 2, 2, 11, 6
    gen = torch.Generator().manual_seed(6)
    q_base = torch.randn(B, H, D, L, generator=gen).to(DEVICE).requires_grad_()  # q: last dim strided
    k_base = torch.randn(B, 1, L, D, generator=gen).to(DEVICE).requires_grad_()  # k: one head expanded (stride 0)
    v_base = torch.randn(L, B, H, D, generator=gen).to(DEVICE).requires_grad_()  # v: sequence first
    views = lambda qb, kb, vb: (qb.transpose(-1, -2), kb.expand(B, H, L, D), vb.permute(1, 2, 0, 3))  # noqa: E731
    before = [t.detach().clone() for t in (q_base, k_base, v_base)]
    mask = M.sliding_window(L, 3) | M.global_tokens(L, 1)
    out = sparse_attention(*views(q_base, k_base, v_base), mask, aggregation=aggregation)
    grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
    grads = torch.autograd.grad(out, (q_base, k_base, v_base), grad_out)
    for t, b in zip((q_base, k_base, v_base), before):
        assert torch.equal(t, b)
    leaves = [t.detach().double().requires_grad_() for t in (q_base, k_base, v_base)]
    expected = dense_attention64(*views(*leaves), mask.dense(), D ** -0.5)
    torch.testing.assert_close(out.double(), expected, rtol=2e-5, atol=2e-5)
    for g, w in zip(grads, torch.autograd.grad(expected, leaves, grad_out.double())):
        torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("aggregation", PATHS)
@pytest.mark.parametrize("B,H,L", [(0, 2, 11), (2, 0, 11), (1, 1, 1)])
def test_empty_batches_heads_and_one_token(aggregation, B, H, L):
    mask = M.causal(L)
    q, k, v = qkv(B, H, L, L, 6)
    out = sparse_attention(q, k, v, mask, aggregation=aggregation)
    assert out.shape == (B, H, L, 6)
    check_against_dense(out, q, k, v, mask.dense(), 6 ** -0.5, torch.float32)


@pytest.mark.parametrize("aggregation", PATHS)
def test_only_some_inputs_need_a_gradient(aggregation):
    mask = SQUARE["bigbird"]
    for needs in ("q", "k", "v", "kv"):
        q, k, v = qkv(1, 2, 13, 13, 6, grad=False)
        leaves = [t.requires_grad_() for name, t in zip("qkv", (q, k, v)) if name in needs]
        out = sparse_attention(q, k, v, mask, aggregation=aggregation)
        grads = torch.autograd.grad(out.square().sum(), leaves)
        x = [t.detach().double().requires_grad_(name in needs) for name, t in zip("qkv", (q, k, v))]
        expected = dense_attention64(*x, mask.dense(), 6 ** -0.5)
        want = torch.autograd.grad(expected.square().sum(), [t for t in x if t.requires_grad])
        for g, w in zip(grads, want):
            torch.testing.assert_close(g.double(), w, rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- N:M
def nm_by_hand(n, m):
    """``keep(scores, allowed)``: in every group of ``m`` consecutive keys (aligned to
    multiples of ``m``), the ``n`` allowed keys of largest score, ties to the lower index
    -- one row and one group at a time (the rule as the docs state it)."""

    def keep(scores, allowed):
        device, scores = scores.device, scores.cpu()
        allowed = allowed.cpu().expand(scores.shape)
        out = torch.zeros(scores.shape, dtype=torch.bool)
        rows_s, rows_a, rows_o = scores.reshape(-1, scores.size(-1)), allowed.reshape(-1, scores.size(-1)), out.view(
            -1, scores.size(-1))
        for s, a, o in zip(rows_s.tolist(), rows_a.tolist(), rows_o):
            for start in range(0, len(s), m):
                group = [j for j in range(start, min(start + m, len(s))) if a[j]]
                for j in sorted(group, key=lambda j: (-s[j], j))[:n]:
                    o[j] = True
        return out.to(device)

    return keep


NM_MASKS = {
    "window": M.sliding_window(10, 4),
    "causal": M.causal(10),
    "dilated": M.dilated(10, 2, 2),
    "per_head": M.stack_heads([M.causal(10), M.global_tokens(10, 2)]),
    "rect": M.from_dense(torch.rand(6, 10, generator=torch.Generator().manual_seed(7)) < 0.7),
}


@pytest.mark.parametrize("nm", [(1, 2), (2, 4), (4, 8)])
@pytest.mark.parametrize("aggregation", ["reference", "block"])
@pytest.mark.parametrize("name", sorted(NM_MASKS))
@pytest.mark.parametrize("ties", [False, True])
def test_n_m_attention_keeps_the_documented_keys(nm, aggregation, name, ties):
    mask = NM_MASKS[name]
    L_q, L_k = mask.shape  # L_k = 10: a partial last group for M = 4 and 8
    q, k, v = qkv(1, 2, L_q, L_k, 5, seed=8, grad=False)
    if ties:  # small integers, equal key pairs: exact equal scores in every dtype
        q, k = q.mul(2).round(), k.mul(2).round()
        k[..., 1::2, :] = k[..., 0::2, :]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = sparse_attention(q, k, v, mask, aggregation=aggregation, nm=nm, scale=0.5)
    check_against_dense(out, q, k, v, mask.dense(), 0.5, torch.float32, keep=nm_by_hand(*nm))


@pytest.mark.parametrize("aggregation", ["reference", "block"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_n_m_attention_in_half_precision_selects_on_exact_scores(aggregation, dtype):
    mask = NM_MASKS["window"]
    q, k, v = qkv(1, 2, 10, 10, 5, seed=9, grad=False)
    q, k = q.mul(2).round(), k.mul(2).round()  # exact scores: the same selection in any dtype
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = sparse_attention(q, k, v, mask, aggregation=aggregation, nm=(2, 4), scale=0.5)
    tol = LOW_PRECISION_TOL[dtype]
    expected = dense_attention64(q, k, v, mask.dense(), 0.5, keep=nm_by_hand(2, 4))
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------- SparseMultiheadAttention
from torch import nn  # noqa: E402

from fusegnn.layers.attention import SparseMultiheadAttention  # noqa: E402


def _pair(E, H, batch_first, bias, aggregation, dtype=torch.float32):
    torch.manual_seed(10)
    ours = SparseMultiheadAttention(E, H, bias=bias, batch_first=batch_first, aggregation=aggregation, dtype=dtype,
                                    device=DEVICE)
    if bias:  # nonzero biases, so that a bias mix-up shows
        nn.init.normal_(ours.in_proj_bias)
        nn.init.normal_(ours.out_proj.bias)
    ref = nn.MultiheadAttention(E, H, bias=bias, batch_first=batch_first, dtype=dtype, device=DEVICE)
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ours, ref


def _blocked(mask, B):
    """nn.MultiheadAttention's boolean attn_mask (True = blocked) for ``mask``."""
    dense = mask.dense()
    return ~(dense.repeat(B, 1, 1) if dense.dim() == 3 else dense).to(DEVICE)


@pytest.mark.parametrize("aggregation", PATHS)
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_mha_is_torch_multihead_attention(aggregation, batch_first, bias):
    E, H, B, L_q, L_k = 12, 3, 2, 7, 11
    ours, ref = _pair(E, H, batch_first, bias, aggregation)
    dense = torch.rand(L_q, L_k, generator=torch.Generator().manual_seed(11)) < 0.5
    dense[:, 0] = True  # nn.MultiheadAttention gives NaN for a query with no key
    mask = M.from_dense(dense)
    gen = torch.Generator().manual_seed(12)
    shape = (lambda L: (B, L, E)) if batch_first else (lambda L: (L, B, E))
    wide = torch.randn(*shape(L_q)[:-1], 2 * E, generator=gen).to(DEVICE)
    query = wide[..., ::2].requires_grad_()  # a strided view
    key, value = (torch.randn(shape(L_k), generator=gen).to(DEVICE).requires_grad_() for _ in range(2))
    out, weights = ours(query, key, value, mask=mask)
    assert weights is None and out.shape == query.shape
    expected, _ = ref(query, key, value, attn_mask=_blocked(mask, B), need_weights=False)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    grad_out = torch.randn(out.shape, generator=gen).to(DEVICE)
    params = list(ours.parameters())
    got = torch.autograd.grad(out, [query, key, value] + params, grad_out)
    want = torch.autograd.grad(expected, [query, key, value] + list(ref.parameters()), grad_out)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("aggregation", PATHS)
def test_mha_key_padding_combined_with_a_structural_mask(aggregation):
    # No key_padding_mask argument: padding shared by the batch is the mask intersected
    # with the allowed keys, which must equal nn.MultiheadAttention's key_padding_mask.
    E, H, B, L = 8, 2, 2, 13
    ours, ref = _pair(E, H, True, True, aggregation)
    padded = torch.zeros(L, dtype=torch.bool)
    padded[10:] = True
    structure = M.sliding_window(L, 2) | M.global_tokens(L, 1)
    mask = structure & M.from_dense((~padded).expand(L, L).clone())
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    out, _ = ours(x, x, x, mask=mask)
    expected, _ = ref(x, x, x, attn_mask=_blocked(structure, B), key_padding_mask=padded.expand(B, L).to(DEVICE),
                      need_weights=False)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("aggregation", ["reference", "block"])
def test_mha_n_m_without_a_mask_is_n_m_over_every_key(aggregation):
    E, H, B, L_q, L_k = 8, 2, 1, 6, 10
    ours = SparseMultiheadAttention(E, H, aggregation=aggregation, nm=(2, 4), device=DEVICE)
    gen = torch.Generator().manual_seed(14)
    query, key = (torch.randn(B, L, E, generator=gen).to(DEVICE) for L in (L_q, L_k))
    out, _ = ours(query, key, key)
    q, k, v = ours._project(query, 0), ours._project(key, 1), ours._project(key, 2)
    every = torch.ones(L_q, L_k, dtype=torch.bool)
    attn = dense_attention64(q, k, v, every, (E // H) ** -0.5, keep=nm_by_hand(2, 4)).float()
    expected = ours.out_proj(attn.transpose(1, 2).reshape(B, L_q, E))
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)


def test_mha_under_no_grad_and_inference_mode_and_empty_batch():
    ours, ref = _pair(8, 2, True, True, "element")
    mask = M.causal(5)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    expected, _ = ref(x, x, x, attn_mask=_blocked(mask, 2), need_weights=False)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            torch.testing.assert_close(ours(x, x, x, mask=mask)[0], expected, rtol=2e-5, atol=2e-5)
    out, _ = ours(x, x, x, mask=mask)  # trains after the inference-mode call
    out.sum().backward()
    empty = torch.randn(0, 5, 8, device=DEVICE)
    assert ours(empty, empty, empty, mask=mask)[0].shape == (0, 5, 8)


def test_mha_argument_checks_name_the_argument():
    for bad in (True, 0, 2.0):
        with pytest.raises(ValueError, match="embed_dim"):
            SparseMultiheadAttention(bad, 1)
        with pytest.raises(ValueError, match="num_heads"):
            SparseMultiheadAttention(8, bad)
    mha = SparseMultiheadAttention(8, 2)
    x = torch.randn(1, 5, 8)
    with pytest.raises(ValueError, match="need_weights"):
        mha(x, x, x, mask=M.causal(5), need_weights=True)
    with pytest.raises(ValueError, match="mask is 6 x 6"):
        mha(x, x, x, mask=M.causal(6))
    with pytest.raises(ValueError, match="3 heads"):
        mha(x, x, x, mask=M.stack_heads([M.causal(5)] * 3))
    with pytest.raises(ValueError, match="batch size"):
        mha(x, torch.randn(2, 5, 8), torch.randn(2, 5, 8))
