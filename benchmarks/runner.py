r"""One case: check every backend's output against an oracle, then time the ones that agree.

Per case:

1. **Graph, once.** A :class:`~fusegnn.sparse.Graph` is built from the data set's
   ``edge_index`` outside any timed region. Graph processing (GCN: ``gcn_norm`` with
   self-loops; GAT: self-loop replacement) and the CSR + CSC conversion are timed once,
   on their own, as ``norm_ms`` and ``convert_ms`` (PyG's own processing for PyG rows).
2. **Correctness, before anything is timed.** The same weights go into every backend's
   model; one forward in eval mode (dropout off) per backend; the first backend of
   :data:`~benchmarks.backends.ORACLE_ORDER` that runs is the oracle, and any other
   whose output differs by more than ``rtol`` in max-norm relative error,
   :math:`\max|o - o_{ref}| / \max|o_{ref}|`, gets ``ok: false`` and is not timed. In
   the ``agg`` suite the check covers the forward output and ``grad_x`` of a backward.
3. **Timing** of each backend that passed: :func:`benchmarks.measure.measure` over a
   training step (``zero_grad``, forward, cross-entropy on the training nodes,
   backward, Adam step) or, for ``agg``, the phases forward and backward.

**CUDA-graph backends** (``*-graphed``): the same step wrapped by
:func:`fusegnn.graphed_step` (Adam with ``capturable=True``, switched by ``graphed_step``
to torch's fused Adam kernel, as it does for a user's default Adam). Before anything is timed,
the replays must train like eager steps: from the same weights, with dropout off (eval
mode), ``GRAPH_WARMUP + VERIFY_CALLS`` graphed calls (eager warm-up, capture, replays) and
as many eager steps must give the same losses and the same output afterwards (within
``rtol``; ``replay_rel_err``), and the eager steps must have moved the output by far more
than that (so a replay that does nothing cannot pass). Then a fresh model in training
mode is warmed up and captured, and its replays are timed like any step; ``peak_mem_mib``
is what the capture allocated (the graph's private memory, held for its lifetime: the
replays themselves allocate nothing). A capture that fails is recorded with its reason
(``capture failed: host sync in <function>() (<file>:<line>)``).

**Compiled backends** (``*-compiled``): the model wrapped by :func:`compile_model`
(``torch.compile(model, mode="reduce-overhead", fullgraph=True)``: Inductor's kernels,
replayed as CUDA graphs by CUDA-graph trees) and trained by the same step as the eager
row (standard Adam). Dynamo's caches are reset before each compiled model, so every row
compiles from scratch. The correctness forward runs through the compiled model; then, as
for the graphed rows, ``GRAPH_WARMUP + VERIFY_CALLS`` compiled steps must train like as
many eager steps (``replay_rel_err``). The timed model's first step (tracing, Inductor
code generation, one run) is ``compile_ms``, not part of ``ms``; ``peak_mem_mib`` is the
peak above what was allocated before that first step, over compilation, warm-up (where
CUDA-graph trees record) and the timed steps. A compilation that fails is recorded with
its reason.

An out-of-memory anywhere is recorded (``ok: false, error: "OOM"``), memory is freed
and the run goes on; so does any other error (its message is recorded).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.backends import AggBackend, PaperBackend, build_csr_formats, oracle_rank, small_graph
from benchmarks.cases import Case
from benchmarks.data import DatasetCache
from benchmarks.measure import free_memory, interleaved_ms, is_oom, measure, synchronize, timed_ms

__all__ = ["RunConfig", "new_record", "run_case", "relative_error", "worst_error", "compile_model", "RECORD_FIELDS"]

RECORD_FIELDS = (
    "case", "backend", "ok", "error", "ms", "bwd_ms", "peak_mem_mib", "launches", "bwd_launches",
    "convert_ms", "norm_ms", "aggregation", "rel_err", "checked_against", "steps", "warmup_steps",
    "replay_rel_err", "compile_ms", "ms_alone",
)

#: Eager calls of a graphed step before its capture.
GRAPH_WARMUP = 2
#: Graphed calls after the warm-up compared with eager steps: the capture call (which
#: replays once) and replays.
VERIFY_CALLS = 4
#: Steps of a compiled model after its first (compiling) call before timing: CUDA-graph
#: trees run a step eagerly, record the next and replay from the one after.
COMPILED_WARMUP = 3

Emit = Callable[[dict], None]


@dataclass(frozen=True)
class RunConfig:
    """How cases are measured (see ``python -m benchmarks.run --help``)."""

    device: torch.device
    steps: int = 10
    warmup: int = 5
    warmup_s: float = 3.0
    rtol: float = 1e-4
    seed: int = 0
    launches: bool = True
    lr: float = 0.01
    weight_decay: float = 5e-4


def new_record(case: Case, backend: str) -> dict:
    """A record with every field, all unset (``ok`` false until proven)."""
    record: dict[str, Any] = {name: None for name in RECORD_FIELDS}
    record.update(case=case.name, backend=backend, ok=False)
    return record


def relative_error(out: Tensor, ref: Tensor) -> float:
    """:math:`\\max|out - ref| / \\max|ref|` in float64 (``inf`` on a shape mismatch,
    ``nan`` if either holds a NaN)."""
    if out.shape != ref.shape:
        return math.inf
    out, ref = out.detach().double(), ref.detach().double()
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (out - ref).abs().max().item() if ref.numel() else 0.0
    return diff / scale if scale > 0 else diff


def worst_error(*errors: float) -> float:
    """The largest of ``errors``, ``nan`` if one is (Python's ``max`` keeps whichever of a
    NaN and a number comes first, so ``max(1e-7, nan)`` would pass a ``<= rtol`` check)."""
    return math.nan if any(math.isnan(e) for e in errors) else max(errors)


def _describe(error: BaseException) -> str:
    if is_oom(error):
        return "OOM"
    text = f"{type(error).__name__}: {error}".strip()
    return text if len(text) <= 500 else text[:497] + "..."


def _fail(record: dict, error: BaseException, device: torch.device) -> None:
    record["ok"] = False
    record["error"] = _describe(error)
    summary = getattr(error, "summary", None)  # fusegnn.CaptureError: say where, first
    if summary is not None and record["error"] != "OOM":
        text = f"capture failed: {summary} | {error}".strip()
        record["error"] = text if len(text) <= 1500 else text[:1497] + "..."
        return
    if record["error"] != "OOM":  # where it happened, innermost first
        record["error"] += " | at " + " <- ".join(
            f"{f.name}:{f.lineno}" for f in reversed(traceback.extract_tb(error.__traceback__)[-3:])
        )


# ----------------------------------------------------------------------------- dispatch


def run_case(
    case: Case,
    backends: list,
    data: DatasetCache,
    config: RunConfig,
    emit: Emit,
    tick: Callable[[], None] = lambda: None,
) -> None:
    """Run ``case`` on ``backends``, handing each finished record to ``emit`` and calling
    ``tick`` once per backend. Never raises for a backend's failure."""
    try:
        if case.suite == "paper":
            _run_paper_case(case, backends, data, config, emit, tick)
        else:
            _run_agg_case(case, backends, data, config, emit, tick)
    finally:
        free_memory(config.device)


