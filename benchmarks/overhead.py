"""Suite ``overhead``: host microseconds per call of the pieces of an eager training step.

    python -m benchmarks.run --suite overhead            # on a GPU; --allow-cpu for a smoke run

On small graphs an eager step is bound by the host: what each op costs to *issue* (Python,
the dispatcher, autograd, the kernel launch), not by its GPU time. This suite times that
cost per call for the primitives (an ATen op, an empty ``autograd.Function``, a Triton
launch), for fusegnn's ops and layers next to PyG's, and for ``sparse_attention`` next to
the kernel it picks, on Cora (or a random graph of Cora's size when the data is absent).

Each probe runs ``calls`` times per round with a device synchronisation between rounds
only; the time of the calls themselves is summed (so a full launch queue never counts)
and the median over rounds is reported. Probes of one group run interleaved round by
round, so drift in the host's speed falls on all of them alike. The results go to
``<out>/overhead/<gpu-slug>.json`` and ``.md``; ``benchmarks/NOTES-overhead.md`` reads them.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["host_us", "run_overhead", "main_from_harness"]

Probe = Callable[[], object]


def host_us(probes: dict[str, Probe], device: torch.device, *, calls: int = 40, rounds: int = 15,
            warmup: int = 10) -> dict[str, float]:
    """Median host microseconds per call of each probe, interleaved round by round."""
    for fn in probes.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: dict[str, list[float]] = {name: [] for name in probes}
    for _ in range(rounds):
        for name, fn in probes.items():
            total = 0.0
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                total += time.perf_counter() - t0
            _sync(device)
            samples[name].append(total / calls * 1e6)
    return {name: round(statistics.median(values), 1) for name, values in samples.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cora(data_root: str | None, device: torch.device):
    """Cora's graph and features, or a random graph of its size (noted in the result)."""
    from fusegnn import Graph
    from fusegnn.datasets import load_dataset

    try:
        data = load_dataset("Cora", root=data_root, normalize_features=True)
        return Graph(data.edge_index.to(device), data.num_nodes), data.x.to(device), "Cora (Planetoid raw files)"
    except (FileNotFoundError, OSError) as err:
        gen = torch.Generator().manual_seed(0)
        edge_index = torch.randint(0, 2708, (2, 10556), generator=gen)
        note = f"random graph of Cora's size (Cora not found: {type(err).__name__})"
        return Graph(edge_index.to(device), 2708), torch.rand(2708, 1433, generator=gen).to(device), note


