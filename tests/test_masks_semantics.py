"""What the attention masks (:mod:`fusegnn.attention.masks`) and their block layouts
(:class:`fusegnn.attention.BlockLayout`) promise, checked from the outside against
independent oracles written here from the documented definitions:

* every constructor's ``dense()`` against a boolean grid built from its docstring formula,
  at odd lengths, lengths no multiple of a block, windows wider than the sequence or zero,
  every token global, and "unbounded" arguments (``sys.maxsize`` and beyond);
* a layout covers exactly the mask's non-empty blocks, full where every in-range element
  is allowed, partial patterns equal to the padded dense slice, and its transposed index
  (the backward's) lists the same blocks by key column;
* caches: a mask reused at another block size or device, results handed out that are not
  the cache itself;
* seeded random blocks: reproducible, independent of and not consuming the global RNG;
* bad arguments raise errors naming the argument;
* ``sparse_attention`` on edge-case masks equals a float64 dense masked softmax (empty
  rows: zeros) on every path (the Triton kernels run in the interpreter on the CPU).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fusegnn.attention import BlockLayout, sparse_attention
from fusegnn.attention import masks as M

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# ----------------------------------------------------------------------------- oracles
def grid(L_q, L_k):
    return torch.arange(L_q).view(-1, 1), torch.arange(L_k).view(1, -1)


def block_codes(dense, BM, BN):
    """``int8 [H, nrb, ncb]`` block codes of a ``[H, L_q, L_k]`` matrix, by loops over the
    in-range part of each block."""
    H, L_q, L_k = dense.shape
    nrb, ncb = math.ceil(L_q / BM), math.ceil(L_k / BN)
    out = torch.empty((H, nrb, ncb), dtype=torch.int8)
    for h in range(H):
        for r in range(nrb):
            for c in range(ncb):
                blk = dense[h, r * BM : (r + 1) * BM, c * BN : (c + 1) * BN]
                out[h, r, c] = 0 if not blk.any() else (2 if blk.all() else 1)
    return out


def padded_block(dense, h, r, c, BM, BN):
    out = torch.zeros(BM, BN, dtype=torch.bool)
    blk = dense[h, r * BM : (r + 1) * BM, c * BN : (c + 1) * BN]
    out[: blk.size(0), : blk.size(1)] = blk
    return out


def as3(dense):
    return dense.unsqueeze(0) if dense.dim() == 2 else dense


def attention64(q, k, v, allowed, scale):
    """Float64 softmax over the allowed keys; a row with no allowed key gives zeros."""
    q, k, v = (t.detach().double().cpu() for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(nan=0.0) @ v


# ----------------------------------------------------------------------------- one-mask head stacks
def test_a_head_stack_of_one_mask_is_that_mask():
    # stack_heads([m]) has num_heads = 1, which every consumer reads as a shared mask and
    # evaluates without a head index: dense(), the layout and the attention paths raised
    # "a per-head mask needs a head index"
    L = 13
    base = M.sliding_window(L, 2) & M.causal(L)
    one = M.stack_heads([base])
    assert one.num_heads == 1 and not one.is_per_head
    assert torch.equal(one.dense(), base.dense())
    assert torch.equal(one.block_map(16, 16), base.block_map(16, 16))
    assert torch.equal(BlockLayout.from_mask(one, 16, 16).dense(), base.dense())
    assert torch.equal(one.to_graph().to_dense().bool(), base.dense())
    q, k = grid(L, L)
    assert torch.equal(one.mask_mod(0, 0, q, k), base.dense())
    assert torch.equal((one | M.global_tokens(L, 1)).dense(), base.dense() | M.global_tokens(L, 1).dense())
    assert one.structure() == "general"
    assert M.stack_heads([M.causal(L)]).structure() == "causal"


# ----------------------------------------------------------------------------- unbounded arguments
BIG = [sys.maxsize, 2**63, 10**30]


@pytest.mark.parametrize("big", BIG)
def test_unbounded_windows_dilations_and_global_counts_follow_the_definition(big):
    # A window, dilation or number of global tokens past int64 (or whose product with the
    # dilation is) was compared with int64 index tensors: sliding_window(L, 2**63) and
    # dilated(L, sys.maxsize, 2) allowed nothing, dilated(L, 2, sys.maxsize) not even the
    # diagonal, global_tokens(L, 2**63) nothing, others raised OverflowError
    L = 11
    q, k = grid(L, L)
    diff = q - k
    cases = [
        (M.sliding_window(L, big), torch.ones(L, L, dtype=torch.bool)),
        (M.dilated(L, big, 2), diff % 2 == 0),
        (M.dilated(L, 2, big), diff == 0),  # |q - k| < L <= dilation: a multiple only at 0
        (M.dilated(L, big, big), diff == 0),
        (M.global_tokens(L, big), torch.ones(L, L, dtype=torch.bool)),
        (M.random_blocks(L, big, 1.0, 0), torch.ones(L, L, dtype=torch.bool)),
        (M.longformer(L, big, 0), torch.ones(L, L, dtype=torch.bool)),
        (M.bigbird(L, 0, big, big, 0.0, 0), torch.ones(L, L, dtype=torch.bool)),
        (M.dilated(L, 2, big) & M.causal(L), diff == 0),
    ]
    for mask, want in cases:
        assert torch.equal(mask.dense(), want), mask
        for BM, BN in ((16, 16), (4, 8)):
            assert torch.equal(as3(mask.block_map(BM, BN)), block_codes(as3(want), BM, BN)), (mask, BM, BN)
        assert torch.equal(BlockLayout.from_mask(mask, 16, 16).dense(), want), mask
        assert torch.equal(mask.to_graph().to_dense().bool(), want), mask
        assert torch.equal(mask.mask_mod(0, 0, q, k).expand(L, L), want), mask
        assert torch.equal(mask.mask_mod(0, 0, q.int(), k.int()).expand(L, L), want), mask  # FlexAttention's int32
        split = mask.dilation_split()
        if split is not None:  # the sub-sequence split is of the same mask
            d, base = split
            assert 2 <= d <= L
            expect = (diff % d == 0) & base.dense()[torch.div(q, d, rounding_mode="floor"),
                                                    torch.div(k, d, rounding_mode="floor")]
            assert torch.equal(expect, want), mask
    assert repr(M.sliding_window(L, big)) == f"SlidingWindow(L={L}, window={big})"


# ----------------------------------------------------------------------------- caches
@pytest.mark.parametrize("per_head", [False, True])
def test_a_block_map_handed_out_is_not_the_cache(per_head):
    # block_map returned (a view of) the block map cached on the mask, which the layouts
    # and the path decisions are built from: writing into it (say, to derive a custom
    # layout) silently changed the mask's layouts
    L = 40
    mask = M.stack_heads([M.causal(L), M.sliding_window(L, 3)]) if per_head else M.sliding_window(L, 3)
    want = mask.dense()
    got = mask.block_map(16, 16)
    got.fill_(M.FULL)
    assert torch.equal(as3(mask.block_map(16, 16)), block_codes(as3(want), 16, 16))
    assert torch.equal(BlockLayout.from_mask(mask, 16, 16).dense(), want)


def test_a_random_table_handed_out_is_not_the_mask_s():
    # RandomBlocks.table was the table the predicate reads, while the block map reads
    # prefix sums taken at construction: writing into it made dense() and the layouts
    # disagree (blocks missing from the layout)
    mask = M.random_blocks(40, 8, 0.3, 3)
    want = mask.dense()
    mask.table.fill_(True)
    assert torch.equal(mask.dense(), want)
    assert torch.equal(BlockLayout.from_mask(mask, 16, 16).dense(), want)


# ----------------------------------------------------------------------------- bad arguments
@pytest.mark.filterwarnings("ignore:Sparse CSC tensor support is in beta state")
def test_bad_arguments_name_the_argument():
    # a seed past what torch.Generator takes raised "Overflow when unpacking long long"
    with pytest.raises(ValueError, match="seed"):
        M.random_blocks(10, 2, 0.5, 2**64)
    with pytest.raises(ValueError, match="seed"):
        M.bigbird(10, 1, 1, 2, 0.5, 2**70)
    assert torch.equal(M.random_blocks(10, 2, 0.5, 2**64 - 1).dense(), M.random_blocks(10, 2, 0.5, 2**64 - 1).dense())
    # a CSC / BSR matrix was read as an edge_index ("L_q is required when graph is an edge_index tensor")
    dense = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    for matrix in (dense.to_sparse_csc(), dense.to_sparse_bsr((1, 1))):
        with pytest.raises(TypeError, match="graph.*COO or CSR"):
            M.from_graph(matrix)
    # a boolean tensor is no length (as a bool is not)
    with pytest.raises(TypeError, match="L must be an int"):
        M.causal(torch.tensor(True))
    with pytest.raises(TypeError, match="window must be an int"):
        M.sliding_window(5, torch.tensor(False))
    assert M.causal(torch.tensor(5)).L == 5
    # a head index tensor outside the heads (a negative one read the last head)
    per_head = M.from_dense(torch.rand(2, 5, 5, generator=torch.Generator().manual_seed(0)) < 0.5)
    stacked = M.stack_heads([M.causal(5), M.sliding_window(5, 1)])
    q, k = torch.tensor([3]), torch.tensor([1])
    for mask in (per_head, stacked):
        for bad in (torch.tensor(-1), torch.tensor([0, 2])):
            with pytest.raises(IndexError, match="head"):
                mask.allowed(q, k, head=bad)
        with pytest.raises(TypeError, match="head"):
            mask.allowed(q, k, head=torch.tensor(1.0))
        assert torch.equal(mask.allowed(q, k, head=torch.tensor([0, 1])), mask.dense()[:, 3, 1])
    with pytest.raises(TypeError, match="head must be an int"):
        M.causal(5).allowed(q, k, head=False)


# ----------------------------------------------------------------------------- definitions at the edges
def oracle(kind, L, p):
    """The documented ``allowed(q, k)`` of each constructor, from index grids."""
    q, k = grid(L, L)
    diff = q - k
    window = (diff.abs() <= p.get("window", 0)).expand(L, L)
    glob = ((q < p.get("num_global", 0)) | (k < p.get("num_global", 0))).expand(L, L)

    def rand(block, density, seed):
        n = -(-L // block)
        R = torch.rand((n, n), generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float64) < density
        return R[torch.div(q, block, rounding_mode="floor"), torch.div(k, block, rounding_mode="floor")]

    if kind == "causal":
        return (k <= q).expand(L, L)
    if kind == "window":
        return window
    if kind == "dilated":
        s = p["dilation"]
        return (diff.abs() <= p["window"] * s) & (diff % s == 0)
    if kind == "global":
        return glob
    if kind == "random":
        return rand(p["block"], p["density"], p["seed"])
    if kind == "longformer":
        return window | glob
    if kind == "bigbird":
        return window | glob | rand(p["random_block"], p["random_density"], p["seed"])
    raise AssertionError(kind)


def build(kind, L, p):
    return {"causal": M.causal, "window": M.sliding_window, "dilated": M.dilated, "global": M.global_tokens,
            "random": M.random_blocks, "longformer": M.longformer, "bigbird": M.bigbird}[kind](L, **p)


def edge_params(L):
    """Window / dilation / global / block arguments around the length: 0, 1, L - 1, L, L + 1."""
    around = sorted({0, 1, max(0, L - 1), L, L + 1})
    at_least_one = [v for v in around if v >= 1]
    density = st.sampled_from([0.0, 0.35, 1.0])
    return st.one_of(
        st.just(("causal", {})),
        st.builds(lambda w: ("window", {"window": w}), st.sampled_from(around)),
        st.builds(lambda w, s: ("dilated", {"window": w, "dilation": s}), st.sampled_from(around),
                  st.sampled_from(at_least_one + [2, 3])),
        st.builds(lambda g: ("global", {"num_global": g}), st.sampled_from(around)),
        st.builds(lambda b, d, s: ("random", {"block": b, "density": d, "seed": s}), st.sampled_from(at_least_one + [3]),
                  density, st.integers(0, 2**64 - 1)),
        st.builds(lambda w, g: ("longformer", {"window": w, "num_global": g}), st.sampled_from(around),
                  st.sampled_from(around)),
        st.builds(lambda w, g, b, d, s: ("bigbird", {"window": w, "num_global": g, "random_block": b,
                                                     "random_density": d, "seed": s}),
                  st.sampled_from(around), st.sampled_from(around), st.sampled_from(at_least_one), density,
                  st.integers(0, 1000)),
    )


@given(st.sampled_from([1, 2, 15, 16, 17, 31, 33]).flatmap(lambda L: st.tuples(st.just(L), edge_params(L))),
       st.sampled_from([(16, 16), (16, 32), (32, 16), (5, 3)]))
def test_every_constructor_is_its_definition_at_the_edges(case, block):
    L, (kind, p) = case
    BM, BN = block
    mask = build(kind, L, p)
    want = oracle(kind, L, p)
    assert mask.shape == (L, L) and mask.num_heads == 1
    assert torch.equal(mask.dense(), want), (kind, p)
    assert torch.equal(mask.block_map(BM, BN), block_codes(want[None], BM, BN)[0]), (kind, p)
    assert torch.equal(mask.to_graph().to_dense().bool(), want), (kind, p)
    q, k = grid(L, L)
    assert torch.equal(mask.mask_mod(0, 0, q, k).expand(L, L), want), (kind, p)
    split = mask.dilation_split()
    if split is not None:  # the documented sub-sequence form of the same mask
        d, base = split
        assert d >= 2 and base.shape == (-(-L // d), -(-L // d))
        expect = (q % d == k % d) & base.dense()[torch.div(q, d, rounding_mode="floor"),
                                                   torch.div(k, d, rounding_mode="floor")]
        assert torch.equal(expect, want), (kind, p)
    structure = mask.structure(block_size=(16, 16))
    expect_structure = ("full" if bool(want.all()) else
                        "causal" if L >= 2 and torch.equal(want, oracle("causal", L, {})) else "general")
    assert structure == expect_structure, (kind, p)


# ----------------------------------------------------------------------------- layouts cover exactly the mask
def spans(ptr):
    """``(head, i, start, end)`` of each row (column) ``i`` of a ``[H, n + 1]`` pointer of
    global offsets, checking that each head starts where the previous one ends."""
    H, n = ptr.size(0), ptr.size(1) - 1
    for h in range(H):
        assert int(ptr[h, 0]) == (int(ptr[h - 1, n]) if h else 0), h
        for i in range(n):
            yield h, i, int(ptr[h, i]), int(ptr[h, i + 1])


def check_layout(layout, want):
    """Every field of ``layout`` against the ``[H, L_q, L_k]`` matrix ``want``: exactly the
    non-empty blocks, full ones without a pattern, partial ones pointing at their padded
    slice, each distinct pattern stored once, the transposed index the same blocks by
    column, and the statistics."""
    H, L_q, L_k = want.shape
    BM, BN = layout.BM, layout.BN
    codes = block_codes(want, BM, BN)
    nrb, ncb = codes.shape[1:]
    assert (layout.L_q, layout.L_k, layout.num_heads, layout.nrb, layout.ncb) == (L_q, L_k, H, nrb, ncb)
    assert torch.equal(as3(layout.block_map()), codes)
    assert torch.equal(as3(layout.dense()), want)
    seen = []
    for h, r, start, end in spans(layout.row_ptr):
        cols = layout.col_idx[start:end].tolist()
        assert cols == [c for c in range(ncb) if codes[h, r, c] != 0], (h, r)
        for pos, c in zip(range(start, end), cols):
            seen.append((h, r, c, pos))
            pid = int(layout.pattern_id[pos])
            if codes[h, r, c] == 2:
                assert pid == -1, (h, r, c)
            else:
                assert 0 <= pid < layout.num_patterns
                assert torch.equal(layout.patterns[pid], padded_block(want, h, r, c, BM, BN)), (h, r, c)
    assert len(seen) == layout.nnzb == int((codes != 0).sum())
    position = {(h, r, c): pos for h, r, c, pos in seen}
    for h, c, start, end in spans(layout.col_ptr):
        rows = layout.row_idx[start:end].tolist()
        assert rows == [r for r in range(nrb) if codes[h, r, c] != 0], (h, c)
        assert layout.t_block[start:end].tolist() == [position[(h, r, c)] for r in rows], (h, c)
    distinct = {tuple(p.flatten().tolist()) for p in layout.patterns}
    assert len(distinct) == layout.num_patterns
    assert layout.num_full == int((codes == 2).sum()) and layout.num_partial == int((codes == 1).sum())
    assert layout.density == pytest.approx(want.double().mean().item(), abs=1e-12)
    assert layout.block_density == pytest.approx((codes != 0).double().mean().item(), abs=1e-12)
    assert layout.max_row_blocks == int((codes != 0).sum(2).max())
    assert layout.max_col_blocks == int((codes != 0).sum(1).max())
    for name in ("row_ptr", "col_idx", "pattern_id", "col_ptr", "row_idx", "t_block"):
        assert getattr(layout, name).dtype == torch.int32, name
    assert layout.patterns.dtype == torch.bool


@st.composite
def any_mask(draw):
    """A mask of any kind over ragged ``L_q x L_k`` (rows with no key, a whole empty or
    full matrix, per head, combined), with its expected ``[H, L_q, L_k]`` matrix."""
    L_q = draw(st.sampled_from([1, 5, 16, 17, 40]))
    L_k = draw(st.sampled_from([L_q, 1, 9, 33]))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["dense", "per_head", "graph", "structured", "union", "intersection", "stack"]))
    square = L_q == L_k
    if kind in ("structured", "stack") and not square:
        kind = "dense"

    def scattered(*shape):
        density = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
        dense = torch.rand(*shape, generator=gen) < density
        if draw(st.booleans()):
            dense[..., :: max(1, L_q // 3), :] = False  # rows with no key
        return dense

    def structured():
        L = L_q
        return draw(st.sampled_from([M.causal(L), M.sliding_window(L, 3), M.dilated(L, 2, 3), M.global_tokens(L, 2),
                                     M.random_blocks(L, 5, 0.4, seed), M.longformer(L, 1, 1),
                                     M.bigbird(L, 1, 1, 4, 0.3, seed), M.dilated(L, 1, 2) & M.causal(L)]))

    if kind == "dense":
        mask = M.from_dense(scattered(L_q, L_k))
    elif kind == "per_head":
        mask = M.from_dense(scattered(3, L_q, L_k))
    elif kind == "graph":
        E = draw(st.integers(0, 3 * L_q))
        edges = torch.stack([torch.randint(0, L_k, (E,), generator=gen), torch.randint(0, L_q, (E,), generator=gen)])
        mask = M.from_graph(edges, L_q, L_k)
    elif kind == "structured":
        mask = structured()
    elif kind == "stack":
        mask = M.stack_heads([structured(), M.from_dense(scattered(L_q, L_k))])
    else:
        a = M.from_dense(scattered(2, L_q, L_k)) if draw(st.booleans()) else M.from_dense(scattered(L_q, L_k))
        b = structured() if square else M.from_dense(scattered(L_q, L_k))
        mask = (a | b) if kind == "union" else (a & b)
    return mask


@given(any_mask(), st.sampled_from([(16, 16), (16, 32), (32, 16), (64, 16)]))
def test_a_layout_covers_exactly_the_mask(mask, block):
    want = as3(mask.dense())
    assert want.shape == (mask.num_heads, mask.L_q, mask.L_k)
    assert torch.equal(as3(mask.block_map(*block)), block_codes(want, *block))
    layout = BlockLayout.from_mask(mask, *block)
    check_layout(layout, want)
    # read back as a mask: the same predicate, block maps at other sizes, graph
    back = layout.to_mask()
    assert torch.equal(as3(back.dense()), want)
    assert torch.equal(as3(back.block_map(16, 16)), block_codes(want, 16, 16))
    check_layout(BlockLayout.from_mask(back, *block), want)
    g = mask.to_graph()
    H = mask.num_heads
    assert (g.num_src_nodes, g.num_dst_nodes) == (H * mask.L_k, H * mask.L_q)
    adjacency = g.to_dense().bool()
    for h in range(H):
        assert torch.equal(adjacency[h * mask.L_q : (h + 1) * mask.L_q, h * mask.L_k : (h + 1) * mask.L_k], want[h])
    assert int(adjacency.sum()) == int(want.sum())  # nothing off the heads' diagonal blocks


# ----------------------------------------------------------------------------- random masks and the global RNG
def test_random_masks_are_their_seed_s_and_leave_the_global_rng_alone():
    L, block, density = 45, 4, 0.4
    torch.manual_seed(1)
    state = torch.get_rng_state()
    masks = [M.random_blocks(L, block, density, 7), M.bigbird(L, 1, 2, block, density, 7)]
    for mask in masks:  # everything derived from them draws nothing either
        mask.dense(), mask.block_map(16, 16), mask.to_graph(), BlockLayout.from_mask(mask, 16, 16)
        sparse_attention(*(torch.randn(1, 1, L, 4, generator=torch.Generator().manual_seed(0)) for _ in range(3)),
                         mask, aggregation="element")
    assert torch.equal(torch.get_rng_state(), state), "building or using a random mask consumed the global RNG"
    torch.manual_seed(12345)  # the global seed does not enter
    again = M.random_blocks(L, block, density, 7)
    assert torch.equal(again.dense(), masks[0].dense())
    want = oracle("random", L, {"block": block, "density": density, "seed": 7})
    assert torch.equal(again.dense(), want) and torch.equal(again.table, want[::block, ::block])
    assert not torch.equal(M.random_blocks(L, block, density, 8).dense(), want)
    bigbird_random = masks[1].dense() & ~M.longformer(L, 1, 2).dense()
    assert torch.equal(bigbird_random, want & ~M.longformer(L, 1, 2).dense())
    if torch.cuda.is_available():  # drawn on the CPU: the same table on every device
        assert torch.equal(again.dense("cuda").cpu(), want)
        assert torch.equal(again.block_map(16, 16, "cuda").cpu(), again.block_map(16, 16))


# ----------------------------------------------------------------------------- reuse
def test_a_mask_reused_across_block_sizes_devices_and_dtypes_stays_right():
    L = 37
    gen = torch.Generator().manual_seed(5)
    mask = M.bigbird(L, 2, 1, 8, 0.3, 4) | M.from_dense(torch.rand(L, L, generator=gen) < 0.05)
    want = mask.dense()
    other = "meta" if DEVICE.type == "cpu" else DEVICE  # another device first (meta stands in on the CPU)
    assert mask.dense(other).shape == (L, L)
    for block in [(16, 16), (32, 16), (16, 64), (16, 16), (64, 64)]:
        assert torch.equal(mask.block_map(*block), block_codes(want[None], *block)[0]), block
        check_layout(BlockLayout.from_mask(mask, *block, device=DEVICE).to("cpu"), want[None])
    assert torch.equal(mask.dense(), want) and torch.equal(mask.to_graph().to_dense().bool(), want)
    q, k, v = (torch.randn(2, 3, L, 8, generator=gen) for _ in range(3))
    expect = attention64(q, k, v, want, 0.3)
    calls = [("block", torch.float32, (16, 16)), ("block", torch.float32, (32, 16)), ("block", torch.float16, (16, 16)),
             ("element", torch.float64, None), ("reference", torch.float32, None), ("dense", torch.float64, None),
             ("block", torch.float32, (16, 16)), ("vector", torch.float32, 16), ("vector", torch.float32, (32, 16))]
    for aggregation, dtype, block in calls:
        args = [t.to(DEVICE, dtype) for t in (q, k, v)]
        out = sparse_attention(*args, mask, aggregation=aggregation, block_size=block, scale=0.3)
        tol = 2e-3 if dtype == torch.float16 else 2e-5
        torch.testing.assert_close(out.cpu().double(), expect, rtol=tol, atol=tol,
                                   msg=lambda m: f"{aggregation} {dtype} {block}: {m}")


# ----------------------------------------------------------------------------- sparse_attention consumes them
def edge_attention_masks():
    gen = torch.Generator().manual_seed(11)
    L = 19
    no_key = torch.rand(2, 6, 23, generator=gen) < 0.3
    no_key[0, ::2] = False  # rows with no key, different per head
    return {
        "stack_of_one": M.stack_heads([M.sliding_window(L, 2) & M.causal(L)]),
        "window_0": M.sliding_window(L, 0),
        "window_past_L": M.sliding_window(L, L + 7),
        "dilated_past_L": M.dilated(L, 2, L + 4),  # only the diagonal; splits into L sub-sequences
        "dilated_window_0": M.dilated(L, 0, 3),
        "dilated_unbounded": M.dilated(L, sys.maxsize, 3) & M.causal(L),
        "every_token_global": M.global_tokens(L, L),
        "global_and_causal": M.global_tokens(L, L - 1) & (M.sliding_window(L, 0) | M.causal(L)),
        "nothing": M.causal(L) & M.from_dense(torch.zeros(L, L, dtype=torch.bool)),
        "one_query": M.from_dense(torch.rand(1, 30, generator=gen) < 0.5),
        "one_key": M.from_dense(torch.tensor([[True], [False], [True]] * 5)),
        "per_head_rectangular_empty_rows": M.from_dense(no_key),
        "layout_16x32": BlockLayout.from_mask(M.longformer(L, 1, 1) | M.random_blocks(L, 3, 0.2, 2), 16, 32),
        "per_head_layout": BlockLayout.from_mask(M.from_dense(no_key), 32, 16),
    }


EDGE_MASKS = edge_attention_masks()
EDGE_PATHS = ["reference", "element", "dense", "block", "vector"]


@pytest.mark.parametrize("aggregation", EDGE_PATHS)
@pytest.mark.parametrize("name", sorted(EDGE_MASKS))
def test_attention_under_edge_masks_is_the_masked_softmax(aggregation, name):
    mask = EDGE_MASKS[name]
    H = mask.num_heads if mask.num_heads > 1 else 2
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float32 if aggregation in ("block", "vector") else torch.float64
    D, D_v = 8, (8 if aggregation == "block" else 5)
    shapes = [(2, H, mask.L_q, D), (2, H, mask.L_k, D), (2, H, mask.L_k, D_v)]
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64).to(DEVICE, dtype).requires_grad_() for s in shapes)
    if isinstance(mask, BlockLayout):
        mask = mask.to(DEVICE)
    allowed = mask.dense()
    out = sparse_attention(q, k, v, mask, aggregation=aggregation, scale=0.7)
    assert out.shape == (2, H, mask.L_q, D_v) and out.dtype == dtype
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    q64, k64, v64 = leaves
    scores = (q64 @ k64.transpose(-1, -2) * 0.7).masked_fill(~allowed, float("-inf"))
    expect = torch.softmax(scores, -1).nan_to_num(nan=0.0) @ v64
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.detach().cpu().double(), expect, rtol=tol, atol=tol)
    empty_rows = ~as3(allowed).any(-1)  # [1 or H, L_q]: documented zeros, never NaN
    assert not out.detach()[:, empty_rows.expand(H, -1)].any()
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad.to(DEVICE, dtype))
    want = torch.autograd.grad(expect, leaves, grad)
    for label, g, w in zip("qkv", got, want):
        assert torch.isfinite(g).all(), label
        torch.testing.assert_close(g.cpu().double(), w, rtol=tol, atol=tol, msg=lambda m: f"d{label}: {m}")
