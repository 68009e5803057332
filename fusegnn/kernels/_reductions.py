r"""Column sums of tall, narrow matrices: the gradients of a bias or of an attention vector,

.. math::
    \frac{\partial \mathcal{L}}{\partial b_k} = \sum_{n=1}^{N} G_{nk}
    \qquad (G \in \mathbb{R}^{N \times K},\; N \gg K),

which the backward passes of the fused layers take over a node dimension (``N`` rows of
``K`` = 3-128 columns). torch's reduction over dimension 0 of such a matrix runs few,
long blocks; on CUDA :func:`column_sum` computes the same sums as one matrix-vector
product with a vector of ones, :math:`G^\top \mathbf{1}` (cuBLAS ``gemv``, which
accumulates in float32 for half inputs and never uses TF32). On an H100 (``N`` =
19,717: PubMed's nodes; ``benchmarks/NOTES-overhead.md``, session 16) it took 3.5-5.7 us
against 5.9-23.4 us for ``G.sum(0)`` at ``K`` = 3-128. Both are deterministic.

The ones come from a per-(device, dtype) vector that grows to the longest ``N`` seen and
is sliced; it is kept only when made outside a CUDA-graph capture (a tensor allocated
inside a capture belongs to that graph's memory pool), so the warm-up steps of
:func:`fusegnn.graphed_step` make it and the captured step reads it.

This module imports only ``torch``.
"""

from __future__ import annotations

import threading

import torch
from torch import Tensor

__all__ = ["column_sum"]

_GEMV_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_ones_lock = threading.Lock()
_ones_cache: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def column_sum(matrix: Tensor) -> Tensor:
    r"""``matrix.sum(0)`` for a 2-D ``matrix`` ``[N, K]``: ``[K]`` of its dtype
    (accumulated in float32 for half inputs). On a CUDA device a product
    :math:`G^\top \mathbf{1}` (module docstring); elsewhere, for other dtypes and for
    ``N = 0`` torch's reduction."""
    if matrix.dim() != 2:
        raise ValueError(f"column_sum takes a 2-D tensor, got shape {tuple(matrix.shape)}")
    rows = matrix.size(0)
    if matrix.device.type != "cuda" or matrix.dtype not in _GEMV_DTYPES or rows == 0 or matrix.size(1) == 0:
        return matrix.sum(0)
    return torch.mv(matrix.t(), _ones(rows, matrix.dtype, matrix.device))


def _ones(n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``n`` ones: a slice of the cached vector, or a fresh one (kept unless capturing)."""
    key = (device, dtype)
    ones = _ones_cache.get(key)
    if ones is not None and ones.numel() >= n:
        return ones[:n]
    fresh = torch.ones(n, dtype=dtype, device=device)
    if not torch.cuda.is_current_stream_capturing():
        with _ones_lock:
            held = _ones_cache.get(key)
            if held is None or held.numel() < n:
                _ones_cache[key] = fresh
    return fresh
