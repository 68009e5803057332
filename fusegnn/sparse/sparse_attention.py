r"""Masked (sparse) scaled dot-product attention on the shared sparse core.

For a batch ``b``, head ``h`` and query ``i``, with :math:`N(i)` the keys query ``i`` may
attend to under the mask (head ``h``'s mask for a per-head mask):

.. math::
    s_{ij} = \mathrm{scale}\cdot q_i \cdot k_j, \qquad
    \alpha_{ij} = \frac{\exp s_{ij}}{\sum_{j' \in N(i)} \exp s_{ij'}}, \qquad
    \mathrm{out}_i = \sum_{j \in N(i)} \alpha_{ij}\, v_j,

and :math:`\mathrm{out}_i = 0` when :math:`N(i)` is empty (never NaN). ``scale``
defaults to :math:`1/\sqrt{D}`. Tensors follow SDPA's layout: ``q`` ``[B, H, L_q, D]``,
``k`` ``[B, H, L_k, D]``, ``v`` ``[B, H, L_k, D_v]``.

Three implementations (``aggregation=``):

* ``"reference"`` -- dense masked softmax in PyTorch over the ``L_q x L_k`` boolean
  mask (the oracle; any device and dtype; memory ``O(B H L_q L_k)``);
* ``"element"`` -- the element-level path on the GNN core: the mask becomes a graph with
  edges ``k -> q`` (:meth:`~fusegnn.sparse.masks.Mask.to_graph`), then exactly the ops
  GAT runs on, :func:`~fusegnn.sparse.sddmm` (``"dot"``) ``->``
  :func:`~fusegnn.sparse.edge_softmax` ``->`` :func:`~fusegnn.sparse.spmm`, with the
  ``B * H`` (batch, head) pairs as the ops' heads (for a per-head mask, the heads'
  graphs are stacked block-diagonally and the batch is the ops' head axis). The inner
  ops dispatch by ``element_aggregation`` (``"auto"``, ``"gas"``, ``"gar"``,
  ``"reference"``), so the same fused kernels serve GAT and attention. Memory and work
  ``O(B H nnz)``; for masks too irregular for blocks;
* ``"block"`` -- the fused block-sparse FlashAttention-style Triton kernel of
  :mod:`fusegnn.kernels.block_attention` over a :class:`BlockLayout`;
* ``"auto"`` -- ``"reference"`` off CUDA; on CUDA ``"block"``, except ``"element"``
  when the block kernel is not available or when the allowed elements fill less than
  :data:`ELEMENT_MAX_FILL` of the non-empty blocks (a very irregular mask, where blocks
  would compute mostly masked-out scores).

The mask is a :class:`~fusegnn.sparse.masks.Mask` or a prebuilt
:class:`~fusegnn.sparse.block_layout.BlockLayout`. Layouts built from a mask are cached
on the mask per (block size, device), graphs per device, so a mask reused across calls
is processed once.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, Callable

import torch
from torch import Tensor

from fusegnn.sparse.block_layout import BlockLayout, check_block_size
from fusegnn.sparse.dispatch import AGGREGATIONS as _ELEMENT_AGGREGATIONS
from fusegnn.sparse.dispatch import Decision
from fusegnn.sparse.masks import Mask
from fusegnn.sparse.ops import edge_softmax, sddmm, spmm

__all__ = [
    "ATTENTION_AGGREGATIONS",
    "ELEMENT_MAX_FILL",
    "sparse_attention",
    "masked_attention_reference",
    "explain_attention",
    "default_block_size",
]

ATTENTION_AGGREGATIONS = ("auto", "block", "element", "reference")

# "auto" on CUDA takes the element path when allowed elements fill less than this
# fraction of the non-empty blocks' BM x BN elements. Calibrated on an NVIDIA H200
# (benchmarks/attention_calibrate.py, 2026-11-21, B=4, H=12, D=64, bf16; results in
# benchmarks/results/attention/calibration-nvidia-h200.json): the element path won only
# on a random graph mask at fill 0.001-0.004 (L=4096, 16384); the block path won at fill
# 0.016 (same mask, L=1024) and above, by 4-50x on the structured masks.
ELEMENT_MAX_FILL = 0.01

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ----------------------------------------------------------------------------- checks
def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, L, D] (SDPA layout), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got dtype {t.dtype}")
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


def _check_mask(mask: Any, q: Tensor, k: Tensor) -> None:
    if not isinstance(mask, (Mask, BlockLayout)):
        raise TypeError(
            "mask must be a fusegnn.sparse.masks.Mask or a fusegnn.sparse.BlockLayout, "
            f"got {type(mask).__name__}"
        )
    if (q.size(2), k.size(2)) != (mask.L_q, mask.L_k):
        raise ValueError(
            f"the mask is {mask.L_q} x {mask.L_k} (L_q x L_k) but q has L_q = {q.size(2)} "
            f"and k has L_k = {k.size(2)}"
        )
    if mask.num_heads not in (1, q.size(1)):
        raise ValueError(
            f"the mask has {mask.num_heads} heads but q has H = {q.size(1)}; "
            "a mask must be shared (1 head) or have one mask per head"
        )


def _check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    return float(scale)


def _as_block_size(block_size: Any) -> tuple[int, int] | None:
    if block_size is None:
        return None
    if isinstance(block_size, (tuple, list)):
        if len(block_size) != 2:
            raise ValueError(f"block_size must be an int or a pair (BM, BN), got {block_size!r}")
        return check_block_size(*block_size)
    return check_block_size(block_size, block_size)


def default_block_size(L_q: int, L_k: int) -> tuple[int, int]:
    """``(BM, BN)`` used when none is given: 64 x 64, shrunk to the next power of two
    >= 16 of a shorter sequence (so tiny sequences do not pad to 64)."""

    def pick(L: int) -> int:
        return max(16, min(64, 1 << max(0, (L - 1).bit_length())))

    return pick(L_q), pick(L_k)


# ----------------------------------------------------------------------------- layouts
def _mask_of(mask: Mask | BlockLayout) -> Mask:
    return mask.to_mask() if isinstance(mask, BlockLayout) else mask


def _layout_of(
    mask: Mask | BlockLayout, block_size: tuple[int, int] | None, device: torch.device
) -> BlockLayout:
    if isinstance(mask, BlockLayout):
        if block_size is not None and block_size != (mask.BM, mask.BN):
            raise ValueError(
                f"block_size={block_size} but the layout given is {mask.BM} x {mask.BN}; "
                "leave block_size=None or build another layout"
            )
        if mask.device != device:
            raise ValueError(
                f"the layout is on {mask.device} but q is on {device}; move it with layout.to(device)"
            )
        return mask
    BM, BN = block_size if block_size is not None else default_block_size(mask.L_q, mask.L_k)
    return mask.cached(("layout", BM, BN, device), lambda: BlockLayout.from_mask(mask, BM, BN, device))


def _block_kernel() -> tuple[Callable[..., Tensor] | None, str]:
    try:
        from fusegnn.kernels.block_attention import block_sparse_attention
    except ImportError as exc:  # the kernel module (or Triton) is missing
        return None, f"{type(exc).__name__}: {exc}"
    return block_sparse_attention, ""


def _block_kernel_dtypes() -> tuple[torch.dtype, ...]:
    from fusegnn.kernels import block_attention

    return tuple(getattr(block_attention, "SUPPORTED_DTYPES", _FLOAT_DTYPES))


# ----------------------------------------------------------------------------- the paths
def masked_attention_reference(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """Dense masked softmax attention (the oracle): ``allowed`` is a boolean
    ``[L_q, L_k]`` or ``[H, L_q, L_k]`` (broadcast over the batch); rows with no allowed
    key give zeros. Differentiable; computes in the inputs' dtype."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    # the row maximum only stabilises exp (the softmax does not depend on it): detached
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)  # masked entries: exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.matmul(p, v)


