"""The ``attention`` suite: masked attention forward / forward+backward.

    python -m benchmarks.run --suite attention                 # 30 cases, ~4 min on an H100
    python -m benchmarks.run --suite attention --quick         # window and bigbird at 4096 / 16384
    python -m benchmarks.run --suite attention --cases 'bigbird-*' --backends 'fusegnn,flex'

**Cases** ``{mask}-L{L}-{mode}`` for ``L`` in 1024, 4096, 16384 and ``mode`` ``fwd`` (the
forward of a training step: inputs require grad, no backward) or ``fwdbwd`` (forward,
then backward of a random ``dO``), batch 4, 12 heads, head dim 64, bfloat16 (issue 5):

* ``window`` -- sliding window ``|q - k| <= 256``;
* ``bigbird`` -- first 64 tokens global, window ``+-256``, 3% of the 64 x 64 blocks random
  (seed 0);
* ``causal`` -- ``k <= q``;
* ``longformer`` -- window ``+-256`` and 64 global tokens;
* ``dilated`` -- ``|q - k| <= 128 * 2`` and ``(q - k) % 2 == 0`` (the window's span, half its keys).

Opt-in cases (run only when ``--cases`` names them, e.g. ``--cases 'full-*'``):

* ``full`` -- every key (dense attention); with the ``fusegnn-nm`` backend, the dense
  N:M case of issue 19 (``sdpa`` computes the same unmasked function there);
* ``irregular1``, ``irregular5`` -- element-irregular masks of issue 17: each ``(q, k)``
  allowed independently with probability 1 % / 5 % (seeded, drawn on the CPU), far too
  scattered for blocks (every 64 x 64 block is non-empty). With the ``fusegnn-vector*``
  backends: ``--cases 'irregular*-L4096-*,irregular*-L16384-*' --backends
  'flex,fusegnn-element,fusegnn-vector*'``.

Each definition is a :mod:`fusegnn.attention.masks` object; FlexAttention gets the same
predicate through ``mask.mask_mod``.

**Backends** (default: ``sdpa``, ``flex``, ``fusegnn`` and their ``*-graphed`` twins):

* ``fusegnn`` -- :func:`fusegnn.attention.sparse_attention.sparse_attention`,
  ``aggregation="auto"``: the fused block kernel, the element path, or dense SDPA where
  the calibrated cost model predicts it faster (the ``path`` column says what it picked:
  ``block 64x64``, ``element``, ``dense sdpa (causal)``, ``dense sdpa (bool mask)``,
  ``dense sdpa (no mask)``; decided for a training step, as the inputs require grad in
  both modes). Its block layout (and a dense path's boolean mask) is built and cached on
  the mask before timing; ``layout_ms`` is the layout's one-off cost;
* ``fusegnn-block``, ``fusegnn-element``, ``fusegnn-dense`` (opt-in) -- the paths forced;
* ``fusegnn-vector``, ``fusegnn-vector32``, ``fusegnn-vector64`` (opt-in) -- the vector
  path (query windows of ``W`` = 16, 32, 64 rows with compacted key columns; issue 17),
  its structure built and cached outside timing (``layout_ms``);
* ``fusegnn-nm`` (opt-in) -- dynamic 2:4 sparse attention (DFSS, issue 19): the block
  kernel with ``nm=(2, 4)`` (of every 4 consecutive keys the 2 largest allowed scores
  enter the softmax). It computes a different function than the masked rows, so it is
  checked against float32 SDPA given the mask *and* the 2:4 selection made on float32
  scores (``checked_against`` says so); ``vs_block`` = ``fusegnn-block`` ms / its ms
  (the issue's target: above 1 / 1.15). The issue's comparison:
  ``--cases 'full-*,bigbird-*,longformer-*' --backends 'sdpa,fusegnn-block,fusegnn-nm'``;
* ``flex`` -- ``torch.compile(flex_attention)`` with
  ``create_block_mask(mask.mask_mod, None, None, L, L)`` built once outside timing
  (``layout_ms``), FlexAttention's default 128 x 128 blocks;
* ``sdpa`` -- dense ``scaled_dot_product_attention`` **without** a mask (flash): the
  "dense" anchor of the issue. It computes a different function, so it is not checked;
* ``sdpa-mask`` (opt-in) -- dense SDPA given the boolean mask;
* ``sdpa-causal`` (opt-in) -- dense SDPA with ``is_causal=True`` (the ``causal`` cases
  only; other masks are reported as not applicable);
* ``sdpa-graphed``, ``flex-graphed``, ``fusegnn-graphed`` -- the same step (forward, or
  forward + backward into the inputs' ``.grad``) captured into one
  :class:`torch.cuda.CUDAGraph` (:func:`benchmarks.graphs.capture_step`: 3 eager calls on
  a side stream, then the recording) and timed per replay: a training loop that
  captures its step pays no host launch cost, which decides the short cases. CUDA only,
  ``L <= 4096`` (at 16384 the step is GPU-bound and the replay saves nothing). Before
  timing, one replay's outputs (and gradients) must equal the eager step's on the same
  inputs within the tolerance below (``replay_rel_err``), and masked rows are checked
  against the reference like their eager twins. A capture that fails (a host sync inside
  the step) is recorded with its reason.

**Correctness before timing.** Every masked backend runs once on the case's inputs (for
``fwdbwd`` with the backward); its output (and ``dq, dk, dv``) on batch 0, heads 0-1 are
compared with float32 SDPA given the dense boolean mask on those heads (attention is
independent per batch and head). Max-norm relative error ``max|x - x_ref| / max|x_ref|``
must be below ``max(--rtol, 3e-2)`` (bfloat16 inputs), else the row is ``mismatch`` and
not timed.

**Columns.** ``ms`` (median of ``--steps`` CUDA-event timed steps, see
:mod:`benchmarks.measure`; after every backend of a case has been checked, warmed up and
measured for memory and launches on its own, the steps are taken again **interleaved**:
5 rounds that run the backends in turn, so that the host's speed, which bounds the short
cases, drifts over all backends alike -- :func:`benchmarks.measure.interleaved_ms`), ``vs_flex`` = flex ms / ms, ``vs_sdpa`` = sdpa ms / ms (above
1: faster; a ``*-graphed`` row is compared with ``sdpa-graphed`` and ``flex-graphed``,
the captured anchors), ``density`` (allowed elements / ``L^2``), ``block_density`` (non-empty blocks
of the row's layout: fusegnn's BM x BN, flex's 128 x 128), ``ideal_ms`` = sdpa ms x
density, ``peak_mem_mib``.

On a CPU (``--allow-cpu``, a smoke run) the sizes shrink to batch 1, 2 heads, head dim 32,
float32, ``L`` = 256 (``window`` ``+-16``, 8 global tokens), and ``flex`` is unavailable.
"""

