r"""Suite ``vector``: vector sparsity against the sparse and dense baselines (issue #17).

    python -m benchmarks.run --suite vector                 # on a GPU, bfloat16
    python -m benchmarks.run --suite vector --quick         # linear s90 V=8, masks at 2%, aggregation F=128
    python -m benchmarks.run --suite vector --cases 'linear-*-s90-*' --backends fusegnn,cublas
    python -m benchmarks.run --suite vector --allow-cpu     # smoke run: tiny shapes, float32, on the CPU
    python -m benchmarks.run --suite vector --cases 'agg-*' --append   # re-run some cases, keep the others

**Cases** (the names carry the parameters):

* ``linear-{in}x{out}-s{S}-v{V}`` -- a pruned linear layer :math:`y = x W^\top`, ``x``
  ``[8192, in]`` (8192 tokens), ``W`` ``[out, in]``: ``nn.Linear``'s initial weight
  with the ``S`` % of its ``V``-row vectors of smallest norm pruned (:meth:`fusegnn.sparse.VectorSparse.prune`,
  as :class:`fusegnn.layers.VectorSparseLinear` builds it); ``in x out`` in
  ``4096x16384``, ``16384x4096``; ``S`` in 70, 90, 95; ``V`` in 4, 8, 16;
* ``mask-random{P}-L{L}`` -- attention of ``q, k, v`` ``[1, 8, L, 64]`` under a random
  element mask: each (query, key) pair allowed with probability ``P`` % (1, 2, 5),
  independently, plus the diagonal (no empty row); ``L`` in 4096, 16384;
* ``agg-reddit-f{F}[-rcm]`` -- ``out = A x`` on the Reddit-like graph of
  :func:`fusegnn.datasets.generate_reddit_like` (``--scale``, ``--avg-degree``; ``A``
  the adjacency, 1 per edge), ``x`` ``[N, F]``, ``F`` in 64, 128, 256; ``-rcm`` on
  ``Graph.reorder("rcm")`` of the same graph.

**Backends** and what their backward computes (``grads`` in the row):

* linear -- ``fusegnn``: :class:`~fusegnn.layers.VectorSparseLinear` as a user runs it
  (``vspmm``): ``dx`` through the transposed pattern and the weight gradient **at the
  kept vectors only** (``vsddmm``, ``dW@pattern``); ``cublas``: ``F.linear`` with the
  dense ``W`` (the same values, zeros included): ``dx`` and the dense ``dW``;
  ``cusparse``: ``torch.sparse.mm`` with ``W`` as CSR (cuSPARSE), torch's autograd:
  ``dx`` and the gradient of the sparse ``W`` (its CSR pattern, ``dW@pattern``);
  ``bsr``: the same with ``W.to_sparse_bsr(16)`` (the gradient on the non-empty 16 x 16
  blocks, ``dW@bsr16``); ``cusparselt``: the layer's 2:4 inference form,
  :meth:`~fusegnn.layers.VectorSparseLinear.to_semi_structured` -- the **same** V-sparse
  weight, its input columns reordered (and zero-padded: ``width``, ``widening``) into an
  exact 2:4 matrix (:mod:`fusegnn.sparse.semi_structured`), ``x``'s columns gathered, one
  ``torch.sparse.to_sparse_semi_structured`` matmul (cuSPARSELt; CUTLASS where
  cuSPARSELt is absent, ``impl`` says which; ``weight_density`` = ``widening / 2``);
  ``build_ms`` includes the host-side layout search. Forward only: torch's 2:4 weight
  has no transposed copy for ``dx``. This row is what decides whether the 2:4 form is
  ever worth picking; no automatic rule picks it. A torch backend whose autograd
  cannot give a gradient falls back to fewer gradients, then to the forward alone, then
  to float32 (the ``note`` says what failed, ``grads`` and ``dtype`` what was timed);
* masks -- ``fusegnn``: ``sparse_attention(..., aggregation="vector")``; ``fusegnn-auto``:
  ``sparse_attention(...)`` as a user calls it (``aggregation="auto"``; ``path``: what the
  rule took); ``element``:
  ``sparse_attention(..., aggregation="element")``; ``flex``: ``torch.compile``\ d
  FlexAttention with ``create_block_mask`` of a ``mask_mod`` reading the same boolean
  matrix (128 x 128 blocks; built once, ``build_ms``); all three ``dq, dk, dv``;
* aggregation -- ``fusegnn``: ``spmm(graph, x, aggregation="window")`` (row windows of 16
  rows of ``A`` and, for ``dx``, of ``A^T``, built once: ``build_ms``; ``tile_density`` /
  ``tile_density_t``, the input of a future ``auto`` rule); ``element``:
  :func:`fusegnn.sparse.spmm`, its automatic GAS / GAR choice (``path``); ``cusparse``:
  ``torch.sparse.mm`` with CSR of ``A`` and ``A^T`` (int32 indices) of the same graph;
  all three ``dx = A^T G``. ``reorder_ms`` (the RCM ordering, on the host) and
  ``build_ms`` are one-off costs, apart from the step time.

**Measured.** Every backend first runs once (forward and backward) and each output is
compared with a float32 reference -- ``x W^T`` and its gradients in float32 (the
cusparselt row too: its 2:4 weight is the same weight, reordered); float32 SDPA with the boolean mask on batch
0, heads 0-1; float32 cuSPARSE on the same graph -- as the norm-wise relative error
``|out - ref| / |ref|`` (``rel_err``: the largest over the outputs, ``rel_errs`` each);
above ``--rtol`` (2e-2 unless given) the row is an error and is not timed. Then
:func:`benchmarks.measure.measure`: warm-up, then ``--steps`` steps of two phases,
``fwd_ms`` (the forward of a training step: the inputs require grad) and ``bwd_ms``,
medians of CUDA-event timings; ``fwdbwd_ms`` is their sum; ``peak_mem_mib`` the peak
memory above what was allocated before the timed steps. ``vs_<anchor>`` = the anchor's
ms / this row's ms (above 1: faster), ``_fwd`` for the forward: anchors ``cublas``
(linear), ``element`` and ``flex`` (masks), ``cusparse`` (aggregation). The markdown
starts with the issue's targets, measured. Results: ``<out>/vector/<gpu-slug>.{json,md,png}``.

On the CPU (``--allow-cpu``, a smoke run) the shapes shrink (linear features / 256, 16
tokens; ``L`` / 64, 2 heads of 16; a Reddit-like graph at scale 0.0004 with 6 edges per
node, ``F`` / 8) and the dtype is float32.
"""

