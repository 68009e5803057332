"""Suite ``dist``: full-graph training across GPUs of one host (:mod:`fusegnn.distributed`).

    python -m benchmarks.run --suite dist                       # every GPU count up to all GPUs
    python -m benchmarks.run --suite dist --cases 'dist-reddit-*' --steps 20
    python -m benchmarks.run --suite dist --allow-cpu           # CPU smoke run: gloo, tiny graphs

Cases: ``dist-reddit-gcn-h128`` (GCN 602 -> 128 -> 41 on the Reddit-like graph),
``dist-reddit-gat-8x16`` (GAT, 8 heads x 16), ``dist-products-gcn-3x256`` (three GCN
layers of width 256 on the ogbn-products-like graph). Backends ``fusegnn-1gpu``,
``fusegnn-2gpu`` and ``fusegnn-<N>gpu`` for every GPU count this host has (1, 2, 4, 8 up
to ``torch.cuda.device_count()``, and the count itself). The suite launches the workers itself
(``torch.multiprocessing.spawn``, NCCL; one spawn per GPU count runs all cases).

Figures per case and GPU count: the median step time (forward, loss, backward, gradient
all-reduce, Adam; the slowest worker's), the halo exchanges of one step run alone
(slowest worker), the bytes every worker sends per step (total and per worker), the peak
memory of each GPU, and the largest relative difference of the loss curve from the
1-GPU one (the same seed and data, dropout off; ``steps_total`` steps).

**Modelled rows** (``modelled: true``) for 4 and 8 GPUs where the host has fewer: the
graph is partitioned into 4 / 8 parts on the host (the partition is exact: halo and send
rows per part), and

* step time = 1-GPU step time x (largest part's incoming edges / all edges)
  + largest per-worker bytes per step / the bandwidth measured on the largest real run
  (its bytes per worker / its exchange time);
* peak memory per GPU = a node term plus an edge term, ``A n + B e`` with ``n`` the
  largest own + halo node count of a part over all nodes and ``e`` the largest incoming
  edge count of a part over all edges (each the largest over the parts, which may be
  two different parts: an upper bound of every part's own); ``A`` and ``B`` are fitted to the 1-GPU peak (``n = e = 1``) and the largest real
  run's (where the two fractions coincide, the node term alone, scaled to that run).
  On the Reddit-sized graph the halo covers nearly every node from 2 parts on, so the
  memory follows the edges: fitted on 1 and 2 H100s, this model gave the 4-GPU peaks
  within 1.4 % (GCN 5674 against 5752 MiB measured, GAT 8321 against 8269); the node
  term alone had said 0.58x of one GPU where 4 GPUs measured 0.35-0.38x.

They are estimates (no contention, no overlap, compute linear in edges), labelled as such.
Writes ``<out>/dist/<gpu-slug>.json``, ``.md`` and (with matplotlib) ``.png``.
"""

from __future__ import annotations

import fnmatch
import json
import socket
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.dist_worker import CASES

__all__ = ["CASES", "backend_counts", "run_dist", "main_from_harness", "model_rows"]

#: the CPU smoke run's graphs: a few thousand nodes, degree 20
SMOKE_SCALE = {"reddit": 0.01, "products": 0.001}
SMOKE_DEGREE = {"reddit": 20.0, "products": 20.0}
MODEL_COUNTS = (4, 8)


def backend_counts(device_count: int) -> list[int]:
    """The GPU counts to run: 1, 2, 4, 8 up to ``device_count``, and ``device_count``."""
    counts = [n for n in (1, 2, 4, 8) if n <= device_count]
    if device_count > 0 and device_count not in counts:
        counts.append(device_count)
    return counts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tails(world_size: int, out_dir: str, chars: int = 1500) -> str:
    """The end of each worker's stderr log of a ``world_size`` spawn."""
    from benchmarks.dist_worker import worker_log

    tails = []
    for rank in range(world_size):
        path = Path(worker_log(out_dir, world_size, rank))
        text = path.read_text(errors="replace").strip() if path.exists() else "(no log)"
        tails.append(f"[worker {rank}] {text[-chars:]}")
    return "\n".join(tails)


