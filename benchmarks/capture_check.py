"""GPU check of :func:`fusegnn.graphed_step` on the small Planetoid graphs.

    FUSEGNN_DATA=.carry/planetoid python -m benchmarks.capture_check
    python -m benchmarks.capture_check --datasets cora --libraries fusegnn --steps 500 --json out.json

For each data set (Cora, CiteSeer, PubMed) and model (GCN hidden 16, GAT 8 heads x 8, the
published recipes; the models and step of the ``paper`` suite, :mod:`benchmarks.runner`)
and library (fusegnn, PyG through the same helper):

1. **replay = eager**: from the same weights, dropout off, the losses and the final
   output of graphed calls (warm-up, capture, replays) against as many eager steps
   (:func:`benchmarks.runner._verify_replay`); a capture that fails prints its full
   :class:`fusegnn.CaptureError` (where and why);
2. **fresh dropout**: in training mode, with the weights fixed (a captured forward and
   loss, no optimizer), consecutive replays give different losses;
3. **throughput**: ``--steps`` back-to-back steps, eager and replayed, timed with CUDA
   events around the whole loop (ms per step, no synchronisation between steps; the
   ``paper`` suite times single synchronised steps instead).

Prints a markdown table; ``--json`` also writes the records. Exit status 1 if a fusegnn
row failed (PyG rows may fail to capture: that is a finding, not an error).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.backends import PAPER_BACKENDS
from benchmarks.cases import Case
from benchmarks.data import DataConfig, DatasetCache
from benchmarks.run import default_data_root
from benchmarks.runner import (
    RunConfig,
    _adam,
    _graphed,
    _paper_model,
    _prepare_paper_case,
    _training_step,
    _verify_replay,
)
from fusegnn.capture import graphed_step

_LIBRARIES = {"fusegnn": ("fusegnn", "fusegnn-graphed"), "pyg": ("pyg", "pyg-graphed")}


def _throughput(step, steps: int) -> float:
    """ms per step over ``steps`` back-to-back calls (after 3 untimed ones)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / steps


def check(case: Case, library: str, data: DatasetCache, config: RunConfig, steps: int) -> dict:
    eager_backend, graphed_backend = (PAPER_BACKENDS[name] for name in _LIBRARIES[library])
    record: dict = {"case": case.name, "library": library, "ok": False}
    try:
        shared = _prepare_paper_case(case, [eager_backend], data, config)
        record["replay_rel_err"] = _verify_replay(graphed_backend, shared, case, config)
        model, graph_arg, graphed = _graphed(graphed_backend, shared, case, config, train=True)

        def loss_only() -> torch.Tensor:  # fixed weights: replays differ by their dropout only
            logits = model(shared.x, graph_arg)
            return F.cross_entropy(logits.index_select(0, shared.train_index), shared.y_train)

        forward = graphed_step(loss_only, warmup=1)
        replays = [float(forward()) for _ in range(5)][1:]
        record["fresh_dropout"] = all(a != b for a, b in zip(replays, replays[1:]))
        del forward
        record["graphed_ms"] = _throughput(graphed, steps)
        del model, graph_arg, graphed
        model, graph_arg = _paper_model(eager_backend, shared, case, config.device)
        model.train()
        record["eager_ms"] = _throughput(_training_step(model, _adam(model, config), graph_arg, shared), steps)
        record["speedup"] = record["eager_ms"] / record["graphed_ms"]
        record["ok"] = record["replay_rel_err"] <= config.rtol and record["fresh_dropout"]
    except Exception as err:  # noqa: BLE001 - reported, the next case runs
        record["error"] = f"{type(err).__name__}: {err}"
        record["traceback"] = traceback.format_exc(limit=-6)
    finally:
        torch.cuda.empty_cache()
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.capture_check", description=__doc__.split("\n")[0])
    p.add_argument("--datasets", default="cora,citeseer,pubmed")
    p.add_argument("--libraries", default="fusegnn,pyg")
    p.add_argument("--steps", type=int, default=200, help="steps per throughput measurement")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--data-root", default=default_data_root())
    p.add_argument("--json", type=Path, help="also write the records here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("capture_check: needs a CUDA device")
    device = torch.device("cuda", torch.cuda.current_device())
    config = RunConfig(device=device, rtol=args.rtol)
    data = DatasetCache(DataConfig(args.data_root, device))
    records = []
    for dataset in args.datasets.split(","):
        for case in (Case(f"gcn-{dataset}-h16", "paper", dataset, "gcn", 16),
                     Case(f"gat-{dataset}-8x8", "paper", dataset, "gat", 8, 8)):
            for library in args.libraries.split(","):
                if library == "pyg" and PAPER_BACKENDS["pyg"].unavailable(device):
                    continue
                record = check(case, library, data, config, args.steps)
                records.append(record)
                if "error" in record:
                    print(f"{case.name} {library}: {record['error']}\n{record['traceback']}", file=sys.stderr)
    print("| case | library | replay vs eager | fresh dropout | eager ms | graphed ms | speedup | status |\n"
          "|---|---|---:|---|---:|---:|---:|---|")
    for r in records:
        def num(key, fmt):
            return format(r[key], fmt) if key in r else "—"

        status = "ok" if r["ok"] else (r.get("error", "failed").splitlines()[0][:90])
        print(f"| {r['case']} | {r['library']} | {num('replay_rel_err', '.1e')} | {r.get('fresh_dropout', '—')} | "
              f"{num('eager_ms', '.3f')} | {num('graphed_ms', '.3f')} | {num('speedup', '.1f')} | {status} |")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                                         "records": records}, indent=1))
    return 0 if all(r["ok"] for r in records if r["library"] == "fusegnn") else 1


if __name__ == "__main__":
    sys.exit(main())
