"""Small dense boolean masks and block layouts for the attention tests.

:func:`dense_masks` draws ``[heads, L_q, L_k]`` masks by name (tiny L only);
:func:`make_layout` turns one into a ``BlockLayout``-compatible object. Until
``fusegnn.sparse.block_layout`` exists, :func:`layout_from_dense` builds it here with plain
loops (an independent oracle of the contract in the issue: forward block-CSR per head with
global offsets, ``pattern_id == -1`` for full blocks, patterns deduplicated by content,
transposed index with ``t_block`` pointing at forward block ids).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

__all__ = ["dense_masks", "layout_from_dense", "make_layout"]


def dense_masks(name: str, L_q: int, L_k: int, heads: int = 1, seed: int = 0) -> torch.Tensor:
    """``[heads, L_q, L_k]`` bool. ``causal``: k <= q; ``window``: |q - k| <= 5;
    ``random_blocks``: 16 x 16 blocks kept with probability 0.4, within them every
    element; ``random``: elements kept with probability 0.3 (hence partial blocks and some
    empty rows); ``empty_rows``: causal with rows 0, 7, 20 .. 31 emptied (a whole empty
    block row at L >= 32); ``bigbird``: 4 global tokens, window 3, random 16-blocks."""
    gen = torch.Generator().manual_seed(seed)
    qi = torch.arange(L_q)[:, None]
    ki = torch.arange(L_k)[None, :]
    out = []
    for _ in range(heads):
        if name == "causal":
            m = ki <= qi
        elif name == "window":
            m = (qi - ki).abs() <= 5
        elif name == "random_blocks":
            blocks = torch.rand(-(-L_q // 16), -(-L_k // 16), generator=gen) < 0.4
            m = blocks.repeat_interleave(16, 0).repeat_interleave(16, 1)[:L_q, :L_k]
        elif name == "random":
            m = torch.rand(L_q, L_k, generator=gen) < 0.3
        elif name == "empty_rows":
            m = (ki <= qi).clone()
            m[[0, 7]] = False
            m[20:32] = False
        elif name == "bigbird":
            blocks = torch.rand(-(-L_q // 16), -(-L_k // 16), generator=gen) < 0.15
            rnd = blocks.repeat_interleave(16, 0).repeat_interleave(16, 1)[:L_q, :L_k]
            m = (qi < 4) | (ki < 4) | ((qi - ki).abs() <= 3) | rnd
        else:
            raise ValueError(f"unknown mask {name!r}")
        out.append(m.expand(L_q, L_k))
    return torch.stack(out).contiguous()


def layout_from_dense(mask: torch.Tensor, BM: int, BN: int, device="cpu") -> SimpleNamespace:
    """A BlockLayout-compatible namespace from a ``[H_l, L_q, L_k]`` bool mask."""
    if mask.dim() == 2:
        mask = mask[None]
    Hl, L_q, L_k = mask.shape
    nrb, ncb = -(-L_q // BM), -(-L_k // BN)
    pad = torch.zeros(Hl, nrb * BM, ncb * BN, dtype=torch.bool)
    pad[:, :L_q, :L_k] = mask
    blocks = pad.view(Hl, nrb, BM, ncb, BN).permute(0, 1, 3, 2, 4)
    valid = torch.zeros(nrb * BM, ncb * BN, dtype=torch.bool)
    valid[:L_q, :L_k] = True
    valid_blocks = valid.view(nrb, BM, ncb, BN).permute(0, 2, 1, 3)
    row_ptr, col_idx, pattern_id, patterns, seen = [], [], [], [], {}
    entries = []  # (head, col block, row block, forward id)
    for h in range(Hl):
        ptr = [len(col_idx)]
        for r in range(nrb):
            for c in range(ncb):
                blk = blocks[h, r, c]
                if not blk.any():
                    continue
                entries.append((h, c, r, len(col_idx)))
                col_idx.append(c)
                if torch.equal(blk, valid_blocks[r, c]):
                    pattern_id.append(-1)
                else:
                    key = blk.numpy().tobytes()
                    if key not in seen:
                        seen[key] = len(patterns)
                        patterns.append(blk.clone())
                    pattern_id.append(seen[key])
            ptr.append(len(col_idx))
        row_ptr.append(ptr)
    entries.sort()
    col_ptr, row_idx, t_block = [], [], []
    for h in range(Hl):
        ptr = [len(row_idx)]
        for c in range(ncb):
            for hh, cc, r, t in entries:
                if hh == h and cc == c:
                    row_idx.append(r)
                    t_block.append(t)
            ptr.append(len(row_idx))
        col_ptr.append(ptr)

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=device)

    nnz = mask.sum().item()
    return SimpleNamespace(
        L_q=L_q, L_k=L_k, BM=BM, BN=BN, num_heads=Hl, nrb=nrb, ncb=ncb,
        row_ptr=i32(row_ptr), col_idx=i32(col_idx), pattern_id=i32(pattern_id),
        patterns=(torch.stack(patterns) if patterns else torch.zeros(0, BM, BN, dtype=torch.bool)).to(device),
        col_ptr=i32(col_ptr), row_idx=i32(row_idx), t_block=i32(t_block),
        density=nnz / max(Hl * L_q * L_k, 1), block_density=len(col_idx) / max(Hl * nrb * ncb, 1),
        num_full=pattern_id.count(-1), num_partial=len(pattern_id) - pattern_id.count(-1),
    )


def make_layout(mask: torch.Tensor, BM: int, BN: int, device="cpu"):
    """The layout of ``mask`` (``[H_l, L_q, L_k]``) at ``BM x BN`` on ``device``."""
    return layout_from_dense(mask, BM, BN, device)
