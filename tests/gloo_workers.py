"""Running a test's worker function on several gloo processes on the CPU, for the
``torch.distributed`` tests: each worker writes ``rank<r>.json`` into a folder, and the
test reads the reports back (``mp.spawn`` raises if a worker fails)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any, Callable

import pytest

__all__ = ["free_port", "spawn_reports"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the workers' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_reports(worker: Callable[..., None], world: int, out: Path, *args: Any) -> list[dict]:
    """Run ``worker(rank, world, init_method, str(out), *args)`` on ``world`` processes and
    return each rank's ``rank<r>.json`` from ``out``."""
    mp = pytest.importorskip("torch.multiprocessing")
    mp.spawn(worker, args=(world, f"tcp://127.0.0.1:{free_port()}", str(out), *args), nprocs=world, join=True)
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(world)]