def _spawn(world_size: int, cfg: dict, out_dir: str, attempts: int = 2, worker=None) -> int:
    """Run the ``world_size`` workers (``worker``, by default
    :func:`benchmarks.dist_worker.worker`); return how many spawns it took.

    A spawn whose process died of a signal (a rendezvous or transport failure of the
    process group, seen once as SIGABRT of a gloo worker on a loaded CI host) is started
    again, up to ``attempts`` times; the last failure is raised with the workers' stderr.
    A worker that raised a Python exception is not retried."""
    import torch.multiprocessing as mp

    if worker is None:
        from benchmarks.dist_worker import worker

    for attempt in range(1, attempts + 1):
        try:
            mp.spawn(worker, args=(world_size, f"tcp://127.0.0.1:{_free_port()}", cfg, out_dir),
                     nprocs=world_size, join=True)
            return attempt
        except mp.ProcessExitedException as err:
            message = f"{err}\n{_log_tails(world_size, out_dir)}"
            print(f"dist: {world_size}-worker spawn {attempt}/{attempts} failed: {message}", file=sys.stderr)
            if err.signal_name is None or attempt == attempts:
                raise RuntimeError(message) from err
    raise AssertionError("unreachable")


def _combine(records: list[dict]) -> dict:
    """One row from the workers' records of a (case, GPU count)."""
    errors = [r["error"] for r in records if "error" in r]
    first = records[0]
    row = dict(case=first["case"], world_size=first["world_size"], backend=f"fusegnn-{first['world_size']}gpu",
               modelled=False)
    if errors:
        row["error"] = errors[0]
        return row
    peaks = [r["peak_mem_mib"] for r in records]
    row.update(
        step_ms=max(r["step_ms"] for r in records),
        exchange_ms=max(r["exchange_ms"] for r in records),
        bytes_per_step=sum(r["bytes_sent"] for r in records),
        bytes_per_worker_max=max(r["bytes_sent"] for r in records),
        exchanges_per_step=first["exchanges_per_step"],
        peak_mem_mib=peaks if None not in peaks else None,
        peak_mem_mib_max=max(peaks) if None not in peaks else None,
        num_own=[r["num_own"] for r in records], num_halo=[r["num_halo"] for r in records],
        local_edges=[r["local_edges"] for r in records], partition=first["partition"],
        num_nodes=first["num_nodes"], num_edges=first["num_edges"], losses=first["losses"],
        widths=first["widths"],
    )
    if "modelled_partitions" in first:
        row["modelled_partitions"] = first["modelled_partitions"]
    return row


def model_rows(rows: list[dict], counts: tuple[int, ...] = MODEL_COUNTS) -> list[dict]:
    """The modelled rows of one case (see the module docstring) for the GPU counts in
    ``counts`` that were not measured; needs the 1-GPU row and a multi-GPU row."""
    measured = {r["world_size"]: r for r in rows if not r.get("modelled") and "error" not in r}
    multi = [n for n in measured if n > 1]
    if 1 not in measured or not multi:
        return []
    base, real = measured[1], measured[max(multi)]
    stats = real.get("modelled_partitions", {})
    bandwidth = real["bytes_per_worker_max"] / max(real["exchange_ms"], 1e-9)  # bytes per ms
    fwd_bytes = sum(w for w, d in real["widths"] if d == "forward")
    bwd_bytes = sum(w for w, d in real["widths"] if d == "backward")

    memory = _memory_model(base, real)
    out = []
    for n in counts:
        if n in measured or str(n) not in stats:
            continue
        parts = stats[str(n)]["parts"]
        per_worker = max(p["send_rows"] * fwd_bytes + p["num_halo"] * bwd_bytes for p in parts)
        compute = base["step_ms"] * max(p["local_edges"] for p in parts) / max(base["num_edges"], 1)
        mem = memory(parts) if memory is not None else None
        out.append(dict(
            case=base["case"], world_size=n, backend=f"fusegnn-{n}gpu", modelled=True,
            step_ms=compute + per_worker / bandwidth, exchange_ms=per_worker / bandwidth,
            bytes_per_step=sum(p["send_rows"] * fwd_bytes + p["num_halo"] * bwd_bytes for p in parts),
            bytes_per_worker_max=per_worker,
            peak_mem_mib_max=mem,
            num_own=[p["num_own"] for p in parts], num_halo=[p["num_halo"] for p in parts],
            partition=dict(method=stats[str(n)]["method"], edge_cut=stats[str(n)]["edge_cut"],
                           balance=stats[str(n)]["balance"]),
            model=dict(bandwidth_gb_s=bandwidth / 1e6, from_world_size=real["world_size"],
                       memory_mib_per_node_share=memory.per_node if memory else None,
                       memory_mib_per_edge_share=memory.per_edge if memory else None),
        ))
    return out