def _fail_all(case: Case, backends: list, error: BaseException, config: RunConfig, emit: Emit, tick) -> None:
    for backend in backends:
        record = new_record(case, backend.name)
        _fail(record, error, config.device)
        record["error"] = f"case setup failed: {record['error']}"
        emit(record)
        tick()


# ----------------------------------------------------------------------------- paper


@dataclass
class _PaperCase:
    """What every backend of a paper case shares."""

    x: Tensor
    y_train: Tensor
    train_index: Tensor
    edge_index: Tensor
    graph: Any  # fusegnn.sparse.Graph, built once for the case
    in_channels: int
    num_classes: int
    state: dict[str, Tensor]  # the weights every backend starts from
    norm_ms: dict[str, float | None]  # library -> graph processing time
    convert_ms: float | None


def _fusegnn_processing(case: Case, graph) -> Callable[[], Any]:
    from fusegnn.sparse import add_self_loops, gcn_norm, remove_self_loops

    if case.model == "gcn":
        return lambda: gcn_norm(graph, dtype=torch.float32)
    if case.model in ("sage", "gin"):  # aggregate over the graph as it is
        return lambda: graph
    return lambda: add_self_loops(remove_self_loops(graph.with_edge_weight(None)))


def _pyg_processing(case: Case, edge_index: Tensor, num_nodes: int) -> Callable[[], Any]:
    if case.model == "gcn":
        from torch_geometric.nn.conv.gcn_conv import gcn_norm

        return lambda: gcn_norm(edge_index, None, num_nodes, False, True, "source_to_target", torch.float32)
    if case.model in ("sage", "gin"):
        return lambda: edge_index
    from torch_geometric.utils import add_self_loops, remove_self_loops

    return lambda: add_self_loops(remove_self_loops(edge_index)[0], num_nodes=num_nodes)


