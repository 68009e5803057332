"""BlockLayout (:mod:`fusegnn.attention.block_layout`): the BCSR full/partial block format.

The dense mask is rebuilt from the forward index (``row_ptr`` / ``col_idx`` /
``pattern_id``) and, separately, from the transposed index (``col_ptr`` / ``row_idx`` /
``t_block``) with plain Python loops, and compared with ``mask.dense()`` for every mask
type, odd ``L``, ``BM != BN``, rectangular and per-head masks. Also: index invariants,
pattern dedupe (few patterns for structured masks, none repeated), statistics, block size
validation, build time of a BigBird layout at L = 16384.
"""

from __future__ import annotations

import time

import pytest
import torch

from fusegnn.attention import masks as M
from fusegnn.attention.block_layout import BlockLayout

CUDA = torch.cuda.is_available()


pytestmark = pytest.mark.usefixtures("one_thread")


def _masks(L):
    gen = torch.Generator().manual_seed(L)
    return {
        "causal": M.causal(L),
        "window": M.sliding_window(L, 5),
        "dilated": M.dilated(L, 3, 4),
        "global": M.global_tokens(L, 5),
        "random": M.random_blocks(L, 8, 0.3, 1),
        "longformer": M.longformer(L, 4, 3),
        "bigbird": M.bigbird(L, 4, 3, 8, 0.2, 0),
        "dense": M.from_dense(torch.rand(L, L, generator=gen) < 0.2),
        "graph": M.from_graph(torch.randint(0, L, (2, 3 * L), generator=gen), L),
        "intersection": M.causal(L) & M.sliding_window(L, 9),
        "per_head": M.stack_heads([M.causal(L), M.sliding_window(L, 3), M.from_dense(torch.zeros(L, L, dtype=torch.bool))]),
        "per_head_union": M.from_dense(torch.rand(2, L, L, generator=gen) < 0.05) | M.global_tokens(L, 2),
    }


def _as3(t):
    return t.unsqueeze(0) if t.dim() == 2 else t


def forward_dense(layout):
    """Dense [H, L_q, L_k] rebuilt from the forward (row) index."""
    H, BM, BN = layout.num_heads, layout.BM, layout.BN
    out = torch.zeros(H, layout.nrb * BM, layout.ncb * BN, dtype=torch.bool)
    row_ptr, col_idx, pid = layout.row_ptr.tolist(), layout.col_idx.tolist(), layout.pattern_id.tolist()
    for h in range(H):
        for r in range(layout.nrb):
            for e in range(row_ptr[h][r], row_ptr[h][r + 1]):
                c = col_idx[e]
                blk = torch.ones(BM, BN, dtype=torch.bool) if pid[e] == -1 else layout.patterns[pid[e]].cpu()
                out[h, r * BM : (r + 1) * BM, c * BN : (c + 1) * BN] = blk
    return out[:, : layout.L_q, : layout.L_k]


def transposed_dense(layout):
    """Dense [H, L_q, L_k] rebuilt from the transposed (column) index."""
    H, BM, BN = layout.num_heads, layout.BM, layout.BN
    out = torch.zeros(H, layout.nrb * BM, layout.ncb * BN, dtype=torch.bool)
    col_ptr, row_idx, t_block = layout.col_ptr.tolist(), layout.row_idx.tolist(), layout.t_block.tolist()
    pid = layout.pattern_id.tolist()
    for h in range(H):
        for c in range(layout.ncb):
            for e in range(col_ptr[h][c], col_ptr[h][c + 1]):
                r, p = row_idx[e], pid[t_block[e]]
                blk = torch.ones(BM, BN, dtype=torch.bool) if p == -1 else layout.patterns[p].cpu()
                out[h, r * BM : (r + 1) * BM, c * BN : (c + 1) * BN] = blk
    return out[:, : layout.L_q, : layout.L_k]