from __future__ import annotations

import fnmatch
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks import graphs
from benchmarks.backends import cuda_graph_unavailable
from benchmarks.measure import free_memory, interleaved_ms, is_oom, measure
from benchmarks.report import ResultFile, clean_number, environment, gpu_slug, update_readme

__all__ = [
    "AttnCase",
    "AttnSizes",
    "BACKENDS",
    "DEFAULT_BACKENDS",
    "GPU_SIZES",
    "CPU_SIZES",
    "attention_cases",
    "build_mask",
    "list_suite",
    "main_from_harness",
    "render_markdown",
    "run_attention_suite",
    "select_attention_backends",
    "select_attention_cases",
]

SUITE = "attention"
ANCHOR = "sdpa"
MASKS = ("window", "bigbird", "causal", "longformer", "dilated")
#: masks of the opt-in cases (selected only by name, ``--cases``)
OPT_IN_MASKS = ("full", "irregular1", "irregular5")
#: element density of the ``irregular*`` masks
IRREGULAR_DENSITY = {"irregular1": 0.01, "irregular5": 0.05}
#: the N:M pattern of the ``fusegnn-nm`` backend
NM = (2, 4)
MODES = ("fwd", "fwdbwd")
QUICK = {("window", 4096), ("window", 16384), ("bigbird", 4096), ("bigbird", 16384)}
MIN_RTOL = 3e-2
CHECK_HEADS = 2
#: Longest sequence the ``*-graphed`` rows run at.
GRAPHED_MAX_L = 4096


@dataclass(frozen=True)
class AttnSizes:
    """Problem sizes of the suite (the GPU grid, or the CPU smoke grid)."""

    batch: int
    heads: int
    head_dim: int
    lengths: tuple[int, ...]
    dtype: torch.dtype
    window: int
    num_global: int
    random_block: int
    random_density: float
    dilated_window: int
    dilation: int


GPU_SIZES = AttnSizes(4, 12, 64, (1024, 4096, 16384), torch.bfloat16, 256, 64, 64, 0.03, 128, 2)
CPU_SIZES = AttnSizes(1, 2, 32, (256,), torch.float32, 16, 8, 16, 0.05, 8, 2)