from __future__ import annotations

import fnmatch
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.measure import free_memory, is_oom, measure, time_limit_passed
from benchmarks.vector_workloads import (
    CPU_SIZES,
    GPU_SIZES,
    AggGraphs,
    CaseInputs,
    Sizes,
    Step,
    Unavailable,
    agg_inputs,
    linear_inputs,
    mask_inputs,
)

__all__ = ["BACKENDS", "CASES", "KIND_BACKENDS", "QUICK", "VectorCase", "main_from_harness", "render_markdown",
           "run_vector_suite", "select_cases"]

SUITE = "vector"
#: every backend name, in the issue's order
BACKENDS = ("fusegnn", "fusegnn-auto", "cublas", "cusparse", "bsr", "cusparselt", "element", "flex")
KIND_BACKENDS = {
    "linear": ("fusegnn", "cublas", "cusparse", "bsr", "cusparselt"),
    "mask": ("fusegnn", "fusegnn-auto", "element", "flex"),
    "agg": ("fusegnn", "element", "cusparse"),
}
#: the rows each row of a case is compared with (``vs_<anchor>``)
ANCHORS = {"linear": ("cublas",), "mask": ("element", "flex"), "agg": ("cusparse",)}
DEFAULT_RTOL = 2e-2  # bfloat16 outputs


@dataclass(frozen=True)
class VectorCase:
    name: str
    kind: str  # "linear", "mask" or "agg"
    in_features: int = 0
    out_features: int = 0
    sparsity: int = 0  # percent of vectors pruned
    V: int = 0
    density: int = 0  # percent of (query, key) pairs allowed
    L: int = 0
    features: int = 0
    reorder: str | None = None

    def info(self) -> dict[str, Any]:
        fields = {"linear": ("in_features", "out_features", "sparsity", "V"), "mask": ("density", "L"),
                  "agg": ("features", "reorder")}[self.kind]
        return {"kind": self.kind, **{f: getattr(self, f) for f in fields}}


def _cases() -> dict[str, VectorCase]:
    cases = [VectorCase(f"linear-{i}x{o}-s{s}-v{V}", "linear", in_features=i, out_features=o, sparsity=s, V=V)
             for i, o in ((4096, 16384), (16384, 4096)) for s in (70, 90, 95) for V in (4, 8, 16)]
    cases += [VectorCase(f"mask-random{p}-L{L}", "mask", density=p, L=L) for p in (1, 2, 5) for L in (4096, 16384)]
    cases += [VectorCase(f"agg-reddit-f{F}{'-rcm' if r else ''}", "agg", features=F, reorder=r)
              for F in (64, 128, 256) for r in (None, "rcm")]
    return {c.name: c for c in cases}


