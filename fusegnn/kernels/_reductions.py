r"""Column sums of tall, narrow matrices: the gradients of a bias or of an attention vector,

.. math::
    \frac{\partial \mathcal{L}}{\partial b_k} = \sum_{n=1}^{N} G_{nk}
    \qquad (G \in \mathbb{R}^{N \times K},\; N \gg K),

which the backward passes of the fused layers take over a node dimension (``N`` rows of
``K`` = 3-128 columns). torch's reduction over dimension 0 of such a matrix runs few,
long blocks; on CUDA :func:`column_sum` computes the same sums of a float32 / float64
matrix as one matrix-vector product with a vector of ones, :math:`G^\top \mathbf{1}`
(cuBLAS ``gemv``, which never uses TF32). On an H100 (``N`` = 19,717: PubMed's nodes;
``benchmarks/NOTES-overhead.md``, session 16) it took 4.6-6.7 us with the ones made per
call, against 5.9-23.4 us for ``G.sum(0)`` at ``K`` = 3-128.

The ones are made per call (one fill): a kept vector would be read at a fixed address by
every CUDA graph captured with it, and freeing or outgrowing it would corrupt their
replays. Half-precision matrices keep torch's reduction, which accumulates in float32
(a half ``gemv`` may reduce in half precision: ``allow_fp16_reduced_precision_reduction``),
and so does ``torch.use_deterministic_algorithms(True)`` (cuBLAS then needs
``CUBLAS_WORKSPACE_CONFIG``; the reduction does not). Both forms are deterministic.

This module imports only ``torch``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["column_sum"]

_GEMV_DTYPES = (torch.float32, torch.float64)


def column_sum(matrix: Tensor) -> Tensor:
    r"""``matrix.sum(0)`` for a 2-D ``matrix`` ``[N, K]``: ``[K]``. For a float32 / float64
    ``matrix`` on a CUDA device the product :math:`G^\top \mathbf{1}` (module docstring),
    of the same dtype; otherwise torch's reduction, as ``matrix.sum(0)`` returns it."""
    if matrix.dim() != 2:
        raise ValueError(f"column_sum takes a 2-D tensor, got shape {tuple(matrix.shape)}")
    rows = matrix.size(0)
    if (matrix.device.type != "cuda" or matrix.dtype not in _GEMV_DTYPES or rows == 0 or matrix.size(1) == 0
            or torch.are_deterministic_algorithms_enabled()):
        return matrix.sum(0)
    return torch.mv(matrix.t(), matrix.new_ones(rows))
