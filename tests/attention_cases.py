"""Inputs shared by the attention tests: q / k / v and a catalogue of masks of every kind
(empty rows, per-head stacks, graph masks with isolated queries)."""

from __future__ import annotations

import torch

from fusegnn.attention import masks as M


def qkv(B, H, L_q, L_k, D, D_v=None, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(B, H, L_q, D), (B, H, L_k, D), (B, H, L_k, D_v or D)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


def with_empty_rows(L_q, L_k, seed, every=4):
    gen = torch.Generator().manual_seed(seed)
    dense = torch.rand(L_q, L_k, generator=gen) < 0.3
    dense[::every] = False
    return M.from_dense(dense)


def mask_cases(L):
    gen = torch.Generator().manual_seed(L)
    isolated = torch.randint(0, L, (2, 2 * L), generator=gen)
    isolated = isolated[:, isolated[1] % 3 != 0]  # queries 0, 3, 6, ... have no key
    return {
        "causal": M.causal(L),
        "window": M.sliding_window(L, 2),
        "dilated": M.dilated(L, 2, 3),
        "global": M.global_tokens(L, 2),
        "random": M.random_blocks(L, 4, 0.3, 1),
        "longformer": M.longformer(L, 1, 2),
        "bigbird": M.bigbird(L, 1, 1, 4, 0.2, 0),
        "full": M.sliding_window(L, L),
        "causal_window": M.causal(L) & M.sliding_window(L, 3),
        "dense_empty_rows": with_empty_rows(L, L, L),
        "graph_isolated": M.from_graph(isolated, L),
        "intersection_empty": M.causal(L) & M.from_dense(torch.zeros(L, L, dtype=torch.bool)),
        "per_head": M.stack_heads([M.causal(L), M.sliding_window(L, 1), with_empty_rows(L, L, 1)]),
        "per_head_causal": M.stack_heads([M.causal(L)] * 3),
    }
