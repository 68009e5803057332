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

Five implementations and the automatic choice (``aggregation=``):

* ``"reference"`` -- dense masked softmax in PyTorch over the ``L_q x L_k`` boolean
  mask (the oracle; any device and dtype; memory ``O(B H L_q L_k)``);
* ``"element"`` -- the element-level path on the GNN core: the mask becomes a graph with
  edges ``k -> q`` (:meth:`~fusegnn.attention.masks.Mask.to_graph`), then exactly the ops
  GAT runs on, :func:`~fusegnn.sparse.sddmm` (``"dot"``) ``->``
  :func:`~fusegnn.sparse.edge_softmax` ``->`` :func:`~fusegnn.sparse.spmm`, with the
  ``B * H`` (batch, head) pairs as the ops' heads (for a per-head mask, the heads'
  graphs are stacked block-diagonally and the batch is the ops' head axis). The inner
  ops dispatch by ``element_aggregation`` (``"auto"``, ``"gas"``, ``"gar"``,
  ``"reference"``), so the same fused kernels serve GAT and attention. Memory and work
  ``O(B H nnz)``; for masks too irregular for blocks;
* ``"block"`` -- the fused block-sparse FlashAttention-style Triton kernel of
  :mod:`fusegnn.kernels.block_attention` over a :class:`BlockLayout`. A mask that only
  connects tokens ``d`` apart and is one mask on each of the ``d`` interleaved
  sub-sequences (:meth:`~fusegnn.attention.masks.Mask.dilation_split`: a dilated window, also
  intersected with a causal mask) runs that mask's layout over the sub-sequences
  (``dilation=d``): a dilated window's blocks, all partial and half empty in token order,
  become a plain window's, mostly full; the cost model counts ``d`` times the base
  layout's blocks;
* ``"vector"`` -- the fused vector-sparse (row-window) Triton kernel of
  :mod:`fusegnn.kernels.vector_attention`, for element-irregular masks too scattered for
  blocks: the queries are cut into windows of ``W`` rows, each window streams the sorted
  list of the keys any of its rows attends (gathered ``BLOCK_N`` at a time) through
  ``[W, BLOCK_N]`` ``tl.dot`` score tiles masked per element, with an online softmax;
  the backward recomputes :math:`P` and walks key windows with their compacted query
  lists for ``dK`` / ``dV`` (deterministic, no atomics). ``block_size`` is ``W`` (16, 32
  or 64; default 16) or ``(W, BLOCK_N)`` (default ``BLOCK_N`` 64). The structure is built
  from the mask's element graph on the device and cached on the mask per
  (``W``, device) (:mod:`fusegnn.attention.vector_windows`). float16, bfloat16 and
  float32, on CUDA (or the Triton interpreter). ``"auto"`` weighs it (default sizes)
  for masks whose allowed elements fill less than
  :data:`~fusegnn.attention.cost_model.VECTOR_MAX_FILL` of their non-empty blocks, by
  the structure's compacted entries;
* ``"dense"`` -- PyTorch's dense ``torch.nn.functional.scaled_dot_product_attention``
  (its flash / memory-efficient kernels), in the variant the mask allows
  (:meth:`~fusegnn.attention.masks.Mask.structure`, decided from the mask's definition):
  no mask when every element is allowed (``"no mask"``), ``is_causal=True`` when the mask
  is exactly :math:`k \le q` (``"causal"``), else the boolean ``attn_mask``
  (``"bool mask"``; rows with no allowed key are given every key inside SDPA, so that it
  stays finite, and their output is then set to zero -- never NaN, and no gradient flows
  from them);
* ``"auto"`` -- ``"reference"`` off CUDA; on CUDA the cheapest of dense SDPA and the
  sparse path under the calibrated cost model (below), where the sparse path is
  ``"block"``, or ``"element"`` when the block kernel is not available or when the
  allowed elements fill less than
  :data:`~fusegnn.attention.cost_model.ELEMENT_MAX_FILL` of the non-empty blocks (a
  very irregular mask, where blocks would compute mostly masked-out scores), or
  ``"vector"`` where the cost model predicts it faster than that path (scattered masks:
  below :data:`~fusegnn.attention.cost_model.VECTOR_MAX_FILL`).

**The auto rule** (:func:`auto_attention_rule`) compares the paths' predicted times under
the calibrated cost model of :mod:`fusegnn.attention.cost_model`; dense SDPA with a boolean
mask is considered only while the mask has at most
:data:`~fusegnn.attention.cost_model.DENSE_MASK_MAX_ELEMENTS` elements (it is
materialised, and SDPA turns it into an additive bias of the same size).
:func:`explain_attention` gives the decision, its reason and the predicted times.

**N:M sparsity** (``nm=(N, M)``, DFSS; :mod:`fusegnn.kernels.nm_sparsity`): of every ``M``
consecutive keys of a row only the ``N`` largest allowed scores enter the softmax (ties
to the lower key index; groups aligned to multiples of ``M``; a partial last group's
missing keys count as masked). Only ``"block"`` (the selection inside the fused kernel's
score tiles, forward and backward) and ``"reference"`` compute it; ``"auto"`` takes the
block kernel on CUDA (dense SDPA and the element path cannot drop scores) and the
reference elsewhere. A mask that splits into sub-sequences runs its own layout (the
groups are of consecutive keys, which a dilated call interleaves).

The mask is a :class:`~fusegnn.attention.masks.Mask` or a prebuilt
:class:`~fusegnn.attention.block_layout.BlockLayout`. Layouts built from a mask are cached
on the mask per (block size, device), graphs per device, so a mask reused across calls
is processed once; so is :func:`sparse_attention`'s path decision, per (aggregation,
block size, shape, dtype, device, whether a gradient is needed) -- the cost model's
constants are read when a mask first meets a configuration.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fusegnn.attention import cost_model, handles
from fusegnn.attention import library  # noqa: F401  (registers the compiled block-attention ops)
from fusegnn.attention.block_layout import BlockLayout, check_block_size
from fusegnn.attention.cost_model import predict_attention_ms
from fusegnn.attention.masks import Mask
from fusegnn.attention.vector_windows import keep_vector_structure, vector_path, vector_sizes, vector_structure
from fusegnn.kernels._triton import BLOCK_ATTENTION_DTYPES, FLOAT_DTYPES
from fusegnn.kernels.attention_inputs import check_qkv, check_scale
from fusegnn.kernels.nm_sparsity import check_nm, nm_keep
from fusegnn.sparse.dispatch import AGGREGATIONS as _ELEMENT_AGGREGATIONS
from fusegnn.sparse.dispatch import Decision
from fusegnn.sparse.graph import is_integer
from fusegnn.sparse.ops import edge_softmax, sddmm, spmm