@dataclass(frozen=True)
class AttnCase:
    name: str
    mask: str
    L: int
    mode: str
    quick: bool

    def info(self, sizes: AttnSizes) -> dict:
        return {
            "suite": SUITE, "mask": self.mask, "L": self.L, "mode": self.mode, "batch": sizes.batch,
            "heads": sizes.heads, "head_dim": sizes.head_dim, "dtype": str(sizes.dtype).replace("torch.", ""),
        }


def build_mask(name: str, L: int, sizes: AttnSizes = GPU_SIZES, seed: int = 0):
    """The :class:`~fusegnn.attention.masks.Mask` of a case (definitions in the module doc)."""
    from fusegnn.attention import masks

    if name == "window":
        return masks.sliding_window(L, sizes.window)
    if name == "bigbird":
        return masks.bigbird(L, sizes.window, sizes.num_global, sizes.random_block, sizes.random_density, seed)
    if name == "causal":
        return masks.causal(L)
    if name == "longformer":
        return masks.longformer(L, sizes.window, sizes.num_global)
    if name == "dilated":
        return masks.dilated(L, sizes.dilated_window, sizes.dilation)
    if name == "full":
        return masks.sliding_window(L, L)
    if name in IRREGULAR_DENSITY:
        gen = torch.Generator().manual_seed(seed)
        rows = [torch.rand(min(1024, L - r), L, generator=gen) < IRREGULAR_DENSITY[name] for r in range(0, L, 1024)]
        return masks.from_dense(torch.cat(rows))
    raise ValueError(f"unknown mask {name!r}; known: {MASKS + OPT_IN_MASKS}")


def attention_cases(sizes: AttnSizes = GPU_SIZES) -> list[AttnCase]:
    """All cases, grouped by (mask, L) so that a mask's preparation is shared by its modes."""
    return [
        AttnCase(f"{m}-L{L}-{mode}", m, L, mode, (m, L) in QUICK or sizes is not GPU_SIZES)
        for m in MASKS
        for L in sizes.lengths
        for mode in MODES
    ]


def opt_in_cases(sizes: AttnSizes = GPU_SIZES) -> list[AttnCase]:
    """The cases run only when ``--cases`` names them (:data:`OPT_IN_MASKS`)."""
    return [AttnCase(f"{m}-L{L}-{mode}", m, L, mode, False) for m in OPT_IN_MASKS for L in sizes.lengths
            for mode in MODES]


