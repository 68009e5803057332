"""Timing, peak memory and kernel-launch counting of a workload.

A workload is a list of **phases** run in order, each a no-argument callable sharing
state through its closure: a training step is one phase; the aggregation benchmark has
two (forward, backward). :func:`measure` runs

1. warm-up steps (at most ``warmup``; after two, it stops once ``warmup_s`` seconds have
   passed, so slow Reddit-size cases do not spend a minute warming up);
2. ``steps`` timed steps: on a GPU a CUDA event is recorded before the first phase and
   after each phase, with the device synchronised before each step, and the
   milliseconds between consecutive events are the phase times; on a CPU
   ``time.perf_counter``. The reported time of a phase is the **median** over steps;
3. peak extra memory over those timed steps: ``torch.cuda.max_memory_allocated()``
   minus ``torch.cuda.memory_allocated()`` taken after the warm-up, just before the
   first timed step (parameters, optimizer state, the graph and its cached formats
   are in that baseline; activations, gradients' temporaries and workspaces are the
   extra). ``None`` on a CPU;
4. kernel launches per phase: one more step under :mod:`torch.profiler`, counting the
   GPU kernels it ran (memcpy / memset excluded; the kernels inside a replayed CUDA
   graph count too), one profiled phase at a time. ``None`` on a CPU.
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "Measurement", "measure", "interleaved_ms", "timed_ms", "is_oom", "free_memory", "count_kernels", "synchronize",
    "time_limit_passed",
]

Phase = Callable[[], object]

_LAUNCH_APIS = (
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaLaunchCooperativeKernel",
    "cudaGraphLaunch",  # a replayed CUDA graph: one launch from the host
)


@dataclass
class Measurement:
    """What :func:`measure` found: per-phase median ms and launches, peak extra MiB."""

    ms: list[float]
    peak_mem_mib: float | None
    launches: list[int | None]
    steps: int
    warmup_steps: int


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


_sync = synchronize


def _run_step(phases: Sequence[Phase]) -> None:
    for phase in phases:
        phase()


def _timed_step(phases: Sequence[Phase], device: torch.device) -> list[float]:
    """Milliseconds of each phase of one step."""
    _sync(device)
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(phases) + 1)]
        events[0].record()
        for phase, event in zip(phases, events[1:]):
            phase()
            event.record()
        events[-1].synchronize()
        return [a.elapsed_time(b) for a, b in zip(events[:-1], events[1:])]
    stamps = [time.perf_counter()]
    for phase in phases:
        phase()
        stamps.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(stamps[:-1], stamps[1:])]


def measure(
    phases: Sequence[Phase],
    device: torch.device,
    *,
    steps: int = 10,
    warmup: int = 5,
    warmup_s: float = 3.0,
    launches: bool = True,
) -> Measurement:
    """Warm up, time ``steps`` steps, take the peak memory and count launches (see the
    module docstring). Exceptions (an out-of-memory included) propagate."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    start, done = time.perf_counter(), 0
    while done < warmup:
        _run_step(phases)
        _sync(device)
        done += 1
        if done >= 2 and time.perf_counter() - start > warmup_s:
            break

    cuda = device.type == "cuda"
    if cuda:
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    samples = [_timed_step(phases, device) for _ in range(steps)]
    peak = None
    if cuda:
        _sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - baseline) / 2**20

    medians = [statistics.median(s[k] for s in samples) for k in range(len(phases))]
    counts: list[int | None] = [None] * len(phases)
    if launches and cuda:
        try:
            counts = [count_kernels(phases, k, device) for k in range(len(phases))]
        except Exception:  # noqa: BLE001 - a profiler problem must not lose the timings
            counts = [None] * len(phases)
            free_memory(device)
    return Measurement(medians, peak, counts, steps, done)


def interleaved_ms(workloads: Sequence[Sequence[Phase]], device: torch.device, *, steps: int = 10,
                   rounds: int = 5) -> list[float]:
    """Median milliseconds of one step of each workload (all its phases), timed in
    ``rounds`` rounds that take the workloads in turn, ``ceil(steps / rounds)`` steps of
    each per round (each step as :func:`measure` times it: device synchronised, CUDA
    events). Comparing backends whose step is bound by host time, a drift of the host's
    speed during the run then falls on all of them alike instead of on whichever ran in
    the slow stretch. The workloads must be warmed up already."""
    if steps < 1 or rounds < 1:
        raise ValueError(f"steps and rounds must be >= 1, got {steps}, {rounds}")
    per_round = -(-steps // rounds)
    samples: list[list[float]] = [[] for _ in workloads]
    for _ in range(rounds):
        for k, phases in enumerate(workloads):
            for _ in range(per_round):
                samples[k].append(sum(_timed_step(phases, device)))
    return [statistics.median(s) for s in samples]


def count_kernels(phases: Sequence[Phase], index: int, device: torch.device) -> int:
    """GPU kernels launched by ``phases[index]`` in one step (the phases before it run
    unprofiled, the ones after it too, so the step completes)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for phase in phases[:index]:
        phase()
    _sync(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            phases[index]()
            _sync(device)
    for phase in phases[index + 1 :]:
        phase()
    _sync(device)
    kernels = runtime_launches = 0
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            if not event.name.startswith(("Memcpy", "Memset", "[memory]")):
                kernels += 1
        elif event.name in _LAUNCH_APIS:
            runtime_launches += 1
    # Device-side kernel records are exact; the runtime-API count is the fallback for
    # builds whose profiler records no device activity.
    return kernels if kernels else runtime_launches


def timed_ms(fn: Callable[[], object], device: torch.device, repeat: int = 3) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` synchronised calls after one
    untimed call (for one-off graph processing and format conversion)."""
    fn()
    times = []
    for _ in range(repeat):
        _sync(device)
        begin = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - begin) * 1e3)
    return statistics.median(times)


_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch.cuda, "OutOfMemoryError", None), getattr(torch, "OutOfMemoryError", None)) if t
)
_OOM_TEXT = ("out of memory", "CUSPARSE_STATUS_ALLOC_FAILED", "CUSPARSE_STATUS_INSUFFICIENT_RESOURCES")


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is a device out-of-memory (PyTorch's, or one from cuSPARSE)."""
    if _OOM_TYPES and isinstance(error, _OOM_TYPES):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in _OOM_TEXT)


def free_memory(device: torch.device) -> None:
    """Collect garbage and return cached device memory (after a case, or an OOM)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_limit_passed(started: float, time_limit: float | None) -> str | None:
    """The error of a case not started because ``--time-limit`` seconds have passed since
    ``started`` (a ``time.perf_counter()``), or ``None`` while there is time (or no limit)."""
    if time_limit is None or time.perf_counter() - started <= time_limit:
        return None
    return f"not run: --time-limit {time_limit:g} s reached"
