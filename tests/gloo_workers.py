"""Running a test's worker function on several gloo processes on the CPU, for the
``torch.distributed`` tests: each worker writes ``rank<r>.json`` into a folder, and the
test reads the reports back (``mp.spawn`` raises if a worker fails)."""

from __future__ import annotations

import datetime
import json
import os
import socket
from pathlib import Path
from typing import Any, Callable

import pytest

__all__ = ["free_port", "spawn_reports", "write_report"]


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


def write_report(rank: int, world: int, init: str, out_dir: str, report: Callable[[], dict],
                 timeout_s: float | None = None) -> None:
    """A worker's body: join the gloo group (one thread; ``timeout_s`` bounds a collective
    that a worker failing alone leaves waiting), write ``report()`` as ``rank<r>.json``
    into ``out_dir``, leave the group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, **timeout)
    try:
        content = report()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(content, f)
    finally:
        dist.destroy_process_group()
