"""Attention masks (:mod:`fusegnn.attention.masks`) against their written definitions.

* ``dense()`` of every constructor equals its docstring formula, written here
  independently with index grids;
* ``block_map`` (analytic for structured masks, derived for combinations) equals the
  block codes counted from the dense matrix, for many ``(L, BM, BN)`` including odd
  ``L``, ``BM != BN``, blocks larger than ``L`` and non-power-of-two blocks, and the
  ragged-edge rule (a block is full iff every in-range element is allowed);
* ``block_elements`` is the padded dense slice; ``mask_mod`` is the same predicate
  (directly and through FlexAttention's ``create_block_mask``); ``to_graph`` has exactly
  the allowed pairs as edges ``k -> q`` sorted by query;
* union / intersection, per-head masks, seeded random blocks, graph masks, bad input.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fusegnn.sparse import Graph
from fusegnn.attention import masks as M

CUDA = torch.cuda.is_available()


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------- oracles
def grid(L_q, L_k):
    return torch.arange(L_q).view(-1, 1), torch.arange(L_k).view(1, -1)


def oracle_random_table(L, block, density, seed):
    n = math.ceil(L / block)
    gen = torch.Generator().manual_seed(seed)
    return torch.rand((n, n), generator=gen, dtype=torch.float64) < density


def oracle(kind, L, **p):
    q, k = grid(L, L)
    if kind == "causal":
        return (k <= q).expand(L, L)
    if kind == "window":
        return (q - k).abs() <= p["window"]
    if kind == "dilated":
        d = q - k
        return (d.abs() <= p["window"] * p["dilation"]) & (torch.remainder(d, p["dilation"]) == 0)
    if kind == "global":
        return (q < p["num_global"]) | (k < p["num_global"])
    if kind == "random":
        R = oracle_random_table(L, p["block"], p["density"], p["seed"])
        out = torch.zeros(L, L, dtype=torch.bool)
        for i in range(L):
            for j in range(L):
                out[i, j] = R[i // p["block"], j // p["block"]]
        return out
    raise AssertionError(kind)


def dense_block_map(dense, BM, BN):
    """Block codes counted from a dense [L_q, L_k] (or [H, L_q, L_k]) matrix by loops."""
    squeeze = dense.dim() == 2
    d3 = dense.unsqueeze(0) if squeeze else dense
    H, L_q, L_k = d3.shape
    nrb, ncb = math.ceil(L_q / BM), math.ceil(L_k / BN)
    out = torch.empty((H, nrb, ncb), dtype=torch.int8)
    for h, i, j in itertools.product(range(H), range(nrb), range(ncb)):
        blk = d3[h, i * BM : (i + 1) * BM, j * BN : (j + 1) * BN]  # in-range part only
        out[h, i, j] = 0 if not blk.any() else (2 if blk.all() else 1)
    return out[0] if squeeze else out


def make(kind, L, **p):
    ctor = {
        "causal": M.causal,
        "window": M.sliding_window,
        "dilated": M.dilated,
        "global": M.global_tokens,
        "random": M.random_blocks,
    }[kind]
    return ctor(L, **p)


ATOMIC_CASES = [
    ("causal", {}),
    ("window", {"window": 0}),
    ("window", {"window": 3}),
    ("window", {"window": 20}),
    ("window", {"window": 200}),
    ("dilated", {"window": 2, "dilation": 1}),
    ("dilated", {"window": 3, "dilation": 4}),
    ("dilated", {"window": 5, "dilation": 7}),
    ("dilated", {"window": 0, "dilation": 3}),
    ("global", {"num_global": 0}),
    ("global", {"num_global": 3}),
    ("global", {"num_global": 17}),
    ("random", {"block": 8, "density": 0.3, "seed": 1}),
    ("random", {"block": 5, "density": 0.5, "seed": 2}),
    ("random", {"block": 16, "density": 0.4, "seed": 3}),
    ("random", {"block": 1, "density": 0.2, "seed": 4}),
    ("random", {"block": 40, "density": 0.7, "seed": 5}),
]
LENGTHS = [1, 7, 16, 33, 64, 70]
BLOCKS = [(16, 16), (16, 32), (32, 16), (64, 64), (3, 5), (1, 1), (128, 16)]


# ----------------------------------------------------------------------------- definitions
@pytest.mark.parametrize("kind,params", ATOMIC_CASES, ids=lambda x: str(x))
def test_dense_matches_definition(kind, params):
    for L in (1, 7, 33, 41):
        assert torch.equal(make(kind, L, **params).dense(), oracle(kind, L, **params)), L


@pytest.mark.parametrize("kind,params", ATOMIC_CASES, ids=lambda x: str(x))
def test_block_map_matches_dense(kind, params):
    for L in LENGTHS:
        mask = make(kind, L, **params)
        dense = mask.dense()
        for BM, BN in BLOCKS:
            got = mask.block_map(BM, BN)
            assert got.dtype == torch.int8
            assert torch.equal(got, dense_block_map(dense, BM, BN)), (L, BM, BN)


def test_ragged_edge_block_can_be_full():
    # L = 17 at 16 x 16: the last block row holds one in-range row (query 16); under a
    # causal mask its block (1, 0) has every in-range element allowed -> full.
    # Block (1, 1) is the single element (16, 16), allowed (k <= q) -> full as well.
    bmap = M.causal(17).block_map(16, 16)
    assert bmap.tolist() == [[M.PARTIAL, M.EMPTY], [M.FULL, M.FULL]]
    assert M.causal(18).block_map(16, 16).tolist() == [[M.PARTIAL, M.EMPTY], [M.FULL, M.PARTIAL]]
    assert M.sliding_window(17, 0).block_map(16, 16)[1, 1] == M.FULL
    assert M.global_tokens(17, 16).block_map(16, 16).tolist() == [[M.FULL, M.FULL], [M.FULL, M.EMPTY]]


@given(
    L=st.integers(1, 80),
    BM=st.sampled_from([1, 2, 5, 16, 32]),
    BN=st.sampled_from([1, 3, 16, 64]),
    window=st.integers(0, 40),
    dilation=st.integers(1, 6),
    num_global=st.integers(0, 30),
)
def test_block_map_property(L, BM, BN, window, dilation, num_global):
    for mask in (
        M.sliding_window(L, window),
        M.dilated(L, window, dilation),
        M.global_tokens(L, num_global),
        M.causal(L),
        M.longformer(L, window, num_global),
    ):
        assert torch.equal(mask.block_map(BM, BN), dense_block_map(mask.dense(), BM, BN)), mask


def test_compound_definitions():
    L = 45
    lf = M.longformer(L, 4, 3)
    assert torch.equal(lf.dense(), oracle("window", L, window=4) | oracle("global", L, num_global=3))
    bb = M.bigbird(L, 4, 3, 8, 0.2, 7)
    expect = (
        oracle("window", L, window=4)
        | oracle("global", L, num_global=3)
        | oracle("random", L, block=8, density=0.2, seed=7)
    )
    assert torch.equal(bb.dense(), expect)
    for BM, BN in [(16, 16), (16, 32), (32, 16), (8, 8), (5, 3)]:
        assert torch.equal(bb.block_map(BM, BN), dense_block_map(expect, BM, BN))
        assert torch.equal(lf.block_map(BM, BN), dense_block_map(lf.dense(), BM, BN))
    assert "BigBird" in repr(bb) and "Longformer" in repr(lf)


def test_dilated_one_is_sliding_window():
    for L, w in [(30, 3), (17, 0), (64, 20)]:
        assert torch.equal(M.dilated(L, w, 1).dense(), M.sliding_window(L, w).dense())
        assert torch.equal(M.dilated(L, w, 1).block_map(16, 16), M.sliding_window(L, w).block_map(16, 16))


def _split_dense(d, base, L_q, L_k):
    """The mask a ``dilation_split`` ``(d, base)`` stands for, materialised."""
    q = torch.arange(L_q).view(-1, 1)
    k = torch.arange(L_k).view(1, -1)
    return (q % d == k % d) & base.dense()[q // d, k // d]


@given(
    L=st.integers(1, 70),
    window=st.integers(0, 12),
    dilation=st.integers(1, 5),
    other=st.sampled_from(["none", "causal", "window", "dilated", "union", "global"]),
)
def test_dilation_split_property(L, window, dilation, other):
    """A dilated window (alone, or intersected with masks that depend on q - k only)
    splits into ``dilation`` sub-sequences carrying one base mask: exactly the same
    predicate. Unions and global tokens do not split."""
    mask = M.dilated(L, window, dilation)
    if other == "causal":
        mask = mask & M.causal(L)
    elif other == "window":
        mask = M.sliding_window(L, 7) & mask
    elif other == "dilated":
        mask = mask & M.dilated(L, 3, 2)
    elif other == "union":
        mask = mask | M.causal(L)
    elif other == "global":
        mask = mask & M.global_tokens(L, 4)
    split = mask.dilation_split()
    if dilation == 1 or other in ("union", "global") or (other == "dilated" and dilation % 2):
        assert split is None
        return
    d, base = split
    assert d == dilation and base.shape == (-(-L // d), -(-L // d))
    assert torch.equal(_split_dense(d, base, L, L), mask.dense())
    assert mask.dilation_split() is split  # cached


def test_dilation_split_of_masks_that_do_not_split():
    for mask in (M.causal(20), M.sliding_window(20, 3), M.bigbird(20, 2, 2, 4, 0.3, 0), M.dilated(20, 3, 1)):
        assert mask.dilation_split() is None


def test_dilated_block_of_one_element_can_be_full():
    # L = 17, 16 x 16 blocks: block (1, 1) is the single element (16, 16), q - k = 0
    assert M.dilated(17, 2, 3).block_map(16, 16)[1, 1] == M.FULL


# ----------------------------------------------------------------------------- random blocks
def test_random_blocks_seeded_and_reproducible():
    a, b = M.random_blocks(100, 8, 0.3, 11), M.random_blocks(100, 8, 0.3, 11)
    assert torch.equal(a.dense(), b.dense())
    assert torch.equal(a.table, oracle_random_table(100, 8, 0.3, 11))
    assert not torch.equal(a.dense(), M.random_blocks(100, 8, 0.3, 12).dense())
    state = torch.get_rng_state()
    M.random_blocks(100, 8, 0.3, 13)
    assert torch.equal(state, torch.get_rng_state()), "must not touch the global RNG"
    assert not M.random_blocks(50, 4, 0.0, 0).dense().any()
    assert M.random_blocks(50, 4, 1.0, 0).dense().all()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here)")
def test_random_blocks_same_on_gpu():
    mask = M.bigbird(300, 5, 4, 16, 0.2, 3)
    assert torch.equal(mask.dense("cuda").cpu(), mask.dense())
    assert torch.equal(mask.block_map(32, 64, device="cuda").cpu(), mask.block_map(32, 64))


# ----------------------------------------------------------------------------- elements
def test_block_elements_are_padded_dense_slices():
    masks = [M.causal(37), M.dilated(37, 3, 2), M.bigbird(37, 2, 3, 5, 0.3, 0), M.from_dense(torch.rand(37, 29) < 0.4)]
    for mask, (BM, BN) in itertools.product(masks, [(16, 16), (16, 32), (32, 16)]):
        dense = mask.dense()
        nrb, ncb = mask.num_blocks(BM, BN)
        for rb, cb in itertools.product(range(nrb), range(ncb)):
            expect = torch.zeros(BM, BN, dtype=torch.bool)
            blk = dense[rb * BM : (rb + 1) * BM, cb * BN : (cb + 1) * BN]
            expect[: blk.size(0), : blk.size(1)] = blk
            assert torch.equal(mask.block_elements(rb, cb, BM, BN), expect)
    with pytest.raises(IndexError, match="outside"):
        M.causal(37).block_elements(3, 0, 16, 16)


def test_allowed_public_predicate():
    mask = M.sliding_window(10, 2)
    assert mask.allowed(torch.tensor([0, 5]), torch.tensor([2, 8])).tolist() == [True, False]
    with pytest.raises(IndexError, match="q_idx"):
        mask.allowed(torch.tensor([10]), torch.tensor([0]))
    with pytest.raises(TypeError, match="k_idx"):
        mask.allowed(torch.tensor([1]), torch.tensor([0.5]))


# ----------------------------------------------------------------------------- combining
def test_union_of_partials_can_be_full_and_intersection_empty():
    L = 32
    low = M.causal(L)  # k <= q
    up = M.from_dense(~low.dense())  # k > q
    union, inter = low | up, low & up
    assert union.dense().all() and not inter.dense().any()
    # diagonal blocks are partial in both parts: element evaluation decides
    assert (union.block_map(16, 16) == M.FULL).all()
    assert (inter.block_map(16, 16) == M.EMPTY).all()


@pytest.mark.parametrize("L", [16, 33, 50])
def test_union_intersection_block_maps(L):
    parts = [
        M.causal(L),
        M.sliding_window(L, 3),
        M.dilated(L, 4, 3),
        M.global_tokens(L, 2),
        M.random_blocks(L, 6, 0.4, 1),
        M.from_dense(torch.rand(L, L, generator=torch.Generator().manual_seed(L)) < 0.5),
    ]
    for a, b in itertools.combinations(parts, 2):
        for combined, expect in ((a | b, a.dense() | b.dense()), (a & b, a.dense() & b.dense())):
            assert torch.equal(combined.dense(), expect)
            for BM, BN in [(16, 16), (16, 32), (4, 8)]:
                assert torch.equal(combined.block_map(BM, BN), dense_block_map(expect, BM, BN)), (a, b, BM, BN)
    triple = (parts[0] | parts[1]) & (parts[3] | parts[4] | parts[5])
    expect = (parts[0].dense() | parts[1].dense()) & (parts[3].dense() | parts[4].dense() | parts[5].dense())
    assert torch.equal(triple.dense(), expect)
    assert torch.equal(triple.block_map(16, 16), dense_block_map(expect, 16, 16))
    assert len((parts[3] | parts[4] | parts[5]).parts) == 3  # nested unions are flattened


def test_combine_errors():
    with pytest.raises(ValueError, match="cannot combine a 10 x 10 mask with a 11 x 11"):
        M.causal(10) | M.causal(11)
    with pytest.raises(TypeError, match="Mask"):
        M.causal(10) | torch.ones(10, 10, dtype=torch.bool)
    two = M.stack_heads([M.causal(10)] * 2)
    three = M.stack_heads([M.causal(10)] * 3)
    with pytest.raises(ValueError, match="heads"):
        two & three


# ----------------------------------------------------------------------------- per head
def test_per_head_masks():
    L = 37
    heads = [M.causal(L), M.sliding_window(L, 2), M.global_tokens(L, 3)]
    stacked = M.stack_heads(heads)
    assert stacked.num_heads == 3 and stacked.is_per_head
    dense = stacked.dense()
    assert dense.shape == (3, L, L)
    for h, m in enumerate(heads):
        assert torch.equal(dense[h], m.dense())
        assert torch.equal(stacked.block_elements(1, 2, 16, 16, head=h), m.block_elements(1, 2, 16, 16))
    for BM, BN in [(16, 16), (32, 16)]:
        assert torch.equal(stacked.block_map(BM, BN), dense_block_map(dense, BM, BN))
    # from a 3-D dense tensor, and combined with a shared mask
    per = M.from_dense(dense)
    assert per.num_heads == 3 and torch.equal(per.dense(), dense)
    mixed = per | M.dilated(L, 2, 5)
    assert mixed.num_heads == 3
    expect = dense | M.dilated(L, 2, 5).dense()
    assert torch.equal(mixed.dense(), expect)
    assert torch.equal(mixed.block_map(16, 16), dense_block_map(expect, 16, 16))
    with pytest.raises(ValueError, match="pass head="):
        stacked.block_elements(0, 0, 16, 16)
    with pytest.raises(IndexError, match="head 3 out of range"):
        stacked.block_elements(0, 0, 16, 16, head=3)
    with pytest.raises(ValueError, match="itself per-head"):
        M.stack_heads([stacked])
    with pytest.raises(ValueError, match="masks\\[1\\] is 36 x 36"):
        M.stack_heads([M.causal(37), M.causal(36)])
    with pytest.raises(TypeError, match="sequence"):
        M.stack_heads(M.causal(3))


# ----------------------------------------------------------------------------- mask_mod
def _all_kinds(L):
    gen = torch.Generator().manual_seed(0)
    return [
        M.causal(L),
        M.sliding_window(L, 5),
        M.dilated(L, 3, 4),
        M.global_tokens(L, 5),
        M.random_blocks(L, 8, 0.3, 1),
        M.longformer(L, 4, 3),
        M.bigbird(L, 4, 3, 8, 0.2, 0),
        M.from_dense(torch.rand(L, L, generator=gen) < 0.2),
        M.from_graph(torch.randint(0, L, (2, 3 * L), generator=gen), L),
        M.stack_heads([M.causal(L), M.sliding_window(L, 3)]),
    ]


def test_mask_mod_is_the_predicate():
    L = 37
    q, k = grid(L, L)
    for mask in _all_kinds(L):
        if mask.num_heads == 1:
            got = mask.mask_mod(0, 0, q, k)
        else:
            got = torch.stack([mask.mask_mod(0, torch.tensor(h), q, k) for h in range(mask.num_heads)])
        assert torch.equal(got.expand_as(mask.dense()), mask.dense()), mask


def test_mask_mod_with_flex_create_block_mask():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    L, B = 64, 16  # a multiple of the block: FlexAttention pads ragged blocks with False
    for mask in _all_kinds(L):
        H = mask.num_heads
        bm = flex.create_block_mask(mask.mask_mod, None, H, L, L, device="cpu", BLOCK_SIZE=B)
        ours = mask.block_map(B, B)
        ours = ours.unsqueeze(0) if H == 1 else ours
        # kv_num_blocks counts the partial blocks, full_kv_num_blocks the full ones
        assert torch.equal(bm.kv_num_blocks[0].long(), (ours == M.PARTIAL).sum(-1)), mask
        assert torch.equal(bm.full_kv_num_blocks[0].long(), (ours == M.FULL).sum(-1)), mask


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention needs a CUDA device (none here)")
@pytest.mark.parametrize("L_q,L_k", [(1000, 1000), (200, 333)])
def test_mask_mod_in_compiled_flex_attention_at_ragged_lengths(L_q, L_k):
    """The table-reading masks' mask_mod (no index clamps) in compiled FlexAttention at
    lengths that are no multiple of its block: forward and gradients equal SDPA with the
    boolean mask (FlexAttention keeps the indices it passes in range)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(1)
    # (a from_graph mask's predicate is a searchsorted, which compiled FlexAttention cannot lower)
    tables = [M.from_dense(torch.rand(L_q, L_k, generator=gen) < 0.05)]
    if L_q == L_k:
        tables += [M.random_blocks(L_q, 64, 0.3, 2), M.bigbird(L_q, 16, 4, 64, 0.2, 3),
                   M.stack_heads([M.from_dense(torch.rand(L_q, L_k, generator=gen) < 0.1), M.causal(L_q)])]
    attend = torch.compile(flex.flex_attention, dynamic=False)
    for mask in tables:
        H = 2
        q, k, v, g = (torch.randn(1, H, n, 32, device="cuda", generator=torch.Generator(device="cuda").manual_seed(i))
                      for i, n in enumerate((L_q, L_k, L_k, L_q)))
        bm = flex.create_block_mask(mask.mask_mod, None, mask.num_heads if mask.num_heads > 1 else None, L_q, L_k,
                                    device="cuda")
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*ins, block_mask=bm)
        out.backward(g)
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        keep = mask.dense("cuda")
        keep = keep.unsqueeze(0) if keep.dim() == 2 else keep  # [1 or H, L_q, L_k]
        has_key = keep.any(-1)  # rows without a key: every key inside SDPA, then zeros (FlexAttention's zeros)
        ref = F.scaled_dot_product_attention(*ref_in, attn_mask=keep | ~has_key.unsqueeze(-1))
        ref = torch.where(has_key.unsqueeze(-1), ref, torch.zeros_like(ref))
        ref.backward(g)
        rows = has_key.expand(1, H, L_q)
        torch.testing.assert_close(out[rows], ref[rows], rtol=2e-3, atol=2e-3)
        for a, b in zip((t.grad for t in ins), (t.grad for t in ref_in)):
            torch.testing.assert_close(a, b, rtol=5e-3, atol=5e-3)


