"""A whole training step with and without the fused head (issue 15's end-to-end target).

    python -m benchmarks.run --suite loss --sweep end-to-end [--steps 10]

GCN h16 and GAT 1x16 on the Reddit-like graph (generated on the device, 602 features, 41
classes, 153k training nodes), Adam, one step = zero_grad, loss, backward, step. Per model,
four rows: the loss as ``model.loss(x, graph, y, train_index)`` (the linear +
cross-entropy head of :mod:`fusegnn.losses` with ``backend="auto"``: fused in a captured
step; in an eager step only from ``fused_min_work(classes)``, so a Reddit-sized eager head of
153k rows x (16 + 41) runs the reference there) or as ``F.cross_entropy`` on the gathered
logits, each eager and captured (:func:`fusegnn.graphed_step`). Same seed, same data:
the first losses agree to float rounding (checked). Median step ms over ``--steps`` timed
steps after 4 warm-up steps (:func:`benchmarks.measure.measure`), and the peak memory
allocated during them (data and graph included).

Writes ``<out>/loss/end-to-end-<gpu-slug>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["sweep_main"]


def _rows(device: torch.device, steps: int, scale: float) -> list[dict]:
    from benchmarks.measure import measure
    from fusegnn.capture import graphed_step
    from fusegnn.datasets import generate_reddit_like
    from fusegnn.models import GAT, GCN
    from fusegnn.sparse import Graph

    data = generate_reddit_like(scale=scale, device=device)
    graph = Graph(data.edge_index, data.num_nodes)
    index = data.train_mask.nonzero().view(-1)
    models = {"gcn-h16": lambda: GCN(data.num_features, 16, data.num_classes),
              "gat-1x16": lambda: GAT(data.num_features, 16, data.num_classes, heads=1)}
    rows = []
    for name, make in models.items():
        for captured in (False, True):
            for fused in (False, True):
                torch.manual_seed(0)
                model = make().to(device).train()
                opt = torch.optim.Adam(model.parameters(), lr=0.01, capturable=captured)

                def step(model=model, opt=opt, fused=fused):
                    opt.zero_grad(set_to_none=True)
                    if fused:
                        loss = model.loss(data.x, graph, data.y, index)
                    else:
                        logits = model(data.x, graph).index_select(0, index)
                        loss = F.cross_entropy(logits, data.y.index_select(0, index))
                    loss.backward()
                    opt.step()
                    return loss

                run = graphed_step(step, opt) if captured else step
                first = float(run())
                # the harness's timing (warm-up, then CUDA events per step); it resets the peak
                # after the warm-up, so the peak read below is that of the timed steps, data
                # and graph included (its own peak_mem_mib is over what was allocated before)
                timed = measure([run], device, steps=steps, warmup=3, launches=False)
                rows.append({"model": name, "fused_head": fused, "captured": captured,
                             "ms": timed.ms[0], "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20,
                             "first_loss": first})
                print(json.dumps(rows[-1]), flush=True)
                del model, opt, run
                torch.cuda.empty_cache()
    for name in models:
        firsts = [r["first_loss"] for r in rows if r["model"] == name]
        if max(firsts) - min(firsts) > 1e-3 * max(abs(v) for v in firsts):
            raise AssertionError(f"{name}: the first losses differ between the variants: {firsts}")
    return rows


def sweep_main(argv: list[str], out_dir: Path, device_fn) -> int:
    from benchmarks.report import environment, markdown_table, write_sweep_result

    p = argparse.ArgumentParser(prog="--sweep end-to-end")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--scale", type=float, default=1.0, help="fraction of the Reddit-like graph's nodes")
    args = p.parse_args(argv)
    device = device_fn()
    if device.type != "cuda":
        raise SystemExit("--sweep end-to-end times CUDA steps and captures: it needs a CUDA device")
    rows = _rows(device, args.steps, args.scale)
    doc = {"sweep": "end-to-end", "environment": environment(device), "config": vars(args), "rows": rows}
    title = f"## training step with and without the fused head, {doc['environment'].get('device', '?')}"
    table = markdown_table(
        [("model", "l"), ("step", "l"), ("head", "l"), ("ms", "r"), ("peak MiB", "r")],
        [[r["model"], "captured" if r["captured"] else "eager",
          "fused (model.loss)" if r["fused_head"] else "logits + F.cross_entropy",
          f"{r['ms']:.2f}", f"{r['peak_mib']:.0f}"] for r in rows])
    lines = [title, "", *table]
    write_sweep_result(out_dir, "end-to-end", device, doc, lines)
    return 0
