"""Fused losses: loss epilogues that never write the logits (thesis ch. 6, EVT).

* :func:`linear_cross_entropy` -- ``F.cross_entropy(F.linear(h[index], W, b), y[index])``
  with the logits only in chunks (:mod:`fusegnn.kernels.linear_cross_entropy`);
* :class:`LinearCrossEntropy` -- the ``nn.Module`` holding ``W`` and ``b``;
* :func:`linear_cross_entropy_reference` -- the PyTorch definition both must match.

Modules: :mod:`~fusegnn.losses.function` (the public function, its dispatch and the eager
autograd Function), :mod:`~fusegnn.losses.library` (the custom ops ``torch.compile``
records), :mod:`~fusegnn.losses.passes` (the kernel passes both run),
:mod:`~fusegnn.losses.checks`, :mod:`~fusegnn.losses.module`,
:mod:`~fusegnn.losses.target_memo`.
"""

from fusegnn.losses.function import FusedLinearCrossEntropy, linear_cross_entropy
from fusegnn.losses.module import LinearCrossEntropy
from fusegnn.kernels.linear_cross_entropy import linear_cross_entropy_reference

__all__ = [
    "FusedLinearCrossEntropy",
    "LinearCrossEntropy",
    "linear_cross_entropy",
    "linear_cross_entropy_reference",
]
