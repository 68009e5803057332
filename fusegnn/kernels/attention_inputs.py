"""The one check of attention inputs ``q``, ``k``, ``v`` (``[B, H, L, D]``, SDPA's layout)
and of the score ``scale``, shared by the block and vector kernels' entry points and
:func:`fusegnn.attention.sparse_attention`, which differ only in the dtypes they accept."""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real
from typing import Any

import torch
from torch import Tensor

__all__ = ["check_qkv", "check_scale", "dtype_names"]


def dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    """``"float16, bfloat16 or float32"`` for those dtypes, in order."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def check_qkv(q: Tensor, k: Tensor, v: Tensor, dtypes: Sequence[torch.dtype]) -> None:
    """``q [B, H, L_q, D]``, ``k [B, H, L_k, D]``, ``v [B, H, L_k, D_v]`` of one dtype out of
    ``dtypes``, on one device; a ``TypeError`` / ``ValueError`` naming the argument else."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, L, D] (SDPA layout), got shape {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must be {dtype_names(dtypes)}, got dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on the same device, got {q.device}, {k.device}, {v.device}")
    if q.shape[:2] != k.shape[:2] or q.shape[:2] != v.shape[:2]:
        raise ValueError(
            "q, k and v must have the same batch and head sizes [B, H, ...], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.size(-1) != k.size(-1):
        raise ValueError(f"q and k must have the same head dim D, got {q.size(-1)} and {k.size(-1)}")
    if k.size(2) != v.size(2):
        raise ValueError(f"k and v must have the same length L_k, got {k.size(2)} and {v.size(2)}")


def check_scale(scale: Any, head_dim: int) -> float:
    """``scale`` as a float: ``None`` is :math:`1/\\sqrt{D}` for ``head_dim`` ``D``; a
    ``TypeError`` / ``ValueError`` naming ``scale`` (or ``q``'s head dim, for a default
    scale of ``D = 0``) for anything else than a finite real number (``True`` is not one;
    NaN and infinities made every row NaN)."""
    if scale is None:
        if head_dim == 0:
            raise ValueError("q: head dim D is 0, so the default scale 1/sqrt(D) is undefined; pass scale=")
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):  # every score would be NaN or +-inf: NaN rows, silently
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)
