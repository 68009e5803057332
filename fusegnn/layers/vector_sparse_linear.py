r"""A linear layer whose weight is vector-sparse (VecSparse, thesis ch.3), trained sparse."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.layers.semi_structured_linear import SemiStructuredLinear
from fusegnn.sparse import VectorSparse, prefers_dense, vspmm
from fusegnn.sparse.graph import type_name
from fusegnn.sparse.vector_library import BACKENDS

__all__ = ["VectorSparseLinear"]


class VectorSparseLinear(nn.Module):
    r""":math:`y = x W^\top + b` with :math:`W` (``[out_features, in_features]``) kept
    vector-sparse: ``nn.Linear``'s initial weight, magnitude-pruned once to ``sparsity``
    in vectors of ``V`` consecutive output rows
    (:meth:`~fusegnn.sparse.VectorSparse.prune`); only the kept vectors are parameters
    (``values`` ``[nnz_v, V]``), the pattern is fixed.

    The forward runs :math:`y^\top = W x^\top` as :func:`~fusegnn.sparse.vspmm` (every
    gathered row of :math:`x^\top` reused by ``V`` outputs on tensor cores); its backward
    gives :math:`\partial x^\top = W^\top \partial y^\top` through the transposed pattern
    and :math:`\partial W = \partial y^\top x` sampled at :math:`W`'s pattern
    (``vsddmm``), never a dense weight gradient.

    **Dense fallback.** Where :func:`~fusegnn.sparse.prefers_dense` says a dense GEMM
    is cheaper (``backend="auto"``, a weight of at least 2^22 entries and more than
    ``V / 512`` of them stored: every pruned transformer-sized layer), the forward is
    ``F.linear`` on the densified weight and the backward two dense GEMMs, the weight's
    gradient gathered at the pattern: same values, the dense layer's speed. On an H100
    (bf16, 4096 x 16384, 90 % sparse, V = 8) the sparse kernels took 3.8 ms forward and
    47 ms backward against cuBLAS's 1.6 and 2.8 ms.

    Args:
        in_features, out_features: as ``nn.Linear``'s.
        sparsity: fraction of ``V``-vectors pruned, in ``[0, 1)``.
        V: vector length (2, 4, 8 or 16).
        bias: learn an additive bias.
        backend: ``"auto"``, ``"triton"`` or ``"reference"`` (see :mod:`fusegnn.sparse.vector_ops`).

    Shapes: ``x`` ``[..., in_features]`` -> ``[..., out_features]``.

    **2:4 form.** :meth:`to_semi_structured` gives the frozen layer as a
    :class:`~fusegnn.layers.SemiStructuredLinear` (the weight's input columns reordered,
    Jigsaw-style, into an exact 2:4 matrix for torch's cuSPARSELt / CUTLASS matmul;
    inference only). It is opt-in: no ``backend`` value, ``"auto"`` included, ever runs
    it; the ``vector`` benchmark suite's ``cusparselt`` row times exactly that form
    against ``cublas`` and ``fusegnn``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        sparsity: float,
        V: int = 8,
        bias: bool = True,
        *,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        _check_backend(backend)
        self.in_features, self.out_features = in_features, out_features
        self.sparsity, self.backend = sparsity, backend
        dense = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        pattern = VectorSparse.prune(dense.weight.detach(), sparsity, V)
        self.V = pattern.V
        self.register_buffer("row_ptr", pattern.row_ptr)
        self.register_buffer("col_idx", pattern.col_idx)
        self.values = nn.Parameter(pattern.values)
        self.bias = dense.bias
        self._pattern: tuple[tuple, VectorSparse] | None = None

    def pattern(self) -> VectorSparse:
        """The weight's structure (with its cached transpose index) holding ``values``."""
        key = (self.row_ptr.data_ptr(), self.col_idx.data_ptr(), self.row_ptr.device)
        if self._pattern is None or self._pattern[0] != key:
            structure = VectorSparse(self.row_ptr, self.col_idx, self.values.detach(),
                                     (self.out_features, self.in_features), validate=False)
            if torch.compiler.is_compiling():
                # no sort traced: the compiled op computes the transpose index in one custom op
                return structure.with_values(self.values)
            structure.index()
            self._pattern = (key, structure)
        return self._pattern[1].with_values(self.values)

    def reset_parameters(self) -> None:
        r"""Draw the kept weights and the bias afresh as ``nn.Linear.reset_parameters``
        draws a dense layer's (each uniform in :math:`\pm 1 / \sqrt{\text{in\_features}}`),
        keeping the pattern; the padding rows of a partial last row group stay 0."""
        bound = 1.0 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.values.uniform_(-bound, bound)
            if self.out_features % self.V:
                rows = self.pattern().vector_groups().unsqueeze(1) * self.V + torch.arange(
                    self.V, device=self.values.device)
                self.values.masked_fill_(rows >= self.out_features, 0.0)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # ``load_state_dict`` copies ``row_ptr`` / ``col_idx`` into the buffers in place (same
        # addresses), so the cached structure and its transpose index would describe the old
        # pattern: drop them.
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._pattern = None

    def dense_weight(self) -> Tensor:
        """The weight as a dense ``[out_features, in_features]`` matrix (differentiable)."""
        return self.pattern().to_dense()

    def to_semi_structured(self, dtype: torch.dtype | None = None, *, window: int = 1024) -> SemiStructuredLinear:
        """The frozen layer as a 2:4 :class:`~fusegnn.layers.SemiStructuredLinear` (same
        outputs up to rounding; CUDA, ``dtype`` float16 / bfloat16, default the layer's;
        ``window``: the layout search's, see
        :func:`~fusegnn.sparse.semi_structured.semi_structured_layout`)."""
        return SemiStructuredLinear(self.pattern(), self.bias, dtype=dtype, window=window)

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type_name(x)}")
        if x.dim() == 0 or x.size(-1) != self.in_features:
            raise ValueError(f"x must have {self.in_features} features in its last axis, got shape {tuple(x.shape)}")
        if x.dtype != self.values.dtype:
            raise TypeError(f"x has dtype {x.dtype} but the layer's weight is {self.values.dtype} "
                            f"(convert one: x.to({self.values.dtype}) or layer.to({x.dtype}))")
        if x.device != self.values.device:
            raise ValueError(f"x is on {x.device} but the layer is on {self.values.device}")
        pattern = self.pattern()
        if prefers_dense(pattern, backend=self.backend):
            return F.linear(x, pattern.to_dense(), self.bias)
        lead = x.shape[:-1]
        xt = x.reshape(-1, self.in_features).t().contiguous()  # [in, T]: rows gathered by column index
        yt = vspmm(pattern, xt, backend=self.backend)  # [out, T]
        y = yt.t()
        if self.bias is not None:
            y = y + self.bias
        return y.contiguous().reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        density = self.values.numel() / max(self.in_features * self.out_features, 1)
        return (f"in_features={self.in_features}, out_features={self.out_features}, V={self.V}, "
                f"sparsity={self.sparsity}, density={density:.3f}, bias={self.bias is not None}")

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, sparsity: float, V: int = 8, *, backend: str = "auto"
    ) -> "VectorSparseLinear":
        r"""A trained ``linear`` made vector-sparse: its weight magnitude-pruned to
        ``sparsity`` in ``V``-vectors (:meth:`~fusegnn.sparse.VectorSparse.prune`), the kept
        vectors holding the trained values, its bias copied; on ``linear``'s device and
        dtype. The result computes :math:`x (W \odot M)^\top + b` with :math:`M` the kept
        vectors' mask; ``linear`` itself is left unchanged (the parameters are copies)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        _check_backend(backend)
        pattern = VectorSparse.prune(linear.weight, sparsity, V)
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = linear.in_features, linear.out_features
        layer.sparsity, layer.backend, layer.V = sparsity, backend, pattern.V
        layer.register_buffer("row_ptr", pattern.row_ptr)
        layer.register_buffer("col_idx", pattern.col_idx)
        layer.values = nn.Parameter(pattern.values)
        layer.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())
        layer._pattern = None
        return layer


def _check_backend(backend: object) -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