class _MemoryModel:
    """Peak MiB of a GPU holding ``parts``' largest share: ``per_node * n + per_edge * e``
    (see the module docstring), fitted by :func:`_memory_model`."""

    def __init__(self, per_node: float, per_edge: float, num_nodes: int, num_edges: int) -> None:
        self.per_node, self.per_edge = per_node, per_edge
        self.num_nodes, self.num_edges = max(num_nodes, 1), max(num_edges, 1)

    def fractions(self, parts: list[dict]) -> tuple[float, float]:
        """(largest own + halo nodes, largest incoming edges), as fractions of the graph's."""
        nodes = max(p["num_own"] + p["num_halo"] for p in parts) / self.num_nodes
        return nodes, max(p["local_edges"] for p in parts) / self.num_edges

    def __call__(self, parts: list[dict]) -> float:
        nodes, edges = self.fractions(parts)
        return self.per_node * nodes + self.per_edge * edges


def _memory_model(base: dict, real: dict) -> _MemoryModel | None:
    """The memory model fitted to the 1-GPU row ``base`` and the multi-GPU row ``real``;
    ``None`` without both peaks. Where the real run's node and edge fractions coincide (or
    the fit comes out negative) the edge term is dropped and the node term scaled to it."""
    peak_one, peak_real = base.get("peak_mem_mib_max"), real.get("peak_mem_mib_max")
    if peak_one is None or peak_real is None:
        return None
    model = _MemoryModel(0.0, 0.0, base["num_nodes"], base["num_edges"])
    parts = [dict(num_own=o, num_halo=h, local_edges=e)
             for o, h, e in zip(real["num_own"], real["num_halo"], real["local_edges"])]
    nodes, edges = model.fractions(parts)
    # per_node + per_edge = peak_one;  per_node * nodes + per_edge * edges = peak_real
    if abs(nodes - edges) > 1e-6:
        per_edge = (peak_one * nodes - peak_real) / (nodes - edges)
        per_node = peak_one - per_edge
        if per_edge >= 0 and per_node >= 0:
            model.per_node, model.per_edge = per_node, per_edge
            return model
    model.per_node = peak_real / max(nodes, 1e-12)
    return model


def _loss_difference(rows: list[dict]) -> None:
    """Each measured row's largest relative loss difference from the 1-GPU curve."""
    base = next((r for r in rows if r["world_size"] == 1 and "losses" in r), None)
    for row in rows:
        if base is not None and "losses" in row:
            row["loss_max_rel_diff"] = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(row["losses"], base["losses"]))