__all__ = [
    "ATTENTION_AGGREGATIONS",
    "AttentionDecision",
    "auto_attention_rule",
    "default_block_size",
    "explain_attention",
    "masked_attention_reference",
    "sparse_attention",
]

ATTENTION_AGGREGATIONS = ("auto", "block", "element", "reference", "dense", "vector")

_VARIANT_OF_STRUCTURE = {"full": "no mask", "causal": "causal", "general": "bool mask"}


@dataclass(frozen=True)
class AttentionDecision(Decision):
    """A :class:`~fusegnn.sparse.dispatch.Decision` of :func:`explain_attention`, plus:

    Attributes:
        dense_variant: for ``name == "dense"``, one of
            :data:`~fusegnn.attention.cost_model.DENSE_VARIANTS`.
        block_size: ``(BM, BN)`` of the block path (``None`` otherwise).
        dilation: the block path's sub-sequence split (1: none; see
            :meth:`~fusegnn.attention.masks.Mask.dilation_split`).
        vector_sizes: ``(W, BLOCK_N)`` of the vector path (``None`` otherwise).
        predicted_ms: ``(label, ms)`` pairs of the cost model when the auto rule used it.
    """

    dense_variant: str | None = None
    block_size: tuple[int, int] | None = None
    predicted_ms: tuple[tuple[str, float], ...] = ()
    dilation: int = 1
    vector_sizes: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        """``"dense sdpa (causal)"``, ``"block 64x64"``, ``"block 64x64 dilation 2"``,
        ``"vector W16 x 64"``, ``"element"``, ``"reference"``."""
        if self.name == "dense":
            return f"dense sdpa ({self.dense_variant})"
        if self.name == "block" and self.block_size is not None:
            dilated = f" dilation {self.dilation}" if self.dilation > 1 else ""
            return f"block {self.block_size[0]}x{self.block_size[1]}{dilated}"
        if self.name == "vector" and self.vector_sizes is not None:
            return f"vector W{self.vector_sizes[0]} x {self.vector_sizes[1]}"
        return self.name


# ----------------------------------------------------------------------------- checks
def _check_mask(mask: Any, q: Tensor, k: Tensor | None) -> None:
    """``mask`` fits ``q`` (and ``k``; ``None`` where only ``q`` is known, as in
    :func:`explain_attention`): its type, lengths and head count."""
    if not isinstance(mask, (Mask, BlockLayout)):
        raise TypeError(
            "mask must be a fusegnn.attention.masks.Mask or a fusegnn.attention.BlockLayout, "
            f"got {type(mask).__name__}"
        )
    if k is None and mask.L_q != q.size(2):
        raise ValueError(f"the mask is {mask.L_q} x {mask.L_k} (L_q x L_k) but q has L_q = {q.size(2)}")
    if k is not None and (q.size(2), k.size(2)) != (mask.L_q, mask.L_k):
        raise ValueError(
            f"the mask is {mask.L_q} x {mask.L_k} (L_q x L_k) but q has L_q = {q.size(2)} "
            f"and k has L_k = {k.size(2)}"
        )
    if mask.num_heads not in (1, q.size(1)):
        raise ValueError(
            f"the mask has {mask.num_heads} heads but q has H = {q.size(1)}; "
            "a mask must be shared (1 head) or have one mask per head"
        )


_check_scale = check_scale  # shared with the kernels' entry points