# ----------------------------------------------------------------------------- graphs
def test_to_graph_edges_are_the_allowed_pairs():
    for L in (1, 37, 70):
        for mask in _all_kinds(L) + [M.causal(L) & M.from_dense(torch.zeros(L, L, dtype=torch.bool))]:
            if mask.num_heads > 1:
                continue
            g = mask.to_graph()
            assert isinstance(g, Graph) and (g.num_src_nodes, g.num_dst_nodes) == (L, L)
            assert torch.equal(g.to_dense().bool(), mask.dense())
            assert g.to_dense().max() <= 1  # no duplicate edges
            key = g.dst * L + g.src
            assert bool((key[1:] > key[:-1]).all()), "edges sorted by query then key"
            assert mask.to_graph() is g  # cached


def test_to_graph_per_head_stacks_heads():
    L = 21
    heads = [M.causal(L), M.sliding_window(L, 1), M.from_dense(torch.zeros(L, L, dtype=torch.bool))]
    mask = M.stack_heads(heads)
    g = mask.to_graph()
    assert (g.num_src_nodes, g.num_dst_nodes) == (3 * L, 3 * L)
    dense = g.to_dense().bool()
    for h, m in enumerate(heads):
        assert torch.equal(dense[h * L : (h + 1) * L, h * L : (h + 1) * L], m.dense())
        assert torch.equal(mask.to_graph(head=h).to_dense().bool(), m.dense())
    off_diagonal = dense.clone()
    for h in range(3):
        off_diagonal[h * L : (h + 1) * L, h * L : (h + 1) * L] = False
    assert not off_diagonal.any()