def select_attention_cases(patterns: list[str] | None, quick: bool, sizes: AttnSizes = GPU_SIZES) -> list[AttnCase]:
    cases = [c for c in attention_cases(sizes) if c.quick or not quick]
    if patterns:
        cases += opt_in_cases(sizes)
        cases = [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    return cases


# ----------------------------------------------------------------------------- backends
@dataclass
class Prepared:
    """One (mask, L): the mask, the inputs and each backend's prebuilt structures."""

    mask: Any
    q: Tensor
    k: Tensor
    v: Tensor
    grad: Tensor
    dense_check: Tensor  # bool [L, L] on the device
    extras: dict = field(default_factory=dict)


@dataclass(frozen=True)
class AttnBackend:
    """A way to compute a case's attention.

    Attributes:
        name: the backend name in results.
        default: run when ``--backends`` is not given.
        unavailable: ``device -> None`` if it can run there, else the reason.
        prepare: ``(prep, device) -> (fn(q, k, v) -> out, info)``; ``info`` fills record
            fields (``aggregation``, ``block_size``, ...). Built outside timing.
        checked: compare with the float32 masked reference (not for unmasked SDPA).
        graphed: time the step captured into a CUDA graph (replays).
        applies: whether the backend runs a case (others are left out silently).
        nm: ``(N, M)`` of an N:M backend: its reference also makes the N:M selection.
    """

    name: str
    default: bool
    unavailable: Callable[[torch.device], str | None]
    prepare: Callable[[Prepared, torch.device], tuple[Callable[[Tensor, Tensor, Tensor], Tensor], dict]]
    checked: bool = True
    graphed: bool = False
    applies: Callable[[AttnCase], bool] = field(default=lambda case: True)
    nm: tuple[int, int] | None = None


def _always(device: torch.device) -> str | None:
    return None


def _fusegnn(aggregation: str, nm: tuple[int, int] | None = None, block_size: int | None = None):
    def prepare(prep: Prepared, device: torch.device):
        from fusegnn.attention.sparse_attention import _block_layout, explain_attention, sparse_attention
        from fusegnn.attention.vector_windows import vector_structure

        info: dict = {}
        # the timed calls have inputs that require grad (both modes): decide as they will
        decision = explain_attention(prep.q, prep.mask, aggregation=aggregation, backward=True, nm=nm,
                                     block_size=block_size)
        info["aggregation"] = decision.name if decision.name == "block" else decision.label
        if aggregation == "auto" and device.type == "cuda":  # the rule built (and cached) the layout
            layout = _block_layout(prep.mask, None, device)[0]  # a dilated mask: its sub-sequences' layout
            info["block_density"] = layout.block_density
        if decision.name == "block":
            key = ("layout_ms", aggregation)
            split = nm is None  # N:M runs the mask's own layout (never its sub-sequences)
            key = ("layout_ms", aggregation, split)
            if key not in prep.extras:  # build outside timing (cached on the mask), time it once
                mask = prep.mask
                start = time.perf_counter()
                layout = _block_layout(mask, None, device, split=split)[0]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                prep.extras[key] = (time.perf_counter() - start) * 1e3
                prep.extras[("layout", split)] = layout
            layout = prep.extras[("layout", split)]
            dilated = f" dilation {decision.dilation}" if decision.dilation > 1 else ""
            pattern = f" nm {nm[0]}:{nm[1]}" if nm is not None else ""
            info.update(layout_ms=prep.extras[key], block_size=f"{layout.BM}x{layout.BN}{dilated}{pattern}",
                        block_density=layout.block_density)
        elif decision.name == "element":
            prep.mask.to_graph(device=device)  # build (cached) outside timing
        elif decision.name == "vector":  # build (cached on the mask) outside timing, time it once
            start = time.perf_counter()
            structure = vector_structure(prep.mask, decision.vector_sizes[0], device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            info.update(layout_ms=(time.perf_counter() - start) * 1e3, block_size=decision.label,
                        block_density=structure.num_entries * structure.W / (structure.num_heads * structure.L_q
                                                                             * structure.L_k))

        def fn(q, k, v):
            return sparse_attention(q, k, v, prep.mask, aggregation=aggregation, nm=nm, block_size=block_size)

        return fn, info

    return prepare


def _fusegnn_unavailable(aggregation: str):
    def check(device: torch.device) -> str | None:
        if aggregation in ("block", "vector"):
            from fusegnn.kernels._triton import fused_can_run

            probe = torch.empty(0, device=device)
            if not fused_can_run(probe):
                return "the fused kernel needs CUDA (or TRITON_INTERPRET=1)"
        return None

    return check


def _flex_unavailable(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "compiled FlexAttention runs on CUDA only here"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as err:
        return f"torch.nn.attention.flex_attention missing: {err}"
    return None


_FLEX: dict[str, Any] = {}


def _compiled_flex():
    if "fn" not in _FLEX:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # one compiled graph per (mask, L, grad mode): more than dynamo's default 8
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 1024
            )
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def _flex(prep: Prepared, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    L = prep.q.size(2)
    if "block_mask" not in prep.extras:
        start = time.perf_counter()
        block_mask = create_block_mask(prep.mask.mask_mod, None, None, L, L, device=device)
        torch.cuda.synchronize(device)
        prep.extras["flex_layout_ms"] = (time.perf_counter() - start) * 1e3
        prep.extras["block_mask"] = block_mask
    block_mask = prep.extras["block_mask"]
    flex = _compiled_flex()
    sparsity = getattr(block_mask, "sparsity", None)
    info = {"layout_ms": prep.extras["flex_layout_ms"], "block_size": "128x128"}
    if callable(sparsity):
        info["block_density"] = 1.0 - float(sparsity()) / 100.0

    def fn(q, k, v):
        return flex(q, k, v, block_mask=block_mask)

    return fn, info


def _sdpa(prep: Prepared, device: torch.device):
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v)), {"aggregation": "dense, no mask"}


def _sdpa_mask(prep: Prepared, device: torch.device):
    dense = prep.dense_check
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)), {"aggregation": "dense + bool mask"}


def _sdpa_causal(prep: Prepared, device: torch.device):
    if prep.mask.structure(device) != "causal":
        raise ValueError("not applicable: sdpa-causal computes causal attention and this mask is not causal")
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), {"aggregation": "dense, is_causal"}


def _short(case: AttnCase) -> bool:
    """The cases a ``*-graphed`` row runs: launch cost matters there."""
    return case.L <= GRAPHED_MAX_L


def _graphed(name: str, unavailable, prepare, checked: bool = True) -> AttnBackend:
    return AttnBackend(name, True, cuda_graph_unavailable(unavailable), prepare, checked, graphed=True, applies=_short)


