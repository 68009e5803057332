"""Train a two-layer GNN (GCN, GAT, ...) on the whole graph across processes (torch.distributed).

    torchrun --nproc-per-node 2 examples/train_distributed.py --dataset Reddit --model gcn
    torchrun --nproc-per-node 2 examples/train_distributed.py --device cpu --dataset Cora   # gloo
    python examples/train_distributed.py --dataset Cora        # one process, no launcher

The graph is partitioned into one part per process (``--partition``: METIS when
``pymetis`` is installed, else a contiguous split of a reverse Cuthill-McKee order);
each process keeps its nodes, their incoming edges and the halo nodes those edges read
(:class:`fusegnn.distributed.DistGraph`), and trains the same ``fusegnn.models`` model
as ``examples/train.py`` on it (every ``--model``; ``tests/test_distributed.py`` checks
each layer on 2 processes against one): every layer fetches the halo rows it
aggregates from their owners (``all_to_all_single``; the gradient goes back in the
backward). Each process computes the loss of its own training nodes over the global
count, and the gradients are summed over the processes
(:func:`fusegnn.distributed.allreduce_gradients`) before every Adam step, so all
replicas stay identical and the step is the single-process one (up to dropout draws and
rounding).

Backend: NCCL on CUDA (each process on ``cuda:LOCAL_RANK``), gloo on the CPU (``--device
cpu``). The flags are those of ``examples/train.py`` (recipes, ``--runs``, ``--epochs``,
``--json``, ...) plus ``--partition``, ``--balance`` (edges, the default, or nodes) and ``--backend``; ``--cuda-graph`` and
``--sampled`` are refused (the steps here are eager and full-graph). Only rank 0 prints:
progress, the partition, and with ``--json`` the summary as the last line (accuracies of
the whole graph, step time, peak memory of every process, halo sizes and bytes exchanged
per step).

Every process loads the data set and partitions it on the host (the same deterministic
partition everywhere); only its share goes to the device. ``--reorder`` renumbers the
nodes in a locality order first, as in ``examples/train.py``, so that each process's
rows gather nearby ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/train.py and _cli.py, imported below
try:
    import fusegnn  # noqa: F401
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train as single  # noqa: E402  (examples/train.py: flags, recipes, model builder)
from _cli import USER_ERRORS, check_device_present, fail, show_progress  # noqa: E402

from fusegnn.datasets import load_dataset  # noqa: E402
from fusegnn.distributed import METHODS, DistGraph, allreduce_gradients, global_count, partition_graph  # noqa: E402
from fusegnn.distributed.training import global_sum  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--partition", choices=METHODS, default="auto",
                     help="how the graph is split: METIS (pymetis), contiguous (RCM order), auto")
    own.add_argument("--balance", choices=("edges", "nodes"), default="edges",
                     help="what the parts balance: incoming edges (each worker's aggregation time and "
                          "memory follow them) or node counts")
    own.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                     help="torch.distributed backend (auto: nccl on CUDA, gloo on the CPU)")
    # train.py's flags this script refuses, parsed here so that their abbreviations
    # (--sampl, --cuda-gr), which train.py's parser would take, are caught too
    own.add_argument("--cuda-graph", action="store_true", help=argparse.SUPPRESS)
    own.add_argument("--sampled", action="store_true", help=argparse.SUPPRESS)
    extra, rest = own.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        own.print_help()
    if extra.cuda_graph:
        raise SystemExit("train_distributed.py: --cuda-graph is not supported (the steps run eagerly)")
    if extra.sampled:
        raise SystemExit("train_distributed.py: --sampled is not supported (every process trains on its "
                         "whole partition; examples/train.py --sampled trains on mini-batches)")
    # the help leaves out what this script refuses (--cuda-graph, --sampled) and what only
    # --sampled reads (--num-neighbors, --batch-size)
    args = single.parse_args(rest + ["--no-cuda-graph"], description=__doc__.split("\n")[0],
                             hidden=("--cuda-graph", "--no-cuda-graph", "--sampled", "--num-neighbors", "--batch-size"))
    args.partition, args.balance, args.backend = extra.partition, extra.balance, extra.backend
    return args


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``; the process group is initialised when launched by
    torchrun (``RANK`` set), else this is the only process."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not launched:
        return 0, 1, device
    backend = args.backend if args.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return dist.get_rank(), dist.get_world_size(), device


@torch.no_grad()
def evaluate(model, x, dg: DistGraph, y, masks: dict) -> dict[str, float]:
    """Accuracy and mean loss of each split over the whole graph (sums over the processes)."""
    model.eval()
    logits = model(x, dg)
    sums = []
    for mask in masks.values():
        sums += [(logits[mask].argmax(-1) == y[mask]).sum().double(),
                 F.cross_entropy(logits[mask], y[mask], reduction="sum").double(), mask.sum().double()]
    totals = global_sum(torch.stack(sums)).tolist()
    result = {}
    for k, split in enumerate(masks):
        correct, loss, count = totals[3 * k:3 * k + 3]
        result[f"{split}_acc"] = correct / max(count, 1.0)
        result[f"{split}_loss"] = loss / max(count, 1.0)
    return result


def train_run(args, data, dg: DistGraph, tensors: dict, run: int, bar) -> dict:
    torch.manual_seed(args.seed + run)  # the same initial parameters on every process
    model = single.build_model(args, data).to(dg.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    torch.manual_seed(dropout_seed(args.seed, run, dg.rank))  # but each process its own dropout draws
    x, y, masks = tensors["x"], tensors["y"], tensors["masks"]
    train_index = masks["train"].nonzero().view(-1)
    y_train = y.index_select(0, train_index)
    train_count = global_count(masks["train"])
    cuda = dg.device.type == "cuda"
    selection = single.Selection(args.patience)
    epoch_ms, step_bytes = [], []
    for epoch in range(1, args.epochs + 1):
        if cuda:
            torch.cuda.synchronize(dg.device)
        start = time.perf_counter()
        model.train()
        optimizer.zero_grad(set_to_none=True)
        dg.log.reset()
        out = model(x, dg)
        # this process's share of the global mean: the sum over its nodes / all training nodes
        loss = F.cross_entropy(out.index_select(0, train_index), y_train, reduction="sum") / train_count
        loss.backward()
        allreduce_gradients(model)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(dg.device)
        epoch_ms.append((time.perf_counter() - start) * 1e3)
        step_bytes.append(dg.log.bytes_sent)
        metrics = evaluate(model, x, dg, y, masks)
        # the same global metrics everywhere, so every process stops at the same epoch
        if selection.update(metrics, epoch, bar, run=run, loss=float(global_sum(loss)), epochs=args.epochs):
            break
    best = selection.best
    # the slowest process sets the pace: the step time is the maximum over processes
    best["epoch_ms_median"] = float(_max_over_processes(statistics.median(epoch_ms)))
    best["bytes_sent_per_step"] = statistics.median(step_bytes)
    best["epochs_run"] = epoch
    return best


def dropout_seed(seed: int, run: int, rank: int) -> int:
    """The seed of process ``rank``'s dropout draws in run ``run``. The parameters are
    initialised from ``seed + run`` on every process (they must start equal); kept for the
    steps, that one seed made processes owning as many nodes drop the same positions of
    their rows (node k of every such part dropped together), where one process draws every
    node's mask independently. Mixed by :class:`numpy.random.SeedSequence`, so that
    neighbouring seeds, runs and ranks give unrelated streams."""
    return int(np.random.SeedSequence([seed, run, rank]).generate_state(1)[0])


def _max_over_processes(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _all_processes(value: float) -> list[float]:
    if not dist.is_initialized():
        return [value]
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [float(v) for v in out]


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    try:
        check_device_present(torch.device(args.device))
    except ValueError as err:
        fail(err, "train_distributed.py", debug=args.debug)
    rank, world_size, device = setup(args)
    try:
        return _main(args, rank, world_size, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _main(args, rank: int, world_size: int, device: torch.device) -> dict | None:
    kwargs = {}
    if args.dataset.lower() in ("cora", "citeseer", "pubmed"):
        kwargs["normalize_features"] = not args.no_normalize_features
    try:
        data = load_dataset(args.dataset, args.root, **kwargs)
        if args.reorder != "none":  # train.py's --reorder: renumber first, then partition
            data = data.reorder(args.reorder)
        part = partition_graph(data.graph, world_size, args.partition, balance_on=args.balance)  # --partition metis without pymetis
    except USER_ERRORS as err:
        fail(err, "train_distributed.py", debug=args.debug)
    dg = DistGraph.build(data.graph, part, rank if world_size > 1 else 0, device=device)
    tensors = {"x": dg.owned_rows(data.x), "y": dg.owned_rows(data.y),
               "masks": {s: dg.owned_rows(getattr(data, f"{s}_mask")) for s in ("train", "val", "test")}}
    halos = _all_processes(float(dg.num_halo))
    lead = rank == 0
    if lead and not args.quiet:
        print(f"{data}  on {world_size} process(es), {device.type}  aggregation={args.aggregation}", file=sys.stderr)
        print(f"partition: {part.method}, parts of {part.sizes()} nodes, edge cut {part.edge_cut} "
              f"({part.edge_cut / max(data.num_edges, 1):.1%} of the edges), balance {part.balance:.3f}, "
              f"halo nodes per process {[int(h) for h in halos]}", file=sys.stderr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    results = []
    bar = tqdm(total=args.runs * args.epochs, disable=not (lead and show_progress(args.quiet)),
               desc=f"{args.model} {data.name} x{world_size}")
    with bar:
        for run in range(args.runs):
            results.append(train_run(args, data, dg, tensors, run, bar))
    peak = _all_processes(torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else -1.0)
    test = [r["test_acc"] for r in results]
    summary = {
        "dataset": data.name,
        "model": args.model,
        "runs": args.runs,
        "world_size": world_size,
        "test_acc_mean": statistics.fmean(test),
        "test_acc_std": statistics.pstdev(test) if len(test) > 1 else 0.0,
        "val_acc_mean": statistics.fmean(r["val_acc"] for r in results),
        "epoch_ms_median": statistics.median(r["epoch_ms_median"] for r in results),
        "peak_mem_mib": peak if device.type == "cuda" else None,
        "aggregation": args.aggregation,
        "reorder": args.reorder,
        "partition": {"method": part.method, "sizes": part.sizes(), "edge_cut": part.edge_cut,
                      "balance": part.balance, "balanced_on": part.balanced_on},
        "halo_nodes": [int(h) for h in halos],
        "bytes_sent_per_step_rank0": results[0]["bytes_sent_per_step"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "best_epochs": [r["epoch"] for r in results],
        "test_accs": test,
    }
    if not lead:
        return summary
    print(
        f"{args.model.upper()} on {data.name}, {world_size} process(es): test accuracy "
        f"{summary['test_acc_mean']:.4f} ± {summary['test_acc_std']:.4f} (val {summary['val_acc_mean']:.4f}) "
        f"over {args.runs} runs; {summary['epoch_ms_median']:.2f} ms per training step"
        + (f"; peak memory per process {', '.join(f'{p:.0f}' for p in peak)} MiB" if device.type == "cuda" else "")
    )
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