def _fresh_copy(graph):
    """The same graph without any cached format (to time a conversion from scratch)."""
    from fusegnn.sparse import Graph

    return Graph(graph.edge_index, (graph.num_src_nodes, graph.num_dst_nodes), graph.edge_weight, validate=False)


def _prepare_paper_case(case: Case, backends: list[PaperBackend], data: DatasetCache, config: RunConfig) -> _PaperCase:
    from fusegnn.sparse import Graph

    from benchmarks.models import build_fusegnn_model

    device = config.device
    dataset = data.get(case.dataset)
    graph = Graph(dataset.edge_index, dataset.num_nodes)
    # "-in64" cases: the first columns of the features, as a tensor of their own
    x = dataset.x if case.in_features is None else dataset.x[:, : case.in_features].contiguous()
    in_channels = x.size(1)
    norm_ms: dict[str, float | None] = {"fusegnn": None, "pyg": None}
    convert_ms = None
    if any(b.library == "fusegnn" for b in backends):
        process = _fusegnn_processing(case, graph)
        norm_ms["fusegnn"] = timed_ms(process, device)
        processed = process()
        convert_ms = timed_ms(lambda: build_csr_formats(_fresh_copy(processed)), device)
        del processed
    if any(b.library == "pyg" for b in backends):
        norm_ms["pyg"] = timed_ms(_pyg_processing(case, dataset.edge_index, dataset.num_nodes), device)
    free_memory(device)

    torch.manual_seed(config.seed)
    template = build_fusegnn_model(case, in_channels, dataset.num_classes, "reference")
    state = {k: v.detach().to(device).clone() for k, v in template.state_dict().items()}
    train_index = dataset.train_mask.nonzero().view(-1)
    return _PaperCase(
        x=x,
        y_train=dataset.y.index_select(0, train_index),
        train_index=train_index,
        edge_index=dataset.edge_index,
        graph=graph,
        in_channels=in_channels,
        num_classes=dataset.num_classes,
        state=state,
        norm_ms=norm_ms,
        convert_ms=convert_ms,
    )


def _paper_model(backend: PaperBackend, shared: _PaperCase, case: Case, device: torch.device):
    from benchmarks.models import copy_weights

    model = backend.build(case, shared.in_channels, shared.num_classes).to(device)
    copy_weights(shared.state, model)
    graph_arg = shared.graph if backend.library == "fusegnn" else shared.edge_index
    return model, graph_arg


def _training_loss(model, shared: _PaperCase) -> Callable[[Tensor, Any], Tensor]:
    """``(x, graph) -> loss``: the model's cross-entropy on the training nodes."""

    def loss(x: Tensor, graph_arg) -> Tensor:
        logits = model(x, graph_arg)
        return F.cross_entropy(logits.index_select(0, shared.train_index), shared.y_train)

    return loss


