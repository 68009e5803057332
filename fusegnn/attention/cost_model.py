r"""The cost model of :func:`~fusegnn.attention.sparse_attention.sparse_attention`'s
``"auto"`` rule: predicted milliseconds of one call on each path.

Milliseconds of one call on the calibration GPU, for ``B`` batches, ``H`` heads, head dim
``D`` (the per-unit costs scale with ``D / 64``), forward only or forward + backward
(``backward``: whether a gradient will be needed):

.. math::
    t_\mathrm{dense} = a_d + c_d\, f\, \tfrac{D}{64}\, B H L_q L_k, \qquad
    f = 1 \text{ (no mask)},\ f_\mathrm{causal} \text{ (is\_causal)},\
    f_\mathrm{mask} \text{ (bool mask)}

.. math::
    t_\mathrm{block} = a_b + c_b\, \tfrac{D}{64}\, \tfrac{BM \cdot BN}{64 \cdot 64}\,
    n_\mathrm{blocks}, \qquad
    t_\mathrm{element} = a_e + c_e\, \tfrac{D}{64}\, n_\mathrm{allowed}, \qquad
    t_\mathrm{vector} = a_v + c_v\, \tfrac{D}{64}\, \tfrac{W}{16}\, n_\mathrm{entries}

with :math:`n_\mathrm{blocks}` the non-empty blocks, :math:`n_\mathrm{allowed}` the
allowed elements and :math:`n_\mathrm{entries}` the vector path's compacted (query window,
key) entries (each ``W`` scores), all summed over the ``B * H`` (batch, head) pairs: the
overheads :math:`a` and per-unit costs :math:`c` are :data:`COST_MODELS` (``"fwd"``,
``"fwdbwd"``), :math:`f_\mathrm{causal}` = :data:`DENSE_CAUSAL_FACTOR`,
:math:`f_\mathrm{mask}` = :data:`DENSE_MASK_FACTOR`. Besides the predicted times the rule
reads four thresholds: :data:`ELEMENT_MAX_FILL` (element path instead of blocks for very
irregular masks), :data:`VECTOR_MAX_FILL` and :data:`VECTOR_MAX_WINDOW_SKEW` (the vector path
is weighed only below them) and
:data:`DENSE_MASK_MAX_ELEMENTS` (largest boolean mask handed to SDPA).

The constants are a least-squares fit to measurements on an NVIDIA H200
(``python -m benchmarks.run --suite attention --sweep calibrate --fit ...``, the inputs
and the fit's accuracy in ``benchmarks/NOTES-attention.md``); a test checks that they are
what the fit gives on the stored measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COST_MODELS",
    "CostModel",
    "DENSE_CAUSAL_FACTOR",
    "DENSE_MASK_FACTOR",
    "DENSE_MASK_MAX_ELEMENTS",
    "DENSE_VARIANTS",
    "ELEMENT_MAX_FILL",
    "VECTOR_MAX_FILL",
    "VECTOR_MAX_WINDOW_SKEW",
    "predict_attention_ms",
]

# "auto" on CUDA takes the element path when allowed elements fill less than this
# fraction of the non-empty blocks' BM x BN elements: below it the block path computes
# mostly masked-out scores (calibration sweep: benchmarks/NOTES-attention.md).
ELEMENT_MAX_FILL = 0.01

# "auto" weighs the vector path only when allowed elements fill less than this fraction of
# the non-empty blocks: it has to build the mask's query-window structure first (sorts of
# the allowed elements). On the calibration's structured masks (window, bigbird,
# longformer, causal: fill 0.5-1; dilated8: 0.44-0.9 on its split layout) the block path was
# faster from L = 4096 on (up to 4.5x); on random and graph masks (fill 0.001-0.05) the vector
# path was up to 17x faster than blocks (benchmarks/NOTES-attention.md).
VECTOR_MAX_FILL = 0.1

# ... and only when its busiest window (query or key window) holds at most this many times
# the mean entries of the non-empty windows: the kernels give a window one program, so a
# row or column attending everything (global tokens) is one long serial program that the
# summed-work model does not see (L = 16384, one global token: the vector path 36 % slower
# than blocks where the model predicted it 5 % faster; benchmarks/NOTES-attention.md).
VECTOR_MAX_WINDOW_SKEW = 8.0


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Constants of the auto rule's cost model (see the module docstring): overheads in
    ms per call; per-unit costs in ms at head dim 64 per dense ``(b, h, q, k)`` element,
    per non-empty 64 x 64 block of one ``(b, h)`` pair, per allowed element of one pair,
    per compacted (16-query window, key) entry of the vector path of one pair. Built by
    keyword only: eight floats in a row are easy to misplace."""

    dense_overhead_ms: float
    dense_ms_per_element: float
    block_overhead_ms: float
    block_ms_per_block: float
    element_overhead_ms: float
    element_ms_per_edge: float
    vector_overhead_ms: float
    vector_ms_per_entry: float


