"""Dynamic N:M sparse attention (DFSS, issue 19): the fused block kernel's selection
against the float64 reference :func:`fusegnn.kernels.nm_sparsity.nm_keep`, outputs and
gradients, through Triton's CPU interpreter (on the GPU when there is one).

Exact ties and bitwise-equal kept sets are tested with integer-valued ``q`` and ``k``:
their products are exact in float32 and float64 alike, so the kernel and the reference
select on the same numbers (many equal ones)."""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from fusegnn.attention.block_layout import BlockLayout  # noqa: E402
from fusegnn.attention.masks import bigbird, causal, longformer, sliding_window  # noqa: E402
from fusegnn.attention.sparse_attention import explain_attention, masked_attention_reference, sparse_attention  # noqa: E402
from fusegnn.kernels.block_attention import block_sparse_attention, block_sparse_attention_lse  # noqa: E402
from fusegnn.kernels.nm_sparsity import NM_PATTERNS, check_nm, nm_keep  # noqa: E402
from tests.test_block_attention import MASKS, _inputs  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def nm_reference(q, k, v, allowed, nm, scale=None):
    """float64 N:M attention: selection on the float64 scaled scores, then the masked softmax."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return masked_attention_reference(q, k, v, allowed.to(q.device), scale, nm)


def _run(q, k, v, g, layout, nm, scale=None):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = block_sparse_attention(q, k, v, layout, scale, nm=nm, allow_tf32=False)
    out.backward(g)
    return out, (q.grad, k.grad, v.grad)


def _check(q, k, v, g, allowed, layout, nm, *, scale=None, atol=2e-5):
    out, grads = _run(q, k, v, g, layout, nm, scale)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = nm_reference(qd, kd, vd, allowed, nm, scale)
    ref.backward(g.double())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=atol)
    for name, a, b in zip(("dq", "dk", "dv"), grads, (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=atol, msg=name)
    return out


# ------------------------------------------------------------------ the rule itself
def test_nm_keep_rule_by_hand():
    s = torch.tensor([[3.0, 1.0, 2.0, 2.0, 5.0, 5.0, 5.0, 0.0, 7.0]])
    allowed = torch.tensor([[True, True, True, True, True, True, True, True, False]])
    keep = nm_keep(s, allowed, 2, 4)
    # group 0: 3 and the first 2 (ties to the lower index); group 1: the first two 5s;
    # group 2 (partial, padding masked): its only key is masked
    assert keep.tolist() == [[True, False, True, False, True, True, False, False, False]]
    few = torch.tensor([[True, False, False, False]])  # fewer than N allowed: all kept
    assert nm_keep(torch.zeros(1, 4), few, 2, 4).tolist() == [[True, False, False, False]]
    assert nm_keep(torch.tensor([[1.0, 1.0]]), torch.ones(1, 2, dtype=torch.bool), 1, 2).tolist() == [[True, False]]


@pytest.mark.parametrize("nm", NM_PATTERNS)
def test_nm_keep_counts(nm):
    n, m = nm
    s = torch.randn(3, 10, 4 * m + 3, dtype=torch.float64)
    allowed = torch.rand(3, 10, 4 * m + 3) < 0.7
    keep = nm_keep(s, allowed, n, m)
    assert not (keep & ~allowed).any()
    pad = (-s.size(-1)) % m
    per_group = torch.nn.functional.pad(keep, (0, pad)).unflatten(-1, (-1, m)).sum(-1)
    allowed_per_group = torch.nn.functional.pad(allowed, (0, pad)).unflatten(-1, (-1, m)).sum(-1)
    assert torch.equal(per_group, allowed_per_group.clamp(max=n))


# ------------------------------------------------------------------ kernel vs reference
# (mask name of tests.test_block_attention.MASKS, L_q, L_k, H, BM, BN, N:M)
CASES = [
    ("causal", 37, 37, 1, 16, 16, (2, 4)),  # odd L: a partial last group and block
    ("window", 40, 40, 2, 16, 16, (1, 2)),
    ("dilated", 40, 40, 1, 16, 16, (2, 4)),  # runs undilated with nm
    ("global", 33, 33, 1, 16, 16, (4, 8)),
    ("random_blocks", 40, 40, 1, 16, 16, (2, 4)),
    ("longformer", 41, 41, 1, 16, 16, (2, 4)),
    ("bigbird", 64, 64, 1, 16, 16, (4, 8)),
    ("combined", 40, 40, 1, 16, 32, (2, 4)),
    ("random", 33, 33, 1, 16, 16, (1, 2)),
    ("empty_rows", 40, 40, 1, 16, 16, (2, 4)),  # rows with no key: zeros
    ("graph", 40, 27, 1, 16, 16, (2, 4)),  # L_q != L_k, L_k % 4 = 3
    ("per_head_stack", 40, 40, 2, 16, 16, (4, 8)),
    ("per_head_dense", 24, 40, 2, 32, 16, (1, 2)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}x{c[2]}-{c[6][0]}of{c[6][1]}-{c[4]}x{c[5]}")
def test_kernel_matches_float64_reference(case):
    name, L_q, L_k, H, BM, BN, nm = case
    mask = MASKS[name](L_q, L_k)
    layout = BlockLayout.from_mask(mask, BM, BN, DEVICE)
    (q, k, v), g = _inputs(1, H, L_q, L_k, 32, seed=sum(map(ord, str(case))))
    allowed = mask.dense()
    out = _check(q, k, v, g, allowed, layout, nm)
    empty = ~allowed.any(-1).expand(H, L_q)
    assert (out[:, empty] == 0).all()


def _integer_inputs(H, L, D, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randint(-1, 2, (1, H, L, D), generator=gen).float() for _ in range(2))
    v, g = (torch.randn(1, H, L, D, generator=gen) for _ in range(2))
    return [t.to(DEVICE, dtype) for t in (q, k, v)], g.to(DEVICE, dtype)


@pytest.mark.parametrize("nm", NM_PATTERNS)
@pytest.mark.parametrize("L", [45, 48])
def test_ties_and_kept_sets_are_the_references(nm, L):
    """Integer q, k (D = 16, scale 1/4: exact scores, many ties inside the groups): the
    kernel's log-sum-exp is that of exactly the reference's kept set, and its outputs and
    gradients are the reference's; keeping the higher index of a tie instead would differ."""
    D = 16
    mask = longformer(L, 6, 3)
    layout = BlockLayout.from_mask(mask, 16, 16, DEVICE)
    (q, k, v), g = _integer_inputs(2, L, D, seed=nm[1])
    s = (q.double() @ k.double().transpose(-1, -2)) / 4.0
    allowed = mask.dense().to(DEVICE)
    keep = nm_keep(s, allowed, *nm)
    ties_higher = nm_keep(s.flip(-1), allowed.flip(-1), *nm).flip(-1)
    grouped = torch.nn.functional.pad(s, (0, (-L) % nm[1])).unflatten(-1, (-1, nm[1]))
    equal_pairs = (grouped.unsqueeze(-1) == grouped.unsqueeze(-2)).sum() - grouped.numel()
    assert equal_pairs > 100  # ties abound
    out, lse = block_sparse_attention_lse(q, k, v, layout, nm=nm, allow_tf32=False)
    ref_lse = s.masked_fill(~keep, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    _check(q, k, v, g, allowed, layout, nm)
    if L % nm[1] == 0:  # flipping keeps the groups: the other tie rule is a different set
        assert not torch.equal(ties_higher, keep)


def test_selection_follows_the_scale_sign():
    """scale < 0 reverses the order: the smallest products are kept; scale 0 makes every
    score a tie (the first N of each group)."""
    mask = causal(40)
    layout = BlockLayout.from_mask(mask, 16, 16, DEVICE)
    (q, k, v), g = _inputs(1, 1, 40, 40, 32, seed=3)
    for scale in (-0.4, 0.0, 1.7):
        _check(q, k, v, g, mask.dense(), layout, (2, 4), scale=scale, atol=2e-5 * max(1.0, abs(scale) * 6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    """16-bit inputs: the kernel selects on float32 products of the 16-bit values -- exact
    for these integer inputs, so the kept set is the reference's."""
    mask = bigbird(48, 3, 4, 16, 0.15, seed=0)
    layout = BlockLayout.from_mask(mask, 16, 16, DEVICE)
    (q, k, v), g = _integer_inputs(1, 48, 16, seed=1, dtype=dtype)
    _check_at(q, k, v, g, mask.dense(), layout, (2, 4), 3e-2 if dtype == torch.bfloat16 else 5e-3)


def _check_at(q, k, v, g, allowed, layout, nm, tol):
    """Outputs within ``tol`` of the float64 reference, gradients within ``4 tol``."""
    out, grads = _run(q, k, v, g, layout, nm)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = nm_reference(qd, kd, vd, allowed, nm)
    ref.backward(g.double())
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for a, b in zip(grads, (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(a.double(), b, atol=4 * tol, rtol=4 * tol)


def test_nm_dense_mask_and_sub_tiled_backward():
    """A full mask (every block full: no element mask), and the backward in sub-tiles
    (dK/dV over 16 of the 32 query rows at a time, dQ over 16 of the 32 keys)."""
    from fusegnn.kernels.block_attention import LaunchConfig

    L = 64
    mask = sliding_window(L, L)
    layout = BlockLayout.from_mask(mask, 32, 32, DEVICE)
    (q, k, v), g = _inputs(1, 2, L, L, 32, seed=4)
    launch = LaunchConfig(4, 2, 4, 1, dkdv_sub_m=16, dq_sub_n=16)
    for nm in ((2, 4), (4, 8)):
        q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
        out = block_sparse_attention(q2, k2, v2, layout, nm=nm, launch=launch, allow_tf32=False)
        out.backward(g)
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = nm_reference(qd, kd, vd, mask.dense(), nm)
        ref.backward(g.double())
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
        for a, b in ((q2, qd), (k2, kd), (v2, vd)):
            torch.testing.assert_close(a.grad.double(), b.grad, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("gate", [(1, 1), (1, 64)], ids=["chunks", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nm", NM_PATTERNS)
def test_both_selection_paths(monkeypatch, nm, dtype, gate):
    """Both in-kernel selections -- elementwise on the chunks of key tiles loaded in the
    N:M order, and on ``[rows, groups, M]`` reshapes in key order (the tiles
    ``nm_chunk_path`` refuses) -- on several key blocks per row, a ragged last block and
    non-integer 16-bit values, against the reference. ``gate`` is ``(NM_MIN_ROWS,
    NM_MIN_CHUNK)`` for the run: ``(1, 1)`` takes the chunk path everywhere. (The
    interpreter cannot show compiled layout bugs; the GPU probe
    ``benchmarks/nm_gpu_probe.py`` runs the same paths compiled.)

    Compiled, the chunk path is only correct on the tiles its gate admits (16-row bf16
    tiles forced through it fail on an H100: the reason for the gate), so on a GPU the
    blocks are 64 x 64 (both paths still forced by ``gate``); the interpreter runs the
    small 16 x 32 blocks, which reach the ragged and multi-block cases faster."""
    import fusegnn.kernels.block_attention as ba

    monkeypatch.setattr(ba, "NM_MIN_ROWS", gate[0])
    monkeypatch.setattr(ba, "NM_MIN_CHUNK", gate[1])
    block_m, block_n, L = (64, 64, 157) if DEVICE.type == "cuda" else (16, 32, 61)
    mask = longformer(L, 12, 2)
    layout = BlockLayout.from_mask(mask, block_m, block_n, DEVICE)  # fresh layout: plans built with the gate
    (q, k, v), g = _inputs(1, 1, L, L, 16, seed=nm[1] + gate[1])
    q, k, v, g = (t.to(dtype) for t in (q, k, v, g))
    _check_at(q, k, v, g, mask.dense(), layout, nm, 2e-5 if dtype == torch.float32 else 3e-2)


def test_nm_launch_config():
    """With N:M the table's dK/dV takes whole query blocks (its selection runs as queries
    x keys, which needs >= 64-row products for warpgroup MMA) and dQ sub-tiles of at
    least 8 M keys (whole 8-column groups per N:M chunk); for M <= 4 the 16-bit forward
    and dQ take N:M's register caps (128) and dQ 3 stages; the rest is the table's."""
    from fusegnn.kernels import block_attention as ba
    from fusegnn.kernels.block_attention import launch_config

    base = launch_config(64, 64, 64, torch.bfloat16)
    for nm in NM_PATTERNS:
        cfg = launch_config(64, 64, 64, torch.bfloat16, nm)
        assert cfg.sub_m(64) == 64
        assert cfg.sub_n(64) == min(64, max(base.sub_n(64), 8 * nm[1]))
        assert (cfg.fwd_warps, cfg.fwd_stages, cfg.bwd_warps, cfg.bwd_stages) == (
            base.fwd_warps, base.fwd_stages, base.bwd_warps, base.bwd_stages)
        if nm[1] <= 4:
            assert (cfg.fwd_maxnreg, cfg.dq_maxnreg, cfg.dq_stages) == (
                ba._NM_FWD_MAXNREG, ba._NM_DQ_MAXNREG, ba._NM_DQ_STAGES)
        else:
            assert (cfg.fwd_maxnreg, cfg.dq_maxnreg, cfg.dq) == (base.fwd_maxnreg, base.dq_maxnreg, base.dq)
        assert cfg.dkdv_maxnreg is None or cfg.dkdv_maxnreg >= (base.dkdv_maxnreg or 0)
    fp32 = launch_config(64, 64, 64, torch.float32, (1, 2))
    assert (fp32.fwd_maxnreg, fp32.dq_maxnreg, fp32.dkdv_maxnreg) == (None, None, None)  # no caps for float32
    assert fp32.dq == launch_config(64, 64, 64, torch.float32).dq
    assert launch_config(64, 64, 64, torch.bfloat16, None) == base


def test_nm_chunk_path_rule():
    """The chunk path needs a selection tile of >= 64 rows with chunks of >= 8 columns
    (16-row tiles gave wrong 16-bit outputs on an H100 even with 8-column chunks); the
    table's 64 x 64 launches (the default block size from L = 64 on) take it in all
    three kernels, 16 x 16 and 32 x 32 blocks in none."""
    import fusegnn.kernels.block_attention as ba

    assert (ba.NM_MIN_ROWS, ba.NM_MIN_CHUNK) == (64, 8)
    assert ba.nm_chunk_path(64, 32, 4) and ba.nm_chunk_path(128, 64, 8)
    assert not ba.nm_chunk_path(16, 16, 2)  # the H100 failure: 16 rows, 8-column chunks
    assert not ba.nm_chunk_path(32, 64, 2) and not ba.nm_chunk_path(64, 16, 4)
    for nm in NM_PATTERNS:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            cfg = ba.launch_config(64, 64, 64, dtype, nm)
            assert ba.nm_paths(64, 64, cfg, nm) == dict.fromkeys(("fwd", "dq", "dkdv"), "chunks")
        for block in (16, 32):
            cfg = ba.launch_config(block, block, 64, torch.bfloat16, nm)
            assert ba.nm_paths(block, block, cfg, nm) == dict.fromkeys(("fwd", "dq", "dkdv"), "grouped")
    sub = ba.LaunchConfig(4, 2, 4, 2, dkdv_sub_m=32, dq_sub_n=16)  # dK/dV on 32-row, dQ on 16-key sub-tiles
    assert ba.nm_selection_tiles(64, 64, sub) == {"fwd": (64, 64), "dq": (64, 16), "dkdv": (32, 64)}
    assert ba.nm_paths(64, 64, sub, (1, 2)) == {"fwd": "chunks", "dq": "chunks", "dkdv": "grouped"}
    assert ba.nm_paths(64, 64, sub, (2, 4)) == {"fwd": "chunks", "dq": "grouped", "dkdv": "grouped"}


@pytest.mark.parametrize("launch", [None, "sub"])
def test_kernels_take_the_path_of_their_tile(launch):
    """Each kernel's ``NM_CHUNKS`` constexpr -- which picks both its key load order and
    its selection -- is ``nm_chunk_path`` of the tile it selects on, read from its own
    constexprs: forward ``BM x BN``, dQ ``BM x SUB_N``, dK/dV ``SUB_M x BN``."""
    import fusegnn.kernels.block_attention as ba

    L, D = 128, 16
    layout = BlockLayout.from_mask(causal(L), 64, 64, DEVICE)
    prep = layout.prepared(DEVICE)
    cfg = None if launch is None else ba.LaunchConfig(4, 2, 4, 2, dkdv_sub_m=32, dq_sub_n=16)
    (q, k, v), g = _inputs(1, 1, L, L, D, seed=0)
    for nm in NM_PATTERNS:
        fwd = ba._forward_plan(q, k, v, layout, prep, 0.25, "ieee", cfg, 1, nm)
        dq, _, dkdv = ba._backward_plan(g, q, k, v, q, layout, prep, 0.25, "ieee", True, True, cfg, 1, nm)
        tiles = {"fwd": (fwd.meta["BM"], fwd.meta["BN"]), "dq": (dq.meta["BM"], dq.meta["SUB_N"]),
                 "dkdv": (dkdv.meta["SUB_M"], dkdv.meta["BN"])}
        for name, plan in (("fwd", fwd), ("dq", dq), ("dkdv", dkdv)):
            assert plan.meta["NM_M"] == nm[1] and "NM_MIN_CHUNK" not in plan.meta
            assert plan.meta["NM_CHUNKS"] == ba.nm_chunk_path(*tiles[name], nm[1]), (name, nm)
        want = ba.nm_paths(64, 64, cfg or ba.launch_config(64, 64, D, q.dtype, nm), nm)
        assert {n: "chunks" if p.meta["NM_CHUNKS"] else "grouped"
                for n, p in (("fwd", fwd), ("dq", dq), ("dkdv", dkdv))} == want
    plain = ba._forward_plan(q, k, v, layout, prep, 0.25, "ieee", cfg, 1, None)
    assert (plain.meta["NM_M"], plain.meta["NM_CHUNKS"]) == (0, False)


@pytest.mark.skipif(CUDA, reason="spies on the interpreter's device functions")
def test_interpreter_runs_the_chosen_selection(monkeypatch):
    """Run through the interpreter with a gate that splits the kernels (``NM_MIN_ROWS =
    32``: forward 32 x 64 and dQ 32 x 32 take the chunks, dK/dV on 16-row sub-tiles the
    key order): the selection functions each kernel calls are the ones ``nm_paths``
    names, and the outputs and gradients are the reference's (so each kernel's key
    order agrees with its selection)."""
    import fusegnn.kernels.block_attention as ba

    L = 64
    mask = bigbird(L, 6, 4, 32, 0.2, seed=1)
    allowed = mask.dense()
    (q, k, v), g = _inputs(1, 1, L, L, 16, seed=5)
    launch = ba.LaunchConfig(2, 1, 2, 1, dkdv_sub_m=16, dq_sub_n=32)
    nm = (1, 2)
    _run(q, k, v, g, BlockLayout.from_mask(mask, 32, 64, DEVICE), nm)  # jit the device functions first
    monkeypatch.setattr(ba, "NM_MIN_ROWS", 32)
    calls = {"chunks": set(), "grouped": set()}
    for path, name in (("chunks", "_nm_keep_chunks"), ("grouped", "_nm_keep_grouped")):
        def spy(s, n, m, rows, cols, _fn=getattr(ba, name), _path=path):
            calls[_path].add((int(rows), int(cols)))
            return _fn(s, n, m, rows, cols)
        monkeypatch.setattr(ba, name, spy)
    layout = BlockLayout.from_mask(mask, 32, 64, DEVICE)  # fresh: plans built with the gate
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    out = block_sparse_attention(q2, k2, v2, layout, nm=nm, launch=launch, allow_tf32=False)
    out.backward(g)
    tiles = ba.nm_selection_tiles(32, 64, launch)
    paths = ba.nm_paths(32, 64, launch, nm)
    assert paths == {"fwd": "chunks", "dq": "chunks", "dkdv": "grouped"}
    assert calls == {p: {tiles[n] for n in tiles if paths[n] == p} for p in ("chunks", "grouped")}
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = nm_reference(qd, kd, vd, allowed, nm)
    ref.backward(g.double())
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    for a, b in ((q2, qd), (k2, kd), (v2, vd)):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=2e-5, rtol=2e-5)


def test_reference_gradcheck_float64():
    mask = causal(12)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fn = lambda q, k, v: masked_attention_reference(q, k, v, mask.dense(), 0.5, (2, 4))  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))


# ------------------------------------------------------------------ the public entry points
def test_sparse_attention_paths():
    mask = bigbird(40, 3, 4, 16, 0.15, seed=0)
    (q, k, v), g = _inputs(1, 2, 40, 40, 32, seed=9)
    ref = nm_reference(q, k, v, mask.dense(), (2, 4))
    for aggregation in ("block", "reference", "auto"):
        out = sparse_attention(q, k, v, mask, aggregation=aggregation, nm="2:4", block_size=16)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert explain_attention(q, mask, aggregation="block", nm=(2, 4), block_size=16).label == "block 16x16"
    expect = "block" if CUDA else "reference"
    assert explain_attention(q, mask, nm=(2, 4)).name == expect
    d = explain_attention(q, MASKS["dilated"](40, 40), aggregation="block", nm=(2, 4))
    assert d.dilation == 1  # N:M runs the mask's own layout, never its sub-sequences
    plain = sparse_attention(q, k, v, mask, aggregation="reference")
    assert not torch.allclose(plain, ref.to(plain.dtype), atol=1e-3)  # N:M changes the result


def test_layer_passes_nm():
    from fusegnn.layers import SparseMultiheadAttention, SparseTransformerEncoderLayer

    torch.manual_seed(0)
    layer = SparseMultiheadAttention(32, 2, nm=(2, 4), aggregation="reference")
    x = torch.randn(2, 20, 32)
    out, _ = layer(x, x, x)  # mask=None: full attention, N:M
    q, k, v = (layer._project(x, i) for i in range(3))
    ref = masked_attention_reference(q, k, v, torch.ones(20, 20, dtype=torch.bool), 1 / math.sqrt(16), (2, 4))
    want = layer.out_proj(ref.transpose(1, 2).reshape(2, 20, 32))
    torch.testing.assert_close(out, want)
    assert "nm=2:4" in repr(layer)
    enc = SparseTransformerEncoderLayer(32, 2, 64, dropout=0.0, mask=causal(20), nm="1:2", aggregation="reference")
    assert enc.self_attn.nm == (1, 2)
    assert enc(x).shape == x.shape


@pytest.mark.parametrize("bad,err,match", [
    ((2, 2), ValueError, "N must be < M"),
    ((4, 4), ValueError, "N must be < M"),
    ((3, 4), ValueError, "nm must be one of 1:2, 2:4, 4:8"),
    ((2, 16), ValueError, "nm must be one of"),
    ("2-4", ValueError, "nm must be None, a pair"),
    ((2.0, 4), TypeError, "two ints"),
    ((2, 4, 8), TypeError, "nm must be None, a pair"),
    (24, TypeError, "nm must be None, a pair"),
])
def test_bad_nm(bad, err, match):
    with pytest.raises(err, match=match):
        check_nm(bad)
    mask = causal(32)
    layout = BlockLayout.from_mask(mask, 16, 16, DEVICE)
    (q, k, v), _ = _inputs(1, 1, 32, 32, 32, seed=0)
    with pytest.raises(err, match=match):
        block_sparse_attention(q, k, v, layout, nm=bad)
    with pytest.raises(err, match=match):
        sparse_attention(q, k, v, mask, nm=bad)
    from fusegnn.layers import SparseMultiheadAttention

    with pytest.raises(err, match=match):
        SparseMultiheadAttention(32, 2, nm=bad)


def test_nm_refuses_dilation_and_paths_that_cannot_drop_scores():
    layout = BlockLayout.from_mask(sliding_window(20, 3), 16, 16, DEVICE)
    (q, k, v), _ = _inputs(1, 1, 40, 40, 32, seed=0)
    with pytest.raises(ValueError, match="needs dilation=1"):
        block_sparse_attention(q, k, v, layout, dilation=2, nm=(2, 4))
    mask = causal(40)
    for aggregation in ("element", "dense"):
        with pytest.raises(ValueError, match="cannot drop scores"):
            sparse_attention(q, k, v, mask, aggregation=aggregation, nm=(2, 4))


# ------------------------------------------------------------------ GPU
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name,nm,dtype", [
    ("bigbird", (2, 4), torch.bfloat16), ("longformer", (2, 4), torch.float16), ("full", (2, 4), torch.bfloat16),
    ("bigbird", (1, 2), torch.float32), ("full", (4, 8), torch.float16),
])
def test_gpu_vs_reference(name, nm, dtype):
    """Larger cases on the GPU: integer-valued q, k (exact float32 scores, hence the
    reference's kept sets; ties included), outputs and gradients against float64."""
    L = 1000
    mask = {"bigbird": bigbird(L, 100, 64, 64, 0.05, seed=0), "longformer": longformer(L, 100, 64),
            "full": sliding_window(L, L)}[name]
    layout = BlockLayout.from_mask(mask, 64, 64, DEVICE)
    (q, k, v), g = _integer_inputs(3, L, 64, seed=2, dtype=dtype)
    q = q / 4  # exact: scores stay exact, softmax less peaked
    out, grads = _run(q, k, v, g, layout, nm)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = nm_reference(qd, kd, vd, mask.dense(), nm)
    ref.backward(g.double())
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for a, b in zip(grads, (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(a.double(), b, atol=4 * tol, rtol=4 * tol)


def test_attention_suite_nm_backend(tmp_path):
    """The suite's opt-in ``full`` cases and ``fusegnn-nm`` backend (CPU smoke run: the
    interpreter): checked against SDPA given the 2:4 selection, ``vs_block`` filled."""
    import json

    from benchmarks import attention as bench
    from benchmarks.run import main

    assert not any(c.mask == "full" for c in bench.select_attention_cases(None, quick=False))
    assert "full-L4096-fwdbwd" in {c.name for c in bench.select_attention_cases(["full-*"], quick=False)}
    cuda = torch.cuda.is_available()  # the CPU smoke run has L = 256 only; a GPU has L >= 1024
    device = ["--device", "cuda"] if cuda else ["--allow-cpu", "--device", "cpu"]
    args = ["--suite", "attention", *device, "--steps", "1", "--warmup", "1", "--quiet",
            "--no-png", "--out", str(tmp_path), "--cases", "full-L1024-fwdbwd" if cuda else "full-L256-fwdbwd",
            "--backends", "sdpa,fusegnn-block,fusegnn-nm"]
    assert main(args) == 0
    (result,) = (tmp_path / "attention").glob("*.json")
    doc = json.loads(result.read_text())
    records = {r["backend"]: r for r in doc["records"]}
    nm = records["fusegnn-nm"]
    assert nm["ok"], nm["error"]
    # float32 on the CPU; the GPU grid is bfloat16, whose rounding of the outputs and
    # gradients alone is ~3e-3 of their largest magnitude (a changed kept set: ~1e-2 and up)
    bound = 1e-4 if (bench.GPU_SIZES if cuda else bench.CPU_SIZES).dtype == torch.float32 else 1e-2
    assert nm["rel_err"] < bound and "2:4 selection" in nm["checked_against"]
    assert nm["block_size"].endswith("nm 2:4") and nm["vs_block"] > 0
    assert records["fusegnn-block"]["ok"] and records["fusegnn-block"]["vs_block"] is None


def test_example_nm_run_writes_json(tmp_path):
    """``examples/sparse_transformer.py --nm 2:4``: every model's layers get nm, the
    summary (loss curves included) goes to ``--json-out``; a bad pattern is refused."""
    import json

    from tests.test_attention_layers import _load_example

    example = _load_example()
    out = tmp_path / "nm.json"
    argv = ["--quick", "--steps", "2", "--seq-len", "64", "--eval-batches", "1", "--quiet", "--nm", "2:4",
            "--json-out", str(out)]
    assert example.main(argv) == 0
    summary = json.loads(out.read_text())
    assert summary["nm"] == "2:4" and summary["config"]["nm"] == [2, 4]
    assert set(summary["models"]) == {"dense", "sparse"}
    assert all(len(m["loss_curve"]) == 2 for m in summary["models"].values())
    assert summary["sparse_path"] == ("block" if CUDA else "reference")
    args = example.parse_args(["--quick", "--nm", "2:4"])
    model = example.RetrievalEncoder(args, None)
    assert all(layer.self_attn.nm == (2, 4) for layer in model.layers)
    with pytest.raises(SystemExit):
        example.parse_args(["--nm", "2:2"])