BACKENDS: dict[str, AttnBackend] = {
    b.name: b
    for b in (
        AttnBackend("sdpa", True, _always, _sdpa, checked=False),
        _graphed("sdpa-graphed", _always, _sdpa, checked=False),
        AttnBackend("flex", True, _flex_unavailable, _flex),
        _graphed("flex-graphed", _flex_unavailable, _flex),
        AttnBackend("fusegnn", True, _always, _fusegnn("auto")),
        _graphed("fusegnn-graphed", _always, _fusegnn("auto")),
        AttnBackend("fusegnn-block", False, _fusegnn_unavailable("block"), _fusegnn("block")),
        AttnBackend("fusegnn-element", False, _always, _fusegnn("element")),
        AttnBackend("fusegnn-dense", False, _always, _fusegnn("dense")),
        AttnBackend("fusegnn-vector", False, _fusegnn_unavailable("vector"), _fusegnn("vector")),
        AttnBackend("fusegnn-vector32", False, _fusegnn_unavailable("vector"), _fusegnn("vector", block_size=32)),
        AttnBackend("fusegnn-vector64", False, _fusegnn_unavailable("vector"), _fusegnn("vector", block_size=64)),
        AttnBackend("fusegnn-nm", False, _fusegnn_unavailable("block"), _fusegnn("block", NM), nm=NM),
        AttnBackend("sdpa-mask", False, _always, _sdpa_mask),
        AttnBackend("sdpa-causal", False, _always, _sdpa_causal),
    )
}
DEFAULT_BACKENDS = tuple(name for name, b in BACKENDS.items() if b.default)


def select_attention_backends(
    device: torch.device, patterns: list[str] | None
) -> tuple[list[AttnBackend], dict[str, str]]:
    names = list(BACKENDS) if patterns else list(DEFAULT_BACKENDS)
    if patterns:
        names = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    runnable, unavailable = [], {}
    for name in names:
        why = BACKENDS[name].unavailable(device)
        if why:
            unavailable[name] = why
        else:
            runnable.append(BACKENDS[name])
    return runnable, unavailable


