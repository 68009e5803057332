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
