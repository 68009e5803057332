r"""Dynamic N:M sparsity of attention scores (DFSS): which scores take part in the softmax.

For every query row :math:`i`, the keys are cut into groups of ``M`` consecutive
positions aligned to multiples of ``M`` in absolute key index
(:math:`G_g = \{gM, \dots, gM + M - 1\}`); within each group only the ``N`` largest
*allowed* scores are kept:

.. math::
    \mathrm{rank}_{ij} = \#\{j' \in G(j) \setminus \{j\} : A_{ij'} \wedge
        (S_{ij'} > S_{ij} \vee (S_{ij'} = S_{ij} \wedge j' < j))\}, \qquad
    \mathrm{keep}_{ij} = A_{ij} \wedge \mathrm{rank}_{ij} < N

with :math:`A` the mask and :math:`S` the scaled scores: ties go to the lower key index,
a score outside the mask is never kept nor counted, and a group with fewer than ``N``
allowed scores keeps all of them. A length ``L_k`` that is not a multiple of ``M``
leaves a partial last group: its missing (padding) keys count as masked. The softmax
then runs over the kept scores only (a row with no allowed key gives zeros).

The fused kernel (:mod:`fusegnn.kernels.block_attention`, ``nm=``) applies the same rule
to each score tile; :func:`nm_keep` is its pure-PyTorch reference (used in float64 by
the tests and by :func:`fusegnn.attention.sparse_attention.masked_attention_reference`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["NM_PATTERNS", "check_nm", "nm_keep"]

#: the supported ``(N, M)``: 1:2, 2:4 and 4:8 (DFSS's patterns; half the scores kept)
NM_PATTERNS = ((1, 2), (2, 4), (4, 8))


def check_nm(nm: Any) -> tuple[int, int] | None:
    """``nm`` as an ``(N, M)`` pair of :data:`NM_PATTERNS`, or ``None`` (no N:M);
    anything else raises an error naming ``nm``. Accepts a pair or ``"N:M"``."""
    if nm is None:
        return None
    if isinstance(nm, str):
        parts = nm.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"nm must be None, a pair (N, M) or 'N:M', got {nm!r}")
        nm = (int(parts[0]), int(parts[1]))
    if not isinstance(nm, (tuple, list)) or len(nm) != 2:
        raise TypeError(f"nm must be None, a pair (N, M) or 'N:M', got {type(nm).__name__} {nm!r}")
    n, m = nm
    if any(isinstance(x, bool) or not isinstance(x, int) for x in (n, m)):
        raise TypeError(f"nm must hold two ints (N, M), got {nm!r}")
    if (n, m) not in NM_PATTERNS:
        reason = f"N must be < M; got N = {n} >= M = {m}" if n >= m else f"got {n}:{m}"
        raise ValueError(
            f"nm must be one of {', '.join(f'{a}:{b}' for a, b in NM_PATTERNS)} (N of every M keys kept); {reason}"
        )
    return n, m


def nm_keep(scores: Tensor, allowed: Tensor, n: int, m: int) -> Tensor:
    """Boolean ``keep`` of the module docstring's rule, shaped like ``scores``
    (``[..., L_q, L_k]``; ``allowed`` broadcasts to it). Compares in ``scores``' dtype
    (float64 for the reference); not differentiable (the selection is piecewise constant)."""
    scores = scores.detach()
    allowed = allowed.expand(scores.shape)
    L_k = scores.size(-1)
    pad = (-L_k) % m  # the partial last group's padding keys: masked
    s = F.pad(scores, (0, pad)).unflatten(-1, (-1, m))  # [..., groups, m]
    a = F.pad(allowed, (0, pad), value=False).unflatten(-1, (-1, m))
    # rank of each key in its group = how many allowed keys of the group beat it (a larger
    # score, or an equal one at a lower index); one pass per "other" key keeps the
    # temporaries [..., g, m] instead of materialising all m x m comparisons
    idx = torch.arange(m, device=scores.device)
    beaten_by = torch.zeros(s.shape, dtype=torch.int8, device=scores.device)
    for j in range(m):
        other, other_ok = s[..., j : j + 1], a[..., j : j + 1]
        beaten_by += other_ok & ((other > s) | ((other == s) & (idx > j)))
    keep = a & (beaten_by < n)
    return keep.flatten(-2)[..., :L_k]