def _training_step(model, optimizer, graph_arg, shared: _PaperCase) -> Callable[[], Tensor]:
    """One full-graph training step: forward, cross-entropy on the training nodes,
    backward, optimizer step; returns the loss (not read: no sync)."""
    loss_of = _training_loss(model, shared)

    def step() -> Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(shared.x, graph_arg)
        loss.backward()
        optimizer.step()
        return loss

    return step


def _adam(model, config: RunConfig, capturable: bool = False) -> torch.optim.Optimizer:
    return torch.optim.Adam(
        model.parameters(), lr=config.lr, weight_decay=config.weight_decay, capturable=capturable
    )


def _graphed(backend: PaperBackend, shared: _PaperCase, case: Case, config: RunConfig, *, train: bool):
    """``(model, graph_arg, graphed step)`` of a fresh model from the case's weights."""
    from fusegnn.capture import graphed_step

    model, graph_arg = _paper_model(backend, shared, case, config.device)
    model.train(train)
    optimizer = _adam(model, config, capturable=True)
    step = graphed_step(_training_step(model, optimizer, graph_arg, shared), optimizer, warmup=GRAPH_WARMUP)
    return model, graph_arg, step


def compile_model(fn: Callable, *, fullgraph: bool = True) -> Callable:
    """What a ``*-compiled`` row compiles: ``torch.compile(fn, mode="reduce-overhead",
    fullgraph=fullgraph)`` (the CPU tests swap this for a backend that runs there)."""
    return torch.compile(fn, mode="reduce-overhead", fullgraph=fullgraph)


def _reset_dynamo() -> None:
    """Forget compiled code: every compiled row compiles from scratch, and a run of many
    cases never reaches Dynamo's recompilation limit."""
    import torch._dynamo as dynamo

    dynamo.reset()


def _compiled(backend: PaperBackend, shared: _PaperCase, case: Case, config: RunConfig, *, train: bool):
    """``(model, graph_arg, step)``: a fresh model from the case's weights and a training
    step compiled the way one trains fast with ``torch.compile``: the forward and the loss
    as one compiled function (``fullgraph``), ``backward()`` through its compiled backward,
    and Adam (``capturable``) with its ``step`` compiled too -- each replayed by CUDA-graph
    trees on a GPU (Dynamo's caches reset first)."""
    _reset_dynamo()
    model, graph_arg = _paper_model(backend, shared, case, config.device)
    model.train(train)
    cuda = config.device.type == "cuda"
    optimizer = _adam(model, config, capturable=cuda)  # capturable needs CUDA parameters
    step = _step_with_compiled_optimizer(compile_model(_training_loss(model, shared)), optimizer, graph_arg,
                                         shared, cuda)
    return model, graph_arg, step


def _step_with_compiled_optimizer(loss_of: Callable[[Tensor, Any], Tensor], optimizer, graph_arg,
                                  shared: _PaperCase, cuda: bool) -> Callable[[], Tensor]:
    """A training step of ``loss_of`` (the compiled forward and loss of a compiled row, or
    the eager ones of its check) whose optimizer step is compiled as a compiled row's."""
    optimizer_step = compile_model(optimizer.step, fullgraph=False)  # Adam's step has a graph break

    def step() -> Tensor:
        if cuda:  # a new iteration: the previous step's graph outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_of(shared.x, graph_arg)
        loss.backward()
        optimizer_step()
        return loss

    return step


