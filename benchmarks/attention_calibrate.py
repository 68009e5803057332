"""Calibrate ``sparse_attention``'s ``auto`` rule and the block kernel's launch table on a GPU.

    python -m benchmarks.run --out $OUT --suite attention --sweep calibrate     # ~4-5 min on an H200
    python -m benchmarks.run --out $OUT --suite attention --sweep calibrate --time-limit 120 --lengths 1024,4096
    python -m benchmarks.run --suite attention --sweep calibrate --fit benchmarks/results/attention/*.json  # CPU

(options after ``--sweep calibrate`` are this sweep's, below).

For the ``attention`` suite's masks (``window``, ``bigbird``, ``causal``, ``longformer``,
``dilated``) at ``L`` in 1024, 4096, 16384, batch 4, 12 heads, head dim 64, bfloat16,
modes ``fwd`` (forward only) and ``fwdbwd`` (forward + backward), in two passes so that a
run cut short by ``--time-limit`` still has the crossover data:

1. **dense vs block crossover** -- dense SDPA without a mask (``sdpa``, the suite's
   anchor; not checked: it computes another function), with the boolean mask
   (``sdpa-mask``), with ``is_causal=True`` (``sdpa-causal``, causal mask only), and the
   fused block kernel at the default ``64 x 64`` blocks and launch table (``block``);
2. **launch-config sweep** of the block kernel at ``64x64``, ``128x64``, ``64x128``,
   ``128x128``: in ``fwd`` mode the forward kernel's ``num_warps`` in {4, 8} x
   ``num_stages`` in {2, 3} (backward at the table's), in ``fwdbwd`` mode the backward
   kernels' ``num_warps`` in {4, 8} x ``num_stages`` in {1, 2} (forward at the table's).

Every timed configuration is first checked against float32 SDPA with the dense mask on
batch 0, heads 0-1 (outputs and, for ``fwdbwd``, gradients; ``--rtol``). ``--element``
also times the element path (slow at 16384: ``--element-max-l 4096``), ``--vector`` the
vector path (query windows of ``DEFAULT_WINDOW`` with compacted key columns), and
``--masks`` takes ``dilated8`` / ``graph16`` / ``random0.5`` ... ``random5`` (irregular
masks for the element and vector paths).

Then it prints (and writes) a **recommendation**:

* the cost model of the ``auto`` rule refitted (:func:`fit_cost_models`): ``COST_MODELS``
  (``fwd`` and ``fwdbwd``: dense SDPA overhead + per-element cost from ``sdpa``, block
  overhead + per-block cost from ``block`` 64x64 at the table's launch, element from
  ``element`` when timed), ``DENSE_CAUSAL_FACTOR`` and ``DENSE_MASK_FACTOR`` (``sdpa-causal``
  / ``sdpa-mask`` per-element cost relative to ``sdpa``, overhead shared), in the form of
  ``fusegnn/attention/cost_model.py``;
* the crossover table: per case the measured block / dense times, what the rule picks
  with the current constants and with the refitted ones, and the measured best;
* per block size the best forward and backward launch configuration (lowest geometric
  mean over the cases of ``ms / best ms``) against ``launch_config``'s current table;
* ``DEFAULT_BLOCK_SIZE`` per ``L`` (best geometric mean over the cases, each block size
  at its best launch) and ``ELEMENT_MAX_FILL`` (when the element path was timed).

The harness's ``--out DIR`` (default ``benchmarks/results``) receives
``DIR/attention/calibration-<gpu>.json`` (every measurement and the recommendation) and
``DIR/attention/raw/calibration-<gpu>.log`` (what was printed). ``--fit FILE...`` refits the cost model
from saved results on any machine: this script's JSON, the attention suite's
(``benchmarks/results/attention/<gpu>.json``: ``sdpa``, ``sdpa-mask``, ``sdpa-causal``
rows and the ``fusegnn`` rows by the path they took), or the earlier calibration format
(records with ``config`` ``"block BMxBN"`` / ``"element"``, sizes of the suite); the
constants in ``fusegnn/attention/cost_model.py`` came from

    python -m benchmarks.run --suite attention --sweep calibrate --fit \\
        benchmarks/results/attention/calibration-crossover-nvidia-h200.json \\
        benchmarks/results/attention/calibration-element-nvidia-h200.json

(the first written by ``--no-sweep``, renamed; the suite's own file is left out so that
re-running the suite does not move them).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from benchmarks.attention import CHECK_HEADS, GPU_SIZES, MASKS, Prepared, _check, _phases, _reference, build_mask
from benchmarks.measure import free_memory, is_oom, measure
from benchmarks.tee import Tee

BLOCK_CONFIGS = [(64, 64), (128, 64), (64, 128), (128, 128)]
DEFAULT_BLOCK = (64, 64)
FWD_SWEEP = [(w, s) for w in (4, 8) for s in (2, 3)]
BWD_SWEEP = [(w, s) for w in (4, 8) for s in (1, 2)]
#: element density of the ``random*`` calibration masks (each pair allowed with this
#: probability, independently, plus the diagonal; shared by the heads)
RANDOM_DENSITY = {"random0.5": 0.005, "random1": 0.01, "random2": 0.02, "random5": 0.05}
EXTRA_MASKS = ("dilated8", "graph16", *RANDOM_DENSITY)
SDPA_KINDS = ("sdpa", "sdpa-mask", "sdpa-causal")


def calibration_mask(name: str, L: int, seed: int = 0):
    """The suite's masks plus irregular ones: ``dilated8`` (``|q - k| <= 32 * 8``,
    ``(q - k) % 8 == 0``), ``graph16`` (16 random keys per query plus the diagonal) and
    ``random<P>`` (:data:`RANDOM_DENSITY`: every pair with probability ``P`` %, plus the
    diagonal -- the ``vector`` suite's masks)."""
    from fusegnn.attention import masks

    if name in RANDOM_DENSITY:
        gen = torch.Generator().manual_seed(seed)
        queries, keys = [], []
        for r0 in range(0, L, 1024):  # row slabs: no L x L float tensor
            q, k = (torch.rand(min(1024, L - r0), L, generator=gen) < RANDOM_DENSITY[name]).nonzero(as_tuple=True)
            queries.append(q + r0)
            keys.append(k)
        diag = torch.arange(L)
        edge_index = torch.stack([torch.cat([*keys, diag]), torch.cat([*queries, diag])])
        return masks.from_graph(edge_index, L, L)
    if name == "dilated8":
        return masks.dilated(L, 32, 8)
    if name == "graph16":
        gen = torch.Generator().manual_seed(seed)
        keys = torch.randint(0, L, (L * 16,), generator=gen)
        queries = torch.arange(L).repeat_interleave(16)
        diag = torch.arange(L)
        edge_index = torch.stack([torch.cat([keys, diag]), torch.cat([queries, diag])])
        return masks.from_graph(edge_index, L, L)
    return build_mask(name, L, GPU_SIZES, seed)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run --suite attention --sweep calibrate",
                                description=__doc__.split("\n")[0])
    p.add_argument("--masks", default=",".join(MASKS), help=f"comma-separated; also {', '.join(EXTRA_MASKS)}")
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--element", action="store_true", help="also time the element path (pass 1)")
    p.add_argument("--element-max-l", type=int, default=None,
                   help="with --element: only at L up to this (the element path is slow at 16384)")
    p.add_argument("--vector", action="store_true", help="also time the vector path (pass 1)")
    p.add_argument("--no-sweep", action="store_true", help="pass 1 only (crossover)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rtol", type=float, default=3e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-limit", type=float, default=270.0,
                   help="seconds; no new measurement starts after it (the rest is recorded as not run)")
    p.add_argument("--fit", type=Path, nargs="+", metavar="FILE",
                   help="no GPU run: refit the cost model from saved result files and print it")
    args = p.parse_args(argv)
    args.masks = [m for m in args.masks.split(",") if m]
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.masks:
        if m not in MASKS + EXTRA_MASKS:
            p.error(f"--masks: unknown mask {m!r}; known: {', '.join(MASKS + EXTRA_MASKS)}")
    for m in args.modes:
        if m not in ("fwd", "fwdbwd"):
            p.error(f"--modes takes fwd and/or fwdbwd, got {m!r}")
    return args