def _reference_path(q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float) -> Tensor:
    return masked_attention_reference(q, k, v, mask.dense(q.device), scale)


def _element_path(q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float, aggregation: str) -> Tensor:
    B, H, L_q, D = q.shape
    D_v = v.size(-1)
    graph = mask.to_graph(device=q.device)
    if mask.num_heads == 1:
        # one graph over positions; (batch, head) pairs are the ops' heads
        def nodes(t: Tensor) -> Tensor:
            return t.permute(2, 0, 1, 3).reshape(t.size(2), B * H, t.size(3))

        def unnodes(t: Tensor) -> Tensor:
            return t.reshape(L_q, B, H, D_v).permute(1, 2, 0, 3)

    else:
        # heads stacked block-diagonally (node h * L + position); the batch is the ops' heads
        def nodes(t: Tensor) -> Tensor:
            return t.permute(1, 2, 0, 3).reshape(H * t.size(2), B, t.size(3))

        def unnodes(t: Tensor) -> Tensor:
            return t.reshape(H, L_q, B, D_v).permute(2, 0, 1, 3)

    qn, kn, vn = nodes(q), nodes(k), nodes(v)
    scores = sddmm(graph, kn, qn, "dot", aggregation=aggregation) * scale  # [E, heads]
    alpha = edge_softmax(graph, scores, aggregation=aggregation)
    out = spmm(graph, vn, alpha, aggregation=aggregation)  # [nodes, heads, D_v]
    return unnodes(out).contiguous()


