"""Suite ``sampled``: mini-batch training on sampled neighbourhoods (issue 18).

    python -m benchmarks.run --suite sampled                  # on a GPU; --allow-cpu --scale 0.002 for a smoke run
    python -m benchmarks.run --suite sampled --cases 'sampled-reddit-*' --backends fusegnn,torch

Cases (GraphSAGE, mean aggregation, hidden 256, one layer per hop, batches of 1024
training nodes, Adam lr 0.003):

* ``sampled-reddit-sage-25x10``: the Reddit-like graph of :mod:`fusegnn.datasets.synthetic`
  (232,965 nodes, 114.6M directed edges, 602 features, 41 classes, 153,431 training
  seeds at ``--scale 1``), fanouts ``[25, 10]``;
* ``sampled-products-sage-15x10x5``: the ogbn-products-like graph of the same generator
  (2,449,029 nodes, 61.9M undirected pairs = 123.7M directed edges, 100 features, 47
  classes, 196,615 training seeds), fanouts ``[15, 10, 5]``.

Backends:

* ``fusegnn``: :class:`fusegnn.loader.NeighborLoader`, graph and features on the GPU;
* ``fusegnn-pinned``: the same with ``pin_features=True`` (features in CPU memory, each
  batch's rows through pinned memory): peak GPU memory bounded by the batch;
* ``torch``: :class:`benchmarks.sampled_baseline.SortingLoader`, the sort-every-candidate
  sampler in plain torch ops on the GPU, same model;
* ``pyg``: ``torch_geometric.loader.NeighborLoader`` (CPU sampling, ``num_workers``
  worker processes), batches moved to the GPU, PyG's ``SAGEConv``; it needs ``pyg-lib``
  or ``torch-sparse``, and is recorded as unavailable (with the error) where they are
  missing.

Metrics per case and backend: ``sample_s``, an epoch of the loader alone (sampling,
feature and label gathering, every batch materialised on the device) and
``seeds_per_s``; ``train_s``, an epoch of training on freshly sampled batches (sampling
included: the time a user waits per epoch); ``peak_mib``, peak GPU memory during the
training epoch and ``batch_peak_mib``, the part above what was allocated before it (the
graph, the features; for ``fusegnn-pinned`` the features are in CPU memory only, so
its peak is the graph's structure plus the batch). A phase that passes its time limit stops and is
extrapolated to the whole epoch (``*_batches`` says how many batches were timed);
``$FUSEGNN_BENCH_PHASE_S`` sets that limit (default 60), ``$FUSEGNN_BENCH_PYG_WORKERS``
PyG's worker count (default ``min(8, cpus)``). ``--scale`` / ``--avg-degree`` size both
generated graphs (a fraction of the real node count; edges per node).
Results go to ``<out>/sampled/<gpu-slug>.json``, ``.md`` and ``.png`` (with matplotlib).
The model is the one of ``examples/train_sampled.py``.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["CASES", "BACKENDS", "run_sampled", "main_from_harness"]

_REPO = Path(__file__).resolve().parent.parent
HIDDEN = 256
BATCH_SIZE = 1024
LR = 0.003


@dataclass(frozen=True)
class SampledCase:
    name: str
    dataset: str  # "reddit" or "products"
    num_neighbors: tuple[int, ...]


CASES = (
    SampledCase("sampled-reddit-sage-25x10", "reddit", (25, 10)),
    SampledCase("sampled-products-sage-15x10x5", "products", (15, 10, 5)),
)
BACKENDS = ("fusegnn", "fusegnn-pinned", "torch", "pyg")


def _example():
    """``examples/train_sampled.py`` as a module (its ``SAGE`` is the model trained here)."""
    spec = importlib.util.spec_from_file_location("fusegnn_example_train_sampled", _REPO / "examples" / "train_sampled.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(case: SampledCase, scale: float, avg_degree: float | None, seed: int, device: torch.device):
    """The case's generated data set on ``device`` (built there: GPU generation is seconds)."""
    from fusegnn.datasets import generate_ogbn_like, generate_reddit_like

    if case.dataset == "reddit":
        return generate_reddit_like(scale, seed, device, avg_degree=avg_degree)
    return generate_ogbn_like("products", scale, seed, device, avg_degree=avg_degree)


