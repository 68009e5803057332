"""Fused against reference linear + cross-entropy by head size: the data for
``linear_cross_entropy``'s ``backend="auto"`` rule (``fusegnn.losses.function.fused_min_work``).

    python -m benchmarks.run --suite loss --sweep crossover [--reps 20]

For heads of (features, classes) 128 x 41 (Reddit), 256 x 47 (products), 128 x 172 and
256 x 349 (ogbn-mag), and 8k to 1M rows: a bf16 forward + backward (gradients of ``h`` and
``W``) through ``backend="fused"`` and ``backend="reference"`` (``F.linear`` +
``F.cross_entropy``). Per point the median step of ``--reps`` steps of each path, timed in
rounds that alternate the two (:func:`benchmarks.measure.interleaved_ms`: each step
synchronised, so host time counts where the host is the bottleneck, and a drift of the
host's speed falls on both paths alike -- two earlier back-to-back runs disagreed by 2x
on the crossover). The losses of both paths are compared before timing.

Writes ``<out>/loss/crossover-<gpu-slug>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

HEADS = ((128, 41), (256, 47), (128, 172), (256, 349))
ROWS = (8192, 32768, 65536, 131072, 262144, 524288, 1048576)


def _rows(device: torch.device, reps: int) -> list[dict]:
    from benchmarks.measure import interleaved_ms
    from fusegnn.losses import linear_cross_entropy

    rows = []
    for features, classes in HEADS:
        for n in ROWS:
            gen = torch.Generator(device=device).manual_seed(n + classes)
            h = torch.randn(n, features, device=device, generator=gen, dtype=torch.bfloat16).requires_grad_()
            w = (torch.randn(classes, features, device=device, generator=gen) * features ** -0.5).to(torch.bfloat16)
            w.requires_grad_()
            y = torch.randint(0, classes, (n,), device=device, generator=gen)
            losses = [float(linear_cross_entropy(h, w, y, backend=b)) for b in ("fused", "reference")]
            if abs(losses[0] - losses[1]) > 2e-2 * abs(losses[1]):
                raise AssertionError(f"{features} x {classes}, {n} rows: fused {losses[0]} != reference {losses[1]}")
            steps = []
            for backend in ("fused", "reference"):
                def step(backend=backend):
                    h.grad = w.grad = None
                    linear_cross_entropy(h, w, y, backend=backend).backward()

                for _ in range(5):  # warm-up
                    step()
                steps.append([step])
            fused_ms, reference_ms = interleaved_ms(steps, device, steps=reps)
            rows.append({"features": features, "classes": classes, "rows": n, "work": n * (features + classes),
                         "fused_ms": fused_ms, "reference_ms": reference_ms})
            print(rows[-1], flush=True)
            del h, w, y
    return rows


def sweep_main(argv: list[str], out_dir: Path, device_fn) -> int:
    from benchmarks.report import environment, markdown_table, write_sweep_result
    from fusegnn.kernels.linear_cross_entropy import HEAD_MAX_CLASSES
    from fusegnn.losses.function import FUSED_MIN_WORK, FUSED_MIN_WORK_HEAD, fused_min_work

    p = argparse.ArgumentParser(prog="--sweep crossover")
    p.add_argument("--reps", type=int, default=20, help="timed steps of each path per point")
    args = p.parse_args(argv)
    device = device_fn()
    if device.type != "cuda":
        raise SystemExit("--sweep crossover times CUDA steps: it needs a CUDA device")
    rows = _rows(device, args.reps)
    doc = {"sweep": "crossover", "environment": environment(device), "config": vars(args),
           "fused_min_work": FUSED_MIN_WORK, "fused_min_work_head": FUSED_MIN_WORK_HEAD, "rows": rows}
    title = (f"## linear cross-entropy, fused vs reference, bf16 forward + backward, "
             f"{doc['environment'].get('device', '?')} (auto: fused from {FUSED_MIN_WORK_HEAD / 1e6:.0f}M up to "
             f"{HEAD_MAX_CLASSES} classes, {FUSED_MIN_WORK / 1e6:.0f}M above)")
    table = markdown_table(
        [("features x classes", "l"), ("rows", "r"), ("rows x (C + K)", "r"), ("fused ms", "r"),
         ("reference ms", "r"), ("fused speed-up", "r"), ("auto", "l")],
        [[f"{r['features']} x {r['classes']}", str(r["rows"]), f"{r['work'] / 1e6:.1f}M", f"{r['fused_ms']:.3f}",
          f"{r['reference_ms']:.3f}", f"{r['reference_ms'] / r['fused_ms']:.2f}x",
          "fused" if r["work"] >= fused_min_work(r["classes"]) else "reference"] for r in rows])
    write_sweep_result(out_dir, "crossover", device, doc, [title, "", *table])
    return 0
