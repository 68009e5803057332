"""Suite ``loss``: a classifier head's linear + cross-entropy, forward and backward.

    python -m benchmarks.run --suite loss                 # on a GPU (bf16)
    python -m benchmarks.run --suite loss --cases 'loss-gnn-*' --backends fusegnn,eager
    python -m benchmarks.run --suite loss --allow-cpu     # smoke run: tiny shapes on the CPU

One step is ``loss = f(h, W, y)`` (mean reduction, no bias, bf16) and the gradients of
``h`` and ``W`` (``torch.autograd.grad``, so nothing accumulates between steps). Backends:

* ``fusegnn`` -- :func:`fusegnn.losses.linear_cross_entropy`;
* ``eager`` -- ``F.cross_entropy(F.linear(h, W), y)``;
* ``compile`` -- the same function under ``torch.compile``;
* ``liger`` -- Liger-Kernel's fused linear cross-entropy, where ``liger_kernel`` imports;
* ``cce`` -- cut-cross-entropy's ``linear_cross_entropy`` (its defaults, gradient
  filtering included), where ``cut_cross_entropy`` imports.

Before timing, each backend's loss and gradients are compared with float32 eager
(``h``, ``W`` upcast): the norm-wise relative errors go into the record
(``rel_err_loss``, ``rel_err_h``, ``rel_err_w``) and a backend whose error exceeds
``--rtol`` (2e-2 unless given: bf16 outputs) is marked failed, but still timed. Time is the median over
``--steps`` of CUDA events around one step; memory is ``max_memory_allocated`` during the
steps minus what was allocated before them (the inputs), so it holds the gradients and
every workspace. Results: ``<out>/loss/<gpu-slug>.{json,md,png}``.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "CASES", "LossCase", "main_from_harness", "run_loss_suite"]


@dataclass(frozen=True)
class LossCase:
    """A head: ``rows x features -> classes``."""

    name: str
    rows: int
    features: int
    classes: int
    note: str

    def smoke(self) -> "LossCase":
        """The same case, tiny (a CPU smoke run)."""
        classes = min(self.classes, 37) if self.classes < 1000 else 301
        return LossCase(self.name, 96, 16, classes, self.note + " (smoke size)")


CASES = {c.name: c for c in (
    LossCase("loss-llm-8192x4096-v128256", 8192, 4096, 128256, "language-model head (Llama-3 vocabulary)"),
    LossCase("loss-gnn-736kx256-c349", 736389, 256, 349, "GNN head, ogbn-mag-sized (736,389 papers, 349 venues)"),
    LossCase("loss-gnn-reddit", 232965, 128, 41, "GNN head, Reddit-sized (232,965 nodes, 41 classes)"),
    LossCase("loss-gnn-products", 2449029, 256, 47, "GNN head, ogbn-products-sized, every node"),
)}

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _eager(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


def _fusegnn(h, w, y):
    from fusegnn.losses import linear_cross_entropy

    return linear_cross_entropy(h, w, y)


_compiled: dict[str, Step] = {}


def _compile(h, w, y):
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(_eager)
    return _compiled["fn"](h, w, y)


def _liger(h, w, y):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(h, w, y)


def _cce(h, w, y):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, y)


BACKENDS: dict[str, tuple[Step, str | None]] = {
    "fusegnn": (_fusegnn, None),
    "eager": (_eager, None),
    "compile": (_compile, None),
    "liger": (_liger, "liger_kernel"),
    "cce": (_cce, "cut_cross_entropy"),
}


def _unavailable(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run here, or ``None``."""
    module = BACKENDS[name][1]
    if module is not None:
        if importlib.util.find_spec(module) is None:
            return f"skipped: {module} not installed (see benchmarks/NOTES-loss.md)"
        try:
            __import__(module)
        except Exception as err:  # noqa: BLE001 - a broken optional install is a skip, not a crash
            return f"skipped: import {module} failed ({type(err).__name__}: {err})"
        if device.type != "cuda":
            return f"skipped: {module} needs a CUDA device"
    if name == "compile" and device.type != "cuda":
        return "skipped: torch.compile is timed on a CUDA device only"
    return None


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(case: LossCase, device: torch.device, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(case.rows, case.features, device=device, dtype=dtype, generator=gen)
    w = torch.randn(case.classes, case.features, device=device, dtype=dtype, generator=gen) * case.features ** -0.5
    y = torch.randint(0, case.classes, (case.rows,), device=device, generator=gen)
    return h.requires_grad_(), w.requires_grad_(), y


def _step(fn: Step, h, w, y):
    loss = fn(h, w, y)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return loss, gh, gw


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _reference(case_inputs) -> tuple:
    """float32 eager loss and gradients (``h``, ``W`` upcast)."""
    h, w, y = case_inputs
    h32 = h.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    loss, gh, gw = _step(_eager, h32, w32, y)
    return loss.detach(), gh, gw


def _time(fn: Step, inputs, device, steps: int, warmup: int) -> tuple[float, float | None]:
    """Median ms of a forward + backward step and peak extra MiB over the timed steps."""
    for _ in range(warmup):
        _step(fn, *inputs)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = _step(fn, *inputs)
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            out = _step(fn, *inputs)
            times.append((time.perf_counter() - t0) * 1e3)
        del out
    peak = None
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return statistics.median(times), peak


def _record(case: LossCase, backend: str) -> dict:
    return {"case": case.name, "backend": backend, "ms": None, "peak_mem_mib": None, "ok": False, "error": None,
            "rel_err_loss": None, "rel_err_h": None, "rel_err_w": None, "steps": 0}


def run_case(case: LossCase, names: list[str], device: torch.device, *, steps: int, warmup: int, rtol: float,
             seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Every backend of ``names`` on ``case``: checked, then timed."""
    from benchmarks.measure import free_memory, is_oom
    from benchmarks.runner import worst_error

    records = []
    inputs = _inputs(case, device, dtype, seed)
    ref = _reference(inputs)
    free_memory(device)
    for name in names:
        record = _record(case, name)
        records.append(record)
        why = _unavailable(name, device)
        if why is not None:
            record["error"] = why
            continue
        fn = BACKENDS[name][0]
        try:
            loss, gh, gw = _step(fn, *inputs)
            record.update(rel_err_loss=_rel(loss.detach(), ref[0]), rel_err_h=_rel(gh, ref[1]),
                          rel_err_w=_rel(gw, ref[2]))
            del loss, gh, gw
            worst = worst_error(record["rel_err_loss"], record["rel_err_h"], record["rel_err_w"])
            if not worst <= rtol:
                record["error"] = f"relative error {worst:.3g} > {rtol:g} against float32 eager"
            record["ms"], record["peak_mem_mib"] = _time(fn, inputs, device, steps, warmup)
            record["steps"] = steps
            record["ok"] = record["error"] is None
        except Exception as err:  # noqa: BLE001 - one backend's failure is a result
            record["error"] = "OOM" if is_oom(err) else f"{type(err).__name__}: {err}"[:300]
        free_memory(device)
    del inputs, ref
    free_memory(device)
    return records


def render_markdown(doc: dict) -> str:
    """The results table: time, memory, speed-up over eager, relative errors."""
    lines = [f"## `loss` on {doc['environment']['device']}", "",
             f"bf16, mean reduction, forward + backward (grads of h and W); median of {doc['config']['steps']} "
             "steps; memory = peak minus the inputs; errors are norm-wise relative to float32 eager.", "",
             "| case | backend | ms | peak MiB | vs eager | rel err loss / dh / dW | status |",
             "|---|---|---:|---:|---:|---|---|"]
    eager = {r["case"]: r for r in doc["records"] if r["backend"] == "eager" and r["ms"]}

    def num(v, fmt):
        return "—" if v is None else format(v, fmt)

    for r in doc["records"]:
        speed = None
        if r["ms"] and r["case"] in eager:
            speed = eager[r["case"]]["ms"] / r["ms"]
        errs = " / ".join(num(r[k], ".1e") for k in ("rel_err_loss", "rel_err_h", "rel_err_w"))
        status = "ok" if r["ok"] else str(r["error"]).replace("|", "/")[:120]
        lines.append(f"| {r['case']} | {r['backend']} | {num(r['ms'], '.2f')} | {num(r['peak_mem_mib'], '.0f')} | "
                     f"{num(speed, '.2f')}{'x' if speed else ''} | {errs} | {status} |")
    return "\n".join(lines) + "\n"


def _write_png(doc: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:  # noqa: BLE001
        return f"matplotlib unavailable ({type(err).__name__})"
    rows = [r for r in doc["records"] if r["ms"]]
    if not rows:
        return "nothing timed"
    cases = list(dict.fromkeys(r["case"] for r in rows))
    names = list(dict.fromkeys(r["backend"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(7, 1.8 * len(cases)), 6))
    width = 0.8 / len(names)
    for ax, field, label in ((axes[0], "ms", "forward + backward, ms"), (axes[1], "peak_mem_mib", "peak extra MiB")):
        for k, name in enumerate(names):
            xs, ys = [], []
            for i, case in enumerate(cases):
                v = next((r[field] for r in rows if r["case"] == case and r["backend"] == name), None)
                if v:
                    xs.append(i + (k - (len(names) - 1) / 2) * width)
                    ys.append(v)
            ax.bar(xs, ys, width, label=name)
        ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, fontsize=8)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=len(names))
    axes[0].set_title(f"loss on {doc['environment']['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def run_loss_suite(device: torch.device, out: Path, *, cases: list[str] | None = None,
                   backends: list[str] | None = None, steps: int = 10, warmup: int = 3, rtol: float = 2e-2,
                   seed: int = 0, png: bool = True, time_limit: float | None = None) -> str:
    """Run the suite; write ``out/loss/<gpu-slug>.{json,md,png}``; return the markdown.
    On the CPU every case runs at a smoke size (:meth:`LossCase.smoke`)."""
    import fnmatch

    from benchmarks.measure import time_limit_passed
    from benchmarks.report import ResultFile, clean_number, environment, gpu_slug

    picked = [c for c in CASES.values() if not cases or any(fnmatch.fnmatchcase(c.name, p) for p in cases)]
    if not picked:
        raise SystemExit(f"benchmarks: --cases {cases} matches no loss case; known: {', '.join(CASES)}")
    names = [n for n in BACKENDS if not backends or any(fnmatch.fnmatchcase(n, p) for p in backends)]
    if not names:
        raise SystemExit(f"benchmarks: --backends {backends} matches no loss backend ({', '.join(BACKENDS)})")
    if device.type != "cuda":
        picked = [c.smoke() for c in picked]
    header = {"suite": "loss", "environment": environment(device),
              "config": {"steps": steps, "warmup": warmup, "rtol": rtol, "seed": seed, "dtype": "bfloat16",
                         "reduction": "mean", "bias": False},
              "cases": {c.name: {"rows": c.rows, "features": c.features, "classes": c.classes, "note": c.note}
                        for c in picked}}
    path = out / "loss" / f"{gpu_slug(device)}.json"
    results = ResultFile(path, header)
    started = time.perf_counter()
    for case in picked:
        late = time_limit_passed(started, time_limit)
        if late is not None:
            for name in names:
                results.add({**_record(case, name), "error": late})
            continue
        for record in run_case(case, names, device, steps=steps, warmup=warmup, rtol=rtol, seed=seed):
            results.add({k: clean_number(v) if isinstance(v, float) else v for k, v in record.items()})
    markdown = render_markdown(results.doc)
    path.with_suffix(".md").write_text(markdown)
    if png:
        why = _write_png(results.doc, path.with_suffix(".png"))
        if why:
            print(f"PNG not written: {why}")
    return markdown


def main_from_harness(args, device: torch.device) -> int:
    """``python -m benchmarks.run --suite loss``."""
    if args.list:
        print("suite loss: linear + cross-entropy forward + backward, bf16")
        for case in CASES.values():
            print(f"  {case.name:28s} {case.rows} x {case.features} -> {case.classes}: {case.note}")
        print("  backends:", ", ".join(BACKENDS))
        return 0
    rtol = args.rtol if args.rtol != 1e-4 else 2e-2  # the harness default is for float32 suites
    print(run_loss_suite(device, args.out, cases=args.cases, backends=args.backends, steps=args.steps,
                         warmup=min(args.warmup, 3), rtol=rtol, seed=args.seed, png=not args.no_png,
                         time_limit=args.time_limit))
    return 0