def _check_explain_inputs(q: Any, mask: Any, backward: Any, value_dim: Any) -> None:
    """What :func:`explain_attention` reads, checked as :func:`sparse_attention` checks it
    (a decision for a mask of other lengths or heads, or for something that is not a
    tensor, is no decision of a call that could run)."""
    if not isinstance(q, Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D [B, H, L_q, D] (SDPA layout), got shape {tuple(q.shape)}")
    _check_mask(mask, q, None)
    if backward is not None and not isinstance(backward, bool):
        raise TypeError(f"backward must be a bool or None, got {type(backward).__name__}")
    if value_dim is not None and (not is_integer(value_dim) or value_dim < 0):
        raise ValueError(f"value_dim must be None or an int >= 0 (v's head dim D_v), got {value_dim!r}")


def _check_aggregation(aggregation: Any) -> None:
    """A ``ValueError`` naming ``aggregation`` unless it is one of
    :data:`ATTENTION_AGGREGATIONS` -- checked before it enters a cache key, where an
    unhashable value (a list) raised a bare 'unhashable type'."""
    if not isinstance(aggregation, str) or aggregation not in ATTENTION_AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {ATTENTION_AGGREGATIONS}, got {aggregation!r}")


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


def _block_layout(
    mask: Mask | BlockLayout, block_size: tuple[int, int] | None, device: torch.device, split: bool = True
) -> tuple[BlockLayout, int]:
    """``(layout, dilation)`` the block kernel runs for ``mask``: a mask that splits into
    interleaved sub-sequences (:meth:`Mask.dilation_split`) runs its base mask's layout
    with ``dilation = d`` (unless ``split`` is false: N:M attention); anything else its own
    layout with ``dilation = 1``. ``block_size`` is the layout's (the base mask's for a
    split one)."""
    if isinstance(mask, Mask) and split:
        split = mask.dilation_split()
        if split is not None:
            d, base = split
            return _layout_of(base, block_size, device), d
    return _layout_of(mask, block_size, device), 1


def _block_kernel() -> tuple[Callable[..., Tensor] | None, str]:
    try:
        from fusegnn.kernels.block_attention import block_sparse_attention
    except ImportError as exc:  # the kernel module (or Triton) is missing
        return None, f"{type(exc).__name__}: {exc}"
    return block_sparse_attention, ""


def _vector_kernel() -> tuple[bool, str]:
    """``(available, why not)`` of the vector path's kernels (as :func:`_block_kernel`)."""
    try:
        import fusegnn.kernels.vector_attention  # noqa: F401
    except ImportError as exc:  # the kernel module (or Triton) is missing
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def _block_prechecked() -> Callable[..., Tensor]:
    from fusegnn.kernels.block_attention import block_sparse_attention_prechecked

    return block_sparse_attention_prechecked


def _decide(
    q: Tensor, mask: Mask | BlockLayout, aggregation: str, block_size: Any, backward: bool,
    nm: tuple[int, int] | None = None, value_dim: int | None = None,
) -> tuple[AttentionDecision, BlockLayout | None, int]:
    """The path decision and, for the block path, its layout (built and cached on the
    mask on ``q``'s device) and dilation (see :func:`_block_layout`)."""
    decision = explain_attention(q, mask, aggregation=aggregation, block_size=block_size, backward=backward, nm=nm,
                                 value_dim=value_dim)
    if decision.name != "block":
        return decision, None, 1
    layout, dilation = _block_layout(mask, _as_block_size(block_size), q.device, split=nm is None)
    return decision, layout, dilation


# ----------------------------------------------------------------------------- the paths
def masked_attention_reference(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float,
                               nm: tuple[int, int] | None = None) -> Tensor:
    """Dense masked softmax attention (the oracle): ``allowed`` is a boolean
    ``[L_q, L_k]`` or ``[H, L_q, L_k]`` (broadcast over the batch); rows with no allowed
    key give zeros. With ``nm = (N, M)`` the softmax runs over the scores
    :func:`~fusegnn.kernels.nm_sparsity.nm_keep` keeps (selected on the scaled scores).
    Differentiable; computes in the inputs' dtype, with ``q`` scaled before the product
    (as SDPA does): float16 products ``q . k`` beyond 65504 whose scaled score is finite
    would otherwise overflow to ``inf`` and make the row NaN."""
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    if nm is not None:
        allowed = nm_keep(scores, allowed, *nm)
    scores = scores.masked_fill(~allowed, float("-inf"))
    # the row maximum only stabilises exp (the softmax does not depend on it): detached
    row_max = scores.detach().amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)  # masked entries: exp(-inf) = 0
    denom = p.sum(dim=-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.matmul(p, v)


def _reference_path(q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float,
                    nm: tuple[int, int] | None = None) -> Tensor:
    return masked_attention_reference(q, k, v, mask.dense(q.device), scale, nm)


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

    # q scaled before the product, as in masked_attention_reference: an unscaled float16
    # score beyond 65504 is inf (a NaN row) where the scaled one is finite
    qn, kn, vn = nodes(q * scale), nodes(k), nodes(v)
    scores = sddmm(graph, kn, qn, "dot", aggregation=aggregation)  # [E, heads]
    alpha = edge_softmax(graph, scores, aggregation=aggregation)
    out = spmm(graph, vn, alpha, aggregation=aggregation)  # [nodes, heads, D_v]
    return unnodes(out).contiguous()


def _structure_block_size(mask: Mask | BlockLayout, block_size: tuple[int, int] | None) -> tuple[int, int]:
    if isinstance(mask, BlockLayout):
        return (mask.BM, mask.BN)
    return block_size if block_size is not None else default_block_size(mask.L_q, mask.L_k)


def _dense_variant(mask: Mask | BlockLayout, block_size: tuple[int, int] | None, device: torch.device) -> str:
    """The dense SDPA variant of ``mask`` (:data:`~.cost_model.DENSE_VARIANTS`), from
    :meth:`Mask.structure` evaluated at the layout's block size (its cached block map)."""
    structure = _mask_of(mask).structure(device, _structure_block_size(mask, block_size))
    return _VARIANT_OF_STRUCTURE[structure]


def _sdpa_bool_mask(mask: Mask, device: torch.device) -> tuple[Tensor, Tensor | None]:
    """``(attn_mask, has_key)`` for SDPA: ``attn_mask`` bool ``[1, 1, L_q, L_k]`` (or
    ``[1, H, L_q, L_k]`` per head), ``True`` = may attend, with the rows that allow no
    key set to all ``True`` (SDPA would give NaN there); ``has_key`` bool
    ``[1, 1 or H, L_q, 1]``, ``False`` at those rows, or ``None`` when there is none.
    Cached on the mask per device while it has at most
    :data:`~fusegnn.attention.cost_model.DENSE_MASK_MAX_ELEMENTS` elements."""

    def build() -> tuple[Tensor, Tensor | None]:
        dense = mask.dense(device)
        dense = dense.view(1, 1, *dense.shape) if dense.dim() == 2 else dense.unsqueeze(0)
        has_key = dense.any(dim=-1, keepdim=True)
        if bool(has_key.all()):
            return dense, None
        return dense | ~has_key, has_key

    if mask.num_heads * mask.L_q * mask.L_k <= cost_model.DENSE_MASK_MAX_ELEMENTS:
        return mask.cached(("sdpa_bool_mask", device), build)
    return build()


def _sdpa_causal(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """SDPA with ``is_causal=True``. A scale that is not positive goes into ``q`` (SDPA
    then scales by 1): PyTorch's CPU kernel applies the scale after the causal mask's
    ``-inf``, so ``scale=0`` gave ``0 * -inf`` and a negative scale ``+inf`` -- NaN rows
    (torch 2.13)."""
    if scale > 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q * scale, k, v, is_causal=True, scale=1.0)


def _dense_path(q: Tensor, k: Tensor, v: Tensor, mask: Mask | BlockLayout, scale: float, variant: str) -> Tensor:
    if variant == "no mask":
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    if variant == "causal":
        return _sdpa_causal(q, k, v, scale)
    attn_mask, has_key = _sdpa_bool_mask(_mask_of(mask), q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    if has_key is not None:  # rows with no allowed key: zeros (and no gradient)
        out = torch.where(has_key, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


# ----------------------------------------------------------------------------- dispatch
def auto_attention_rule(
    mask: Mask | BlockLayout,
    *,
    batch: int,
    heads: int,
    head_dim: int,
    backward: bool,
    block_size: int | tuple[int, int] | None = None,
    device: torch.device | str = "cpu",
    element_allowed: bool = True,
    vector_allowed: bool = True,
    block_allowed: bool = True,
) -> AttentionDecision:
    r"""The ``"auto"`` rule of :func:`sparse_attention` on CUDA (where block kernel and
    dtype are supported), for ``batch`` x ``heads`` (batch, head) pairs of head dim
    ``head_dim``: evaluated on ``device`` (it builds and caches the block layout there;
    any device gives the same decision).

    1. The sparse path: ``"element"`` when the allowed elements fill less than
       :data:`~.cost_model.ELEMENT_MAX_FILL` of the non-empty blocks' ``BM x BN`` elements (and
       ``element_allowed``) or when not ``block_allowed`` (inputs the block kernel does
       not take: ``D_v != D``), else ``"block"``; then, for a :class:`Mask` whose allowed
       elements fill less than :data:`~.cost_model.VECTOR_MAX_FILL` (and
       ``vector_allowed``) and whose busiest query or key window holds at most
       :data:`~.cost_model.VECTOR_MAX_WINDOW_SKEW` times the mean entries, ``"vector"``
       instead when its predicted time is below that path's (the query-window structure
       is built to count its entries, and kept on the mask only when the vector path is
       picked).
    2. The dense variant from :meth:`Mask.structure`: ``"no mask"`` (every element
       allowed), ``"causal"`` (exactly ``k <= q``), else ``"bool mask"`` -- not
       considered above :data:`~.cost_model.DENSE_MASK_MAX_ELEMENTS` mask elements.
    3. ``"dense"`` when its predicted time (:func:`~.cost_model.predict_attention_ms`) is below the
       sparse path's, else the sparse path.
    """
    bs = _as_block_size(block_size)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # the key the paths' caches use (q.device)
    layout, dilation = _block_layout(mask, bs, device)
    BM, BN = layout.BM, layout.BN
    pairs = batch * heads
    per_layout_head = pairs // layout.num_heads  # pairs that share each layout head
    # a split mask runs its layout once per sub-sequence (dilation of them)
    blocks = layout.nnzb * per_layout_head * dilation
    allowed = layout.density * layout.num_heads * layout.L_q * layout.L_k * per_layout_head * dilation
    computed = layout.nnzb * BM * BN
    fill = layout.density * layout.num_heads * layout.L_q * layout.L_k / computed if computed else 1.0
    mode = "fwd+bwd" if backward else "fwd"
    predict = lambda path, work, **kw: predict_attention_ms(path, work, head_dim=head_dim, backward=backward, **kw)  # noqa: E731

    if not (block_allowed or element_allowed):
        raise ValueError("block_allowed and element_allowed are both False: no sparse path to weigh")
    if not block_allowed:
        sparse = AttentionDecision("element", "", block_size=None)
        sparse_ms = predict("element", allowed)
        why_sparse = "the block kernel is left out (it needs v's head dim D_v == D)"
    elif element_allowed and fill < cost_model.ELEMENT_MAX_FILL:
        sparse = AttentionDecision("element", "", block_size=None)
        sparse_ms = predict("element", allowed)
        why_sparse = f"allowed elements fill {fill:.3f} < {cost_model.ELEMENT_MAX_FILL} of the non-empty blocks"
    else:
        sparse = AttentionDecision("block", "", block_size=(BM, BN), dilation=dilation)
        sparse_ms = predict("block", blocks, block_size=(BM, BN))
        why_sparse = f"allowed elements fill {fill:.3f} >= {cost_model.ELEMENT_MAX_FILL} of the non-empty blocks"
    predicted = [(sparse.label, sparse_ms)]
    structure = None  # the vector path's, when it is the sparse path (cached on the mask if it is picked)
    if vector_allowed and isinstance(mask, Mask) and fill < cost_model.VECTOR_MAX_FILL:
        try:
            candidate = _vector_candidate(mask, pairs, device, predict)
        except (ValueError, MemoryError, torch.cuda.OutOfMemoryError) as exc:  # a structure too large to build
            why_sparse += f"; the vector path not weighed ({type(exc).__name__}: {exc})"
        else:
            if isinstance(candidate, str):  # too skewed to weigh
                why_sparse += f"; the vector path not weighed: {candidate}"
            else:
                vector, vector_ms, counted = candidate
                predicted.append((vector.label, vector_ms))
                if vector_ms < sparse_ms:
                    why_sparse = (f"allowed elements fill {fill:.3f} < {cost_model.VECTOR_MAX_FILL} of the "
                                  f"non-empty blocks; {vector.label} predicted faster than {sparse.label}")
                    sparse, sparse_ms, structure = vector, vector_ms, counted

    def sparse_decision(reason: str) -> AttentionDecision:
        if structure is not None:
            keep_vector_structure(mask, structure, device)
        return AttentionDecision(sparse.name, reason, block_size=sparse.block_size, predicted_ms=tuple(predicted),
                                 dilation=sparse.dilation, vector_sizes=sparse.vector_sizes)

    variant = _dense_variant(mask, bs, device)
    L_q, L_k = _mask_of(mask).shape  # the mask's own lengths (a split mask's layout is shorter)
    mask_elements = layout.num_heads * L_q * L_k
    if variant == "bool mask" and mask_elements > cost_model.DENSE_MASK_MAX_ELEMENTS:
        reason = (
            f"{sparse.label}: {why_sparse}; dense sdpa (bool mask) not considered: the mask has "
            f"{mask_elements} elements > DENSE_MASK_MAX_ELEMENTS = {cost_model.DENSE_MASK_MAX_ELEMENTS}"
        )
        return sparse_decision(reason)
    dense = AttentionDecision("dense", "", dense_variant=variant)
    dense_ms = predict("dense", pairs * L_q * L_k, dense_variant=variant)
    predicted.insert(0, (dense.label, dense_ms))
    costs = f"predicted {mode}: {dense.label} {dense_ms:.3g} ms, {sparse.label} {sparse_ms:.3g} ms"
    if dense_ms < sparse_ms:
        reason = f"{dense.label} is predicted faster ({costs}; {why_sparse}; mask structure: {variant})"
        return AttentionDecision("dense", reason, dense_variant=variant, predicted_ms=tuple(predicted))
    return sparse_decision(f"{sparse.label} is predicted faster ({costs}; {why_sparse})")


def _vector_candidate(mask: Mask, pairs: int, device: torch.device,
                      predict) -> tuple[AttentionDecision, float, Any] | str:
    """``(decision, predicted ms, structure)`` of the vector path at its default sizes for
    ``pairs`` (batch, head) pairs: the work is the structure's compacted entries, each
    mask head's counted for the pairs that share it. The count is cached on the mask (it
    is the same on every device), the structure is not: it is returned when this call
    built it (else ``None``; the path builds and caches it at its first call). A mask
    whose busiest window would be most of the work (one long program the summed-work
    model does not see) is not weighed: then the reason, a string."""
    sizes = vector_sizes(None)
    built = []

    def count() -> tuple[int, int, float]:
        structure = vector_structure(mask, sizes[0], device, keep=False)
        built.append(structure)
        return structure.num_entries, structure.num_heads, _window_skew(structure)

    entries, mask_heads, skew = mask.cached(("vector_entries", sizes[0]), count)
    if skew > cost_model.VECTOR_MAX_WINDOW_SKEW:
        return (f"its busiest window holds {skew:.0f}x the mean entries "
                f"(> VECTOR_MAX_WINDOW_SKEW = {cost_model.VECTOR_MAX_WINDOW_SKEW:g})")
    ms = predict("vector", entries * (pairs // mask_heads), window=sizes[0])
    return AttentionDecision("vector", "", vector_sizes=sizes), ms, built[0] if built else None


def _window_skew(structure) -> float:
    """The busiest window's entries over the mean of the non-empty windows, the larger of
    the query windows' (forward, ``dQ``) and the key windows' (``dK``, ``dV``)."""
    skew = 1.0
    for index in (structure.rows, structure.cols):
        counts = (index.ptr[1:] - index.ptr[:-1]).to(torch.float64)
        busy = counts[counts > 0]
        if busy.numel():
            skew = max(skew, float(busy.max() / busy.mean()))
    return skew


def _needs_backward(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def explain_attention(
    q: Tensor,
    mask: Mask | BlockLayout,
    *,
    aggregation: str = "auto",
    block_size: int | tuple[int, int] | None = None,
    backward: bool | None = None,
    nm: tuple[int, int] | str | None = None,
    value_dim: int | None = None,
) -> AttentionDecision:
    """The path (``"reference"``, ``"element"``, ``"block"``, ``"dense"`` or ``"vector"``) and the reason
    :func:`sparse_attention` takes for ``q`` and ``mask`` (builds and caches the block
    layout when the rule needs it; runs no attention). ``backward``: whether a gradient
    will be needed (``None``: grad mode is on and ``q`` requires grad; pass it when only
    ``k`` or ``v`` does); the cost model predicts forward or forward + backward time.
    ``decision.label`` names the path as the benchmarks print it (``"dense sdpa
    (causal)"``, ``"block 64x64"``), ``decision.predicted_ms`` the cost model's times.
    ``nm``: N:M attention (module docstring), which only ``"block"`` and
    ``"reference"`` compute. ``value_dim``: ``D_v``, the head dim of ``v`` (``None``:
    ``q``'s ``D``); the block kernel needs ``D_v == D``, so ``"auto"`` leaves it out
    otherwise."""
    _check_aggregation(aggregation)
    _check_explain_inputs(q, mask, backward, value_dim)
    nm = check_nm(nm)
    if aggregation == "vector":
        return _vector_decision(q, nm, block_size)
    bs = _as_block_size(block_size)
    if backward is None:
        backward = _needs_backward(q)
    if nm is not None:
        return _nm_decision(q, mask, aggregation, bs, nm, value_dim)
    if aggregation != "auto":
        reason = f"aggregation={aggregation!r} was asked for"
        if aggregation == "block":
            kernel, why = _block_kernel()
            if kernel is None:
                raise NotImplementedError(
                    "aggregation='block' needs the fused kernel "
                    "fusegnn.kernels.block_attention.block_sparse_attention, which is not "
                    f"available in this build ({why}); use 'element', 'dense' or 'reference'"
                )
            _check_block_inputs(q, value_dim)
            split = mask.dilation_split() if isinstance(mask, Mask) else None
            dilation, inner = split if split is not None else (1, mask)
            BM, BN = (mask.BM, mask.BN) if isinstance(mask, BlockLayout) else (bs or default_block_size(inner.L_q, inner.L_k))
            return AttentionDecision("block", reason, block_size=(BM, BN), dilation=dilation)
        if aggregation == "dense":
            variant = _dense_variant(mask, bs, q.device)
            return AttentionDecision("dense", f"{reason}; mask structure: {variant}", dense_variant=variant)
        return AttentionDecision(aggregation, reason)
    if not _auto_runs_kernels(q.device):
        return AttentionDecision("reference", f"q is on {q.device.type}: auto runs fused kernels on CUDA only")
    kernel, why = _block_kernel()
    if kernel is None:
        return AttentionDecision("element", f"the block kernel is not available ({why})")
    if q.dtype not in BLOCK_ATTENTION_DTYPES:
        return AttentionDecision("element", f"the block kernel does not take {q.dtype}")
    B, H, _, D = q.shape
    return auto_attention_rule(
        mask, batch=B, heads=H, head_dim=D, backward=backward, block_size=bs, device=q.device,
        vector_allowed=_vector_kernel()[0], block_allowed=value_dim in (None, D),
    )


def _auto_runs_kernels(device: torch.device) -> bool:
    """Whether ``"auto"`` weighs the fused kernels for tensors on ``device`` (CUDA only)."""
    return device.type == "cuda"


def _check_block_inputs(q: Tensor, value_dim: int | None) -> None:
    """What the block kernel takes, checked where ``aggregation="block"`` is decided (so also
    for ``torch.compile``, whose block op runs the kernel without its own checks)."""
    if q.dtype not in BLOCK_ATTENTION_DTYPES:
        raise TypeError(f"q: aggregation='block' takes float16, bfloat16 or float32, got dtype {q.dtype}")
    if value_dim is not None and value_dim != q.size(-1):
        raise ValueError(
            f"v: aggregation='block' needs v's head dim D_v equal to q's D = {q.size(-1)}, got D_v = {value_dim}; "
            "use 'auto', 'element', 'vector', 'dense' or 'reference'"
        )


def _vector_decision(q: Tensor, nm: tuple[int, int] | None, block_size: Any) -> AttentionDecision:
    """The decision of ``aggregation="vector"`` (checked: no N:M, a valid ``block_size``,
    a dtype the kernel takes, the kernel importable)."""
    if nm is not None:
        raise ValueError(
            f"nm={nm[0]}:{nm[1]} is computed by aggregation='block' or 'reference' (or 'auto'), not 'vector'"
        )
    sizes = vector_sizes(block_size)
    if q.dtype not in BLOCK_ATTENTION_DTYPES:
        raise TypeError(f"q: aggregation='vector' takes float16, bfloat16 or float32, got dtype {q.dtype}")
    available, why = _vector_kernel()
    if not available:
        raise NotImplementedError(
            f"aggregation='vector' needs fusegnn.kernels.vector_attention, not available in this build "
            f"({why}); use 'element', 'dense' or 'reference'"
        )
    return AttentionDecision("vector", "aggregation='vector' was asked for", vector_sizes=sizes)


def _nm_decision(q: Tensor, mask: Mask | BlockLayout, aggregation: str, bs: tuple[int, int] | None,
                 nm: tuple[int, int], value_dim: int | None = None) -> AttentionDecision:
    """The path of N:M attention: ``"block"`` (never split into sub-sequences) or
    ``"reference"``; ``"auto"`` takes the block kernel where it runs (and ``D_v == D``)."""
    label = f"{nm[0]}:{nm[1]}"
    if aggregation in ("element", "dense", "vector"):
        raise ValueError(
            f"nm={label} is computed by aggregation='block' or 'reference' (or 'auto'), not {aggregation!r}: "
            "dense SDPA and the element path cannot drop scores"
        )
    BM, BN = (mask.BM, mask.BN) if isinstance(mask, BlockLayout) else (bs or default_block_size(mask.L_q, mask.L_k))
    block = AttentionDecision("block", "", block_size=(BM, BN))
    if aggregation == "block":
        if _block_kernel()[0] is None:
            raise NotImplementedError(f"aggregation='block' needs the fused kernel ({_block_kernel()[1]})")
        _check_block_inputs(q, value_dim)
        return replace(block, reason=f"aggregation='block' was asked for, nm={label}")
    if aggregation == "reference":
        return AttentionDecision("reference", f"aggregation='reference' was asked for, nm={label}")
    if not _auto_runs_kernels(q.device):
        return AttentionDecision("reference", f"q is on {q.device.type}: auto runs fused kernels on CUDA only")
    same_value_dim = value_dim is None or value_dim == q.size(-1)
    kernel, why = _block_kernel()
    if kernel is None or q.dtype not in BLOCK_ATTENTION_DTYPES or not same_value_dim:
        why = why or (f"the block kernel does not take {q.dtype}" if same_value_dim
                      else "the block kernel needs v's head dim D_v == D")
        return AttentionDecision("reference", f"nm={label} needs the block kernel, not available ({why})")
    return replace(block, reason=f"nm={label}: only the block kernel computes N:M attention on CUDA")


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
    nm: tuple[int, int] | str | None = None,
) -> Tensor:
    r"""Masked scaled dot-product attention (see the module docstring for the math).

    Args:
        q: ``[B, H, L_q, D]`` queries.
        k: ``[B, H, L_k, D]`` keys.
        v: ``[B, H, L_k, D_v]`` values (same dtype and device as ``q`` and ``k``).
        mask: a :class:`~fusegnn.attention.masks.Mask` over ``L_q x L_k`` (shared, or with
            ``H`` heads), or a :class:`~fusegnn.attention.BlockLayout` built from one.
        scale: score scale; ``None`` for :math:`1/\sqrt{D}`.
        aggregation: ``"auto"``, ``"block"``, ``"element"``, ``"reference"``,
            ``"dense"`` (PyTorch's SDPA: no mask, ``is_causal=True`` or a boolean mask, as
            the mask allows) or ``"vector"`` (query windows with compacted key columns,
            for element-irregular masks; ``"auto"`` weighs it at its default sizes).
        block_size: ``BM`` (square) or ``(BM, BN)``, powers of two >= 16, for the block
            layout built from a ``Mask`` -- for a mask that splits into sub-sequences
            (:meth:`~fusegnn.attention.masks.Mask.dilation_split`), its base mask's layout
            (``None``: :func:`default_block_size` of the layout's length). For
            ``aggregation="vector"``: the query window ``W`` (16, 32 or 64) or
            ``(W, BLOCK_N)`` (``BLOCK_N`` compacted keys per step, a power of two in
            ``[16, 128]``); ``None``: ``(16, 64)``.
        element_aggregation: backend of the element path's inner ``sddmm`` /
            ``edge_softmax`` / ``spmm`` (``"auto"``, ``"gas"``, ``"gar"``,
            ``"reference"``).
        nm: ``(N, M)`` in ``(1, 2)``, ``(2, 4)``, ``(4, 8)`` (or ``"N:M"``): dynamic
            N:M sparse attention -- of every ``M`` consecutive keys of a row only the
            ``N`` largest allowed scores enter the softmax (module docstring). Paths
            ``"block"`` and ``"reference"`` (``"auto"`` picks between them).
            ``None``: every allowed score.

    Returns:
        ``[B, H, L_q, D_v]``; rows with no allowed key are zeros. Differentiable with
        respect to ``q``, ``k`` and ``v`` on every path.
    """
    if torch.compiler.is_compiling():  # the decision outside the trace, the block kernels as custom ops
        return _compiled_call(q, k, v, mask, scale, aggregation, block_size, element_aggregation, nm)
    if isinstance(mask, Mask):  # a call like an earlier one skips the checks and the decision
        signature = _call_signature(q, k, v, scale, aggregation, block_size, element_aggregation, nm)
        calls = mask.cached("prepared_calls", dict)
        run = calls.get(signature) if signature is not None else None
        if run is None:
            run = _prepare_call(q, k, v, mask, scale, aggregation, block_size, element_aggregation, nm)
            if signature is not None:
                if len(calls) >= _MAX_PREPARED_CALLS:
                    calls.clear()
                calls[signature] = run
        return run(q, k, v)
    return _prepare_call(q, k, v, mask, scale, aggregation, block_size, element_aggregation, nm)(q, k, v)


def _compiled_call(q: Tensor, k: Tensor, v: Tensor, mask: Mask | BlockLayout, scale, aggregation: str,
                   block_size, element_aggregation: str, nm=None) -> Tensor:
    """:func:`sparse_attention` as ``torch.compile`` traces it (see
    :mod:`fusegnn.attention.library`)."""
    check_qkv(q, k, v, FLOAT_DTYPES)
    _check_mask(mask, q, k)
    scale = _check_scale(scale, q.size(-1))
    _check_aggregation(aggregation)
    if element_aggregation not in _ELEMENT_AGGREGATIONS:
        raise ValueError(f"element_aggregation must be one of {_ELEMENT_AGGREGATIONS}, got {element_aggregation!r}")
    bs = _size_key(aggregation, block_size)
    nm = check_nm(nm)
    if aggregation == "block":  # here too, so that the error is not one inside compiled_decision
        _check_block_inputs(q, v.size(-1))
    nm_n, nm_m = nm if nm is not None else (0, 0)
    shape, value_dim = _static_sizes(q, v)
    name, variant, layout, dilation, precision, window, block_n = compiled_decision(
        mask.handle, shape, q.dtype, str(q.device), aggregation, bs[0] if bs else 0, bs[1] if bs else 0,
        _needs_backward(q, k, v), nm_n, nm_m, value_dim,
    )
    if name == "reference":
        return _reference_path(q, k, v, _mask_of(mask), scale, nm)
    if name == "element":
        return _element_path(q, k, v, _mask_of(mask), scale, element_aggregation)
    if name == "dense":
        return _dense_path(q, k, v, mask, scale, variant)
    if name == "vector":
        out, _ = torch.ops.fusegnn.vector_attention(q, k, v, _mask_of(mask).handle, window, block_n, scale, precision)
        return out
    out, _ = torch.ops.fusegnn.block_attention(q, k, v, layout, scale, precision, dilation, nm_n, nm_m)
    return out


def _static_sizes(q: Tensor, v: Tensor) -> tuple[tuple[int, ...], int]:
    """``(q.shape, D_v)`` as plain ints for :func:`compiled_decision`, whose arguments must
    be constants. When a call with another batch size (say) makes Dynamo's sizes symbolic,
    ``operator.index`` specialises them (a guard and a recompile per size, as for static
    shapes): the path and the cost model depend on the sizes, and
    ``assume_constant_result`` cannot take a symbolic size (``tuple(q.shape)`` raised
    'assume_constant_result argument conversion failed' under ``fullgraph=True``)."""
    return tuple(operator.index(s) for s in q.shape), operator.index(v.size(-1))


@torch.compiler.assume_constant_result
def compiled_decision(mask: int, shape: tuple, dtype: torch.dtype, device: str, aggregation: str, block_m: int,
           block_n: int, backward: bool, nm_n: int = 0, nm_m: int = 0, value_dim: int = 0) -> tuple:
    """The path of a compiled call, as constants: ``(name, dense variant, layout handle,
    dilation, precision, W, BLOCK_N)`` (the last two the vector path's sizes, 0 on the other
    paths); whatever the path reads is built and cached on the mask here
    (Dynamo calls this function instead of tracing it: see
    :mod:`fusegnn.attention.library`). ``nm_m = 0``: no N:M; ``value_dim``: ``v``'s head
    dim (0: ``q``'s)."""
    target = handles.lookup(mask)
    dev = torch.device(device)
    q = torch.empty((), dtype=dtype, device=dev).expand(shape)  # shape, dtype and device, no memory
    block_size = (block_m, block_n) if block_m > 0 else None
    nm = (nm_n, nm_m) if nm_m > 0 else None
    value_dim = value_dim or shape[-1]
    if isinstance(target, Mask):
        key = ("decision", aggregation, block_size, tuple(shape), value_dim, dtype, dev, backward, nm)
        decision, layout, dilation = target.cached(
            key, lambda: _decide(q, target, aggregation, block_size, backward, nm, value_dim))
    else:
        decision, layout, dilation = _decide(q, target, aggregation, block_size, backward, nm, value_dim)
    plain = target.to_mask() if not isinstance(target, Mask) else target
    if decision.name == "dense" and decision.dense_variant not in ("no mask", "causal"):
        _sdpa_bool_mask(plain, dev)
    if decision.name == "element":
        plain.to_graph(device=dev)
    if decision.name == "vector":
        vector_structure(plain, decision.vector_sizes[0], dev)
    from fusegnn.kernels.block_attention import _precision

    precision = _precision(dtype, None) if decision.name in ("block", "vector") else ""
    window, keys_per_step = decision.vector_sizes or (0, 0)  # what "vector" was asked with, or what auto chose
    return (decision.name, decision.dense_variant or "", layout.handle if layout is not None else 0, dilation,
            precision, window, keys_per_step)


def _size_key(aggregation: str, block_size: Any) -> tuple[int, int] | None:
    """``block_size`` as the decision caches key it: ``(W, BLOCK_N)`` for the vector path
    (an int is ``W`` there), ``(BM, BN)`` or ``None`` for the block path."""
    return vector_sizes(block_size) if aggregation == "vector" else _as_block_size(block_size)


#: prepared calls kept per mask (callers varying shapes call after call start over)
_MAX_PREPARED_CALLS = 64


def _call_signature(q: Tensor, k: Tensor, v: Tensor, scale, aggregation, block_size, element_aggregation, nm=None):
    """Everything the argument checks and the path decision of :func:`sparse_attention`
    read, as a hashable key (``None`` when an argument is of a kind the checks reject or
    cannot hash: such a call is checked, and fails or runs, every time)."""
    if type(q) is not Tensor or type(k) is not Tensor or type(v) is not Tensor:
        return None
    # the options with their types: equal values of other types hash alike (True == 1,
    # 16.0 == 16) but are not what the checks accepted
    signature = (
        q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
        *map(_typed, (scale, aggregation, block_size, element_aggregation, nm)),
    )
    try:
        hash(signature)
    except TypeError:
        return None
    return signature


def _typed(value: Any) -> Any:
    """``value`` with the type of each of its parts (tuples walked), for a cache key."""
    if type(value) is tuple:
        return tuple, tuple(_typed(part) for part in value)
    return type(value), value


def _prepare_call(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask | BlockLayout, scale, aggregation: str, block_size,
    element_aggregation: str, nm=None,
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """Check the arguments, decide the path and return ``run(q, k, v)``, the call on that
    path (every later call with the same :func:`_call_signature` reuses it)."""
    check_qkv(q, k, v, FLOAT_DTYPES)
    _check_mask(mask, q, k)
    scale = _check_scale(scale, q.size(-1))
    _check_aggregation(aggregation)
    if element_aggregation not in _ELEMENT_AGGREGATIONS:
        raise ValueError(f"element_aggregation must be one of {_ELEMENT_AGGREGATIONS}, got {element_aggregation!r}")
    nm = check_nm(nm)
    backward = _needs_backward(q, k, v)
    if isinstance(mask, Mask):  # the rule is a pure function of these: decide once per mask
        key = ("decision", aggregation, _size_key(aggregation, block_size), tuple(q.shape), v.size(-1), q.dtype,
               q.device, backward, nm)
        decision, layout, dilation = mask.cached(
            key, lambda: _decide(q, mask, aggregation, block_size, backward, nm, v.size(-1)))
    else:
        decision, layout, dilation = _decide(q, mask, aggregation, block_size, backward, nm, v.size(-1))
    if decision.name == "reference":
        plain = _mask_of(mask)
        return lambda q, k, v: _reference_path(q, k, v, plain, scale, nm)
    if decision.name == "element":
        plain = _mask_of(mask)
        return lambda q, k, v: _element_path(q, k, v, plain, scale, element_aggregation)
    if decision.name == "vector":
        plain, sizes = _mask_of(mask), decision.vector_sizes
        return lambda q, k, v: vector_path(q, k, v, plain, scale, sizes)
    if decision.name == "dense":
        variant = decision.dense_variant
        if variant == "no mask":
            return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=scale)
        if variant == "causal":
            return lambda q, k, v: _sdpa_causal(q, k, v, scale)
        return lambda q, k, v: _dense_path(q, k, v, mask, scale, variant)
    if aggregation == "auto":  # the rule checked the dtype; q, k, v, mask and layout are checked above
        prechecked = _block_prechecked()
        return lambda q, k, v: prechecked(q, k, v, layout, scale, dilation, nm)
    kernel, _ = _block_kernel()
    assert kernel is not None  # explain_attention checked it
    return lambda q, k, v: kernel(q, k, v, layout, scale, dilation=dilation, nm=nm)