# Fitted on an NVIDIA H200 (B=4, H=12, D=64, bf16) by fit_cost_models in
# benchmarks/attention_calibrate.py; inputs, command and accuracy of the fit are in
# benchmarks/NOTES-attention.md ("Cost model of the auto rule").
# "fwd": forward only; "fwdbwd": forward + backward.
COST_MODELS: dict[str, CostModel] = {
    "fwd": CostModel(
        dense_overhead_ms=0.0228, dense_ms_per_element=5.54e-10,
        block_overhead_ms=0.0622, block_ms_per_block=3.96e-6,
        element_overhead_ms=0.425, element_ms_per_edge=6.14e-8,
        vector_overhead_ms=0.0962, vector_ms_per_entry=5.1e-8,
    ),
    "fwdbwd": CostModel(
        dense_overhead_ms=0.0731, dense_ms_per_element=1.97e-9,
        block_overhead_ms=0.19, block_ms_per_block=1.4e-5,
        element_overhead_ms=1.17, element_ms_per_edge=2.15e-7,
        vector_overhead_ms=0.379, vector_ms_per_entry=1.55e-7,
    ),
}

# Per-element cost of SDPA with is_causal=True relative to no mask (same fit):
# FlashAttention skips the blocks above the diagonal, a bit more than half of the work remains.
DENSE_CAUSAL_FACTOR = 0.565

# Per-element cost of SDPA with a boolean attn_mask relative to no mask (same fit): a mask
# rules out the flash kernel, and the kernel that takes it costs more per element.
DENSE_MASK_FACTOR = 1.85

# auto considers SDPA with a boolean mask only up to this many mask elements
# (L_q * L_k * mask heads; 2**26 = an 8192 x 8192 mask): the mask is materialised and
# cached, and SDPA builds an additive bias of as many elements in the inputs' dtype.
DENSE_MASK_MAX_ELEMENTS = 1 << 26

#: variants of the dense path: no mask, is_causal=True, boolean attn_mask
DENSE_VARIANTS = ("no mask", "causal", "bool mask")


def predict_attention_ms(
    path: str,
    work: float,
    *,
    head_dim: int,
    backward: bool,
    dense_variant: str = "no mask",
    block_size: tuple[int, int] = (64, 64),
    window: int = 16,
) -> float:
    r"""The cost model's milliseconds for one call (see the module docstring).

    Args:
        path: ``"dense"``, ``"block"``, ``"element"`` or ``"vector"``.
        work: summed over the ``B * H`` (batch, head) pairs: ``L_q * L_k`` elements
            (dense), non-empty blocks (block), allowed elements (element), compacted
            (query window, key) entries (vector).
        head_dim: ``D``; per-unit costs scale with ``D / 64``.
        backward: forward + backward (:data:`COST_MODELS` ``["fwdbwd"]``), else forward.
        dense_variant: one of :data:`DENSE_VARIANTS` (dense path).
        block_size: ``(BM, BN)`` (block path); the per-block cost scales with
            ``BM * BN / 64**2``.
        window: ``W`` (vector path); the per-entry cost scales with ``W / 16``.
    """
    model = COST_MODELS["fwdbwd" if backward else "fwd"]
    d = head_dim / 64.0
    if path == "dense":
        factors = {"no mask": 1.0, "causal": DENSE_CAUSAL_FACTOR, "bool mask": DENSE_MASK_FACTOR}
        if dense_variant not in factors:
            raise ValueError(f"dense_variant must be one of {DENSE_VARIANTS}, got {dense_variant!r}")
        return model.dense_overhead_ms + model.dense_ms_per_element * factors[dense_variant] * d * work
    if path == "block":
        area = block_size[0] * block_size[1] / 4096.0
        return model.block_overhead_ms + model.block_ms_per_block * d * area * work
    if path == "element":
        return model.element_overhead_ms + model.element_ms_per_edge * d * work
    if path == "vector":
        return model.vector_overhead_ms + model.vector_ms_per_entry * d * (window / 16.0) * work
    raise ValueError(f"path must be 'dense', 'block', 'element' or 'vector', got {path!r}")