def test_from_graph_inputs():
    L_q, L_k = 9, 6
    ei = torch.tensor([[0, 5, 5, 2, 0], [1, 8, 8, 0, 1]])  # duplicates count once
    expect = torch.zeros(L_q, L_k, dtype=torch.bool)
    expect[ei[1], ei[0]] = True
    from_ei = M.from_graph(ei, L_q, L_k)
    from_g = M.from_graph(Graph(ei, (L_k, L_q)))
    sparse = torch.sparse_coo_tensor(torch.stack([ei[1], ei[0]]), torch.ones(5), (L_q, L_k), check_invariants=True).coalesce()
    for mask in (from_ei, from_g, M.from_graph(sparse), M.from_graph(sparse.to_sparse_csr())):
        assert mask.shape == (L_q, L_k)
        assert torch.equal(mask.dense(), expect)
        assert torch.equal(mask.block_map(16, 16), dense_block_map(expect, 16, 16))
        assert torch.equal(mask.block_map(2, 4), dense_block_map(expect, 2, 4))
        assert torch.equal(mask.to_graph().to_dense().bool(), expect)
    assert from_ei.num_allowed == 3
    empty = M.from_graph(torch.empty(2, 0, dtype=torch.int64), 5)
    assert not empty.dense().any() and (empty.block_map(16, 16) == M.EMPTY).all()
    with pytest.raises(ValueError, match="L_q is required"):
        M.from_graph(ei)
    with pytest.raises(ValueError, match="L_q=10 but the graph has 9"):
        M.from_graph(Graph(ei, (L_k, L_q)), L_q=10)
    with pytest.raises(IndexError, match="target node id 8"):
        M.from_graph(ei, 8, 6)
    with pytest.raises(TypeError, match="graph must be"):
        M.from_graph([[0, 1], [1, 0]], 2)