def timed_epoch(batches: Iterable, total: int, step: Callable[[object], None], device: torch.device,
                phase_s: float) -> tuple[float, int]:
    """``(seconds for the whole epoch, batches timed)``: ``step`` on each batch, stopped
    after ``phase_s`` seconds and extrapolated to ``total`` batches."""
    _sync(device)
    t0 = time.perf_counter()
    done = 0
    for batch in batches:
        step(batch)
        done += 1
        if time.perf_counter() - t0 > phase_s:
            break
    _sync(device)
    elapsed = time.perf_counter() - t0
    return elapsed * total / max(done, 1), done


# ----------------------------------------------------------------------------- backends


def _fusegnn_pipeline(data, case, device, seed, pinned: bool):
    from fusegnn.loader import NeighborLoader

    example = _example()
    loader = NeighborLoader(data.graph, list(case.num_neighbors), BATCH_SIZE, data.train_mask, x=data.x, y=data.y,
                            seed=seed, device=device, pin_features=pinned)
    model = example.SAGE(data.num_features, HIDDEN, data.num_classes, len(case.num_neighbors)).to(device)
    return loader, model, lambda model, batch: model(batch.x, batch.blocks), lambda batch: batch.y


def _torch_pipeline(data, case, device, seed):
    from benchmarks.sampled_baseline import SortingLoader

    example = _example()
    seeds = torch.nonzero(data.train_mask).squeeze(1)
    loader = SortingLoader(data.graph, data.x, data.y, seeds, list(case.num_neighbors), BATCH_SIZE, seed)
    model = example.SAGE(data.num_features, HIDDEN, data.num_classes, len(case.num_neighbors)).to(device)
    return loader, model, lambda model, batch: model(batch.x, batch.blocks), lambda batch: batch.y


def _pyg_pipeline(data, case, device, seed):
    import torch_geometric.nn as pyg_nn
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader as PygNeighborLoader

    cpu = Data(x=data.x.cpu(), y=data.y.cpu(), edge_index=data.edge_index.cpu(), num_nodes=data.num_nodes)
    workers = int(os.environ.get("FUSEGNN_BENCH_PYG_WORKERS", min(8, os.cpu_count() or 1)))
    torch.manual_seed(seed)
    loader = PygNeighborLoader(cpu, num_neighbors=list(case.num_neighbors), batch_size=BATCH_SIZE,
                               input_nodes=data.train_mask.cpu(), shuffle=True, num_workers=workers,
                               persistent_workers=workers > 0, pin_memory=device.type == "cuda")

    class PygSAGE(torch.nn.Module):
        def __init__(self, widths):
            super().__init__()
            self.convs = torch.nn.ModuleList(pyg_nn.SAGEConv(a, b) for a, b in zip(widths[:-1], widths[1:]))

        def forward(self, x, edge_index):
            for k, conv in enumerate(self.convs):
                x = conv(x, edge_index)
                if k < len(self.convs) - 1:
                    x = F.dropout(F.relu(x), 0.5, self.training)
            return x

    widths = [data.num_features] + [HIDDEN] * (len(case.num_neighbors) - 1) + [data.num_classes]
    model = PygSAGE(widths).to(device)

    def forward(model, batch):
        batch = batch.to(device, non_blocking=True)
        return model(batch.x, batch.edge_index)[: batch.batch_size]

    return loader, model, forward, lambda batch: batch.y[: batch.batch_size].to(device, non_blocking=True)


def pyg_unavailable() -> str | None:
    """Why PyG's NeighborLoader cannot run here (``None`` if it can)."""
    try:
        from torch_geometric.data import Data
        from torch_geometric.loader import NeighborLoader as PygNeighborLoader

        tiny = Data(edge_index=torch.tensor([[0, 1], [1, 0]]), num_nodes=2)
        next(iter(PygNeighborLoader(tiny, num_neighbors=[1], batch_size=1)))
    except Exception as err:  # noqa: BLE001 - any failure is the reason recorded
        return f"{type(err).__name__}: {err}"
    return None


