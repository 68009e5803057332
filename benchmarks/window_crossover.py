"""Where Jigsaw row windows beat the row-parallel (GAR) aggregation: the data for
``spmm``'s ``auto`` rule on :func:`fusegnn.sparse.window_tile_density`.

    python -m benchmarks.run --suite vector --sweep window-crossover [--nodes N] [--degree D] [--features 128,256]

The windows' kernel multiplies dense ``16 x BLOCK_K`` tiles: it gains where a window's
16 target rows share source columns (tile density near 1) and wastes ``1 - d`` of its
multiply-adds at tile density ``d``. The sweep generates graphs of ``--nodes`` nodes and
``--degree`` in-edges per node whose sources come, with probability ``locality``, from
the target's own aligned block of ``--block`` nodes (else uniformly from the whole
graph): locality 0 is a random graph (tile density about ``1 / 16`` at Reddit's degree),
locality 1 a block-diagonal one. Per graph and feature width it checks the window
output against GAR's, then times both (forward; forward + backward, the backward's
windows of ``A^T`` included) with :func:`benchmarks.measure.interleaved_ms`, structures
built beforehand (a transductive graph builds them once).

Writes ``<out>/vector/window-crossover-<gpu-slug>.json`` and ``.md``: per row the tile
densities (of ``A`` and of ``A^T``), the times, and ``window_over_gar``; the summary is
the lowest tile density from which the windows win at every width measured (``null``
if they never do).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

__all__ = ["generate_local_graph", "sweep_main"]


def generate_local_graph(num_nodes: int, degree: int, block: int, locality: float, seed: int,
                         device: torch.device):
    """A :class:`~fusegnn.sparse.Graph` with ``degree`` in-edges per node; each edge's
    source lies in the target's aligned block of ``block`` nodes with probability
    ``locality``, else anywhere (duplicates kept, as a sampled graph has them)."""
    from fusegnn.sparse import Graph

    gen = torch.Generator(device=device).manual_seed(seed)
    dst = torch.arange(num_nodes, device=device).repeat_interleave(degree)
    local = torch.rand(dst.numel(), generator=gen, device=device) < locality
    start = (dst // block) * block
    width = torch.clamp(num_nodes - start, max=block)
    near = start + (torch.rand(dst.numel(), generator=gen, device=device) * width).long()
    far = torch.randint(0, num_nodes, (dst.numel(),), generator=gen, device=device)
    src = torch.where(local, near, far)
    return Graph(torch.stack([src, dst]), num_nodes)


def _row(graph, features: int, dtype: torch.dtype, device: torch.device, steps: int) -> dict:
    from benchmarks.measure import interleaved_ms
    from fusegnn.sparse import spmm
    from fusegnn.sparse.window_aggregation import WINDOW_ROWS, graph_windows, window_tile_density, window_values

    gen = torch.Generator(device=device).manual_seed(features)
    x = torch.randn(graph.num_nodes, features, generator=gen, device=device).to(dtype).requires_grad_()
    g = torch.randn(graph.num_nodes, features, generator=gen, device=device).to(dtype)
    started = time.perf_counter()
    for transposed in (False, True):
        graph_windows(graph, WINDOW_ROWS, transposed=transposed)
        window_values(graph, None, dtype, transposed=transposed)
    torch.cuda.synchronize(device) if device.type == "cuda" else None
    build_ms = (time.perf_counter() - started) * 1e3

    def forward(aggregation: str):
        return lambda: spmm(graph, x, aggregation=aggregation)

    def both(aggregation: str):
        def step():
            x.grad = None
            spmm(graph, x, aggregation=aggregation).backward(g)
        return step

    reference = spmm(graph, x.detach().float(), aggregation="gar")
    out = spmm(graph, x.detach(), aggregation="window").float()
    rel_err = float((out - reference).norm() / reference.norm().clamp_min(1e-30))
    if not rel_err < 2e-2:
        raise AssertionError(f"window output differs from GAR's: relative error {rel_err:.3g}")
    for step in (forward("gar"), forward("window"), both("gar"), both("window")):
        step()  # compile and warm up
    fwd_gar, fwd_win, both_gar, both_win = interleaved_ms(
        [[forward("gar")], [forward("window")], [both("gar")], [both("window")]], device, steps=steps)
    return {
        "features": features, "tile_density": window_tile_density(graph, WINDOW_ROWS),
        "tile_density_t": window_tile_density(graph, WINDOW_ROWS, transposed=True),
        "gar_fwd_ms": fwd_gar, "window_fwd_ms": fwd_win, "gar_fwdbwd_ms": both_gar, "window_fwdbwd_ms": both_win,
        "window_over_gar": both_gar / both_win, "window_over_gar_fwd": fwd_gar / fwd_win,
        "build_ms": build_ms, "rel_err": rel_err,
    }


def crossover(rows: list[dict]) -> float | None:
    """The lowest tile density from which the windows' forward + backward beats GAR's at
    every width and every denser graph measured (``None`` if at none)."""
    by_density: dict[float, bool] = {}
    for r in rows:
        by_density[r["tile_density"]] = by_density.get(r["tile_density"], True) and r["window_over_gar"] > 1
    found = None
    for density in sorted(by_density, reverse=True):
        if not by_density[density]:
            break
        found = density
    return found


def sweep_main(argv: list[str], out_dir: Path, device_fn) -> int:
    from benchmarks.report import environment, markdown_table, write_sweep_result

    p = argparse.ArgumentParser(prog="--sweep window-crossover")
    p.add_argument("--nodes", type=int, default=232_965)
    p.add_argument("--degree", type=int, default=128)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--localities", default="0,0.5,0.8,0.9,0.95,0.98,1")
    p.add_argument("--features", default="128,256")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    device = device_fn()
    dtype = getattr(torch, args.dtype)
    rows = []
    for locality in (float(v) for v in args.localities.split(",")):
        graph = generate_local_graph(args.nodes, args.degree, args.block, locality, args.seed, device)
        for features in (int(v) for v in args.features.split(",")):
            row = {"locality": locality, **_row(graph, features, dtype, device, args.steps)}
            rows.append(row)
            print(f"locality {locality:.2f} F {features}: tile density {row['tile_density']:.3f} "
                  f"(A^T {row['tile_density_t']:.3f}); fwd+bwd gar {row['gar_fwdbwd_ms']:.3f} ms, "
                  f"window {row['window_fwdbwd_ms']:.3f} ms ({row['window_over_gar']:.2f}x)", flush=True)
        del graph
    doc = {"sweep": "window-crossover", "environment": environment(device), "config": vars(args),
           "rows": rows, "crossover_tile_density": crossover(rows)}
    table = markdown_table(
        [("locality", "r"), ("F", "r"), ("tile density (A / A^T)", "l"), ("GAR fwd / fwd+bwd ms", "l"),
         ("window fwd / fwd+bwd ms", "l"), ("window speed-up", "r")],
        [[f"{r['locality']:.2f}", str(r["features"]), f"{r['tile_density']:.3f} / {r['tile_density_t']:.3f}",
          f"{r['gar_fwd_ms']:.3f} / {r['gar_fwdbwd_ms']:.3f}", f"{r['window_fwd_ms']:.3f} / {r['window_fwdbwd_ms']:.3f}",
          f"{r['window_over_gar']:.2f}x"] for r in rows])
    lines = [f"## window vs GAR aggregation on {doc['environment'].get('device', '?')}", "",
             f"{args.nodes} nodes, {args.degree} in-edges each, blocks of {args.block}, {args.dtype}; "
             f"crossover tile density: {doc['crossover_tile_density']}", "", *table]
    write_sweep_result(out_dir, "window-crossover", device, doc, lines)
    return 0