CASES = _cases()
#: ``--quick``: the cases of the issue's targets at one parameter each
QUICK = ("linear-4096x16384-s90-v8", "linear-16384x4096-s90-v8", "mask-random2-L4096", "mask-random2-L16384",
         "agg-reddit-f128", "agg-reddit-f128-rcm")


def select_cases(patterns: list[str] | None, quick: bool) -> list[VectorCase]:
    """The cases matching ``patterns`` (names or globs; all when ``None``), within
    :data:`QUICK` under ``quick``."""
    pool = [CASES[n] for n in QUICK] if quick else list(CASES.values())
    return [c for c in pool if not patterns or any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]


def select_backends(patterns: list[str] | None) -> list[str]:
    return [b for b in BACKENDS if not patterns or any(fnmatch.fnmatchcase(b, p) for p in patterns)]


# ----------------------------------------------------------------------------- running


def new_record(case: VectorCase, backend: str) -> dict[str, Any]:
    return {"case": case.name, "kind": case.kind, "backend": backend, "ok": False, "error": None, "note": None,
            "dtype": None, "grads": None, "fwd_ms": None, "bwd_ms": None, "fwdbwd_ms": None, "peak_mem_mib": None,
            "rel_err": None, "rel_errs": None, "steps": None, "warmup_steps": None, "build_ms": None,
            "reorder_ms": None}


def _describe(err: BaseException) -> str:
    lines = f"{type(err).__name__}: {err}".strip().splitlines()
    return lines[0][:300] if lines else type(err).__name__


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@dataclass(frozen=True)
class RunConfig:
    device: torch.device
    steps: int
    warmup: int
    warmup_s: float
    rtol: float


def _phases(step: Step) -> list:
    """``[forward, backward]`` (``[forward]`` without gradients) sharing the output."""
    state: dict[str, torch.Tensor] = {}

    def forward() -> None:
        state["out"] = step.forward()

    def backward() -> None:
        torch.autograd.grad(state.pop("out"), step.wrt, step.grad_out)

    return [forward, backward] if step.wrt else [forward]


def run_backend(case: VectorCase, name: str, inputs: CaseInputs, cfg: RunConfig) -> dict[str, Any]:
    """One row: the first candidate of ``name`` that runs, checked, then timed."""
    record = new_record(case, name)
    record.update(inputs.info)
    try:
        candidates = inputs.candidates[name]()
    except Unavailable as why:
        record["error"] = f"skipped: {why}"
        return record
    failed: list[str] = []
    step = results = None
    for candidate in candidates:
        try:
            step = candidate.build()
            results = step.run_once()
            record["grads"] = candidate.label
            break
        except Exception as err:  # noqa: BLE001 - a candidate that cannot run is a result
            step = results = None
            free_memory(cfg.device)
            if is_oom(err):
                record["error"] = "OOM"
                return record
            failed.append(f"{candidate.label}: {_describe(err)}")
    if failed:
        record["note"] = "; ".join(failed)[:600]
    if step is None:
        record["error"] = record.pop("note") or "no way to run it"
        record["note"] = None
        return record
    try:
        record.update(step.info)
        if step.describe is not None:
            record.update(step.describe())
        reference = {**inputs.reference, **step.reference}
        errors = {key: _rel(inputs.view(value), reference[key]) for key, value in results.items()}
        del results
        record["rel_errs"], record["rel_err"] = errors, max(errors.values())
        if not all(math.isfinite(e) and e <= cfg.rtol for e in errors.values()):
            worst = max(errors, key=lambda k: errors[k] if math.isfinite(errors[k]) else math.inf)
            record["error"] = f"mismatch: rel err of {worst} {errors[worst]:.3g} > {cfg.rtol:g} (not timed)"
            return record
        m = measure(_phases(step), cfg.device, steps=cfg.steps, warmup=cfg.warmup, warmup_s=cfg.warmup_s,
                    launches=False)
        record.update(ok=True, fwd_ms=m.ms[0], bwd_ms=m.ms[1] if len(m.ms) > 1 else None, fwdbwd_ms=sum(m.ms),
                      peak_mem_mib=m.peak_mem_mib, steps=m.steps, warmup_steps=m.warmup_steps)
        if len(m.ms) == 1:
            record["fwdbwd_ms"] = None
    except Exception as err:  # noqa: BLE001 - one backend's failure is a result
        record["error"] = "OOM" if is_oom(err) else _describe(err)
    finally:
        del step
        free_memory(cfg.device)
    return record


