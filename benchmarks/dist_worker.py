"""The worker process of the ``dist`` suite (:mod:`benchmarks.dist`): one per GPU.

Each worker joins the process group, and for every case generates the data set (the same,
seeded, on every worker), partitions it (the same deterministic partition everywhere),
builds its :class:`~fusegnn.distributed.DistGraph` share on its device and trains the
case's model for ``cfg["steps_total"]`` steps (Adam, dropout off, the gradients summed over
the workers). It records per step the wall time (device synchronised, the workers
aligned by a barrier before each step) and the global loss, then replays one step's halo
exchanges alone to time them, and writes ``<out_dir>/<case>-n<N>-r<rank>.json``.
Worker 0 of the largest run also partitions the graph for the modelled GPU counts
(:func:`partition_stats`).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

#: case -> (data set, model, hidden width per head, heads, layers)
CASES = {
    "dist-reddit-gcn-h128": ("reddit", "gcn", 128, 1, 2),
    "dist-reddit-gat-8x16": ("reddit", "gat", 16, 8, 2),
    "dist-products-gcn-3x256": ("products", "gcn", 256, 1, 3),
}


class Stack(nn.Module):
    """``layers`` GCN or GAT layers with ReLU / ELU between them (no dropout)."""

    def __init__(self, model: str, in_dim: int, hidden: int, heads: int, out_dim: int, layers: int) -> None:
        super().__init__()
        from fusegnn.layers import GATConv, GCNConv

        convs = []
        width = in_dim
        for k in range(layers):
            last = k == layers - 1
            if model == "gcn":
                convs.append(GCNConv(width, out_dim if last else hidden, cached=True))
                width = hidden
            else:
                convs.append(GATConv(width, out_dim if last else hidden, heads=1 if last else heads, concat=not last))
                width = hidden * heads
        self.convs = nn.ModuleList(convs)
        self.act = F.relu if model == "gcn" else F.elu

    def forward(self, x, graph):
        for k, conv in enumerate(self.convs):
            x = conv(x, graph)
            if k < len(self.convs) - 1:
                x = self.act(x)
        return x


def load(dataset: str, scale: float, seed: int, device: torch.device, avg_degree: float | None = None):
    """The generated data set (``avg_degree``: ``None`` for the real graph's)."""
    from fusegnn.datasets.synthetic import generate_ogbn_like, generate_reddit_like

    kwargs = {} if avg_degree is None else {"avg_degree": avg_degree}
    if dataset == "reddit":
        return generate_reddit_like(scale, seed, device, **kwargs)
    return generate_ogbn_like("ogbn-products", scale, seed, device, **kwargs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_exchanges(dg, widths: list, reps: int) -> float:
    """Milliseconds of one step's halo exchanges run alone (median of ``reps``)."""
    from fusegnn.distributed.exchange import _all_to_all

    buffers = []
    for row_bytes, direction in widths:
        width = max(1, row_bytes // 4)
        if direction == "forward":
            buffers.append((torch.randn(dg.send_index.numel(), width, device=dg.device), dg.num_halo,
                            dg.recv_counts, dg.send_counts))
        else:
            buffers.append((torch.randn(dg.num_halo, width, device=dg.device), dg.send_index.numel(),
                            dg.send_counts, dg.recv_counts))
    samples = []
    for _ in range(reps):
        dist.barrier()
        _sync(dg.device)
        start = time.perf_counter()
        for rows, out_rows, out_splits, in_splits in buffers:
            _all_to_all(rows, out_rows, out_splits, in_splits, dg.group)
        _sync(dg.device)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def run_case(name: str, rank: int, world_size: int, device: torch.device, cfg: dict, cache: dict) -> dict:
    from fusegnn.distributed import DistGraph, allreduce_gradients, global_count, partition_graph
    from fusegnn.distributed.training import global_sum

    dataset, model_kind, hidden, heads, layers = CASES[name]
    if dataset not in cache:
        cache.clear()  # one data set at a time
        cache[dataset] = load(dataset, cfg["scale"][dataset], cfg["seed"], device, cfg["avg_degree"].get(dataset))
    data = cache[dataset]
    graph_cpu = data.edge_index.cpu()
    part = partition_graph(graph_cpu, world_size, cfg["partition"], balance_on=cfg.get("balance_on", "edges"))
    dg = DistGraph.build(graph_cpu, part, rank, device=device)
    x, y, train = dg.owned_rows(data.x), dg.owned_rows(data.y), dg.owned_rows(data.train_mask)
    train_index = train.nonzero().view(-1)
    y_train = y.index_select(0, train_index)
    count = global_count(train)
    torch.manual_seed(cfg["seed"])
    model = Stack(model_kind, data.num_features, hidden, heads, data.num_classes, layers).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step_ms, losses, sent, received, widths = [], [], [], [], []
    for _ in range(cfg["steps_total"]):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        dg.log.reset()
        opt.zero_grad(set_to_none=True)
        out = model(x, dg)
        loss = F.cross_entropy(out.index_select(0, train_index), y_train, reduction="sum") / count
        loss.backward()
        allreduce_gradients(model)
        opt.step()
        _sync(device)
        step_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(float(global_sum(loss.detach())))
        sent.append(dg.log.bytes_sent)
        received.append(dg.log.bytes_received)
        widths = list(dg.log.widths)
    timed = step_ms[cfg["warmup"]:] or step_ms
    record = dict(
        case=name, world_size=world_size, rank=rank, step_ms=statistics.median(timed),
        exchange_ms=_time_exchanges(dg, widths, cfg["exchange_reps"]) if world_size > 1 else 0.0,
        bytes_sent=sent[-1], bytes_received=received[-1], exchanges_per_step=len(widths), widths=widths,
        peak_mem_mib=torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        num_own=dg.num_own, num_halo=dg.num_halo, local_edges=dg.graph.num_edges, send_rows=dg.send_index.numel(),
        losses=losses, num_nodes=data.num_nodes, num_edges=data.num_edges,
        partition=dict(method=part.method, edge_cut=part.edge_cut, balance=part.balance),
    )
    if rank == 0 and world_size == cfg["model_from"]:
        record["modelled_partitions"] = {str(p): partition_stats(graph_cpu, p, cfg["partition"],
                                                                 cfg.get("balance_on", "edges"))
                                         for p in cfg["model_parts"]}
    del model, opt, dg, x, y, out, loss
    return record


def partition_stats(edge_index: torch.Tensor, parts: int, method: str, balance_on: str = "edges") -> dict:
    """Per part of a ``parts``-way partition: owned nodes, halo nodes, rows sent per
    forward exchange, incoming edges (what the ``dist`` model scales by)."""
    from fusegnn.distributed import partition_graph
    from fusegnn.distributed.dist_graph import share_of

    part = partition_graph(edge_index, parts, method, balance_on=balance_on)
    src, dst = edge_index.numpy()
    rows = []
    for r in range(parts):
        share = share_of(src, dst, part, r)
        rows.append(dict(num_own=share["owned"].numel(), num_halo=share["halo"].numel(),
                         send_rows=share["send_index"].numel(), local_edges=share["edge_index"].size(1)))
    return dict(method=part.method, edge_cut=part.edge_cut, balance=part.balance, parts=rows)


def worker_log(out_dir: str, world_size: int, rank: int) -> str:
    """Where worker ``rank`` of a ``world_size`` spawn writes its stderr."""
    return os.path.join(out_dir, f"worker-n{world_size}-r{rank}.log")


def _log_stderr(out_dir: str, world_size: int, rank: int) -> None:
    """Send this process's stderr (Python's and C++'s: fd 2) also to :func:`worker_log`, so
    that a worker killed by a signal leaves its last words for the parent's error row."""
    sys.stderr.flush()
    log = os.open(worker_log(out_dir, world_size, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 2)
    os.close(log)


def worker(rank: int, world_size: int, init: str, cfg: dict, out_dir: str) -> None:
    """The spawned process (``torch.multiprocessing.spawn``): every case of ``cfg["cases"]``."""
    cuda = cfg["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    _log_stderr(out_dir, world_size, rank)
    if cuda:
        torch.cuda.set_device(device)
    else:  # the CPU smoke run: one thread each (os.cpu_count() may be the host's, not the job's)
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world_size,
                            device_id=device if cuda else None)
    cache: dict = {}
    try:
        for name in cfg["cases"]:
            try:
                record = run_case(name, rank, world_size, device, cfg, cache)
            except Exception as err:  # noqa: BLE001 - one case failing (OOM) must not end the run
                record = dict(case=name, world_size=world_size, rank=rank,
                              error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-2000:])
                if cuda:
                    torch.cuda.empty_cache()
            with open(os.path.join(out_dir, f"{name}-n{world_size}-r{rank}.json"), "w") as f:
                json.dump(record, f)
        dist.barrier()  # nobody tears the group down while a peer still talks to it
    finally:
        dist.destroy_process_group()
