"""The ``--sweep`` modes of the harness: GPU tuning runs that are not suites.

    python -m benchmarks.run --suite attention --sweep calibrate [--fit FILE ...]
    python -m benchmarks.run --suite attention --sweep kernels [--bands both]
    python -m benchmarks.run --suite agg --sweep spmm [--stages calib]

A sweep is a module with ``sweep_main(argv, out_dir, device)``: ``argv`` are the
options the harness did not recognise (the sweep's own: ``--sweep NAME --help`` lists
them), ``out_dir`` is ``<--out>/<suite>`` (JSON results there, logs under its ``raw/``)
and ``device()`` resolves the run's device the way the suites do (``--device``,
``--allow-cpu``; it exits with the harness's message when there is no GPU), so that a
sweep that needs no device (``--fit``) never asks for one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Sweep", "SWEEPS", "suite_sweeps", "run_sweep"]


@dataclass(frozen=True)
class Sweep:
    """One ``--sweep`` mode.

    Attributes:
        suite: the suite it belongs to (``--suite``).
        name: its ``--sweep`` name.
        module: the module holding ``sweep_main``.
        what: one line for ``--list``.
    """

    suite: str
    name: str
    module: str
    what: str


SWEEPS: tuple[Sweep, ...] = (
    Sweep("attention", "calibrate", "benchmarks.attention_calibrate",
          "refit sparse_attention's auto rule (dense / block / element crossover) and the block kernel's "
          "launch table; --fit FILE... refits from saved results without a GPU"),
    Sweep("attention", "kernels", "benchmarks.attention_kernels_gpu",
          "per-kernel launch sweep (fwd, dq, dkdv) of the block-sparse attention kernels"),
    Sweep("loss", "end-to-end", "benchmarks.loss_end_to_end",
          "GCN / GAT training steps on the Reddit-like graph with and without the fused head, eager and captured"),
    Sweep("vector", "window-crossover", "benchmarks.window_crossover",
          "window vs GAR aggregation over graphs of rising tile density: the data for spmm's auto rule"),
    Sweep("agg", "spmm", "benchmarks.kernels_spmm_gpu",
          "GAS / GAR checks, launch-parameter sweep, timings against cuSPARSE, and the auto crossover (calib)"),
)


def suite_sweeps(suite: str) -> dict[str, Sweep]:
    """The sweeps of ``suite`` by name."""
    return {s.name: s for s in SWEEPS if s.suite == suite}


def run_sweep(suite: str, name: str, argv: list[str], out: Path, device: Callable[[], torch.device]) -> int:
    """Run sweep ``name`` of ``suite`` (see the module docstring); returns its exit status.

    Raises:
        ValueError: no sweep of that name in ``suite`` (the message lists the known ones).
    """
    sweeps = suite_sweeps(suite)
    if name not in sweeps:
        known = ", ".join(f"--suite {s.suite} --sweep {s.name}" for s in SWEEPS)
        raise ValueError(f"--sweep {name!r}: suite {suite!r} has no such sweep; known: {known}")
    module = importlib.import_module(sweeps[name].module)
    return module.sweep_main(list(argv), Path(out) / suite, device)