def add_speedups(records: list[dict[str, Any]], kind: str) -> None:
    """``vs_<anchor>_fwd`` and ``vs_<anchor>`` (forward + backward) of the rows of one case."""
    by_name = {r["backend"]: r for r in records}
    for r in records:
        for anchor in ANCHORS[kind]:
            base = by_name.get(anchor, {})
            for suffix, field in (("_fwd", "fwd_ms"), ("", "fwdbwd_ms")):
                mine, theirs = r.get(field), base.get(field) if base.get("ok") else None
                r[f"vs_{anchor}{suffix}"] = theirs / mine if mine and theirs else None


def _case_inputs(case: VectorCase, sizes: Sizes, cfg: RunConfig, seed: int, graphs: AggGraphs) -> CaseInputs:
    if case.kind == "linear":
        return linear_inputs(case, sizes, cfg.device, seed)
    if case.kind == "mask":
        return mask_inputs(case, sizes, cfg.device, seed)
    return agg_inputs(case, sizes, cfg.device, seed, graphs)


def run_vector_suite(device: torch.device, out: Path, *, cases: list[str] | None = None,
                     backends: list[str] | None = None, quick: bool = False, steps: int = 10, warmup: int = 5,
                     warmup_s: float = 3.0, rtol: float = DEFAULT_RTOL, seed: int = 0, scale: float = 1.0,
                     avg_degree: float | None = None, png: bool = True, time_limit: float | None = None,
                     progress: bool = True, append: bool = False) -> str:
    """Run the suite; write ``out/vector/<gpu-slug>.{json,md,png}`` (the JSON after every
    record; ``append`` keeps the records of the cases not run now); return the markdown."""
    from benchmarks.report import ResultFile, clean_number, environment, gpu_slug

    picked = select_cases(cases, quick)
    if not picked:
        known = ", ".join(c.name for c in select_cases(None, quick))
        raise SystemExit(f"benchmarks: --cases {cases} matches no vector case; known: {known}")
    names = select_backends(backends)
    if not names:
        raise SystemExit(f"benchmarks: --backends {backends} matches no vector backend ({', '.join(BACKENDS)})")
    sizes = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    cfg = RunConfig(device, steps, warmup, warmup_s, rtol)
    agg_scale = sizes.agg_scale if sizes.agg_scale is not None else scale
    agg_degree = sizes.agg_avg_degree if sizes.agg_avg_degree is not None else avg_degree
    graphs = AggGraphs(agg_scale, agg_degree, seed, device)
    header = {
        "suite": SUITE, **environment(device), "anchors": ANCHORS,
        "config": {"steps": steps, "warmup": warmup, "warmup_s": warmup_s, "rtol": rtol, "seed": seed,
                   "quick": quick, "dtype": str(sizes.dtype).removeprefix("torch."), "tokens": sizes.tokens,
                   "heads": sizes.heads, "head_dim": sizes.head_dim, "smoke_sizes": device.type != "cuda"},
        "cases": {c.name: c.info() for c in picked},
    }
    path = out / SUITE / f"{gpu_slug(device)}.json"
    results = ResultFile(path, header, append=append, rerun_cases=[c.name for c in picked])
    started = time.perf_counter()
    try:
        for case in picked:
            applicable = [n for n in KIND_BACKENDS[case.kind] if n in names]
            if not applicable:
                continue
            late = time_limit_passed(started, time_limit)
            if late is not None:
                for name in applicable:
                    results.add({**new_record(case, name), "error": late})
                continue
            if progress:
                print(f"vector {case.name} ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
            try:
                inputs = _case_inputs(case, sizes, cfg, seed, graphs)
            except Exception as err:  # noqa: BLE001 - a case that cannot be set up is recorded
                for name in applicable:
                    record = new_record(case, name)
                    record["error"] = "OOM" if is_oom(err) else f"case setup: {_describe(err)}"
                    results.add(record)
                free_memory(device)
                continue
            records = [run_backend(case, name, inputs, cfg) for name in applicable]
            del inputs
            free_memory(device)
            add_speedups(records, case.kind)
            for record in records:
                results.add({k: clean_number(v) if isinstance(v, float) else v for k, v in record.items()})
            if graphs.facts:
                results.doc["datasets"]["reddit-like"] = graphs.facts
    finally:
        graphs.release()
        free_memory(device)
        results.write()
    markdown = render_markdown(results.doc)
    path.with_suffix(".md").write_text(markdown)
    if png:
        why = write_png(results.doc, path.with_suffix(".png"))
        if why:
            print(f"PNG not written: {why}", file=sys.stderr)
    print(f"wrote {path} (+ .md{'' if not png or why else ', .png'})", file=sys.stderr)
    return markdown


# ----------------------------------------------------------------------------- report

#: the issue's targets: (what, case pattern, anchor backend, suffix that the anchor's case lacks, goal[,
#: the row measured against the anchor: "fusegnn" unless named])
TARGETS = (
    ("pruned linear 90% V=8 vs cuBLAS", "linear-*-s90-v8", "cublas", "", 1.3),
    ("pruned linear 90% V=8 vs cuSPARSE CSR", "linear-*-s90-v8", "cusparse", "", 4.0),
    ("pruned linear 90% V=8 vs BSR", "linear-*-s90-v8", "bsr", "", 1.5),
    ("masks vs our element path", "mask-*", "element", "", 2.0),
    ("masks vs FlexAttention", "mask-*", "flex", "", 1.0),
    ("masks, auto's path, vs FlexAttention", "mask-*", "flex", "", 1.0, "fusegnn-auto"),
    ("aggregation F=128/256 vs cuSPARSE (original graph)", "agg-reddit-f[12][25]*", "cusparse", "-rcm", 2.0),
    ("aggregation F=128/256, auto's path (`spmm` as a user calls it), vs cuSPARSE (original graph)",
     "agg-reddit-f[12][25]*", "cusparse", "-rcm", 2.0, "element"),
)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}g}"