# ----------------------------------------------------------------------------- measuring
class Clock:
    def __init__(self, limit: float | None) -> None:
        self.start = time.perf_counter()
        self.limit = limit

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def out(self) -> bool:
        return self.limit is not None and self.elapsed() > self.limit


def _time(fn, prep: Prepared, mode: str, args, device, checked: bool = True) -> tuple[float | None, float | None, str | None]:
    """``(ms, rel_err, error)`` of ``fn`` in ``mode`` (checked first unless ``checked=False``)."""
    key = ("ref", mode)
    try:
        err = None
        if checked:
            if key not in prep.extras:
                prep.extras[key] = _reference(prep, mode == "fwdbwd")
            err = _check(fn, prep, mode == "fwdbwd", prep.extras[key])
            if not math.isfinite(err) or err > args.rtol:
                return None, err, f"mismatch {err:.3g}"
        m = measure(_phases(fn, prep, mode), device, steps=args.steps, warmup=args.warmup, warmup_s=2.0, launches=False)
        return m.ms[0], err, None
    except Exception as exc:  # noqa: BLE001 - a failed config is a result
        free_memory(device)
        return None, None, "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc)[:160]}"


def _prepare(name: str, L: int, args, device) -> Prepared:
    mask = calibration_mask(name, L, args.seed)
    sizes = GPU_SIZES
    gen = torch.Generator().manual_seed(args.seed)
    shape = (sizes.batch, sizes.heads, L, sizes.head_dim)
    q, k, v, g = (torch.randn(shape, generator=gen).to(device, sizes.dtype) for _ in range(4))
    return Prepared(mask, q, k, v, g, mask.dense(device))