def check_invariants(layout, mask):
    H, nrb, ncb, nnzb = layout.num_heads, layout.nrb, layout.ncb, layout.nnzb
    for name in ("row_ptr", "col_idx", "pattern_id", "col_ptr", "row_idx", "t_block"):
        assert getattr(layout, name).dtype == torch.int32, name
    assert layout.patterns.dtype == torch.bool
    assert layout.row_ptr.shape == (H, nrb + 1) and layout.col_ptr.shape == (H, ncb + 1)
    rp, cp = layout.row_ptr.long(), layout.col_ptr.long()
    assert rp[0, 0] == 0 and rp[-1, -1] == nnzb and cp[0, 0] == 0 and cp[-1, -1] == nnzb
    assert torch.equal(rp[1:, 0], rp[:-1, -1]) and torch.equal(cp[1:, 0], cp[:-1, -1])  # global offsets
    assert bool((rp[:, 1:] >= rp[:, :-1]).all()) and bool((cp[:, 1:] >= cp[:, :-1]).all())
    # column indices increase within a row, row indices within a column
    col, row = layout.col_idx.long(), layout.row_idx.long()
    for ptr, idx in ((rp, col), (cp, row)):
        for h in range(H):
            starts = ptr[h, :-1].tolist()
            ends = ptr[h, 1:].tolist()
            for s, e in zip(starts, ends):
                assert bool((idx[s + 1 : e] > idx[s : e - 1]).all())
    # t_block is a permutation pointing at the same block
    t = layout.t_block.long()
    assert torch.equal(torch.sort(t).values, torch.arange(nnzb))
    fwd_rows = torch.repeat_interleave(torch.arange(H * nrb), (rp[:, 1:] - rp[:, :-1]).reshape(-1))
    bwd_cols = torch.repeat_interleave(torch.arange(H * ncb), (cp[:, 1:] - cp[:, :-1]).reshape(-1))
    assert torch.equal(fwd_rows[t] % nrb, row) and torch.equal(col[t], bwd_cols % ncb)
    assert torch.equal(fwd_rows[t] // nrb, bwd_cols // ncb)  # same head
    # patterns: each used, none repeated, each strictly partial
    P = layout.num_patterns
    pid = layout.pattern_id.long()
    assert pid.min() >= -1 if nnzb else True
    assert torch.equal(torch.unique(pid[pid >= 0]), torch.arange(P))
    if P:
        assert torch.unique(layout.patterns.reshape(P, -1), dim=0).size(0) == P
        assert bool(layout.patterns.reshape(P, -1).any(1).all())
    # statistics
    dense = _as3(mask.dense())
    bmap = _as3(mask.block_map(layout.BM, layout.BN))
    assert layout.num_full == int((bmap == M.FULL).sum()) and layout.num_partial == int((bmap == M.PARTIAL).sum())
    assert layout.density == pytest.approx(dense.double().mean().item(), abs=1e-12)
    assert layout.block_density == pytest.approx((bmap != M.EMPTY).double().mean().item(), abs=1e-12)
    assert layout.max_row_blocks == int((bmap != M.EMPTY).sum(-1).max())
    assert layout.max_col_blocks == int((bmap != M.EMPTY).sum(-2).max())
    assert torch.equal(_as3(layout.block_map()), bmap)


@pytest.mark.parametrize("L", [1, 37, 64, 70])
@pytest.mark.parametrize("BM,BN", [(16, 16), (16, 32), (32, 16), (64, 16)])
def test_layout_rebuilds_the_mask(L, BM, BN):
    for name, mask in _masks(L).items():
        layout = BlockLayout.from_mask(mask, BM, BN)
        dense = _as3(mask.dense())
        assert torch.equal(forward_dense(layout), dense), (name, "forward")
        assert torch.equal(transposed_dense(layout), dense), (name, "transposed")
        assert torch.equal(_as3(layout.dense()), dense), name
        check_invariants(layout, mask)


def test_rectangular_masks():
    gen = torch.Generator().manual_seed(3)
    for L_q, L_k in [(37, 90), (90, 17), (16, 1)]:
        for mask in (
            M.from_dense(torch.rand(L_q, L_k, generator=gen) < 0.3),
            M.from_graph(torch.stack([torch.randint(0, L_k, (50,), generator=gen), torch.randint(0, L_q, (50,), generator=gen)]), L_q, L_k),
        ):
            for BM, BN in [(16, 32), (32, 16)]:
                layout = BlockLayout.from_mask(mask, BM, BN)
                assert (layout.nrb, layout.ncb) == (-(-L_q // BM), -(-L_k // BN))
                assert torch.equal(forward_dense(layout)[0], mask.dense())
                assert torch.equal(transposed_dense(layout)[0], mask.dense())
                check_invariants(layout, mask)


def test_empty_and_full_masks():
    L = 40
    empty = BlockLayout.from_mask(M.from_dense(torch.zeros(L, L, dtype=torch.bool)), 16, 16)
    assert empty.nnzb == 0 and empty.num_patterns == 0 and empty.density == 0.0
    assert empty.patterns.shape == (0, 16, 16)
    assert not empty.dense().any()
    full = BlockLayout.from_mask(M.from_dense(torch.ones(L, L, dtype=torch.bool)), 16, 32)
    assert full.nnzb == full.num_full == full.nrb * full.ncb and full.num_patterns == 0
    assert full.density == 1.0 and bool((full.pattern_id == -1).all())


def test_few_patterns_for_structured_masks():
    L = 1000  # not a multiple of the block: edge blocks add a few patterns
    window = BlockLayout.from_mask(M.sliding_window(L, 100), 64, 64)
    # interior partial blocks sit at two diagonal offsets; edge blocks add a few more
    assert window.num_partial > 20 and window.num_patterns <= 6
    dil = BlockLayout.from_mask(M.dilated(L, 30, 3), 32, 64)
    assert dil.num_partial > 100 and dil.num_patterns <= 16
    causal = BlockLayout.from_mask(M.causal(1024), 64, 64)
    assert causal.num_partial == 16 and causal.num_patterns == 1


def test_patterns_shared_across_heads():
    L = 256
    mask = M.stack_heads([M.sliding_window(L, 20)] * 4)
    layout = BlockLayout.from_mask(mask, 32, 32)
    single = BlockLayout.from_mask(M.sliding_window(L, 20), 32, 32)
    assert layout.num_patterns == single.num_patterns
    assert layout.nnzb == 4 * single.nnzb
    assert torch.equal(layout.col_idx, single.col_idx.repeat(4))


def test_block_size_validation():
    mask = M.causal(40)
    for bad in (8, 48, 0, -16):
        with pytest.raises(ValueError, match="power of two >= 16"):
            BlockLayout.from_mask(mask, bad, 16)
        with pytest.raises(ValueError, match="BN must be a power of two >= 16"):
            BlockLayout.from_mask(mask, 16, bad)
    with pytest.raises(TypeError, match="BM must be an int"):
        BlockLayout.from_mask(mask, 16.0, 16)
    with pytest.raises(TypeError, match="mask must be a fusegnn.attention.masks.Mask"):
        BlockLayout.from_mask(torch.ones(4, 4, dtype=torch.bool), 16, 16)


def test_layout_mask_round_trip_and_to():
    mask = M.bigbird(77, 3, 2, 8, 0.3, 5)
    layout = BlockLayout.from_mask(mask, 16, 32)
    back = layout.to_mask()
    assert back is layout.to_mask()
    assert torch.equal(back.dense(), mask.dense())
    for BM, BN in [(16, 32), (32, 16), (7, 5)]:
        assert torch.equal(back.block_map(BM, BN), mask.block_map(BM, BN))
    again = BlockLayout.from_mask(back, 16, 32)
    assert torch.equal(again.pattern_id, layout.pattern_id) and torch.equal(again.patterns, layout.patterns)
    assert layout.to("cpu") is layout
    assert "BlockLayout(L_q=77" in repr(layout)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here)")
def test_layout_on_gpu_equals_cpu():
    for mask in _masks(300).values():
        cpu = BlockLayout.from_mask(mask, 64, 32)
        gpu = BlockLayout.from_mask(mask, 64, 32, device="cuda")
        assert gpu.device.type == "cuda"
        for name in ("row_ptr", "col_idx", "pattern_id", "patterns", "col_ptr", "row_idx", "t_block"):
            assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
        assert torch.equal(cpu.to("cuda").col_idx, gpu.col_idx)


def test_bigbird_layout_at_16k_builds_fast():
    mask = M.bigbird(16384, 256, 64, 64, 0.03, 0)  # the BigBird-like case
    best = float("inf")
    for _ in range(2):
        fresh = M.bigbird(16384, 256, 64, 64, 0.03, 0)  # no cached block maps
        start = time.perf_counter()
        layout = BlockLayout.from_mask(fresh, 64, 64)
        best = min(best, time.perf_counter() - start)
    assert best < 1.0, f"building the layout took {best:.2f} s"
    assert layout.nrb == layout.ncb == 256 and layout.num_patterns <= 4
    assert 0.05 < layout.block_density < 0.1
    # spot-check some block rows against the mask's predicate
    for r in (0, 1, 100, 255):
        s, e = layout.row_ptr[0, r].item(), layout.row_ptr[0, r + 1].item()
        for idx in range(s, e, max(1, (e - s) // 5)):
            c, p = layout.col_idx[idx].item(), layout.pattern_id[idx].item()
            expect = mask.block_elements(r, c, 64, 64)
            got = torch.ones(64, 64, dtype=torch.bool) if p == -1 else layout.patterns[p]
            assert torch.equal(got, expect)


def test_prepared_is_built_once_and_kept_by_the_layout():
    """``BlockLayout.prepared(device)``: the block kernels' arrays, built on first use
    (by the kernel module's plain ``prepare_layout``) and kept by the layout; a string
    device finds the same arrays; a layout moved with ``to`` starts without them."""
    pytest.importorskip("triton")
    from fusegnn.kernels.block_attention import PreparedLayout, prepare_layout

    layout = BlockLayout.from_mask(M.sliding_window(40, 5), 16, 16)
    first = layout.prepared(torch.device("cpu"))
    assert isinstance(first, PreparedLayout) and first.device == torch.device("cpu")
    assert layout.prepared(torch.device("cpu")) is first
    assert layout.prepared("cpu") is first
    fresh = prepare_layout(layout, torch.device("cpu"))  # the plain function keeps nothing
    assert fresh is not first and layout.prepared(torch.device("cpu")) is first
    for name in ("row_ptr", "col_idx", "col_ptr", "row_idx", "row_sched", "col_sched", "bands"):
        assert torch.equal(getattr(fresh, name), getattr(first, name)), name
    assert first.nnzb == layout.nnzb and first.plans == {}
    assert layout.to("cpu") is layout
    moved = BlockLayout(**{f: getattr(layout, f) for f in layout.__dataclass_fields__ if f != "_mask"})
    assert moved.prepared(torch.device("cpu")) is not first