def target_rows(doc: dict) -> list[tuple]:
    """``(target, case, fwd speed-up, fwd+bwd speed-up, goal)`` of fusegnn against the
    anchor of each target (for aggregation: cuSPARSE on the original graph, fusegnn on
    the original and on the reordered graph)."""
    rows = {(r["case"], r["backend"]): r for r in doc["records"] if r.get("ok")}
    out = []
    for what, pattern, anchor, strip, goal, *measured in TARGETS:
        for case in doc["cases"]:
            mine = rows.get((case, measured[0] if measured else "fusegnn"))
            if not fnmatch.fnmatchcase(case, pattern) or mine is None:
                continue
            base = rows.get((case.removesuffix(strip) if strip else case, anchor))
            if base is None:
                continue
            speed = [base[f] / mine[f] if base.get(f) and mine.get(f) else None for f in ("fwd_ms", "fwdbwd_ms")]
            out.append((what, case, speed[0], speed[1], goal))
    return out


def _speed(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}x"


def _status(r: dict) -> str:
    text = "ok" if r.get("ok") else str(r.get("error"))
    extras = [f"{k} {r[k]}" for k in ("path", "impl", "dtype") if r.get(k)]
    if r.get("tile_density") is not None:
        extras.append(f"tile density {r['tile_density']:.3f}")
    if r.get("note"):
        extras.append(f"fell back: {r['note']}")
    return "; ".join([text, *extras]).replace("|", "/")[:300]