def pipeline(backend: str, data, case, device, seed):
    if backend == "fusegnn":
        return _fusegnn_pipeline(data, case, device, seed, pinned=False)
    if backend == "fusegnn-pinned":
        return _fusegnn_pipeline(data, case, device, seed, pinned=True)
    if backend == "torch":
        return _torch_pipeline(data, case, device, seed)
    if backend == "pyg":
        return _pyg_pipeline(data, case, device, seed)
    raise ValueError(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")


@contextlib.contextmanager
def features_on_host(data, device: torch.device) -> Iterator[None]:
    """``data.x`` in CPU memory for the ``with`` block (the generator makes it on the
    device): the pinned backend's peak must not count a device copy of the features the
    loader never reads. The device copy is freed and remade after the block."""
    if device.type != "cuda" or not data.x.is_cuda:
        yield
        return
    on_device = data.x
    data.x = on_device.cpu()
    del on_device
    torch.cuda.empty_cache()
    try:
        yield
    finally:
        data.x = data.x.to(device)


def measure(backend: str, data, case: SampledCase, device: torch.device, seed: int, phase_s: float,
            warmup: int = 2) -> dict:
    """One record: sampling epoch, training epoch, peak memory (for ``fusegnn-pinned``
    with the features in CPU memory only, see :func:`features_on_host`)."""
    if backend == "fusegnn-pinned":
        with features_on_host(data, device):
            record = _measure(backend, data, case, device, seed, phase_s, warmup)
        record["features"] = "CPU memory, each batch through pinned buffers (no device copy)"
        return record
    record = _measure(backend, data, case, device, seed, phase_s, warmup)
    record["features"] = "device" if data.x.device.type == device.type else "CPU"
    return record


def _measure(backend: str, data, case: SampledCase, device: torch.device, seed: int, phase_s: float,
             warmup: int) -> dict:
    loader, model, forward, target = pipeline(backend, data, case, device, seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses: list[torch.Tensor] = []

    def train_step(batch) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward(model, batch), target(batch))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())

    model.train()
    for k, batch in enumerate(loader):  # warm-up: kernels compiled, allocator and workers started
        train_step(batch)
        if k + 1 >= warmup:
            break
    total = len(loader)
    sample_s, sample_batches = timed_epoch(loader, total, lambda batch: None, device, phase_s)
    losses.clear()
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    train_s, train_batches = timed_epoch(loader, total, train_step, device, phase_s)
    record = {
        "case": case.name, "backend": backend, "ok": True, "batches": total,
        "seeds": int(data.train_mask.sum()), "sample_s": sample_s, "sample_batches": sample_batches,
        "seeds_per_s": int(data.train_mask.sum()) / sample_s, "train_s": train_s, "train_batches": train_batches,
        "first_loss": float(losses[0]), "last_loss": float(losses[-1]),
    }
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        record.update(peak_mib=peak / 2**20, batch_peak_mib=(peak - before) / 2**20)
    del loader, model, optimizer
    return record


# ----------------------------------------------------------------------------- suite


def run_sampled(device: torch.device, out: Path, *, scale: float = 1.0, avg_degree: float | None = None,
                seed: int = 0, cases: list[str] | None = None, backends: list[str] | None = None,
                phase_s: float = 60.0, time_limit: float | None = None, png: bool = True) -> str:
    """Run the suite; write ``out/sampled/<gpu-slug>.json`` (after every record), ``.md``
    (and ``.png``); return the markdown."""
    from benchmarks.report import environment, gpu_slug

    chosen_cases = [c for c in CASES if not cases or any(fnmatch.fnmatchcase(c.name, p) for p in cases)]
    chosen_backends = [b for b in BACKENDS if not backends or any(fnmatch.fnmatchcase(b, p) for p in backends)]
    if not chosen_cases:
        raise SystemExit(f"benchmarks: --cases {cases} matches no sampled case; known: "
                         f"{', '.join(c.name for c in CASES)}")
    if not chosen_backends:
        raise SystemExit(f"benchmarks: --backends {backends} matches no sampled backend; known: {', '.join(BACKENDS)}")
    unavailable = {}
    if "pyg" in chosen_backends and (reason := pyg_unavailable()) is not None:
        unavailable["pyg"] = reason
    if device.type != "cuda" and "fusegnn-pinned" in chosen_backends:
        unavailable["fusegnn-pinned"] = "pinned CPU memory feeds a CUDA device only"
    doc = {"suite": "sampled", "environment": environment(device),
           "config": dict(scale=scale, avg_degree=avg_degree, seed=seed, batch_size=BATCH_SIZE, hidden=HIDDEN,
                          lr=LR, phase_s=phase_s),
           "unavailable": unavailable, "datasets": {}, "records": []}
    folder = out / "sampled"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{gpu_slug(device)}.json"
    started = time.perf_counter()

    def write() -> None:
        path.write_text(json.dumps(doc, indent=1) + "\n")

    for case in chosen_cases:
        if time_limit is not None and time.perf_counter() - started > time_limit:
            doc["records"] += [{"case": case.name, "backend": b, "ok": False,
                                "error": f"not run: --time-limit {time_limit:g} s reached"} for b in chosen_backends]
            continue
        t0 = time.perf_counter()
        data = generate(case, scale, avg_degree, seed, device)
        doc["datasets"][case.dataset] = dict(nodes=data.num_nodes, edges=data.num_edges, features=data.num_features,
                                             classes=data.num_classes, train=int(data.train_mask.sum()),
                                             generated_s=round(time.perf_counter() - t0, 2),
                                             source="fusegnn.datasets.synthetic (generated on the device)")
        for backend in chosen_backends:
            if backend in unavailable:
                doc["records"].append({"case": case.name, "backend": backend, "ok": False,
                                       "error": f"unavailable: {unavailable[backend]}"})
                continue
            try:
                doc["records"].append(measure(backend, data, case, device, seed, phase_s))
            except torch.cuda.OutOfMemoryError:
                doc["records"].append({"case": case.name, "backend": backend, "ok": False, "error": "OOM"})
            except Exception as err:  # noqa: BLE001 - one backend's failure must not end the run
                doc["records"].append({"case": case.name, "backend": backend, "ok": False,
                                       "error": f"{type(err).__name__}: {err}"})
            if device.type == "cuda":
                torch.cuda.empty_cache()
            write()
        del data
    write()
    markdown = render(doc)
    path.with_suffix(".md").write_text(markdown + "\n")
    if png:
        why = write_png(doc, path.with_suffix(".png"))
        if why:
            print(f"PNG not written: {why}", file=sys.stderr)
    return markdown


