r"""The vector path of :func:`~fusegnn.attention.sparse_attention.sparse_attention`
(``aggregation="vector"``): a mask's query windows with compacted key columns, built
once per mask and run by :mod:`fusegnn.kernels.vector_attention`.

* :func:`vector_sizes` -- ``(W, BLOCK_N)`` from ``sparse_attention``'s ``block_size``
  argument: ``None`` for the defaults (:data:`~fusegnn.kernels.vector_attention.DEFAULT_WINDOW`
  queries per window, :data:`~fusegnn.kernels.vector_attention.DEFAULT_BLOCK_N`
  compacted columns per step), an int for ``W`` (with the default ``BLOCK_N``), or a pair
  ``(W, BLOCK_N)``;
* :func:`vector_structure` -- the mask's
  :class:`~fusegnn.kernels.vector_attention.VectorAttentionStructure` on a device, built
  from the mask's allowed elements (:meth:`~fusegnn.attention.masks.Mask.allowed_elements`,
  not cached: only the structure is) with torch ops on that device and cached on the mask
  per (``W``, device), like the block path's layouts;
* :func:`vector_path` -- the attention itself.

The auto rule of :func:`~fusegnn.attention.sparse_attention.sparse_attention` weighs this
path by the structure's compacted entries (:mod:`fusegnn.attention.cost_model`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fusegnn.attention.masks import Mask

__all__ = ["keep_vector_structure", "vector_path", "vector_sizes", "vector_structure"]


def vector_sizes(block_size: Any) -> tuple[int, int]:
    """``(W, BLOCK_N)`` of the vector path for ``sparse_attention``'s ``block_size``
    (``None``, ``W`` or ``(W, BLOCK_N)``); a ``ValueError`` / ``TypeError`` naming
    ``block_size`` for anything else."""
    from fusegnn.kernels.vector_attention import DEFAULT_BLOCK_N, DEFAULT_WINDOW, check_vector_sizes

    if block_size is None:
        return DEFAULT_WINDOW, DEFAULT_BLOCK_N
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"block_size must be W or a pair (W, BLOCK_N) for aggregation='vector', got {block_size!r}")
        return check_vector_sizes(*block_size)
    return check_vector_sizes(block_size, DEFAULT_BLOCK_N)


def vector_structure(mask: Mask, W: int, device: torch.device, *, keep: bool = True):
    """The :class:`~fusegnn.kernels.vector_attention.VectorAttentionStructure` of
    ``mask`` with windows of ``W`` on ``device``, cached on the mask (``keep=False``: a
    structure not cached yet is built and returned without being cached -- the auto rule
    counts its entries and keeps it only if it picks the vector path, through
    :func:`keep_vector_structure`)."""
    from fusegnn.kernels.vector_attention import build_structure

    def build():
        # the triples, not mask.to_graph(): that graph is cached on the mask, and at issue
        # sizes (L = 16384, 8 heads, 5 %: 10^8 elements) it would keep gigabytes alive
        # next to the structure, which is all this path reads
        head, query, key = mask.allowed_elements(device=device)
        return build_structure(head, query, key, mask.L_q, mask.L_k, mask.num_heads, W)

    return mask.cached(("vector_structure", W, device), build, keep=keep)


def keep_vector_structure(mask: Mask, structure, device: torch.device) -> None:
    """Cache ``structure`` (``vector_structure(mask, structure.W, device, keep=False)``)
    on ``mask``, where :func:`vector_structure` and :func:`vector_path` find it."""
    mask.cached(("vector_structure", structure.W, device), lambda: structure)


def vector_path(q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float, sizes: tuple[int, int]) -> Tensor:
    """``sparse_attention(..., aggregation="vector")`` after its checks."""
    from fusegnn.kernels.vector_attention import vector_sparse_attention

    W, block_n = sizes
    return vector_sparse_attention(q, k, v, vector_structure(mask, W, q.device), scale, block_n=block_n)