def _groups(graph, x: torch.Tensor, device: torch.device) -> dict[str, dict[str, Probe]]:
    """The probes, by group (each group is timed interleaved)."""
    from fusegnn.kernels.spmm import GASSpmm
    from fusegnn.layers import GATConv, GCNConv
    from fusegnn.sparse import gcn_norm, spmm

    n = graph.num_nodes
    norm = gcn_norm(graph)
    h = torch.randn(n, 16, device=device, requires_grad=True)
    g16 = torch.randn(n, 16, device=device)
    g64 = torch.randn(n, 64, device=device)

    class Noop(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return grad

    def single_threaded(fn: Probe) -> Probe:
        def run():
            with torch.autograd.set_multithreading_enabled(False):
                return fn()

        return run

    groups: dict[str, dict[str, Probe]] = {
        "primitives": {
            "torch.zeros [N, 16]": lambda: torch.zeros(n, 16, device=device),
            "one elementwise op": lambda: h.detach() + 1,
            "empty autograd.Function, forward": lambda: Noop.apply(h),
            "empty autograd.Function, forward + backward": lambda: Noop.apply(h).backward(g16),
            "empty autograd.Function, fwd + bwd, single-threaded autograd": single_threaded(
                lambda: Noop.apply(h).backward(g16)
            ),
            "ATen op (x * 1), forward + backward": lambda: (h * 1.0).backward(g16),
        },
        "spmm [N, 16], GCN-normalised Cora": {
            "spmm auto, forward": lambda: spmm(norm, h.detach()),
            "spmm gas, forward": lambda: spmm(norm, h.detach(), aggregation="gas"),
            "spmm auto, forward + backward": lambda: spmm(norm, h).backward(g16),
            "spmm gas, forward + backward": lambda: spmm(norm, h, aggregation="gas").backward(g16),
            "spmm reference, forward + backward": lambda: spmm(norm, h, aggregation="reference").backward(g16),
            "GASSpmm.apply (no op layer), forward + backward": lambda: GASSpmm.apply(h, None, None, norm).backward(g16),
            "spmm gas, fwd + bwd, single-threaded autograd": single_threaded(
                lambda: spmm(norm, h, aggregation="gas").backward(g16)
            ),
        },
    }
    gcn = {"fusegnn auto": GCNConv(x.size(1), 16, cached=True), "fusegnn gas": GCNConv(x.size(1), 16, cached=True, aggregation="gas")}
    gat = {"fusegnn auto": GATConv(x.size(1), 8, heads=8, dropout=0.6)}
    try:
        import torch_geometric.nn as pyg

        gcn["PyG"] = pyg.GCNConv(x.size(1), 16, cached=True)
        gat["PyG"] = pyg.GATConv(x.size(1), 8, heads=8, dropout=0.6)
    except Exception:  # noqa: BLE001 - PyG is optional: its rows are left out
        pass
    edge_index = graph.edge_index
    layer_probes: dict[str, Probe] = {}
    for name, layer in gcn.items():
        layer.to(device).train()
        arg = edge_index if name == "PyG" else graph
        layer_probes[f"GCNConv 1433 -> 16, {name}, forward + backward"] = (
            lambda layer=layer, arg=arg: layer(x, arg).backward(g16)
        )
    for name, layer in gat.items():
        layer.to(device).train()
        arg = edge_index if name == "PyG" else graph
        layer_probes[f"GATConv 1433 -> 8 x 8, {name}, forward + backward"] = (
            lambda layer=layer, arg=arg: layer(x, arg).backward(g64)
        )
    params = [p for layer in gcn.values() for p in layer.parameters()]
    for p in params:
        p.grad = torch.zeros_like(p)
    adam = torch.optim.Adam(list(gcn["fusegnn auto"].parameters()), lr=0.01, weight_decay=5e-4)
    layer_probes["Adam.step, GCNConv's 2 parameters"] = adam.step
    groups["layers"] = layer_probes
    if device.type == "cuda":
        groups["sparse_attention, L = 1024, B 1, H 2, D 64, bf16, forward"] = _attention_probes(device)
    else:  # a smoke run: the fused kernels need CUDA (or the slow interpreter)
        groups = {g: {k: f for k, f in probes.items() if "gas" not in k and "GAS" not in k}
                  for g, probes in groups.items()}
    return groups


def _attention_probes(device: torch.device) -> dict[str, Probe]:
    """``sparse_attention`` and the kernel it picks, called directly."""
    from fusegnn.kernels.block_attention import block_sparse_attention_prechecked
    from fusegnn.attention import masks, sparse_attention

    module = sys.modules["fusegnn.attention.sparse_attention"]
    L, D = 1024, 64
    q, k, v = (torch.randn(1, 2, L, D, device=device, dtype=torch.bfloat16) for _ in range(3))
    probes: dict[str, Probe] = {}
    for name, mask in (("causal", masks.Causal(L)), ("window 256", masks.SlidingWindow(L, 256)),
                       ("dilated 128 x 2", masks.Dilated(L, 128, 2))):
        decision = module.explain_attention(q, mask, backward=False)
        if decision.name == "dense" and decision.dense_variant == "causal":
            kernel = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        elif decision.name == "dense":
            bool_mask = module._sdpa_bool_mask(mask, device)[0]
            kernel = lambda m=bool_mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
        else:
            layout, dilation = module._block_layout(mask, None, device)
            kernel = lambda lo=layout, d=dilation: block_sparse_attention_prechecked(q, k, v, lo, D ** -0.5, d)  # noqa: E731
        probes[f"{name}: sparse_attention ({decision.label})"] = lambda m=mask: sparse_attention(q, k, v, m)
        probes[f"{name}: the kernel alone"] = kernel
    return probes


def run_overhead(device: torch.device, data_root: str | None, out: Path, **timing: int) -> str:
    """Run every probe group; write ``out/overhead/<gpu-slug>.json`` and ``.md``; return the
    markdown. ``timing`` overrides :func:`host_us`'s ``calls`` / ``rounds`` / ``warmup``."""
    from benchmarks.report import environment, gpu_slug

    graph, x, data_note = _cora(data_root, device)
    results: dict[str, dict[str, float]] = {}
    for group, probes in _groups(graph, x, device).items():
        grad_free = group.startswith("sparse_attention")
        if grad_free:
            with torch.no_grad():
                results[group] = host_us(probes, device, **timing)
        else:
            results[group] = host_us(probes, device, **timing)
    doc = {"suite": "overhead", "environment": environment(device), "data": data_note, "host_us": results}
    lines = [f"## `overhead` on {doc['environment'].get('device', device)}", "",
             f"Host microseconds per call, median of interleaved rounds; data: {data_note}.", ""]
    for group, rows in results.items():
        lines += [f"### {group}", "", "| call | host us |", "|---|---:|"]
        lines += [f"| {name} | {value:.1f} |" for name, value in rows.items()]
        lines.append("")
    markdown = "\n".join(lines)
    folder = out / "overhead"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{gpu_slug(device)}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (folder / f"{gpu_slug(device)}.md").write_text(markdown + "\n")
    return markdown


def main_from_harness(args, device: torch.device) -> int:
    """``python -m benchmarks.run --suite overhead``."""
    print(run_overhead(device, args.data_root, args.out))
    return 0