def render_markdown(doc: dict) -> str:
    """The targets, then one table per kind of case."""
    cfg = doc["config"]
    lines = [f"## `vector` on {doc.get('device')}", "",
             f"{cfg['dtype']}; medians of {cfg['steps']} steps; fwd = the forward of a training step, fwd+bwd = "
             "forward + backward (`grads`: what the backward computes); vs X = X's ms / this row's ms (above 1: "
             "faster); rel err: norm-wise against float32; one-off costs (`build`, `reorder`) are not in the step.",
             "", "### Targets (issue #17)", "",
             "| target | case | fwd | fwd+bwd | goal | met (fwd / fwd+bwd) |", "|---|---|---:|---:|---:|---|"]

    def met(speed: float | None, goal: float) -> str:
        return "—" if speed is None else ("yes" if speed > goal or (goal != 1 and speed == goal) else "no")

    for what, case, fwd, both, goal in target_rows(doc):
        lines.append(f"| {what} | {case} | {_speed(fwd)} | {_speed(both)} | {'>' if goal == 1 else '>='} {goal:g}x "
                     f"| {met(fwd, goal)} / {met(both, goal)} |")
    titles = {"linear": "Pruned linear layers", "mask": "Irregular attention masks", "agg": "Aggregation"}
    for kind, title in titles.items():
        records = [r for r in doc["records"] if r.get("kind") == kind]
        if not records:
            continue
        anchors = ANCHORS[kind]
        head = "".join(f" vs {a} fwd | vs {a} fwd+bwd |" for a in anchors)
        lines += ["", f"### {title}", "",
                  f"| case | backend | fwd ms | fwd+bwd ms |{head} build ms | peak MiB | rel err | grads | status |",
                  "|---|---|---:|---:|" + "---:|---:|" * len(anchors) + "---:|---:|---:|---|---|"]
        for r in records:
            speeds = "".join(f" {_fmt(r.get(f'vs_{a}_fwd'))} | {_fmt(r.get(f'vs_{a}'))} |" for a in anchors)
            build = r.get("build_ms")
            if r.get("reorder_ms"):
                build = f"{_fmt(build)} (+ reorder {_fmt(r['reorder_ms'])})"
            else:
                build = _fmt(build)
            times = f"{_fmt(r.get('fwd_ms'), 4)} | {_fmt(r.get('fwdbwd_ms'), 4)}"
            lines.append(f"| {r['case']} | {r['backend']} | {times} |{speeds} {build} | "
                         f"{_fmt(r.get('peak_mem_mib'), 4)} | {_fmt(r.get('rel_err'), 2)} | "
                         f"{r.get('grads') or '—'} | {_status(r)} |")
    if doc.get("datasets"):
        lines += ["", f"Reddit-like: {doc['datasets'].get('reddit-like')}"]
    return "\n".join(lines) + "\n"


def write_png(doc: dict, path: Path) -> str | None:
    """Forward + backward ms (forward where there is no backward) per case and backend,
    one panel per kind, log scale; returns why not where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:  # noqa: BLE001
        return f"matplotlib unavailable ({type(err).__name__})"
    kinds = [k for k in KIND_BACKENDS if any(r.get("ok") and r.get("kind") == k for r in doc["records"])]
    if not kinds:
        return "nothing timed"
    fig, axes = plt.subplots(len(kinds), 1, figsize=(12, 3.2 * len(kinds)), squeeze=False)
    for ax, kind in zip(axes[:, 0], kinds):
        rows = [r for r in doc["records"] if r.get("ok") and r.get("kind") == kind]
        cases = list(dict.fromkeys(r["case"] for r in rows))
        names = [b for b in KIND_BACKENDS[kind] if any(r["backend"] == b for r in rows)]
        width = 0.8 / len(names)
        for k, name in enumerate(names):
            xs, ys = [], []
            for i, case in enumerate(cases):
                r = next((r for r in rows if r["case"] == case and r["backend"] == name), None)
                if r is not None:
                    xs.append(i + (k - (len(names) - 1) / 2) * width)
                    ys.append(r["fwdbwd_ms"] or r["fwd_ms"])
            ax.bar(xs, ys, width, label=name)
        ax.set_yscale("log")
        ax.set_ylabel("fwd+bwd ms")
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, fontsize=7, rotation=40, ha="right")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=len(names))
    axes[0, 0].set_title(f"vector on {doc.get('device')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def list_suite(cases: list[str] | None, quick: bool, backends: list[str] | None) -> None:
    picked = select_cases(cases, quick)
    print(f"suite vector: {len(picked)} of {len(CASES)} cases")
    for case in picked:
        print(f"  {case.name:28s} {', '.join(f'{k}={v}' for k, v in case.info().items())}")
    for kind, names in KIND_BACKENDS.items():
        print(f"  backends ({kind}): {', '.join(n for n in names if n in select_backends(backends))}")
    print("  all backend names:", ", ".join(BACKENDS))


def main_from_harness(args, device: torch.device) -> int:
    """``python -m benchmarks.run --suite vector``."""
    if args.list:
        list_suite(args.cases, args.quick, args.backends)
        return 0
    rtol = args.rtol if args.rtol != 1e-4 else DEFAULT_RTOL  # the harness default is for float32 suites
    print(run_vector_suite(device, args.out, cases=args.cases, backends=args.backends, quick=args.quick,
                           steps=args.steps, warmup=args.warmup, warmup_s=args.warmup_s, rtol=rtol, seed=args.seed,
                           scale=args.scale, avg_degree=args.avg_degree, png=not args.no_png,
                           time_limit=args.time_limit, progress=not args.quiet, append=args.append))
    return 0
