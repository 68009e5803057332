"""``LinearCrossEntropy``: a classifier head that returns the loss, never the logits, in training."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.losses.checks import check_options
from fusegnn.losses.function import linear_cross_entropy

__all__ = ["LinearCrossEntropy"]


class LinearCrossEntropy(nn.Module):
    r"""A linear classifier fused with its cross-entropy loss.

    ``module(h, target, index=None)`` is
    ``F.cross_entropy(F.linear(h[index], weight, bias), target[index], ...)`` computed by
    :func:`fusegnn.losses.linear_cross_entropy` (no ``[M, C]`` logits in memory);
    :meth:`logits` gives the logits for evaluation. Parameters are initialised as
    ``nn.Linear``'s.
    """

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        bias: bool = True,
        *,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if in_features < 1 or num_classes < 1:
            raise ValueError(
                f"LinearCrossEntropy: in_features and num_classes must be >= 1, got {in_features}, {num_classes}"
            )
        check_options("LinearCrossEntropy", ignore_index, reduction, label_smoothing)
        self.in_features, self.num_classes = in_features, num_classes
        self.ignore_index, self.reduction, self.label_smoothing = int(ignore_index), reduction, float(label_smoothing)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_classes, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(num_classes, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, h: Tensor, target: Tensor, index: Tensor | None = None) -> Tensor:
        """The loss over the rows ``index`` of ``h`` (all rows when ``None``)."""
        return linear_cross_entropy(
            h, self.weight, target, self.bias, index=index, ignore_index=self.ignore_index,
            reduction=self.reduction, label_smoothing=self.label_smoothing,
        )

    def logits(self, h: Tensor) -> Tensor:
        """``F.linear(h, weight, bias)`` (evaluation)."""
        return F.linear(h, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, num_classes={self.num_classes}, bias={self.bias is not None}, "
                f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}")