def _verify_training(
    backend: PaperBackend, shared: _PaperCase, case: Case, config: RunConfig, *, graphed: bool
) -> float:
    """Relative error between ``GRAPH_WARMUP + VERIFY_CALLS`` steps of the graphed (or
    compiled) row and as many eager steps from the same weights, dropout off: the
    larger of the losses' and the final outputs' max-norm relative errors. On a GPU the
    eager steps use Adam's ``capturable`` variant, as graphed and compiled rows do (the
    standard one rounds its bias correction on the host: over several steps Adam's
    normalisation amplifies that into ~1e-3 differences, the same for PyG and fusegnn,
    which is not what this check is about), for a graphed row torch's fused Adam
    kernel, which :func:`fusegnn.graphed_step` switches its optimizer to, and for a
    compiled row Adam's ``step`` compiled as the row compiles it: Inductor's Adam rounds
    differently from the eager one, and on Cora (GCN h64) Adam's normalisation amplified
    that to 2.7e-3 in five steps, while the compiled forward and backward agree with the
    eager ones to 1e-7 (H100, ``benchmarks/NOTES-overhead.md``, session 16). Raises if the
    eager steps barely moved the output (the comparison would then prove nothing)."""
    calls = GRAPH_WARMUP + VERIFY_CALLS
    model, graph_arg = _paper_model(backend, shared, case, config.device)
    model.eval()  # dropout off: both runs compute the same function
    with torch.no_grad():
        start = model(shared.x, graph_arg).float()
    capturable = config.device.type == "cuda"  # as the graphed and compiled steps' Adam
    optimizer = _adam(model, config, capturable=capturable)
    if graphed:  # the same update as graphed_step's Adam: its own switch to torch's fused kernel
        from fusegnn.capture import _use_fused_implementation

        _use_fused_implementation(optimizer)
    if graphed:
        step = _training_step(model, optimizer, graph_arg, shared)
    else:  # the compiled row's Adam step (its model runs eagerly here)
        _reset_dynamo()
        step = _step_with_compiled_optimizer(_training_loss(model, shared), optimizer, graph_arg, shared,
                                             capturable)
    eager_losses = torch.stack([step().detach().clone() for _ in range(calls)])
    with torch.no_grad():
        eager_out = model(shared.x, graph_arg).float()
    del model, step

    build = _graphed if graphed else _compiled
    model, graph_arg, other = build(backend, shared, case, config, train=False)
    other_losses = torch.stack([other().detach().clone() for _ in range(calls)])
    if graphed and not other.captured:
        raise RuntimeError(f"the step was not captured after {calls} calls")
    with torch.no_grad():  # the eager module: its parameters are what the steps trained
        other_out = model(shared.x, graph_arg).float()
    del model, other

    err = worst_error(relative_error(other_out, eager_out), relative_error(other_losses, eager_losses))
    moved = relative_error(eager_out, start)
    if not moved > 10 * max(err, config.rtol):
        raise RuntimeError(
            f"replay check inconclusive: {calls} eager steps moved the output by {moved:.2e} "
            f"(replay error {err:.2e})"
        )
    return err


def _check_training(record: dict, backend: PaperBackend, shared: _PaperCase, case: Case, config: RunConfig,
                    *, graphed: bool) -> bool:
    """Run :func:`_verify_training` into ``record``; whether the row may be timed."""
    err = _verify_training(backend, shared, case, config, graphed=graphed)
    record["replay_rel_err"] = err
    if not err <= config.rtol:
        what = "replay" if graphed else "compiled"
        record.update(ok=False, error=f"{what} mismatch: rel err {err:.2e} > rtol {config.rtol:g} vs eager steps")
        return False
    free_memory(config.device)
    return True


def _time_compiled(record: dict, backend: PaperBackend, shared: _PaperCase, case: Case, config: RunConfig) -> None:
    """Check that the compiled model trains like the eager one, then time its steps,
    the first (compiling) step apart (see the module docstring)."""
    device = config.device
    if not _check_training(record, backend, shared, case, config, graphed=False):
        return
    cuda = device.type == "cuda"
    model, graph_arg, step = _compiled(backend, shared, case, config, train=True)
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    begin = time.perf_counter()
    step()  # tracing, code generation and one run
    synchronize(device)
    compile_ms = (time.perf_counter() - begin) * 1e3
    for _ in range(COMPILED_WARMUP):
        step()
    synchronize(device)
    if cuda:
        warm_peak = torch.cuda.max_memory_allocated(device) - baseline
        held = torch.cuda.memory_allocated(device) - baseline
    found = measure([step], device, steps=config.steps, warmup=0, launches=config.launches)
    peak = None
    if cuda:
        peak = max(warm_peak, held + found.peak_mem_mib * 2**20) / 2**20
    record.update(
        ms=found.ms[0], peak_mem_mib=peak, launches=found.launches[0], compile_ms=compile_ms,
        steps=found.steps, warmup_steps=1 + COMPILED_WARMUP,
    )


