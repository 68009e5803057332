"""Calibrate the ``auto`` rule of ``fusegnn.sparse.sparse_attention`` on a GPU.

    python -m benchmarks.attention_calibrate                       # ~6 min on an H100
    python -m benchmarks.attention_calibrate --lengths 4096 --modes fwdbwd --json calib.json

For every mask of the ``attention`` suite (``window``, ``bigbird``, ``causal``,
``longformer``, ``dilated``) plus two irregular ones that the element path is meant for
(``dilated8``: ``|q - k| <= 32 * 8``, ``(q - k) % 8 == 0``; ``graph16``: 16 random keys per
query plus the diagonal), at each ``L`` and mode (``fwd``, ``fwdbwd``), batch 4, 12 heads,
head dim 64, bfloat16, it times

* the fused block kernel at ``BM x BN`` for ``BM`` in {64, 128} and ``BN`` in {32, 64, 128}
  (layout built outside timing), with the kernel's own ``num_warps`` / ``num_stages`` table;
* the element path (``sddmm -> edge_softmax -> spmm``, ``aggregation="element"``);

after checking each against float32 SDPA with the dense mask (batch 0, heads 0-1).

It prints one table per case and then a **recommendation** block meant to be pasted into
``fusegnn/sparse/sparse_attention.py``::

    RECOMMENDATION
    DEFAULT_BLOCK_SIZE = {1024: (64, 64), 4096: (128, 64), 16384: (128, 64)}
    ELEMENT_MAX_FILL = 0.03
    # per case: best config, its ms, block / element ms, fill at the default block size

* ``DEFAULT_BLOCK_SIZE[L]`` -- the ``(BM, BN)`` with the lowest geometric mean over the
  cases at that ``L`` of ``ms / best ms of the case`` (``fwdbwd`` and ``fwd`` both count); a
  length between two calibrated ones takes the nearest (in log) calibrated one;
* ``ELEMENT_MAX_FILL`` -- the threshold ``t`` of the rule "element path when the allowed
  elements fill less than ``t`` of the non-empty blocks at the default block size" that
  minimises the summed time over all cases (0.0 when the element path never wins).

``--json PATH`` also writes every measurement and the recommendation.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.attention import CHECK_HEADS, GPU_SIZES, MASKS, Prepared, _check, _phases, _reference, build_mask
from benchmarks.measure import free_memory, is_oom, measure

BLOCK_CONFIGS = [(bm, bn) for bm in (64, 128) for bn in (32, 64, 128)]
EXTRA_MASKS = ("dilated8", "graph16")


def calibration_mask(name: str, L: int, seed: int = 0):
    """The suite's masks plus the two irregular ones (see the module docstring)."""
    from fusegnn.sparse import masks

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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--masks", default=",".join(MASKS + EXTRA_MASKS))
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--modes", default="fwd,fwdbwd")
    p.add_argument("--no-element", action="store_true", help="skip the element path")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rtol", type=float, default=3e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.masks = [m for m in args.masks.split(",") if m]
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    args.modes = [m for m in args.modes.split(",") if m]
    return args


def _time(fn, prep, mode, args, device) -> tuple[float | None, float | None, str | None]:
    """(ms, rel_err, error)."""
    key = ("ref", mode)
    if key not in prep.extras:
        prep.extras[key] = _reference(prep, mode == "fwdbwd")
    ref = prep.extras[key]
    try:
        err = _check(fn, prep, mode == "fwdbwd", ref)
        if not math.isfinite(err) or err > args.rtol:
            return None, err, f"mismatch {err:.3g}"
        m = measure(_phases(fn, prep, mode), device, steps=args.steps, warmup=args.warmup, warmup_s=2.0, launches=False)
        return m.ms[0], err, None
    except Exception as exc:  # noqa: BLE001 - a failed config is a result
        free_memory(device)
        return None, None, "OOM" if is_oom(exc) else f"{type(exc).__name__}: {str(exc)[:120]}"


def calibrate(args, device) -> dict:
    from fusegnn.sparse.block_layout import BlockLayout
    from fusegnn.sparse.sparse_attention import sparse_attention

    sizes = GPU_SIZES
    records = []
    for name in args.masks:
        for L in args.lengths:
            mask = calibration_mask(name, L, args.seed)
            gen = torch.Generator().manual_seed(args.seed)
            shape = (sizes.batch, sizes.heads, L, sizes.head_dim)
            q, k, v, g = (torch.randn(shape, generator=gen).to(device, sizes.dtype) for _ in range(4))
            prep = Prepared(mask, q, k, v, g, mask.dense(device))
            density = prep.dense_check.float().mean().item()
            layouts = {}
            for bm, bn in BLOCK_CONFIGS:
                start = time.perf_counter()
                layout = BlockLayout.from_mask(mask, bm, bn, device)
                torch.cuda.synchronize(device)
                layouts[(bm, bn)] = (layout, (time.perf_counter() - start) * 1e3)
            for mode in args.modes:
                case = f"{name}-L{L}-{mode}"
                for (bm, bn), (layout, build_ms) in layouts.items():
                    fn = lambda q, k, v, layout=layout: sparse_attention(q, k, v, layout, aggregation="block")  # noqa: E731
                    ms, err, error = _time(fn, prep, mode, args, device)
                    fill = density * L * L / max(layout.nnzb * bm * bn, 1)
                    records.append(dict(case=case, mask=name, L=L, mode=mode, config=f"block {bm}x{bn}", BM=bm, BN=bn,
                                        ms=ms, rel_err=err, error=error, density=density,
                                        block_density=layout.block_density, fill=fill, layout_ms=build_ms))
                if not args.no_element:
                    fn = lambda q, k, v: sparse_attention(q, k, v, mask, aggregation="element")  # noqa: E731
                    ms, err, error = _time(fn, prep, mode, args, device)
                    records.append(dict(case=case, mask=name, L=L, mode=mode, config="element", BM=None, BN=None,
                                        ms=ms, rel_err=err, error=error, density=density, block_density=None,
                                        fill=None, layout_ms=None))
                _print_case(case, [r for r in records if r["case"] == case])
            del prep, q, k, v, g, layouts
            free_memory(device)
    return {"records": records, "recommendation": recommend(records, args.lengths)}