def render(doc: dict) -> str:
    env = doc["environment"]
    lines = [
        f"## `sampled` on {env.get('device', '?')}", "",
        f"torch {env.get('torch')}, triton {env.get('triton')}, torch_geometric {env.get('torch_geometric')}; "
        f"{env.get('date')}. GraphSAGE (mean) h{doc['config']['hidden']}, batch {doc['config']['batch_size']}; "
        "sample = an epoch of the loader alone, train = an epoch of training with sampling; "
        "`~` = extrapolated from the batches timed.", "",
        "| case | backend | sample s | seeds/s | train s | peak MiB | batch peak MiB | loss first -> last | status |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in doc["records"]:
        if not r.get("ok"):
            lines.append(f"| {r['case']} | {r['backend']} |  |  |  |  |  |  | {r.get('error', 'failed')} |")
            continue
        mark = lambda phase: "~" if r[f"{phase}_batches"] < r["batches"] else ""  # noqa: E731
        peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else ""
        batch_peak = f"{r['batch_peak_mib']:.0f}" if "batch_peak_mib" in r else ""
        lines.append(
            f"| {r['case']} | {r['backend']} | {mark('sample')}{r['sample_s']:.3f} | {r['seeds_per_s']:,.0f} | "
            f"{mark('train')}{r['train_s']:.3f} | {peak} | {batch_peak} | {r['first_loss']:.3f} -> "
            f"{r['last_loss']:.3f} | ok |"
        )
    for name, info in doc.get("datasets", {}).items():
        lines.append(f"\n{name}: {info}")
    return "\n".join(lines)


def write_png(doc: dict, path: Path) -> str | None:
    """Bar chart of the epoch times; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"matplotlib not importable ({err})"
    ok = [r for r in doc["records"] if r.get("ok")]
    if not ok:
        return "no successful record"
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.4 * len(ok)))
    labels = [f"{r['case']} / {r['backend']}" for r in ok]
    ax.barh(labels, [r["train_s"] for r in ok], label="train epoch")
    ax.barh(labels, [r["sample_s"] for r in ok], label="sampling epoch", alpha=0.7)
    ax.set_xlabel("seconds per epoch")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main_from_harness(args, device: torch.device) -> int:
    """``python -m benchmarks.run --suite sampled``."""
    if args.list:
        print("suite sampled:", ", ".join(c.name for c in CASES))
        print("  backends:", ", ".join(BACKENDS))
        return 0
    phase_s = float(os.environ.get("FUSEGNN_BENCH_PHASE_S", 60.0))
    print(run_sampled(device, args.out, scale=args.scale, avg_degree=args.avg_degree, seed=args.seed,
                      cases=args.cases, backends=args.backends, phase_s=phase_s, time_limit=args.time_limit,
                      png=not args.no_png))
    return 0