def _record(prep: Prepared, name: str, L: int, mode: str, kind: str, config: str, **extra) -> dict:
    sizes = GPU_SIZES
    rec = dict(case=f"{name}-L{L}-{mode}", mask=name, L=L, mode=mode, kind=kind, config=config,
               BM=None, BN=None, fwd_warps=None, fwd_stages=None, bwd_warps=None, bwd_stages=None,
               default_launch=None, ms=None, rel_err=None, error=None, density=prep.extras["density"],
               block_density=None, nnzb=None, layout_heads=None, fill=None,
               batch=sizes.batch, heads=sizes.heads, head_dim=sizes.head_dim)
    rec.update(extra)
    return rec


def _layout(prep: Prepared, bm: int, bn: int, device):
    from fusegnn.attention.sparse_attention import _layout_of

    layout = _layout_of(prep.mask, (bm, bn), device)  # cached on the mask
    fill = prep.extras["density"] * layout.L_q * layout.L_k * layout.num_heads / max(layout.nnzb * bm * bn, 1)
    info = dict(BM=bm, BN=bn, block_density=layout.block_density, nnzb=layout.nnzb,
                layout_heads=layout.num_heads, fill=fill)
    return layout, info


def _crossover(prep: Prepared, name: str, L: int, mode: str, args, device, clock: Clock) -> list[dict]:
    """Pass 1: the SDPA variants and the block kernel at the default size and launch."""
    import torch.nn.functional as F

    from fusegnn.attention.sparse_attention import sparse_attention

    dense = prep.dense_check
    variants: list[tuple[str, Callable, bool]] = [
        ("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), False),
        ("sdpa-mask", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense), True),
    ]
    if prep.mask.structure(device) == "causal":
        variants.append(("sdpa-causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), True))
    rows = []
    for kind, fn, checked in variants:
        rec = _record(prep, name, L, mode, kind, kind)
        if clock.out():
            rec["error"] = f"not run: --time-limit {args.time_limit:g} s"
        else:
            rec["ms"], rec["rel_err"], rec["error"] = _time(fn, prep, mode, args, device, checked)
        rows.append(rec)
    layout, info = _layout(prep, *DEFAULT_BLOCK, device)
    rec = _record(prep, name, L, mode, "block", f"block {DEFAULT_BLOCK[0]}x{DEFAULT_BLOCK[1]}", default_launch=True, **info)
    if clock.out():
        rec["error"] = f"not run: --time-limit {args.time_limit:g} s"
    else:
        fn = lambda q, k, v: sparse_attention(q, k, v, layout, aggregation="block")  # noqa: E731
        rec["ms"], rec["rel_err"], rec["error"] = _time(fn, prep, mode, args, device)
    rows.append(rec)
    if args.element and (args.element_max_l is None or L <= args.element_max_l):
        rec = _record(prep, name, L, mode, "element", "element")
        if clock.out():
            rec["error"] = f"not run: --time-limit {args.time_limit:g} s"
        else:
            fn = lambda q, k, v: sparse_attention(q, k, v, prep.mask, aggregation="element")  # noqa: E731
            rec["ms"], rec["rel_err"], rec["error"] = _time(fn, prep, mode, args, device)
        rows.append(rec)
    if args.vector:
        rows.append(_vector_row(prep, name, L, mode, info["fill"], args, device, clock))
    return rows


def _vector_row(prep: Prepared, name: str, L: int, mode: str, fill: float, args, device, clock: Clock) -> dict:
    """The vector path at its default sizes, with the structure's compacted entries (the
    cost model's work) and the default block layout's fill (where the rule considers it)."""
    from fusegnn.attention.sparse_attention import sparse_attention
    from fusegnn.attention.vector_windows import vector_sizes, vector_structure

    W, block_n = vector_sizes(None)
    rec = _record(prep, name, L, mode, "vector", f"vector W{W} x {block_n}", W=W, fill=fill)
    if clock.out():
        rec["error"] = f"not run: --time-limit {args.time_limit:g} s"
        return rec
    try:
        structure = vector_structure(prep.mask, W, device)
        rec.update(entries=structure.num_entries, layout_heads=structure.num_heads)
    except Exception as exc:  # noqa: BLE001 - a mask too large for the structure is a result
        free_memory(device)
        rec["error"] = "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc)[:160]}"
        return rec
    fn = lambda q, k, v: sparse_attention(q, k, v, prep.mask, aggregation="vector")  # noqa: E731
    rec["ms"], rec["rel_err"], rec["error"] = _time(fn, prep, mode, args, device)
    return rec


def _sweep(prep: Prepared, name: str, L: int, mode: str, args, device, clock: Clock) -> list[dict]:
    """Pass 2: launch configurations of the block kernel at each block size."""
    from fusegnn.kernels.block_attention import block_sparse_attention, launch_config

    D = GPU_SIZES.head_dim
    rows = []
    for bm, bn in BLOCK_CONFIGS:
        layout, info = _layout(prep, bm, bn, device)
        table = launch_config(bm, bn, D)
        sweep = FWD_SWEEP if mode == "fwd" else BWD_SWEEP
        for warps, stages in sweep:
            # the table's other settings (dq launch, sub-tiles, register caps) are kept
            if mode == "fwd":
                cfg = replace(table, fwd_warps=warps, fwd_stages=stages)
            else:
                cfg = replace(table, bwd_warps=warps, bwd_stages=stages)
            label = f"block {bm}x{bn} {'fwd' if mode == 'fwd' else 'bwd'} w{warps} s{stages}"
            rec = _record(prep, name, L, mode, "block", label, fwd_warps=cfg.fwd_warps, fwd_stages=cfg.fwd_stages,
                          bwd_warps=cfg.bwd_warps, bwd_stages=cfg.bwd_stages, default_launch=cfg == table, **info)
            if clock.out():
                rec["error"] = f"not run: --time-limit {args.time_limit:g} s"
            else:
                fn = lambda q, k, v, layout=layout, cfg=cfg: block_sparse_attention(q, k, v, layout, launch=cfg)  # noqa: E731
                rec["ms"], rec["rel_err"], rec["error"] = _time(fn, prep, mode, args, device)
            rows.append(rec)
    return rows


def calibrate(args, device, emit: Callable[[str], None] = print) -> list[dict]:
    clock = Clock(args.time_limit)
    records: list[dict] = []
    passes = [("crossover", _crossover)] + ([] if args.no_sweep else [("sweep", _sweep)])
    for pass_name, run in passes:
        emit(f"\n=== pass: {pass_name} (t = {clock.elapsed():.0f} s)")
        for name in args.masks:
            for L in args.lengths:
                if clock.out():
                    prep = None
                else:
                    prep = _prepare(name, L, args, device)
                    prep.extras["density"] = prep.dense_check.float().mean().item()
                for mode in args.modes:
                    if prep is None:
                        records.append(dict(case=f"{name}-L{L}-{mode}", mask=name, L=L, mode=mode, kind=pass_name,
                                            config=None, ms=None, error=f"not run: --time-limit {args.time_limit:g} s"))
                        continue
                    rows = run(prep, name, L, mode, args, device, clock)
                    records.extend(rows)
                    _print_rows(f"{name}-L{L}-{mode}", rows, prep.extras["density"], emit)
                del prep
                free_memory(device)
    emit(f"\nmeasured in {clock.elapsed():.0f} s")
    return records


def _print_rows(case: str, rows: list[dict], density: float, emit) -> None:
    done = [r["ms"] for r in rows if r.get("ms")]
    best = min(done) if done else None
    emit(f"\n{case}  (density {density:.4f})")
    emit(f"  {'config':28s} {'ms':>9s} {'x best':>7s} {'blocks':>7s}  status")
    for r in rows:
        ms = f"{r['ms']:.3f}" if r.get("ms") else "—"
        rel = f"{r['ms'] / best:.2f}" if r.get("ms") and best else "—"
        blocks = f"{r['block_density']:.3f}" if r.get("block_density") is not None else ""
        emit(f"  {r['config']:28s} {ms:>9s} {rel:>7s} {blocks:>7s}  {r['error'] or 'ok'}")


# ----------------------------------------------------------------------------- fitting
def _wls(xs: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares on the relative error: minimise sum(((x . c) - y) / y)^2."""
    import numpy as np

    X = np.asarray(xs, dtype=float) / np.asarray(ys, dtype=float)[:, None]
    coef, *_ = np.linalg.lstsq(X, np.ones(len(ys)), rcond=None)
    return [float(c) for c in coef]


def observations(records: Iterable[dict]) -> list[dict]:
    """Normalise measurement records (this script's, or normalised by
    :func:`load_observations`) to ``dict(kind, mode, x, ms, label)`` where ``x`` is the
    cost model's work at head dim 64: ``B*H*L_q*L_k*D/64`` for the SDPA kinds, non-empty
    blocks over all (batch, head) pairs ``* BM*BN/64**2 * D/64`` for ``block`` (default
    block size and launch only), allowed elements over all pairs ``* D/64`` for
    ``element``, compacted (window, key) entries over all pairs ``* W/16 * D/64`` for
    ``vector``."""
    out = []
    for r in records:
        if not r.get("ms") or r.get("kind") not in SDPA_KINDS + ("block", "element", "vector"):
            continue
        pairs = r["batch"] * r["heads"]
        d = r["head_dim"] / 64.0
        L2 = r["L"] * r["L"]
        if r["kind"] in SDPA_KINDS:
            x = pairs * L2 * d
        elif r["kind"] == "block":
            if (r["BM"], r["BN"]) != DEFAULT_BLOCK or not r.get("default_launch"):
                continue
            x = r["nnzb"] * pairs / r["layout_heads"] * r["BM"] * r["BN"] / 4096.0 * d
        elif r["kind"] == "vector":
            x = r["entries"] * pairs / r["layout_heads"] * r["W"] / 16.0 * d
        else:
            x = r["density"] * L2 * pairs * d
        out.append(dict(kind=r["kind"], mode=r["mode"], x=x, ms=r["ms"], label=f"{r['mask']}-L{r['L']}"))
    return out


def fit_cost_models(obs: list[dict]) -> dict:
    """Fit the auto rule's constants to :func:`observations` (see the module docstring of
    ``fusegnn.attention.cost_model``): per mode, ``ms = a + c x`` for ``sdpa``,
    ``block``, ``element`` and ``vector`` by least squares on the relative error; then the factors
    ``f`` of ``sdpa-causal`` and ``sdpa-mask`` in ``ms = a + f c x`` (``a``, ``c`` of that
    mode's ``sdpa``), one factor over both modes. Missing kinds give ``None``. Also the
    relative errors ``predicted / measured`` of every observation."""
    fit: dict[str, Any] = {"fwd": {}, "fwdbwd": {}, "DENSE_CAUSAL_FACTOR": None, "DENSE_MASK_FACTOR": None, "residuals": []}
    names = {"sdpa": ("dense_overhead_ms", "dense_ms_per_element"), "block": ("block_overhead_ms", "block_ms_per_block"),
             "element": ("element_overhead_ms", "element_ms_per_edge"),
             "vector": ("vector_overhead_ms", "vector_ms_per_entry")}
    for mode in ("fwd", "fwdbwd"):
        for kind, (a_name, c_name) in names.items():
            rows = [o for o in obs if o["mode"] == mode and o["kind"] == kind]
            if len({round(o["x"]) for o in rows}) < 2:
                fit[mode][a_name] = fit[mode][c_name] = None
                continue
            a, c = _wls([[1.0, o["x"]] for o in rows], [o["ms"] for o in rows])
            if a < 0:  # a negative overhead: refit through the origin
                a, c = 0.0, _wls([[o["x"]] for o in rows], [o["ms"] for o in rows])[0]
            fit[mode][a_name], fit[mode][c_name] = a, c
            fit["residuals"] += [dict(o, predicted=a + c * o["x"]) for o in rows]
    for kind, key in (("sdpa-causal", "DENSE_CAUSAL_FACTOR"), ("sdpa-mask", "DENSE_MASK_FACTOR")):
        used = []  # (observation, a, c) of that mode's sdpa fit
        for o in obs:
            model = fit[o["mode"]]
            if o["kind"] == kind and model.get("dense_ms_per_element") is not None:
                used.append((o, model["dense_overhead_ms"], model["dense_ms_per_element"]))
        if not used:
            continue
        # minimise sum(((a + f c x) - y) / y)^2 over f
        num = sum(c * o["x"] * (o["ms"] - a) / o["ms"] ** 2 for o, a, c in used)
        den = sum((c * o["x"]) ** 2 / o["ms"] ** 2 for o, a, c in used)
        f = num / den
        fit[key] = f
        fit["residuals"] += [dict(o, predicted=a + f * c * o["x"]) for o, a, c in used]
    return fit


def format_cost_models(fit: dict) -> str:
    """The fit as the constants of ``fusegnn/attention/cost_model.py`` (current
    values where a kind was not measured)."""
    from fusegnn.attention import cost_model as cm

    lines = ["COST_MODELS: dict[str, CostModel] = {"]
    for mode in ("fwd", "fwdbwd"):
        current = cm.COST_MODELS[mode]
        vals = {}
        for field in cm.CostModel.__dataclass_fields__:
            v = fit[mode].get(field)
            vals[field] = f"{v:.3g}," if v is not None else f"{getattr(current, field)!r},  # not measured: current"
        lines.append(f'    "{mode}": CostModel(')
        lines += [f"        {k}={v}" for k, v in vals.items()]
        lines.append("    ),")
    lines.append("}")
    for key in ("DENSE_CAUSAL_FACTOR", "DENSE_MASK_FACTOR"):
        v = fit[key]
        if v is None:
            lines.append(f"{key} = {getattr(cm, key)!r}  # not measured: current")
        else:
            lines.append(f"{key} = {v:.3g}" + ("  # implausible (<= 0): check the measurements" if v <= 0 else ""))
    res = fit["residuals"]
    for kind in sorted({r["kind"] for r in res}):
        for mode in ("fwd", "fwdbwd"):
            ratios = [r["predicted"] / r["ms"] for r in res if r["kind"] == kind and r["mode"] == mode]
            if ratios:
                lines.append(f"# {kind:11s} {mode:6s}: predicted / measured {min(ratios):.2f} .. {max(ratios):.2f} "
                             f"over {len(ratios)} measurements")
    return "\n".join(lines)


def load_observations(paths: Iterable[Path]) -> list[dict]:
    """Records of this script, of the attention suite and of the earlier calibration
    format, normalised to this script's record fields (see the module docstring)."""
    out: list[dict] = []
    for path in paths:
        doc = json.loads(Path(path).read_text())
        records = doc.get("records", [])
        if doc.get("suite") == "attention":  # the suite's result file
            cases = doc.get("cases", {})
            for r in records:
                info = cases.get(r["case"])
                if not info or not r.get("ok"):
                    continue
                base = dict(mask=info["mask"], L=info["L"], mode=info["mode"], batch=info["batch"],
                            heads=info["heads"], head_dim=info["head_dim"], ms=r["ms"], density=r["density"])
                path_name = r.get("aggregation") or ""
                kind = {"sdpa": "sdpa", "sdpa-mask": "sdpa-mask", "sdpa-causal": "sdpa-causal"}.get(r["backend"])
                if r["backend"].startswith("fusegnn"):
                    kind = {"dense sdpa (no mask)": "sdpa", "dense sdpa (bool mask)": "sdpa-mask",
                            "dense sdpa (causal)": "sdpa-causal", "block": "block", "element": "element"}.get(path_name)
                if kind is None:
                    continue
                if kind == "block":
                    if not r.get("block_size") or r.get("block_density") is None:
                        continue
                    bm, bn = (int(x) for x in r["block_size"].split("x"))
                    nnzb = r["block_density"] * math.ceil(info["L"] / bm) * math.ceil(info["L"] / bn)
                    base.update(BM=bm, BN=bn, nnzb=nnzb, layout_heads=1, default_launch=True)
                out.append(dict(base, kind=kind))
        else:
            for r in records:
                if "kind" in r:  # this script's format
                    out.append(r)
                    continue
                config = r.get("config") or ""  # the earlier calibration format (suite sizes)
                base = dict(mask=r["mask"], L=r["L"], mode=r["mode"], batch=GPU_SIZES.batch, heads=GPU_SIZES.heads,
                            head_dim=GPU_SIZES.head_dim, ms=r["ms"], density=r["density"])
                if config == "element":
                    out.append(dict(base, kind="element"))
                elif config.startswith("block ") and r.get("block_density") is not None:
                    bm, bn = r["BM"], r["BN"]
                    nnzb = r["block_density"] * math.ceil(r["L"] / bm) * math.ceil(r["L"] / bn)
                    out.append(dict(base, kind="block", BM=bm, BN=bn, nnzb=nnzb, layout_heads=1, default_launch=True))
    return out


# ----------------------------------------------------------------------------- recommending
def _geomean(xs: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs))


def recommend_launch(records: list[dict]) -> dict:
    """Per block size: the forward (``fwd`` mode) and backward (``fwdbwd`` mode) launch
    configuration with the lowest geometric mean over the cases of ``ms / best ms of the
    case at that block size``, and the table's (``default_launch``) score."""
    out = {}
    for bm, bn in BLOCK_CONFIGS:
        entry = {}
        for mode, keys in (("fwd", ("fwd_warps", "fwd_stages")), ("fwdbwd", ("bwd_warps", "bwd_stages"))):
            rows = [r for r in records if r.get("kind") == "block" and r.get("mode") == mode and r.get("BM") == bm
                    and r.get("BN") == bn and r.get(keys[0]) is not None]
            best_of = {}
            for r in rows:
                if r["ms"]:
                    best_of[r["case"]] = min(best_of.get(r["case"], math.inf), r["ms"])
            scores, table = {}, None
            for cfg in sorted({(r[keys[0]], r[keys[1]]) for r in rows}):
                ratios = []
                for case, best in best_of.items():
                    match = [r for r in rows if r["case"] == case and (r[keys[0]], r[keys[1]]) == cfg]
                    if match:  # a failed configuration counts as 10x the best
                        ratios.append(match[0]["ms"] / best if match[0]["ms"] else 10.0)
                        if match[0].get("default_launch"):
                            table = cfg
                if ratios:
                    scores[cfg] = _geomean(ratios)
            if scores:
                best = min(scores, key=scores.get)
                entry["fwd" if mode == "fwd" else "bwd"] = dict(
                    best=list(best), score=scores[best], table=list(table) if table else None,
                    table_score=scores.get(table), scores={f"w{w} s{s}": v for (w, s), v in scores.items()})
        if entry:
            out[f"{bm}x{bn}"] = entry
    return out


def recommend(records: list[dict], lengths: list[int]) -> dict:
    """``DEFAULT_BLOCK_SIZE[L]``: the ``(BM, BN)`` with the lowest geometric mean over the
    cases at that ``L`` of ``ms / best ms of the case`` (a block size counts at its best
    launch configuration); ``ELEMENT_MAX_FILL``: the threshold ``t`` of "element path when
    the allowed elements fill less than ``t`` of the non-empty blocks at the default block
    size" that minimises the summed time over the cases (0.0 when the element path never
    wins, or was not timed)."""
    blockish = [r for r in records if r.get("ms") and r.get("BM") is not None]
    element = {r["case"]: r for r in records if r.get("config") == "element"}
    cases = sorted({r["case"] for r in blockish} | set(element))
    # best time of each (case, block size) over its launch configurations
    per_size: dict[tuple[str, int, int], dict] = {}
    for r in blockish:
        key = (r["case"], r["BM"], r["BN"])
        if key not in per_size or r["ms"] < per_size[key]["ms"]:
            per_size[key] = r
    best_of = {}
    for c in cases:
        times = [r["ms"] for (cc, _, _), r in per_size.items() if cc == c]
        if c in element and element[c].get("ms"):
            times.append(element[c]["ms"])
        best_of[c] = min(times) if times else None
    sizes = sorted({(bm, bn) for (_, bm, bn) in per_size})
    default_bs = {}
    for L in lengths:
        scores = {}
        for bm, bn in sizes:
            ratios = []
            for c in cases:
                rows = [r for (cc, b1, b2), r in per_size.items() if cc == c and (b1, b2) == (bm, bn) and r["L"] == L]
                if rows and best_of[c]:
                    ratios.append(rows[0]["ms"] / best_of[c])
                elif best_of[c] and any(r["L"] == L for (cc, _, _), r in per_size.items() if cc == c):
                    ratios.append(10.0)  # failed at this size
            if ratios:
                scores[(bm, bn)] = _geomean(ratios)
        if scores:
            default_bs[L] = min(scores, key=scores.get)

    pairs = []  # (fill, block ms, element ms, case) at the default block size
    for c in cases:
        rows = [r for (cc, _, _), r in per_size.items() if cc == c]
        if not rows or rows[0]["L"] not in default_bs or c not in element:
            continue
        bm, bn = default_bs[rows[0]["L"]]
        blk = per_size.get((c, bm, bn))
        ele = element[c]
        if blk and blk.get("fill") is not None:
            pairs.append((blk["fill"], blk["ms"], ele["ms"] if ele.get("ms") else math.inf, c))
    fills = sorted({p[0] for p in pairs})
    candidates = [0.0] + [(a + b) / 2 for a, b in zip(fills, fills[1:])] + ([fills[-1] * 1.25] if fills else [])
    threshold, best_total = 0.0, math.inf
    for t in candidates:
        t = float(f"{t:.3g}")
        total = sum(e if f < t else b for f, b, e, _ in pairs)
        if total < best_total - 1e-9:
            threshold, best_total = t, total
    per_case = []
    for c in cases:
        rows = [r for (cc, _, _), r in per_size.items() if cc == c]
        if c in element and element[c].get("ms"):
            rows = rows + [element[c]]
        if not rows:
            per_case.append({"case": c, "best": None})
            continue
        top = min(rows, key=lambda r: r["ms"])
        label = "element" if top.get("config") == "element" else f"block {top['BM']}x{top['BN']}"
        pair = next((p for p in pairs if p[3] == c), None)
        per_case.append({"case": c, "best": label, "best_ms": top["ms"],
                         "default_block_ms": pair[1] if pair else None,
                         "element_ms": pair[2] if pair and math.isfinite(pair[2]) else None,
                         "fill_at_default": pair[0] if pair else None})
    return {"DEFAULT_BLOCK_SIZE": {L: list(bs) for L, bs in default_bs.items()},
            "ELEMENT_MAX_FILL": threshold, "per_case": per_case}


def crossover_table(records: list[dict], fit: dict) -> list[dict]:
    """Per case: measured block (64x64, table launch) and dense times, the rule's pick
    with the current constants and with the refitted ones, and the measured best of the
    two candidates the rule weighs."""
    from fusegnn.attention import cost_model as cm

    rows = []
    for case in sorted({r["case"] for r in records if r.get("kind") in SDPA_KINDS + ("block",)}):
        by_kind = {}
        for r in records:
            if r["case"] != case:
                continue
            if r.get("kind") == "block" and (r.get("BM"), r.get("BN")) == DEFAULT_BLOCK and r.get("default_launch"):
                by_kind.setdefault("block", r)
            elif r.get("kind") in SDPA_KINDS:
                by_kind[r["kind"]] = r
        blk = by_kind.get("block")
        if blk is None or blk.get("nnzb") is None:
            continue
        dense_kind = "sdpa-causal" if "sdpa-causal" in by_kind else "sdpa-mask"
        variant = "causal" if dense_kind == "sdpa-causal" else "bool mask"
        pairs = blk["batch"] * blk["heads"]
        backward = blk["mode"] == "fwdbwd"
        work_dense = pairs * blk["L"] ** 2
        work_block = blk["nnzb"] * pairs / blk["layout_heads"]
        capped = variant == "bool mask" and blk["L"] ** 2 > cm.DENSE_MASK_MAX_ELEMENTS

        def pick(model: Any, factors: dict) -> str:
            if capped:
                return "block"
            d = blk["head_dim"] / 64
            dense_ms = model.dense_overhead_ms + model.dense_ms_per_element * factors[variant] * d * work_dense
            block_ms = model.block_overhead_ms + model.block_ms_per_block * d * work_block
            return "dense" if dense_ms < block_ms else "block"

        mode = "fwdbwd" if backward else "fwd"
        now = pick(cm.COST_MODELS[mode], {"causal": cm.DENSE_CAUSAL_FACTOR, "bool mask": cm.DENSE_MASK_FACTOR})
        refit_model = cm.CostModel(**{k: (fit[mode].get(k) if fit[mode].get(k) is not None else getattr(cm.COST_MODELS[mode], k))
                                      for k in cm.CostModel.__dataclass_fields__})
        refit = pick(refit_model, {"causal": fit["DENSE_CAUSAL_FACTOR"] or cm.DENSE_CAUSAL_FACTOR,
                                   "bool mask": fit["DENSE_MASK_FACTOR"] or cm.DENSE_MASK_FACTOR})
        dense_ms = by_kind.get(dense_kind, {}).get("ms")
        measured = {"block": blk.get("ms"), "dense": dense_ms}
        done = {k: v for k, v in measured.items() if v}
        best = min(done, key=done.get) if done else None
        rows.append(dict(case=case, block_ms=blk.get("ms"), dense=f"sdpa ({variant})", dense_ms=dense_ms,
                         sdpa_ms=by_kind.get("sdpa", {}).get("ms"), block_density=blk.get("block_density"),
                         rule_now=now, rule_refit=refit, best=best,
                         now_ms=measured.get(now), refit_ms=measured.get(refit)))
    return rows


def print_recommendation(rec: dict, emit: Callable[[str], None] = print) -> None:
    emit("\nRECOMMENDATION (fusegnn/attention/cost_model.py, sparse_attention.py)")
    emit(rec["cost_models_text"])
    if rec.get("crossover"):
        emit("\n# crossover (ms; rule = what auto picks with the current / refitted constants)")
        emit(f"# {'case':26s} {'block':>8s} {'dense':>8s} {'variant':16s} {'sdpa':>8s} {'blocks':>6s}  now    refit  best")
        fmt = lambda v: f"{v:.3f}" if v else "—"  # noqa: E731
        for r in rec["crossover"]:
            bd = f"{r['block_density']:.3f}" if r["block_density"] is not None else "—"
            emit(f"# {r['case']:26s} {fmt(r['block_ms']):>8s} {fmt(r['dense_ms']):>8s} {r['dense']:16s} "
                 f"{fmt(r['sdpa_ms']):>8s} {bd:>6s}  {r['rule_now']:6s} {r['rule_refit']:6s} {r['best'] or '—'}")
    if rec.get("launch"):
        emit("\n# launch configuration (head dim 64; geometric mean of ms / best; table = launch_config's now)")
        for size, entry in rec["launch"].items():
            for direction, e in entry.items():
                table = f"w{e['table'][0]} s{e['table'][1]} {e['table_score']:.3f}" if e.get("table") else "—"
                emit(f"# {size:8s} {direction}: best w{e['best'][0]} s{e['best'][1]} {e['score']:.3f}; table {table}")
    bs = ", ".join(f"{L}: ({v[0]}, {v[1]})" for L, v in rec["block"]["DEFAULT_BLOCK_SIZE"].items())
    emit("")
    emit(f"DEFAULT_BLOCK_SIZE = {{{bs}}}")
    emit(f"ELEMENT_MAX_FILL = {rec['block']['ELEMENT_MAX_FILL']}  (0.0 also when the element path was not timed)")


def build_recommendation(records: list[dict], lengths: list[int]) -> dict:
    fit = fit_cost_models(observations(records))
    return {"cost_models": {k: v for k, v in fit.items() if k != "residuals"},
            "cost_models_text": format_cost_models(fit),
            "crossover": crossover_table(records, fit),
            "launch": recommend_launch(records),
            "block": recommend(records, lengths)}


# ----------------------------------------------------------------------------- entry
def sweep_main(argv: list[str], out_dir: Path, device: Callable[[], torch.device]) -> int:
    """``python -m benchmarks.run --suite attention --sweep calibrate [options]``: writes
    ``<out_dir>/calibration-<gpu>.json`` and ``<out_dir>/raw/calibration-<gpu>.log``
    (see :mod:`benchmarks.sweeps`); with ``--fit`` only prints the refitted model."""
    args = parse_args(argv)
    if args.fit:
        obs = load_observations(args.fit)
        fit = fit_cost_models(observations(obs))
        print(f"# fitted to {len(observations(obs))} measurements from {', '.join(str(p) for p in args.fit)}")
        print(format_cost_models(fit))
        return 0
    from benchmarks.report import environment, gpu_slug

    dev = device()
    if dev.type != "cuda":
        raise SystemExit("--sweep calibrate times GPU kernels: it needs a CUDA device (--fit FILE... needs none)")
    stem = out_dir / f"calibration-{gpu_slug(dev)}"
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    emit = Tee(out_dir / "raw" / f"{stem.name}.log")
    emit(f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}; B={GPU_SIZES.batch} H={GPU_SIZES.heads} "
         f"D={GPU_SIZES.head_dim} bf16; check heads 0..{CHECK_HEADS - 1}; time limit {args.time_limit:g} s")
    records = calibrate(args, dev, emit)
    rec = build_recommendation(records, args.lengths)
    print_recommendation(rec, emit)
    doc = dict(environment(dev), args={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               records=records, recommendation=rec)
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {stem}.json and raw/{stem.name}.log", file=sys.stderr)
    return 0