def _time_graphed(record: dict, backend: PaperBackend, shared: _PaperCase, case: Case,
                  config: RunConfig) -> Callable[[], Tensor] | None:
    """Check the replays against eager steps, then time them (see the module docstring);
    the timed step, or ``None`` when the check failed."""
    device = config.device
    if not _check_training(record, backend, shared, case, config, graphed=True):
        return None
    model, graph_arg, step = _graphed(backend, shared, case, config, train=True)
    for _ in range(GRAPH_WARMUP):
        step()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    step()  # the capture, and one replay
    torch.cuda.synchronize(device)
    capture_mib = (torch.cuda.max_memory_allocated(device) - baseline) / 2**20
    if not step.captured:
        raise RuntimeError(f"the step was not captured after {GRAPH_WARMUP + 1} calls")
    found = measure(
        [step], device, steps=config.steps, warmup=config.warmup,
        warmup_s=config.warmup_s, launches=config.launches,
    )
    record.update(
        ms=found.ms[0], peak_mem_mib=capture_mib, launches=found.launches[0],
        steps=found.steps, warmup_steps=GRAPH_WARMUP + 1 + found.warmup_steps,
    )
    return step


def _paths_taken(backend: PaperBackend, shared: _PaperCase, case: Case, config: RunConfig) -> str | None:
    """The sparse paths (``"gar"``, ``"gas+gar"``, ``"reference"``, ...) that one training
    step of ``backend``'s model takes, as :func:`fusegnn.sparse.dispatch.decisions_taken`
    records them; for a graphed or compiled row an eager step under
    :func:`~fusegnn.sparse.dispatch.for_capture`, whose rules a capture and the compiled
    custom ops follow. On a fresh model, so the timed ones start from the case's weights.
    ``None`` when the step records no sparse op."""
    from fusegnn.sparse.dispatch import decisions_taken, for_capture

    model, graph_arg = _paper_model(backend, shared, case, config.device)
    model.train()
    optimizer = _adam(model, config)
    captured = backend.graphed or backend.compiled
    with for_capture() if captured else contextlib.nullcontext(), decisions_taken() as taken:
        _training_step(model, optimizer, graph_arg, shared)()
    synchronize(config.device)
    return "+".join(sorted({decision.name for decision in taken})) or None


