"""Which implementation of a sparse op runs where.

Every public op takes ``aggregation``:

* ``"reference"`` -- the pure-PyTorch oracle (:mod:`fusegnn.sparse.reference`), any device;
* ``"gas"`` -- fused gather-apply-scatter: edge-parallel over unsorted COO with atomics;
* ``"gar"`` -- fused gather-apply-reduce: segment-parallel over CSR (forward) / CSC
  (backward), no atomics;
* ``"window"`` (:func:`~fusegnn.sparse.spmm` only, and what runs nothing but it:
  :func:`~fusegnn.sparse.propagate`, ``GCNConv``, ``SGConv``, ``APPNP``) -- Jigsaw's row
  windows (:mod:`fusegnn.sparse.window_aggregation`): dense tiles of 16 target rows by
  the window's compacted source columns on tensor cores, no atomics; ``reduce="max"``
  and per-head ``[E, H]`` weights are handed to GAR (:func:`note_path`);
* ``"auto"`` -- the best registered backend for the inputs:

  1. tensors not on a CUDA device take the reference (also under the Triton
     interpreter, which only explicit ``"gas"`` / ``"gar"`` use on the CPU);
  2. in deterministic mode (below) GAR, which has no atomics;
  3. otherwise fuseGNN's rule (for ``spmm``, after the row-window rule below): GAR when the
     smaller of the graph's average in- and out-degree (:func:`smaller_side_degree`: a square
     graph's average degree; a sampled block's, whose many sources hold about one edge each,
     is about 1, not its fan-out: GAR's backward runs over those sources) is at least
     :func:`gar_min_avg_degree` of the feature width (38 at 16 columns, 20 at 64, 5 at
     256: ``python -m benchmarks.run --suite agg --sweep spmm``, see
     ``benchmarks/NOTES-spmm.md``), GAS below it. The threshold assumes the CSR / CSC
     formats are reused (transductive training); the first GAR call on a graph also
     pays the conversion. The fused attention layers (GAT, GATv2) have their own,
     lower crossover (:data:`ATTENTION_GAR_CROSSOVER`: GAR for GAT from degree 2-3.5);
  4. the reference when no kernel backend can run (Triton missing, unsupported dtype).

  For ``spmm`` one regime comes before 3: **host-bound**. When the op's work (edges x
  feature columns) is below :data:`HOST_BOUND_WORK`, its GPU time is a few microseconds
  whichever path runs, and an eager step costs what the host spends issuing it: the
  reference (three ATen ops whose backward is C++) then costs less than a fused kernel
  behind a Python autograd node (one extra thread hand-off and Python frame in every
  backward; measured on an H100 host, ``benchmarks/NOTES-overhead.md``). Inside a CUDA
  graph capture, under :func:`for_capture` (what :func:`fusegnn.graphed_step`'s warm-up
  and the ``torch.compile`` custom ops use) the host cost is paid once, so the fused
  kernels are chosen by the rule of 3 as before. An op of a training step (gradients on)
  with nothing to differentiate (a model's raw input features, aggregated before their
  projection: ``fusegnn.layers._utils.project_before_aggregating``) has no backward to pay
  for, and its bound is the larger :data:`HOST_BOUND_FORWARD_WORK`
  (:func:`host_bound_work`). With gradients off (evaluation, and the hops inside an
  autograd function such as :func:`~fusegnn.sparse.propagate`, which has its own backward)
  the bound stays :data:`HOST_BOUND_WORK`: there the wider reference would only add GPU
  time and messages. :func:`takes_host_bound_reference` is the rule on its own.

**Row windows.** For ``spmm`` one more rule comes before 3: ``"window"`` (for float16 /
bfloat16 / float32 ``x``, the vector-sparse kernels' dtypes) when the graph's row-window
tile density (the fraction of the windows' tile entries holding an edge,
:func:`~fusegnn.sparse.tile_density.estimate_tile_density`: counted on a sample of
4,096 windows, cached on the graph) is at least :data:`WINDOW_MIN_TILE_DENSITY`. Measured
on an H100 (bf16, F = 128 and 256, ``python -m benchmarks.run --suite vector --sweep
window-crossover``): on 233k-node graphs of in-degree 128 the windows beat GAR at every
tile density from 0.063 (1.18x) up, 1.7x at 0.096, 2.8-3.2x at 0.16 and 2.8-6.1x above
0.25; on the Reddit-like graph (in-degree 492, heavy-tailed) GAR won at 0.065 (and 0.080
after RCM): 8.5 against 10.8 ms forward + backward at F = 128. The threshold, 0.25, keeps
GAR wherever the sweep leaves a doubt and bounds the forward windows' tile memory to 4
entries per edge (about what the CSR they replace takes). Only the forward density is
estimated: the backward's windows (of the transposed matrix) are as dense on a symmetric
graph, but can be sparser where sources cluster differently from targets (down to
``1 / 16``, 16 entries per edge, on a graph whose forward windows are dense). The rule is for eager
calls: a CUDA-graph capture, :func:`for_capture` and the compiled custom ops keep rule 3
(the estimate's sorts sync the host, and the windows inside captured or compiled steps
have not been measured).

**Seeing the choice.** :func:`explain` returns the :class:`Decision` (backend name and
reason) for given inputs without running anything; :func:`last_decision` /
:func:`last_backend` give the one taken by the most recent op call, and
:func:`decisions_taken` collects every decision taken inside a block (e.g. one forward
of a layer: what path did it take on this graph and input?). A backend that hands
part of its work to another path (GAS hands ``reduce="max"`` and ``edge_aggregate`` to
GAR) records that with :func:`note_path`.

Under ``torch.compile`` nothing here is traced: the public ops hand their arguments to
the ``torch.library`` custom ops of :mod:`fusegnn.sparse.library`, which call
:func:`resolve_aggregation` when they run, so :func:`last_decision` is recorded at run
time, from inside the op, as eagerly.

**Determinism.** :func:`deterministic` (a context manager; :func:`set_deterministic` for
the global switch) or ``torch.use_deterministic_algorithms(True)`` route ``"auto"`` to GAR,
whose results are bitwise identical from run to run. An explicit ``aggregation="gas"`` in
that mode raises :class:`RuntimeError`, as PyTorch does for its own non-deterministic
ops; with ``torch.use_deterministic_algorithms(True, warn_only=True)`` (and
:func:`deterministic` not set) it warns and runs GAS.

Kernel backends register themselves with :func:`register_backend`. The Triton ones
(:mod:`fusegnn.sparse.kernel_backends`) are registered on the first dispatch, only if Triton can be
imported, so ``import fusegnn`` never needs Triton. Asking for a backend that is not
available raises a clear error instead of silently falling back.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor

from fusegnn.sparse.graph import Graph
from fusegnn.sparse.tile_density import estimate_tile_density
from fusegnn.sparse.vector_library import use_kernel

__all__ = [
    "AGGREGATIONS",
    "SPMM_AGGREGATIONS",
    "GAR_MIN_AVG_DEGREE",
    "GAR_CROSSOVER",
    "ATTENTION_GAR_CROSSOVER",
    "smaller_side_degree",
    "HOST_BOUND_WORK",
    "HOST_BOUND_FORWARD_WORK",
    "needs_grad",
    "host_bound_work",
    "takes_host_bound_reference",
    "for_capture",
    "capture_mode",
    "gar_min_avg_degree",
    "Backend",
    "Decision",
    "register_backend",
    "available_backends",
    "check_aggregation",
    "resolve_aggregation",
    "checks_every_call",
    "explain",
    "last_decision",
    "last_backend",
    "decisions_taken",
    "note_path",
    "record_decision",
    "backend_named",
    "deterministic",
    "set_deterministic",
    "is_deterministic",
]

AGGREGATIONS = ("auto", "gas", "gar", "reference")
# spmm alone also takes the row windows (see the module docstring)
SPMM_AGGREGATIONS = (*AGGREGATIONS, "window")

#: ``"auto"`` runs ``spmm`` on row windows from this tile density up (module docstring)
WINDOW_MIN_TILE_DENSITY = 0.25

# Degree (smaller_side_degree) at and above which "auto" prefers GAR over GAS on a GPU, by feature
# width (columns of x: H * F). Calibrated on an H200 by the "calib" stage of
# python -m benchmarks.run --suite agg --sweep spmm (fp32, forward + backward, formats cached; see
# benchmarks/NOTES-spmm.md): GAS's atomics cost grows with the width, GAR's per-row
# overhead does not, so the crossover degree falls as the features widen. Between the
# measured widths the threshold is interpolated log-log; outside, it is held constant.
GAR_CROSSOVER: tuple[tuple[int, float], ...] = ((16, 38.0), (64, 20.0), (256, 5.0))
# The threshold when the width is unknown (that of 64 columns).
GAR_MIN_AVG_DEGREE = 20.0
# The same crossover for the fused attention layers (``op`` ``"gat"``: :func:`gat_attention`,
# :func:`gat_layer`; ``"gatv2"``: :func:`gatv2_attention`), whose backward differs from
# spmm's: GAS scatters each edge's H * C-wide gradient of h (GATv2: of x_l) with atomics
# where GAR's second pass gathers it over the CSC, and both passes share the per-edge
# softmax recomputation. Measured on an H100 (fp32, attention dropout 0.6, forward +
# backward GPU time, formats cached; Cora, CiteSeer, PubMed and 100k-node graphs of average
# degree 3-151 at widths 4 / 16 / 64 (8 x 8 and 1 x 64) / 128; benchmarks/NOTES-overhead.md,
# session 16): GAT's GAR won 38 of 40 cases by 1.04-1.99x and lost 0.86-0.92x only at widths
# 4 and 16 on the degree-3 graph (so 3.5 there; CiteSeer's 3.7 went to GAR, 1.18-1.22x) and
# won from width 64 at degree 3 (1.12-1.17x); GATv2's GAR won at widths from 64 at every
# degree (1.11-2.29x; 0.84x on Cora / CiteSeer at 8 x 16); at width 16 GAS won to degree 6
# (0.95x) and they tied at 11 (so 10); at width 4 GAS won at degree 21 (0.92x) and GAR at 51
# (1.06x), not measured between (so 30, near their log-midpoint). Like spmm's, these read
# :func:`smaller_side_degree`; a sampled block (sources with about one edge each) takes GAS,
# GAT's GAR having lost there also with the formats cached (1.1-1.7x), hence 2.0 at the wide end.
ATTENTION_GAR_CROSSOVER: dict[str, tuple[tuple[int, float], ...]] = {
    "gat": ((16, 3.5), (64, 2.0)),
    "gatv2": ((4, 30.0), (16, 10.0), (64, 2.0)),
}
# Below this many edge-columns (edges x feature width), an eager spmm on a GPU is bound by
# the host (see the module docstring): Cora, CiteSeer and PubMed at widths up to 64, and
# Cora's 1,433 raw input features (10,556 x 1,433 = 15.1M: SAGE and GIN aggregate them
# first; at 2^23 they took a fused kernel and both steps were 3-6 % slower than PyG's,
# at 2^24 SAGE is 1.05x and GIN 1.00x PyG: H100, benchmarks/NOTES-overhead.md).
HOST_BOUND_WORK = 1 << 24
# The same bound for an spmm of a training step (gradients on) with no backward (no input,
# edge weight or bias needs a gradient): a forward-only reference is three ATen ops and no
# autograd node, and its GPU time (up to ~0.4 ms at 2^26 on an H100) hides behind a small
# graph's host-bound step (not in evaluation, gradients off: nothing to hide it behind).
# PubMed's 500 raw input features (88,648 x 500 = 44M), aggregated first by SAGE: 0.99x /
# 0.97x PyG eager with the fused kernel (bound 2^24), 1.06x / 1.05x with the reference
# (2^26), h64 / h16, paired rounds on an H100 (benchmarks/NOTES-overhead.md).
HOST_BOUND_FORWARD_WORK = 1 << 26


def needs_grad(*tensors: Tensor | None) -> bool:
    """Whether an op on ``tensors`` records a backward (gradients on and one of them needs
    one; ``None`` entries are skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def host_bound_work(records_backward: bool) -> int:
    """The host-bound size (edges x columns) of an eager ``spmm``: :data:`HOST_BOUND_FORWARD_WORK`
    for an op of a training step (gradients on) that records no backward, else
    :data:`HOST_BOUND_WORK`."""
    if torch.is_grad_enabled() and not records_backward:
        return HOST_BOUND_FORWARD_WORK
    return HOST_BOUND_WORK


def takes_host_bound_reference(graph: Graph, x: Tensor, aggregation: str, records_backward: bool) -> bool:
    """Whether an eager ``spmm`` of ``x`` (``[N, F]`` or ``[N, H, F]``) on ``graph`` with
    ``aggregation`` runs the ATen reference because it is host-bound: ``"auto"`` on CUDA,
    not deterministic, not captured or warming up for a capture, and edges x columns below
    :func:`host_bound_work`. The rule ``auto`` applies (see the module docstring)."""
    if aggregation != "auto" or x.device.type != "cuda" or graph.device.type != "cuda":
        return False
    if is_deterministic() or capture_mode():
        return False
    width = _feature_width((x,))
    return width is not None and graph.num_edges * width < host_bound_work(records_backward)


def smaller_side_degree(graph: Graph) -> float:
    """The degree the GAS / GAR rule reads: ``E / max(N_src, N_dst)``, the smaller of the
    average in- and out-degree (a square graph's average degree). GAR's backward runs a
    pass over the sources (the CSC), and a sampled block's many sources hold about one edge
    each: on blocks of 1,024 targets x 25 and 25,000 x 10 (25k / 200k sources, H100,
    forward + backward with the formats built per block, as a loader's blocks are) GAS ran
    spmm 1.6-7.9x and the GAT op 1.4-3.2x faster, while the in-degree (25, 10) had sent
    spmm at 64 / 256 columns and GAT to GAR (``benchmarks/NOTES-overhead.md``, session 16)."""
    return graph.num_edges / max(graph.num_src_nodes, graph.num_dst_nodes, 1)


def gar_min_avg_degree(width: int | None, op: str = "") -> float:
    """The degree (:func:`smaller_side_degree`) from which ``"auto"`` picks GAR for
    ``width`` feature columns, for ``op`` (an attention layer's own crossover,
    :data:`ATTENTION_GAR_CROSSOVER`, else spmm's :data:`GAR_CROSSOVER`), interpolated
    log-log between the measured widths."""
    points = ATTENTION_GAR_CROSSOVER.get(op, GAR_CROSSOVER)
    if width is None:
        return GAR_MIN_AVG_DEGREE if points is GAR_CROSSOVER else max(d for _, d in points)
    if width <= points[0][0]:
        return points[0][1]
    for (w0, d0), (w1, d1) in zip(points, points[1:]):
        if width == w1:
            return d1  # the measured threshold itself: exp(log(...)) is an ulp off it (10.000000000000002)
        if width < w1:
            t = math.log(width / w0) / math.log(w1 / w0)
            return math.exp(math.log(d0) + t * (math.log(d1) - math.log(d0)))
    return points[-1][1]


@dataclass(frozen=True)
class Backend:
    """A set of op implementations with the signatures of :mod:`fusegnn.sparse.reference`,
    and their backwards as plain functions with the signatures of
    :mod:`fusegnn.sparse.reference_grads`.

    The forwards are differentiable (eager autograd); the backwards are what code outside
    autograd runs, the ``torch.library`` ops of :mod:`fusegnn.sparse.library`, so that the
    compiled path dispatches its backward exactly as its forward. ``None``: the backend
    has no plain backward (such an op cannot be compiled with it).

    ``edge_aggregate`` / ``edge_aggregate_backward`` (:func:`fusegnn.sparse.edge_aggregate`)
    have the signatures of :func:`fusegnn.sparse.reference.edge_aggregate` and
    :func:`fusegnn.sparse.reference_grads.edge_aggregate_backward`; ``None``: the backend
    does not run that op (asking for it raises).

    ``supports(graph, *tensors)`` says whether this backend can run on those inputs
    (device, dtype, ...); ``None`` means always.
    """

    name: str
    spmm: Callable[..., Tensor]
    sddmm: Callable[..., Tensor]
    edge_softmax: Callable[..., Tensor]
    supports: Callable[..., bool] | None = None
    spmm_backward: Callable[..., tuple] | None = None
    sddmm_backward: Callable[..., tuple] | None = None
    edge_softmax_backward: Callable[..., Tensor] | None = None
    edge_aggregate: Callable[..., Tensor] | None = None
    edge_aggregate_backward: Callable[..., tuple] | None = None

    def can_run(self, graph: Graph, *tensors: Tensor) -> bool:
        return self.supports is None or bool(self.supports(graph, *tensors))


@dataclass(frozen=True)
class Decision:
    """The path an op takes: the backend ``name`` and the ``reason`` it was chosen."""

    name: str
    reason: str


_BACKENDS: dict[str, Backend] = {}
_kernels_loaded = False
_state = threading.local()
_deterministic_global = False
_recorders_lock = threading.Lock()
# The open decisions_taken logs are process-wide, not per thread: a CUDA backward runs in
# the autograd engine's own device threads, and its decisions must reach the block that
# started it as they do on the CPU (where the calling thread runs the backward itself).
_open_logs: tuple[list["Decision"], ...] = ()


# ------------------------------------------------------------------------- registry
def register_backend(backend: Backend) -> None:
    """Make ``backend`` selectable by its name (one of :data:`SPMM_AGGREGATIONS` but ``auto``)."""
    if backend.name not in SPMM_AGGREGATIONS or backend.name == "auto":
        raise ValueError(f"backend name must be one of {SPMM_AGGREGATIONS[1:]}, got {backend.name!r}")
    _BACKENDS[backend.name] = backend


_BACKEND_LOADERS: list[Callable[[], object]] = []


def add_backend_loader(loader: Callable[[], object]) -> None:
    """Have ``loader()`` run once, on the first dispatch, to register backends (the
    package registers the Triton ones this way: nothing imports Triton before it is
    used, and this module imports no backend)."""
    _BACKEND_LOADERS.append(loader)


def _load_kernel_backends() -> None:
    """Run the backend loaders once (the Triton backends register only if Triton can
    be imported)."""
    global _kernels_loaded
    if _kernels_loaded:
        return
    _kernels_loaded = True
    for loader in _BACKEND_LOADERS:
        loader()


def available_backends() -> tuple[str, ...]:
    """Names of the registered backends."""
    _load_kernel_backends()
    return tuple(_BACKENDS)


def check_aggregation(aggregation: str, op: str = "") -> str:
    """``aggregation`` if it is a valid choice for ``op`` (``"spmm"``: one of
    :data:`SPMM_AGGREGATIONS`; any other op: one of :data:`AGGREGATIONS`)."""
    choices = SPMM_AGGREGATIONS if op == "spmm" else AGGREGATIONS
    if not isinstance(aggregation, str) or aggregation not in choices:
        if aggregation == "window":
            raise ValueError(
                "aggregation='window' (row windows) runs spmm only (spmm, propagate and the layers built on "
                f"them alone: GCNConv, SGConv, APPNP); here aggregation must be one of {choices}"
            )
        raise ValueError(f"aggregation must be one of {choices}, got {aggregation!r}")
    return aggregation


# ------------------------------------------------------------------------- determinism
def _switch(enabled: object) -> bool:
    """``enabled`` as a bool; a string or ``None`` raises (``bool("false")`` is ``True``:
    ``set_deterministic("false")`` would switch the mode on), as
    ``torch.use_deterministic_algorithms`` refuses them."""
    if enabled is None or isinstance(enabled, (str, bytes)):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    return bool(enabled)


def set_deterministic(enabled: bool) -> None:
    """Switch deterministic mode on or off globally (see the module docstring)."""
    global _deterministic_global
    _deterministic_global = _switch(enabled)


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Context manager: deterministic mode on (or off) inside the block, in this thread."""
    enabled = _switch(enabled)
    previous = getattr(_state, "deterministic", None)
    _state.deterministic = enabled
    try:
        yield
    finally:
        _state.deterministic = previous


def _own_flag() -> bool:
    local = getattr(_state, "deterministic", None)
    return _deterministic_global if local is None else local


def is_deterministic() -> bool:
    """Whether ops must give bitwise-reproducible results: fuseGNN's own flag
    (:func:`deterministic`, :func:`set_deterministic`) or
    ``torch.are_deterministic_algorithms_enabled()``."""
    return _own_flag() or torch.are_deterministic_algorithms_enabled()


# ------------------------------------------------------------------------- the choice
def _feature_width(tensors: tuple[Tensor, ...]) -> int | None:
    if not tensors or tensors[0].dim() < 2:
        return None
    return math.prod(tensors[0].shape[1:])


def _usable(name: str, graph: Graph, tensors: tuple[Tensor, ...]) -> bool:
    backend = _BACKENDS.get(name)
    return backend is not None and backend.can_run(graph, *tensors)


@contextlib.contextmanager
def for_capture(enabled: bool = True) -> Iterator[None]:
    """Context manager: ops inside pick the paths a CUDA-graph capture runs (no
    host-bound regime), also while not capturing yet -- for the warm-up steps of a step
    that will be captured, and for the compiled custom ops."""
    enabled = _switch(enabled)
    previous = getattr(_state, "for_capture", False)
    _state.for_capture = enabled
    try:
        yield
    finally:
        _state.for_capture = previous


def capture_mode() -> bool:
    """Whether the running op will be replayed (captured, or warming up for it)."""
    return getattr(_state, "for_capture", False) or (
        torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    )


def explain(graph: Graph, *tensors: Tensor, aggregation: str = "auto", op: str = "",
            records_backward: bool | None = None) -> Decision:
    """The :class:`Decision` an op on ``graph`` and ``tensors`` takes for ``aggregation``,
    without running it (``op``: ``"spmm"`` enables the host-bound regime of the module
    docstring, and admits ``"window"``; ``"gat"`` / ``"gatv2"`` take the attention layers'
    GAR crossover, :data:`ATTENTION_GAR_CROSSOVER`; ``records_backward``: whether the op
    records a backward, by default whether one of ``tensors`` needs a gradient -- an
    ``spmm`` passes its edge weights' and bias's too). Raises like the op would for an
    unavailable backend."""
    check_aggregation(aggregation, op)
    _load_kernel_backends()
    if aggregation != "auto":
        backend = _BACKENDS.get(aggregation)
        if backend is None:
            raise NotImplementedError(
                f"aggregation={aggregation!r} is not available in this build of fusegnn "
                f"(available: {tuple(_BACKENDS)}; the fused backends need Triton, and CUDA or "
                "Triton's interpreter TRITON_INTERPRET=1 on the CPU)"
            )
        if not backend.can_run(graph, *tensors):
            why = (": the fused kernels run on CUDA devices, and on the CPU only through Triton's "
                   "interpreter (TRITON_INTERPRET=1 set before the first fused op; slow, for testing)"
                   if graph.device.type == "cpu" else "")
            raise ValueError(
                f"aggregation={aggregation!r} cannot run on these inputs "
                f"(device {graph.device}, dtypes {[t.dtype for t in tensors]}){why}; "
                "use 'reference' or 'auto'"
            )
        if aggregation == "gas" and is_deterministic():
            if torch.is_deterministic_algorithms_warn_only_enabled() and not _own_flag():
                warnings.warn(
                    "aggregation='gas' uses atomic additions and is not deterministic; "
                    "running it anyway (warn_only=True)",
                    UserWarning,
                    stacklevel=3,
                )
            else:
                raise RuntimeError(
                    "aggregation='gas' uses atomic additions and is not deterministic, but "
                    "deterministic mode is on (fusegnn.sparse.dispatch.deterministic or "
                    "torch.use_deterministic_algorithms); use aggregation='gar' or 'auto'"
                )
        return Decision(aggregation, f"aggregation={aggregation!r} was asked for")

    devices = {graph.device.type, *(t.device.type for t in tensors)}
    if devices != {"cuda"}:
        return Decision("reference", f"tensors on {'/'.join(sorted(devices))}: auto runs fused kernels on CUDA only")
    if is_deterministic():
        if _usable("gar", graph, tensors):
            return Decision("gar", "deterministic mode: GAR has no atomics")
        return Decision("reference", "deterministic mode and GAR cannot run on these inputs")
    avg = smaller_side_degree(graph)
    width = _feature_width(tensors)
    if records_backward is None:
        records_backward = needs_grad(*tensors)
    if op == "spmm" and takes_host_bound_reference(graph, tensors[0], aggregation, records_backward):
        bound = host_bound_work(records_backward)
        return Decision(
            "reference",
            f"host-bound: {graph.num_edges} edges x {width} columns < {bound} in an eager step"
            f"{'' if bound == HOST_BOUND_WORK else ' of a training step with no backward'} "
            "(the fused kernels run inside CUDA graphs and on larger graphs)",
        )
    if op == "spmm" and (windowed := _window_rule(graph, tensors)) is not None:
        return windowed
    threshold = gar_min_avg_degree(width, op)
    if avg >= threshold:
        order, why = ("gar", "gas"), f"degree {avg:.1f} >= {threshold:.1f}"
    else:
        order, why = ("gas", "gar"), f"degree {avg:.1f} < {threshold:.1f}"
    rule = f"{op} " if op in ATTENTION_GAR_CROSSOVER else ""
    why += f" ({rule}GAR threshold for feature width {width})" if width is not None else " (feature width unknown)"
    for name in order:
        if _usable(name, graph, tensors):
            return Decision(name, why)
    return Decision("reference", "no fused backend can run on these inputs (Triton missing or unsupported dtype)")


def _window_rule(graph: Graph, tensors: tuple[Tensor, ...]) -> Decision | None:
    """The row-window rule of ``auto`` for an eager ``spmm`` (module docstring); ``None``
    when it does not pick the windows."""
    if capture_mode() or not _usable("window", graph, tensors):
        return None
    if not use_kernel("auto", *tensors):
        return None  # float64: the windows' products would run the vector-sparse reference (V x N per tile column)
    density = estimate_tile_density(graph)
    if density < WINDOW_MIN_TILE_DENSITY:
        return None
    return Decision("window", f"row-window tile density {density:.3f} >= {WINDOW_MIN_TILE_DENSITY}")


def resolve_aggregation(aggregation: str, graph: Graph, *tensors: Tensor, op: str = "",
                        records_backward: bool | None = None) -> Backend:
    """The backend that runs for ``aggregation`` on these inputs (recorded for
    :func:`last_decision`; ``records_backward`` as for :func:`explain`).

    The decision is a function of the graph's size, the tensors' devices, dtypes and
    feature width, the deterministic mode, the host-bound size and the registered
    backends, so it is made once per such combination and remembered on the graph (an
    op call then costs a dictionary look-up, not the rule). Decisions that warn are not
    remembered."""
    if not isinstance(aggregation, str):  # checked before it enters a cache key (a list is unhashable)
        check_aggregation(aggregation, op)
    deterministic_mode = is_deterministic()
    if records_backward is None:
        records_backward = needs_grad(*tensors)
    key = (aggregation, op, deterministic_mode, op == "spmm" and capture_mode(),
           op == "spmm" and host_bound_work(records_backward), len(_BACKENDS), _feature_width(tensors),
           *[(t.dtype, t.device) for t in tensors])
    memo = graph.cached("dispatch_decisions", dict, structural=True)
    decision = memo.get(key)
    if decision is None:
        decision = explain(graph, *tensors, aggregation=aggregation, op=op, records_backward=records_backward)
        if not checks_every_call(aggregation):
            memo[key] = decision
    _state.last = decision
    if _open_logs:
        _collect(decision)
    return _BACKENDS[decision.name]


def checks_every_call(aggregation: str) -> bool:
    """Whether a call with ``aggregation`` must be decided afresh every time, not taken from
    a remembered decision: an explicit ``"gas"`` in deterministic mode warns (under
    ``torch.use_deterministic_algorithms(True, warn_only=True)``) or raises, and whether
    it warns or raises depends on switches that no cache key holds."""
    return aggregation == "gas" and is_deterministic()


def record_decision(decision: Decision) -> None:
    """Record ``decision`` as the path of the running op (for :func:`last_decision` and
    :func:`decisions_taken`)."""
    _state.last = decision
    if _open_logs:
        _collect(decision)


def _collect(decision: Decision) -> None:
    for log in _open_logs:
        log.append(decision)


@contextlib.contextmanager
def decisions_taken() -> Iterator[list[Decision]]:
    """Context manager: a list that collects, in order, every :class:`Decision` recorded
    while the block is open (the path each op took, including a backend's hand-over of
    :func:`note_path`): the ops called in the block and the backward of a
    ``loss.backward()`` in it (which on CUDA runs in the autograd engine's device
    threads). The log is process-wide: ops that other threads run meanwhile are collected
    too. ::

        with decisions_taken() as taken:
            layer(x, graph)
        taken[0].name, taken[0].reason   # e.g. "gar", "degree 492.0 >= 20.0 ..."
    """
    global _open_logs
    log: list[Decision] = []
    with _recorders_lock:
        _open_logs = (*_open_logs, log)
    try:
        yield log
    finally:
        with _recorders_lock:
            _open_logs = tuple(other for other in _open_logs if other is not log)


def backend_named(name: str) -> Backend:
    """The registered backend ``name``."""
    return _BACKENDS[name]


def note_path(name: str, reason: str) -> None:
    """Record that the running op actually took path ``name`` (a backend delegating)."""
    record_decision(Decision(name, reason))


def last_decision() -> Decision | None:
    """The :class:`Decision` of the most recent op call in this thread (``None`` before any)."""
    return getattr(_state, "last", None)


def last_backend() -> str | None:
    """Name of the path the most recent op call in this thread took."""
    decision = last_decision()
    return decision.name if decision is not None else None