def test_from_dense_copies_and_validates():
    t = torch.rand(5, 7) < 0.5
    mask = M.from_dense(t)
    before = mask.dense()
    t.fill_(True)
    assert torch.equal(mask.dense(), before), "later changes to the input must not leak"
    with pytest.raises(TypeError, match="bool tensor"):
        M.from_dense(torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"\[L_q, L_k\] or \[H, L_q, L_k\]"):
        M.from_dense(torch.ones(3, dtype=torch.bool))


# ----------------------------------------------------------------------------- bad input
def test_constructor_validation():
    with pytest.raises(ValueError, match="L must be >= 1"):
        M.causal(0)
    with pytest.raises(TypeError, match="L must be an int"):
        M.causal(3.0)
    with pytest.raises(ValueError, match="window must be >= 0"):
        M.sliding_window(5, -1)
    with pytest.raises(ValueError, match="dilation must be >= 1"):
        M.dilated(5, 1, 0)
    with pytest.raises(ValueError, match="num_global must be >= 0"):
        M.global_tokens(5, -2)
    with pytest.raises(ValueError, match="density must lie in"):
        M.random_blocks(5, 2, 1.5, 0)
    with pytest.raises(TypeError, match="density must be a float"):
        M.random_blocks(5, 2, True, 0)
    with pytest.raises(ValueError, match="block must be >= 1"):
        M.random_blocks(5, 0, 0.5, 0)
    with pytest.raises(TypeError, match="seed must be an int"):
        M.bigbird(5, 1, 1, 2, 0.5, "x")
    with pytest.raises(ValueError, match="BM must be >= 1"):
        M.causal(5).block_map(0, 16)
