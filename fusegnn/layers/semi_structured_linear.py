r"""The 2:4 (semi-structured) inference form of a vector-sparse linear layer (issue #17)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.sparse import VectorSparse
from fusegnn.sparse.graph import type_name
from fusegnn.sparse.semi_structured import (
    SEMI_STRUCTURED_DTYPES,
    SemiStructuredLayout,
    semi_structured_layout,
    to_semi_structured,
    vector_pattern,
)

__all__ = ["SemiStructuredLinear"]


class SemiStructuredLinear(nn.Module):
    r""":math:`y = x W^\top + b` for a frozen vector-sparse ``W`` (``[out, in]``), run as
    torch's 2:4 matmul (``torch.sparse.to_sparse_semi_structured``: cuSPARSELt, or
    CUTLASS where cuSPARSELt is absent) with no value lost:

    .. math:: y = x[:, \mathrm{gather}]\; W_P^\top + b

    where the layout (:func:`~fusegnn.sparse.semi_structured.semi_structured_layout`,
    Jigsaw's column reordering) permutes and zero-pads ``W``'s input columns so that
    ``W_P`` (``[out, width]``) has at most 2 non-zeros in every 4 consecutive columns of
    a row. The forward is one ``index_select`` of ``x``'s columns and one 2:4 matmul.

    Usually built by :meth:`fusegnn.layers.VectorSparseLinear.to_semi_structured`. It is
    **opt-in**: nothing picks it automatically (whether it beats the dense or the
    ``vspmm`` product is the ``vector`` benchmark suite's ``cusparselt`` row to decide:
    ``python -m benchmarks.run --suite vector --backends fusegnn,cublas,cusparselt``).

    **Inference only.** ``to_sparse_semi_structured`` keeps no transposed copy of the
    weight (its ``packed_t`` is ``None``), so torch has no 2:4 kernel for
    :math:`\partial x = \partial y\, W_P`; the forward refuses inputs that require grad
    (run it under ``torch.no_grad()`` / ``torch.inference_mode()``). The weight is built
    on its device and cannot be moved (torch's 2:4 tensors move to the CPU only, as dense), nor
    cast: ``.half()`` and the like leave the layer in its ``dtype``, bias included.

    Args:
        weight: the vector-sparse weight ``[out, in]`` (CUDA).
        bias: ``[out]`` or ``None``.
        dtype: float16 or bfloat16 (default: ``weight``'s; float32 raises).
        align, window: as :func:`~fusegnn.sparse.semi_structured.semi_structured_layout`'s.

    Shapes: ``x`` ``[..., in]`` (``dtype``) -> ``[..., out]``.
    """

    def __init__(self, weight: VectorSparse, bias: Tensor | None = None, *, dtype: torch.dtype | None = None,
                 align: int = 64, window: int = 1024) -> None:
        super().__init__()
        if not isinstance(weight, VectorSparse):
            raise TypeError(f"weight must be a VectorSparse, got {type_name(weight)}")
        dtype = dtype or weight.dtype
        if dtype not in SEMI_STRUCTURED_DTYPES:
            raise TypeError(f"the 2:4 form runs in float16 or bfloat16 (torch's semi-structured matmul), "
                            f"got dtype {dtype}: pass dtype=torch.bfloat16")
        self.out_features, self.in_features = weight.shape
        if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (self.out_features,)):
            raise ValueError(f"bias must be a tensor of shape ({self.out_features},) or None")
        self.layout: SemiStructuredLayout = semi_structured_layout(vector_pattern(weight), align=align, window=window)
        permuted = self.layout.permute_weight(weight.to_dense().detach().to(dtype))
        self.weight_2_4 = to_semi_structured(permuted)
        self.register_buffer("gather", self.layout.gather)
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype).clone())
        self.dtype = dtype

    def _apply(self, fn, recurse: bool = True):
        """``Module.half()`` / ``.float()`` / ``.to(dtype)`` would cast the bias but cannot
        cast torch's 2:4 weight (an attribute, and not convertible): the bias is kept in
        the layer's ``dtype``, so the output's dtype never changes behind the user's back
        (a float16 bias on a bfloat16 layer gave float32 outputs)."""
        super()._apply(fn, recurse)
        if self.bias is not None and self.bias.dtype != self.dtype:
            self.bias = self.bias.to(self.dtype)
        return self

    @property
    def width(self) -> int:
        """The widened input dimension of the 2:4 weight."""
        return self.layout.width

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) or x.size(-1) != self.in_features:
            raise ValueError(f"x must have {self.in_features} features in its last axis, "
                             f"got {tuple(x.shape) if isinstance(x, Tensor) else type_name(x)}")
        if x.dtype != self.dtype:
            raise TypeError(f"x must be {self.dtype} like the 2:4 weight, got dtype {x.dtype}")
        if x.device != self.weight_2_4.device or self.gather.device != self.weight_2_4.device:
            raise ValueError(
                f"x is on {x.device} and the column index on {self.gather.device}, but the 2:4 weight lives on "
                f"{self.weight_2_4.device} (torch's 2:4 tensors cannot move between devices: build the layer "
                "where it runs)"
            )
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("SemiStructuredLinear is inference only: torch's 2:4 weight has no transposed copy "
                               "for dx; call it under torch.no_grad() or on x.detach()")
        lead = x.shape[:-1]
        x_perm = x.reshape(-1, self.in_features).index_select(1, self.gather)
        y = F.linear(x_perm, self.weight_2_4)[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, width={self.width} "
                f"(widening {self.layout.widening:.3f}), dtype={self.dtype}, bias={self.bias is not None}")