def _run_paper_case(case, backends, data, config, emit, tick) -> None:
    device = config.device
    backends = sorted((b for b in backends if b.applies(case)), key=lambda b: oracle_rank(b.name))
    try:
        shared = _prepare_paper_case(case, backends, data, config)
    except Exception as err:  # noqa: BLE001 - recorded, the run goes on
        _fail_all(case, backends, err, config, emit, tick)
        return

    records, oracle, oracle_name = {}, None, None
    for backend in backends:  # 1. correctness, every backend, before any timing
        record = records[backend.name] = new_record(case, backend.name)
        record["norm_ms"] = shared.norm_ms[backend.library]
        model = out = None
        try:
            if backend.library == "fusegnn":
                paths = _paths_taken(backend, shared, case, config)  # None: the step ran no sparse op
                record["aggregation"] = paths
                record["convert_ms"] = shared.convert_ms if paths and "gar" in paths.split("+") else None
            model, graph_arg = _paper_model(backend, shared, case, device)
            model.eval()
            if backend.compiled:  # the function the timed steps compute
                _reset_dynamo()
                model = compile_model(model)
            with torch.no_grad():
                out = model(shared.x, graph_arg).float().clone()
            _judge(record, out, oracle, oracle_name, config.rtol)
            if oracle is None and record["ok"]:
                oracle, oracle_name = out, backend.name
        except Exception as err:  # noqa: BLE001
            _fail(record, err, device)
        finally:
            del model, out
            free_memory(device)
        if not record["ok"]:
            emit(record)
            tick()
    del oracle

    # 2. timing of those that passed. On small graphs the steps are bound by host time, which
    # drifts during a run: the eager and graphed steps are timed again interleaved, backends
    # in turn (``ms``; ``ms_alone`` keeps the separate timing). Compiled rows come last and
    # keep their separate timing: each compiles from a reset Dynamo (which also resets the
    # CUDA-graph trees), so no step of another row runs after one.
    interleave = small_graph(case)
    timed: list[tuple[dict, Callable[[], Tensor]]] = []
    passed = [records[b.name] for b in backends if records[b.name]["ok"]]
    for backend in sorted((b for b in backends if records[b.name]["ok"]), key=lambda b: b.compiled):
        record = records[backend.name]
        if backend.compiled and timed:
            _time_interleaved(timed, case, config)
        model = optimizer = step = None
        try:
            if backend.graphed:
                step = _time_graphed(record, backend, shared, case, config)
            elif backend.compiled:
                _time_compiled(record, backend, shared, case, config)
            else:
                model, graph_arg = _paper_model(backend, shared, case, device)
                model.train()
                optimizer = _adam(model, config)
                step = _training_step(model, optimizer, graph_arg, shared)
                found = measure(
                    [step], device, steps=config.steps, warmup=config.warmup,
                    warmup_s=config.warmup_s, launches=config.launches,
                )
                record.update(
                    ms=found.ms[0], peak_mem_mib=found.peak_mem_mib, launches=found.launches[0],
                    steps=found.steps, warmup_steps=found.warmup_steps,
                )
            if interleave and step is not None and record["ms"] is not None:
                timed.append((record, step))
        except Exception as err:  # noqa: BLE001
            _fail(record, err, device)
        finally:
            model = optimizer = step = None  # the closure holds both: drop it too
            if not interleave:
                free_memory(device)
    _time_interleaved(timed, case, config)
    for record in passed:
        emit(record)
        tick()


def _time_interleaved(timed: list[tuple[dict, Callable[[], Tensor]]], case: Case, config: RunConfig) -> None:
    """Time the steps in ``timed`` again, interleaved (their ``ms``; ``ms_alone`` keeps
    the separate timing), then drop them (``timed`` is emptied)."""
    if len(timed) > 1:
        try:
            medians = interleaved_ms([[step] for _, step in timed], config.device, steps=config.steps)
            for (record, _), ms in zip(timed, medians):
                record["ms_alone"], record["ms"] = record["ms"], ms
        except Exception as err:  # noqa: BLE001 - the separate timings stand
            print(f"{case.name}: interleaved timing failed ({type(err).__name__}: {err}); "
                  "keeping the separate timings", file=sys.stderr)
    timed.clear()
    free_memory(config.device)


def _judge(record: dict, out: Tensor, oracle: Tensor | None, oracle_name: str | None, rtol: float) -> None:
    """Compare a backend's output with the oracle's (or make it the oracle)."""
    if not bool(torch.isfinite(out).all()):
        record.update(ok=False, error="output has NaN or Inf")
        return
    if not bool(out.any()):  # an all-zero output would be the oracle, or match an all-zero one
        record.update(ok=False, error="output is all zeros (nothing checked; not timed)")
        return
    if oracle is None:
        record.update(ok=True, rel_err=0.0, checked_against=None)
        return
    err = relative_error(out, oracle)
    record.update(rel_err=err, checked_against=oracle_name)
    if err <= rtol:
        record["ok"] = True
    else:
        record.update(ok=False, error=f"mismatch: rel err {err:.2e} > rtol {rtol:g} vs {oracle_name}")


# ----------------------------------------------------------------------------- agg


