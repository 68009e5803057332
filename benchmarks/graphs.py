"""Capture a benchmark step into a CUDA graph (the ``*-graphed`` rows of the ``attention``
suite; the ``paper`` suite's graphed rows go through :func:`fusegnn.graphed_step`, which
also handles the optimizer).

The step runs ``warmup`` times eagerly on a side stream (compilation, cached layouts,
autotuning: work a recording cannot hold), then once under :func:`torch.cuda.graph`
with the host-sync debug mode set to ``"error"``, so a step that reads a device value
back fails at the capture instead of recording a stale one. Every later call is one
replay; what the step returned at the capture is overwritten in place by each replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CapturedStep", "capture_step"]

#: Eager calls on the side stream before the capture.
CAPTURE_WARMUP = 3


class CapturedStep:
    """A recorded step: calling it replays the graph and returns the step's outputs
    (the same tensors at every call, overwritten by the next replay)."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", outputs: Any) -> None:
        self.graph = graph
        self.outputs = outputs

    def __call__(self) -> Any:
        self.graph.replay()
        return self.outputs


def capture_step(step: Callable[[], Any], device: torch.device, warmup: int = CAPTURE_WARMUP) -> CapturedStep:
    """Warm ``step`` up, record it into a :class:`torch.cuda.CUDAGraph` and return the
    replayable step (see the module docstring).

    Raises:
        ValueError: ``device`` is not a CUDA device, or ``warmup < 1``.
        RuntimeError: the capture failed (a host synchronisation inside ``step``, an
            operation CUDA graphs cannot record); the message says the capture failed.
    """
    if not isinstance(device, torch.device) or device.type != "cuda":
        raise ValueError(f"capture_step: device must be a CUDA device (CUDA graphs record CUDA work), got {device}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"capture_step: warmup must be an int >= 1, got {warmup!r}")
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    current.wait_stream(side)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    previous = torch.cuda.get_sync_debug_mode()
    try:
        with torch.cuda.graph(graph):
            torch.cuda.set_sync_debug_mode("error")
            try:
                outputs = step()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
    except Exception as err:  # noqa: BLE001 - re-raised with what failed
        raise RuntimeError(f"capture failed: {type(err).__name__}: {err}") from err
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return CapturedStep(graph, outputs)