# ----------------------------------------------------------------------------- dispatch
def explain_attention(
    q: Tensor,
    mask: Mask | BlockLayout,
    *,
    aggregation: str = "auto",
    block_size: int | tuple[int, int] | None = None,
) -> Decision:
    """The path (``"reference"``, ``"element"`` or ``"block"``) and the reason
    :func:`sparse_attention` takes for ``q`` and ``mask`` (builds and caches the block
    layout when the rule needs it; runs no attention)."""
    if aggregation not in ATTENTION_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {ATTENTION_AGGREGATIONS}, got {aggregation!r}")
    bs = _as_block_size(block_size)
    if aggregation != "auto":
        if aggregation == "block":
            kernel, why = _block_kernel()
            if kernel is None:
                raise NotImplementedError(
                    "aggregation='block' needs the fused kernel "
                    "fusegnn.kernels.block_attention.block_sparse_attention, which is not "
                    f"available in this build ({why}); use 'element' or 'reference'"
                )
        return Decision(aggregation, f"aggregation={aggregation!r} was asked for")
    if q.device.type != "cuda":
        return Decision("reference", f"q is on {q.device.type}: auto runs fused kernels on CUDA only")
    kernel, why = _block_kernel()
    if kernel is None:
        return Decision("element", f"the block kernel is not available ({why})")
    if q.dtype not in _block_kernel_dtypes():
        return Decision("element", f"the block kernel does not take {q.dtype}")
    layout = _layout_of(mask, bs, q.device)
    computed = layout.nnzb * layout.BM * layout.BN
    fill = layout.density * layout.num_heads * layout.L_q * layout.L_k / computed if computed else 1.0
    if fill < ELEMENT_MAX_FILL:
        return Decision("element", f"allowed elements fill {fill:.3f} < {ELEMENT_MAX_FILL} of the non-empty blocks")
    return Decision("block", f"allowed elements fill {fill:.3f} >= {ELEMENT_MAX_FILL} of the non-empty blocks")


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask | BlockLayout,
    *,
    scale: float | None = None,
    aggregation: str = "auto",
    block_size: int | tuple[int, int] | None = None,
    element_aggregation: str = "auto",
) -> Tensor:
    r"""Masked scaled dot-product attention (see the module docstring for the math).

    Args:
        q: ``[B, H, L_q, D]`` queries.
        k: ``[B, H, L_k, D]`` keys.
        v: ``[B, H, L_k, D_v]`` values (same dtype and device as ``q`` and ``k``).
        mask: a :class:`~fusegnn.sparse.masks.Mask` over ``L_q x L_k`` (shared, or with
            ``H`` heads), or a :class:`~fusegnn.sparse.BlockLayout` built from one.
        scale: score scale; ``None`` for :math:`1/\sqrt{D}`.
        aggregation: ``"auto"``, ``"block"``, ``"element"`` or ``"reference"``.
        block_size: ``BM`` (square) or ``(BM, BN)``, powers of two >= 16, for the block
            layout built from a ``Mask`` (``None``: :func:`default_block_size`).
        element_aggregation: backend of the element path's inner ``sddmm`` /
            ``edge_softmax`` / ``spmm`` (``"auto"``, ``"gas"``, ``"gar"``,
            ``"reference"``).

    Returns:
        ``[B, H, L_q, D_v]``; rows with no allowed key are zeros. Differentiable with
        respect to ``q``, ``k`` and ``v`` on every path.
    """
    _check_qkv(q, k, v)
    _check_mask(mask, q, k)
    scale = _check_scale(scale, q.size(-1))
    if element_aggregation not in _ELEMENT_AGGREGATIONS:
        raise ValueError(f"element_aggregation must be one of {_ELEMENT_AGGREGATIONS}, got {element_aggregation!r}")
    decision = explain_attention(q, mask, aggregation=aggregation, block_size=block_size)
    if decision.name == "reference":
        return _reference_path(q, k, v, _mask_of(mask), scale)
    if decision.name == "element":
        return _element_path(q, k, v, _mask_of(mask), scale, element_aggregation)
    kernel, _ = _block_kernel()
    assert kernel is not None  # explain_attention checked it
    layout = _layout_of(mask, _as_block_size(block_size), q.device)
    return kernel(q, k, v, layout, scale)