def run_dist(device: torch.device, out: Path, *, cases: list[str] | None = None, counts: list[int] | None = None,
             steps: int = 10, warmup: int = 5, steps_total: int = 50, scale: float = 1.0, seed: int = 0,
             partition: str = "auto", balance_on: str = "edges", exchange_reps: int = 5) -> str:
    """Run the suite; write ``out/dist/<gpu-slug>.{json,md,png}``; return the markdown."""
    from benchmarks.report import environment, gpu_slug

    cuda = device.type == "cuda"
    if counts is None:
        counts = backend_counts(torch.cuda.device_count()) if cuda else [1, 2]
    names = [c for c in CASES if cases is None or any(fnmatch.fnmatchcase(c, p) for p in cases)]
    if not names:
        raise ValueError(f"no dist case among {cases}; known: {', '.join(CASES)}")
    scales = {"reddit": scale, "products": scale} if cuda else dict(SMOKE_SCALE)
    if not cuda:  # a smoke run: only the steps asked for
        steps_total = warmup + steps
    cfg = dict(device=device.type, cases=names, scale=scales, avg_degree={} if cuda else dict(SMOKE_DEGREE),
               seed=seed, partition=partition, balance_on=balance_on, warmup=warmup,
               steps_total=max(steps_total, warmup + steps), exchange_reps=exchange_reps,
               model_from=max(counts), model_parts=[n for n in MODEL_COUNTS if n not in counts])
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in counts:
            try:
                spawns = _spawn(n, cfg, tmp)
            except Exception as err:  # noqa: BLE001 - recorded, the other counts still run
                rows += [dict(case=c, world_size=n, backend=f"fusegnn-{n}gpu", modelled=False,
                              error=f"spawn failed: {type(err).__name__}: {err}") for c in names]
                continue
            for name in names:
                records = [json.loads(Path(tmp, f"{name}-n{n}-r{r}.json").read_text()) for r in range(n)]
                rows.append(_combine(records))
                rows[-1]["spawns"] = spawns
    for name in names:
        case_rows = [r for r in rows if r["case"] == name]
        _loss_difference(case_rows)
        rows += model_rows(case_rows)
    doc = dict(suite="dist", environment=environment(device), config=cfg, cases={c: CASES[c] for c in names},
               results=rows)
    folder = out / "dist"
    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / gpu_slug(device)
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    markdown = render_markdown(doc)
    stem.with_suffix(".md").write_text(markdown + "\n")
    why = write_png(doc, stem.with_suffix(".png"))
    if why:
        print(f"PNG not written: {why}", file=sys.stderr)
    return markdown


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_markdown(doc: dict) -> str:
    lines = [f"## `dist` on {doc['environment'].get('device', '?')}", "",
             "Step = forward + loss + backward + gradient all-reduce + Adam (slowest worker, median). "
             "Exchange = one step's halo exchanges alone. Rows marked *modelled* are estimates "
             "(see benchmarks/dist.py), not measurements.", "",
             "| case | backend | step ms | x vs 1 GPU | exchange ms | MB sent / step | peak MiB / GPU (max) "
             "| mem vs 1 GPU | halo nodes (max) | loss rel. diff |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in doc["cases"]:
        rows = sorted((r for r in doc["results"] if r["case"] == name), key=lambda r: r["world_size"])
        base = next((r for r in rows if r["world_size"] == 1 and "error" not in r), None)
        for r in rows:
            label = r["backend"] + (" *modelled*" if r.get("modelled") else "")
            if "error" in r:
                lines.append(f"| {name} | {label} | error: {r['error'][:80]} | | | | | | | |")
                continue
            speedup = base["step_ms"] / r["step_ms"] if base else None
            mem_ratio = (r["peak_mem_mib_max"] / base["peak_mem_mib_max"]
                         if base and r.get("peak_mem_mib_max") and base.get("peak_mem_mib_max") else None)
            lines.append(
                f"| {name} | {label} | {_fmt(r['step_ms'])} | {_fmt(speedup)} | {_fmt(r['exchange_ms'])} "
                f"| {_fmt(r['bytes_per_step'] / 1e6)} | {_fmt(r.get('peak_mem_mib_max'), 0)} | {_fmt(mem_ratio)} "
                f"| {max(r['num_halo'])} | {_fmt(r.get('loss_max_rel_diff'), 6) if 'loss_max_rel_diff' in r else '-'} |"
            )
    return "\n".join(lines)


def write_png(doc: dict, path: Path) -> str | None:
    """Step time and peak memory per GPU against the GPU count, one line per case."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        return f"matplotlib unavailable ({type(err).__name__})"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in doc["cases"]:
        rows = sorted((r for r in doc["results"] if r["case"] == name and "error" not in r),
                      key=lambda r: r["world_size"])
        for ax, key in zip(axes, ("step_ms", "peak_mem_mib_max")):
            xs = [r["world_size"] for r in rows if r.get(key) is not None]
            ys = [r[key] for r in rows if r.get(key) is not None]
            if xs:
                line, = ax.plot(xs, ys, marker="o", label=name)
                modelled = [(r["world_size"], r[key]) for r in rows if r.get("modelled") and r.get(key) is not None]
                if modelled:
                    ax.scatter(*zip(*modelled), facecolors="none", edgecolors=line.get_color(), s=120)
    for ax, title in zip(axes, ("step time (ms)", "peak memory per GPU (MiB)")):
        ax.set_xlabel("GPUs (hollow: modelled)")
        ax.set_title(title)
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main_from_harness(args, device: torch.device) -> int:
    """``python -m benchmarks.run --suite dist`` (``--backends`` picks GPU counts by name)."""
    counts = backend_counts(torch.cuda.device_count()) if device.type == "cuda" else [1, 2]
    if args.backends:
        counts = [n for n in counts if any(fnmatch.fnmatchcase(f"fusegnn-{n}gpu", p) for p in args.backends)]
        if not counts:
            raise SystemExit(f"benchmarks: --backends {args.backends} matches no GPU count here")
    print(run_dist(device, args.out, cases=args.cases, counts=counts, steps=args.steps, warmup=args.warmup,
                   scale=args.scale, seed=args.seed))
    return 0