def _run_agg_case(case, backends: list[AggBackend], data, config, emit, tick) -> None:
    from fusegnn.sparse import Graph, gcn_norm
    from fusegnn.sparse.dispatch import decisions_taken

    device = config.device
    backends = sorted(backends, key=lambda b: oracle_rank(b.name))
    try:
        dataset = data.get(case.dataset)
        graph = gcn_norm(Graph(dataset.edge_index, dataset.num_nodes), dtype=torch.float32)
        generator = torch.Generator(device=device).manual_seed(config.seed + case.width)
        x = torch.randn(graph.num_src_nodes, case.width, generator=generator, device=device)
        grad_out = torch.randn(graph.num_dst_nodes, case.width, generator=generator, device=device)
    except Exception as err:  # noqa: BLE001
        _fail_all(case, backends, err, config, emit, tick)
        return

    def convert_cost(backend: AggBackend, paths: str | None) -> float | None:
        converts = backend.converts
        if backend.aggregation == "auto":
            converts = build_csr_formats if paths and "gar" in paths.split("+") else None
        if converts is None:
            return None
        return timed_ms(lambda: converts(_fresh_copy(graph)), device)

    records, oracle, oracle_name = {}, None, None
    for backend in backends:  # 1. correctness of forward and backward
        record = records[backend.name] = new_record(case, backend.name)
        op = out = grad = None
        try:
            op = backend.prepare(graph)
            xx = x.detach().clone().requires_grad_(True)
            with decisions_taken() as taken:  # the paths spmm took, forward and backward, as timed
                out = op(xx)
                out.backward(grad_out)
            synchronize(device)
            out, grad = out.detach(), xx.grad
            del xx
            paths = "+".join(sorted({decision.name for decision in taken})) or None
            if backend.aggregation is not None:
                record["aggregation"] = paths
            record["convert_ms"] = convert_cost(backend, paths)
            _judge_pair(record, out, grad, oracle, oracle_name, config.rtol)
            if oracle is None and record["ok"]:
                oracle, oracle_name = (out, grad), backend.name
        except Exception as err:  # noqa: BLE001
            _fail(record, err, device)
        finally:
            del op, out, grad
            free_memory(device)
        if not record["ok"]:
            emit(record)
            tick()
    del oracle

    for backend in backends:  # 2. timing: forward and backward phases
        record = records[backend.name]
        if not record["ok"]:
            continue
        state: dict[str, Any] = {}
        try:
            op = backend.prepare(graph)
            xx = x.detach().clone().requires_grad_(True)

            def forward(op=op, xx=xx) -> None:
                xx.grad = None
                state["out"] = op(xx)

            def backward(xx=xx) -> None:
                state.pop("out").backward(grad_out)
                xx.grad = None  # freed inside the step, so the peak counts it

            found = measure(
                [forward, backward], device, steps=config.steps, warmup=config.warmup,
                warmup_s=config.warmup_s, launches=config.launches,
            )
            record.update(
                ms=found.ms[0], bwd_ms=found.ms[1], peak_mem_mib=found.peak_mem_mib,
                launches=found.launches[0], bwd_launches=found.launches[1],
                steps=found.steps, warmup_steps=found.warmup_steps,
            )
        except Exception as err:  # noqa: BLE001
            _fail(record, err, device)
        finally:
            state.clear()
            op = xx = forward = backward = None
            free_memory(device)
        emit(record)
        tick()


def _judge_pair(record, out, grad, oracle, oracle_name, rtol) -> None:
    if not (bool(torch.isfinite(out).all()) and bool(torch.isfinite(grad).all())):
        record.update(ok=False, error="output or gradient has NaN or Inf")
        return
    if not (bool(out.any()) and bool(grad.any())):  # as in _judge: zeros prove nothing
        record.update(ok=False, error="output or gradient is all zeros (nothing checked; not timed)")
        return
    if oracle is None:
        record.update(ok=True, rel_err=0.0, checked_against=None)
        return
    err = worst_error(relative_error(out, oracle[0]), relative_error(grad, oracle[1]))
    record.update(rel_err=err, checked_against=oracle_name)
    if err <= rtol:
        record["ok"] = True
    else:
        record.update(ok=False, error=f"mismatch: rel err {err:.2e} > rtol {rtol:g} vs {oracle_name} (forward or grad_x)")