# ----------------------------------------------------------------------------- running
def _rel(x: Tensor, ref: Tensor) -> float:
    scale = ref.abs().max().item()
    return (x.float() - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def _nm_selection(q: Tensor, k: Tensor, allowed: Tensor, nm: tuple[int, int], rows: int = 2048) -> Tensor:
    """bool ``[1, H, L, L]``: the N:M selection (:func:`fusegnn.kernels.nm_sparsity.nm_keep`)
    on the float32 scores of ``q``, ``k`` ``[1, H, L, D]`` under ``allowed`` ``[L, L]``,
    ``rows`` query rows at a time (the selection's temporaries are ``M`` times the scores)."""
    from fusegnn.kernels.nm_sparsity import nm_keep

    keep = torch.empty(q.shape[:3] + (k.size(2),), dtype=torch.bool, device=q.device)
    scale = 1.0 / math.sqrt(q.size(-1))
    for start in range(0, q.size(2), rows):
        sl = slice(start, start + rows)
        scores = (q[:, :, sl] @ k.transpose(-1, -2)) * scale
        keep[:, :, sl] = nm_keep(scores, allowed[sl], *nm)
    return keep


def _reference(prep: Prepared, with_grad: bool, nm: tuple[int, int] | None = None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """float32 SDPA with the dense mask (and, for ``nm``, the N:M selection made on the
    float32 scores) on batch 0, heads 0..CHECK_HEADS-1."""
    sl = [t[:1, :CHECK_HEADS].detach().float().requires_grad_(with_grad) for t in (prep.q, prep.k, prep.v)]
    allowed = prep.dense_check
    if nm is not None:
        with torch.no_grad():
            allowed = _nm_selection(sl[0], sl[1], allowed, nm)
    out = F.scaled_dot_product_attention(*sl, attn_mask=allowed)
    if not with_grad:
        return out.detach(), ()
    out.backward(prep.grad[:1, :CHECK_HEADS].float())
    return out.detach(), tuple(t.grad for t in sl)


def _run_once(fn, prep: Prepared, with_grad: bool) -> tuple[Tensor, ...]:
    """``(out,)``, or ``(out, dq, dk, dv)`` after the backward of ``prep.grad``."""
    q, k, v = (t.detach().requires_grad_(with_grad) for t in (prep.q, prep.k, prep.v))
    out = fn(q, k, v)
    if not with_grad:
        return (out.detach(),)
    out.backward(prep.grad)
    return (out.detach(), q.grad, k.grad, v.grad)


def _error_vs_reference(outputs: tuple[Tensor, ...], ref) -> float:
    """Largest relative error of ``outputs`` (batch 0, the checked heads) against ``ref``."""
    refs = (ref[0], *ref[1])
    return max(_rel(t[:1, :CHECK_HEADS], r) for t, r in zip(outputs, refs))


def _check(fn, prep: Prepared, with_grad: bool, ref) -> float:
    return _error_vs_reference(_run_once(fn, prep, with_grad), ref)


def _phases(fn, prep: Prepared, mode: str):
    q, k, v = (t.detach().requires_grad_() for t in (prep.q, prep.k, prep.v))
    if mode == "fwd":
        return [lambda: fn(q, k, v)]

    def step():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(prep.grad)

    return [step]


def _captured_phases(fn, prep: Prepared, mode: str, device: torch.device) -> tuple[list, Callable[[], tuple]]:
    """``([replay], replay)`` of the step of ``mode`` captured by
    :func:`benchmarks.graphs.capture_step`; a replay returns ``_run_once``'s outputs
    (static tensors, overwritten by the next replay)."""
    q, k, v = (t.detach().requires_grad_() for t in (prep.q, prep.k, prep.v))

    def step() -> tuple[Tensor, ...]:
        if mode == "fwd":
            return (fn(q, k, v).detach(),)
        q.grad = k.grad = v.grad = None  # the recorded backward writes fresh gradients
        out = fn(q, k, v)
        out.backward(prep.grad)
        return (out.detach(), q.grad, k.grad, v.grad)

    replay = graphs.capture_step(step, device)
    return [replay], replay


def _replay_error(replay: Callable[[], tuple], fn, prep: Prepared, with_grad: bool) -> tuple[float, tuple]:
    """``(max relative error of one replay against the eager step, the replay's outputs)``."""
    replayed = tuple(t.clone() for t in replay())
    eager = _run_once(fn, prep, with_grad)
    return max(_rel(a, b.float()) for a, b in zip(replayed, eager)), replayed


def _prepare(case: AttnCase, sizes: AttnSizes, device: torch.device, seed: int) -> Prepared:
    mask = build_mask(case.mask, case.L, sizes, seed)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (sizes.batch, sizes.heads, case.L, sizes.head_dim)
    q, k, v, g = (torch.randn(shape, generator=gen).to(device, sizes.dtype) for _ in range(4))
    return Prepared(mask, q, k, v, g, mask.dense(device))


def new_record(case: AttnCase, backend: str) -> dict:
    return {
        "case": case.name, "backend": backend, "ok": False, "error": None, "ms": None, "peak_mem_mib": None,
        "launches": None, "aggregation": None, "block_size": None, "density": None, "block_density": None,
        "ideal_ms": None, "vs_flex": None, "vs_sdpa": None, "vs_block": None, "layout_ms": None, "rel_err": None,
        "checked_against": None, "steps": None, "warmup_steps": None, "ms_alone": None, "replay_rel_err": None,
    }


def _describe(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".strip().splitlines()
    return text[0][:300] if text else type(err).__name__


def run_case(case, backends, prep: Prepared, sizes, args, device, emit) -> None:
    with_grad = case.mode == "fwdbwd"
    density = prep.dense_check.float().mean().item()
    rtol = max(args.rtol, MIN_RTOL)
    refs: dict = {}  # per N:M pattern (None: the mask alone)
    records = []
    timed = []  # (record, phases) of the backends timed, for the interleaved pass
    for backend in (b for b in backends if b.applies(case)):
        record = new_record(case, backend.name)
        record["density"] = density
        try:
            fn, info = backend.prepare(prep, device)
            record.update({k: v for k, v in info.items() if k in record})
            outputs = None
            if backend.graphed:
                phases, replay = _captured_phases(fn, prep, case.mode, device)
                err, outputs = _replay_error(replay, fn, prep, with_grad)
                record["replay_rel_err"] = err
                if not math.isfinite(err) or err > rtol:
                    record["error"] = f"replay mismatch: rel err {err:.3g} > {rtol:g} vs the eager step"
                    records.append(record)
                    continue
            else:
                phases = _phases(fn, prep, case.mode)
            if backend.checked:
                if backend.nm not in refs:
                    refs[backend.nm] = _reference(prep, with_grad, backend.nm)
                ref = refs[backend.nm]
                err = _check(fn, prep, with_grad, ref) if outputs is None else _error_vs_reference(outputs, ref)
                against = "sdpa(float32, dense mask)"
                if backend.nm is not None:
                    against = f"sdpa(float32, dense mask + {backend.nm[0]}:{backend.nm[1]} selection)"
                record["rel_err"], record["checked_against"] = err, against
                if not math.isfinite(err) or err > rtol:
                    record["error"] = f"mismatch: rel err {err:.3g} > {rtol:g}"
                    records.append(record)
                    continue
            m = measure(
                phases, device, steps=args.steps, warmup=args.warmup,
                warmup_s=args.warmup_s, launches=not args.no_launches and case.L <= 1024,
            )
            record.update(ok=True, ms=m.ms[0], peak_mem_mib=m.peak_mem_mib, launches=m.launches[0],
                          steps=m.steps, warmup_steps=m.warmup_steps)
            timed.append((record, phases))
        except Exception as err:  # noqa: BLE001 - one backend's failure is a result
            record["error"] = "OOM" if is_oom(err) else _describe(err)
            free_memory(device)
        records.append(record)
    if len(timed) > 1 and device.type == "cuda":  # the same steps again, backends in turn
        try:
            medians = interleaved_ms([phases for _, phases in timed], device, steps=args.steps)
            for (record, _), ms in zip(timed, medians):
                record["ms_alone"], record["ms"] = record["ms"], ms
        except Exception as err:  # noqa: BLE001 - keep the separate timings
            free_memory(device)
            for record, _ in timed:
                record["interleave_error"] = _describe(err)
    by_name = {r["backend"]: r for r in records}
    for r in records:
        graphed = BACKENDS[r["backend"]].graphed if r["backend"] in BACKENDS else False
        sdpa_ms = by_name.get(anchor_name("sdpa", graphed), {}).get("ms")
        flex_ms = by_name.get(anchor_name("flex", graphed), {}).get("ms")
        if r["ms"]:
            r["vs_sdpa"] = sdpa_ms / r["ms"] if sdpa_ms else None
            r["vs_flex"] = flex_ms / r["ms"] if flex_ms else None
            block_ms = by_name.get("fusegnn-block", {}).get("ms")
            if r["backend"] == "fusegnn-nm" and block_ms:
                r["vs_block"] = block_ms / r["ms"]
        r["ideal_ms"] = sdpa_ms * density if sdpa_ms else None
        emit(r)


def anchor_name(anchor: str, graphed: bool) -> str:
    """The row a backend is compared with: ``sdpa`` / ``flex``, or their captured twins
    for a ``*-graphed`` row (eager against eager, replay against replay)."""
    return f"{anchor}-graphed" if graphed else anchor


def _fmt(v, digits=3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def render_markdown(doc: dict, heading: str = "##") -> str:
    lines = [
        f"{heading} attention on {doc.get('device')} (torch {doc.get('torch')}, triton {doc.get('triton')})",
        "",
        "Anchor: `sdpa` = dense SDPA without a mask. vs flex / vs sdpa: their ms / this row's ms "
        "(above 1: faster; `*-graphed` rows, CUDA-graph replays, against `flex-graphed` / `sdpa-graphed`). "
        "ideal = sdpa ms x density.",
        "",
        "| case | backend | ms | vs flex | vs sdpa | ideal ms | density | block density | path | status |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    order = {name: i for i, name in enumerate(BACKENDS)}
    case_order = {name: i for i, name in enumerate(doc.get("cases", {}))}
    for r in sorted(doc["records"], key=lambda r: (case_order.get(r["case"], 1 << 30), order.get(r["backend"], 99))):
        status = "ok" if r["ok"] else (r["error"] or "failed")
        path = r.get("aggregation") or ""
        if r.get("block_size"):
            path = f"{path} {r['block_size']}".strip()
        lines.append(
            f"| {r['case']} | {r['backend']} | {_fmt(r['ms'])} | {_fmt(r['vs_flex'], 3)} | {_fmt(r['vs_sdpa'], 3)} | "
            f"{_fmt(r['ideal_ms'])} | {_fmt(r['density'], 3)} | {_fmt(r['block_density'], 3)} | {path} | {status} |"
        )
    if doc.get("unavailable"):
        lines.append("")
        lines += [f"* `{k}` not available: {v}" for k, v in doc["unavailable"].items()]
    return "\n".join(lines) + "\n"


def write_png(doc: dict, path: Path) -> str | None:
    """Grouped bars (log scale) of each case's ms per backend."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    cases = list(doc.get("cases", {}))
    backends = [b for b in BACKENDS if any(r["backend"] == b for r in doc["records"])]
    if not cases or not backends:
        return "no records"
    ms = {(r["case"], r["backend"]): r["ms"] for r in doc["records"] if r["ok"]}
    fig, ax = plt.subplots(figsize=(max(8, len(cases) * 0.6), 4.5))
    width = 0.8 / len(backends)
    for i, b in enumerate(backends):
        xs = [j + i * width for j, c in enumerate(cases) if (c, b) in ms]
        ax.bar(xs, [ms[(c, b)] for c in cases if (c, b) in ms], width, label=b)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases, rotation=70, ha="right", fontsize=7)
    ax.set(yscale="log", ylabel="ms (median)", title=f"attention, {doc.get('device')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def list_suite(args, device: torch.device) -> None:
    cases = select_attention_cases(args.cases, args.quick, GPU_SIZES)
    print(f"suite {SUITE}: {len(cases)} of {len(attention_cases(GPU_SIZES))} cases (a CPU smoke run uses L = 256 only)")
    for case in cases:
        print(f"  {case.name}")
    runnable, unavailable = select_attention_backends(device, args.backends)
    print("  backends:", ", ".join(b.name for b in runnable) or "none")
    for name, why in unavailable.items():
        print(f"  not available: {name}: {why}")
    print("  all backend names:", ", ".join(BACKENDS))


def run_attention_suite(args, device: torch.device, started: float | None = None, sizes: AttnSizes | None = None) -> str:
    """Run the suite with the harness's options (``benchmarks.run.parse_args``); returns
    the markdown table. Writes ``<out>/attention/<gpu-slug>.{json,md,png}``."""
    from tqdm.auto import tqdm

    started = time.perf_counter() if started is None else started
    if sizes is None:
        sizes = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    cases = select_attention_cases(args.cases, args.quick, sizes)
    if not cases:
        known = ", ".join(c.name for c in select_attention_cases(None, args.quick, sizes))
        raise SystemExit(f"benchmarks: --cases {args.cases} matches no attention case; known: {known}")
    backends, unavailable = select_attention_backends(device, args.backends)
    if not backends:
        raise SystemExit(f"benchmarks: no attention backend can run here: {unavailable}")
    header = environment(device)
    header.update(
        suite=SUITE,
        anchor=ANCHOR,
        config=dict(
            steps=args.steps, warmup=args.warmup, warmup_s=args.warmup_s, rtol=max(args.rtol, MIN_RTOL),
            seed=args.seed, quick=args.quick, sizes={k: (str(v) if isinstance(v, torch.dtype) else v)
                                                     for k, v in vars(sizes).items()},
        ),
        cases={c.name: c.info(sizes) for c in cases},
        datasets={},
        unavailable=unavailable,
    )
    path = Path(args.out) / SUITE / f"{gpu_slug(device)}.json"
    results = ResultFile(path, header, append=args.append, rerun_cases=[c.name for c in cases])
    total = sum(1 for c in cases for b in backends if b.applies(c))
    bar = tqdm(total=total, desc=SUITE, file=sys.stderr, disable=True if args.quiet else None, dynamic_ncols=True)
    groups: dict[tuple[str, int], list[AttnCase]] = {}
    for case in cases:
        groups.setdefault((case.mask, case.L), []).append(case)
    try:
        for (mask_name, L), group in groups.items():
            prep = None
            for case in group:
                bar.set_description(f"{SUITE} {case.name}")
                applicable = [b for b in backends if b.applies(case)]
                if args.time_limit is not None and time.perf_counter() - started > args.time_limit:
                    for b in applicable:
                        record = new_record(case, b.name)
                        record["error"] = f"not run: --time-limit {args.time_limit:g} s reached"
                        results.add(record)
                        bar.update()
                    continue
                try:
                    if prep is None:
                        prep = _prepare(case, sizes, device, args.seed)

                    def emit(record):
                        results.add({k: clean_number(v) if isinstance(v, float) else v for k, v in record.items()})
                        bar.update()

                    run_case(case, backends, prep, sizes, args, device, emit)
                except Exception as err:  # noqa: BLE001 - a harness error in one case must not end the run
                    done = {r["backend"] for r in results.doc["records"] if r["case"] == case.name}
                    for b in applicable:
                        if b.name not in done:
                            record = new_record(case, b.name)
                            record["error"] = "OOM" if is_oom(err) else f"harness error: {_describe(err)}"
                            results.add(record)
                            bar.update()
            del prep
            free_memory(device)
    finally:
        bar.close()
        results.write()
    table = render_markdown(results.doc)
    path.with_suffix(".md").write_text(table)
    why = None if args.no_png else write_png(results.doc, path.with_suffix(".png"))
    if args.update_readme:
        from benchmarks.report import README

        if not update_readme(README, SUITE, render_markdown(results.doc, heading="###"), str(path.name)):
            print(f"warning: no results markers for suite {SUITE!r} in {README}", file=sys.stderr)
    print(f"wrote {path} (+ .md{'' if why or args.no_png else ', .png'})", file=sys.stderr)
    return table


def main_from_harness(args, device: torch.device) -> int:
    """Entry used by ``benchmarks.run`` for ``--suite attention``."""
    if args.list:
        list_suite(args, device)
        return 0
    print(run_attention_suite(args, device))
    return 0