def _print_case(case: str, rows: list[dict]) -> None:
    done = [r["ms"] for r in rows if r["ms"]]
    best = min(done) if done else None
    print(f"\n{case}  (density {rows[0]['density']:.4f})")
    print(f"  {'config':14s} {'ms':>9s} {'x best':>7s} {'fill':>6s} {'blocks':>7s}  status")
    for r in rows:
        ms = f"{r['ms']:.3f}" if r["ms"] else "—"
        rel = f"{r['ms'] / best:.2f}" if r["ms"] and best else "—"
        fill = f"{r['fill']:.3f}" if r["fill"] is not None else ""
        blocks = f"{r['block_density']:.3f}" if r["block_density"] is not None else ""
        print(f"  {r['config']:14s} {ms:>9s} {rel:>7s} {fill:>6s} {blocks:>7s}  {r['error'] or 'ok'}")
    sys.stdout.flush()


def recommend(records: list[dict], lengths: list[int]) -> dict:
    cases = sorted({r["case"] for r in records})
    best_of = {c: min((r["ms"] for r in records if r["case"] == c and r["ms"]), default=None) for c in cases}
    default_bs = {}
    for L in lengths:
        scores = {}
        for bm, bn in BLOCK_CONFIGS:
            ratios = []
            for c in cases:
                rows = [r for r in records if r["case"] == c and r["L"] == L and r["BM"] == bm and r["BN"] == bn]
                if rows and best_of[c]:
                    # a failed config counts as 10x the best
                    ratios.append(rows[0]["ms"] / best_of[c] if rows[0]["ms"] else 10.0)
            if ratios:
                scores[(bm, bn)] = math.exp(statistics.fmean(math.log(x) for x in ratios))
        if scores:
            default_bs[L] = min(scores, key=scores.get)

    # element threshold at the default block size: minimise the summed time of the rule
    pairs = []  # (fill, block ms, element ms)
    for c in cases:
        rows = [r for r in records if r["case"] == c]
        L = rows[0]["L"]
        if L not in default_bs:
            continue
        bm, bn = default_bs[L]
        blk = next((r for r in rows if r["BM"] == bm and r["BN"] == bn), None)
        ele = next((r for r in rows if r["config"] == "element"), None)
        if blk and blk["ms"] and ele:
            pairs.append((blk["fill"], blk["ms"], ele["ms"] if ele["ms"] else float("inf"), c))
    # candidate thresholds: 0 (never element), midpoints between consecutive fills, above all
    fills = sorted({p[0] for p in pairs})
    candidates = [0.0] + [(a + b) / 2 for a, b in zip(fills, fills[1:])] + ([fills[-1] * 1.25] if fills else [])
    threshold, best_total = 0.0, float("inf")
    for t in candidates:
        t = float(f"{t:.3g}")
        total = sum(e if f < t else b for f, b, e, _ in pairs)
        if total < best_total - 1e-9:
            threshold, best_total = t, total
    per_case = []
    for c in cases:
        rows = [r for r in records if r["case"] == c and r["ms"]]
        if not rows:
            per_case.append({"case": c, "best": None})
            continue
        top = min(rows, key=lambda r: r["ms"])
        pair = next((p for p in pairs if p[3] == c), None)
        per_case.append({"case": c, "best": top["config"], "best_ms": top["ms"],
                         "default_block_ms": pair[1] if pair else None,
                         "element_ms": pair[2] if pair and math.isfinite(pair[2]) else None,
                         "fill_at_default": pair[0] if pair else None})
    return {"DEFAULT_BLOCK_SIZE": {L: list(bs) for L, bs in default_bs.items()},
            "ELEMENT_MAX_FILL": threshold, "per_case": per_case}


def print_recommendation(rec: dict) -> None:
    print("\nRECOMMENDATION")
    bs = ", ".join(f"{L}: ({v[0]}, {v[1]})" for L, v in rec["DEFAULT_BLOCK_SIZE"].items())
    print(f"DEFAULT_BLOCK_SIZE = {{{bs}}}")
    print(f"ELEMENT_MAX_FILL = {rec['ELEMENT_MAX_FILL']}")
    for row in rec["per_case"]:
        if row["best"] is None:
            print(f"# {row['case']}: nothing ran")
            continue
        ele = f"{row['element_ms']:.3f}" if row.get("element_ms") else "—"
        blk = f"{row['default_block_ms']:.3f}" if row.get("default_block_ms") else "—"
        fill = f"{row['fill_at_default']:.3f}" if row.get("fill_at_default") is not None else "—"
        print(f"# {row['case']}: best {row['best']} {row['best_ms']:.3f} ms; default block {blk} ms; "
              f"element {ele} ms; fill {fill}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_calibrate needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; B={GPU_SIZES.batch} "
          f"H={GPU_SIZES.heads} D={GPU_SIZES.head_dim} bf16; check heads 0..{CHECK_HEADS - 1}")
    result = calibrate(args, device)
    print_recommendation(result["recommendation"])
    if args.json:
        result["device"] = torch.cuda.get_device_name(device)
        result["torch"] = torch.__version__
        args.json.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
