"""GATv2 against GAT, op level, on one GPU: the fused kernels' forward and forward +
backward on a generated Reddit-shaped graph (~20M edges), dropout 0.6, ``"gar"``.

    python -m benchmarks.gatv2_kernels_gpu            # ~30-60 s on an H100 (mostly compiles)
    python -m benchmarks.gatv2_kernels_gpu --quick    # 1 x 16 and 1 x 48 only, no tile variants

Issue 14 asks for a GATv2 1 x 16 training step within 1.3x of GATConv's; the two layers
of the Reddit model are 1 x 16 and 1 x 41 (run at 48 channels), so those are timed, plus
8 x 16. For each case: milliseconds of GAT's ``fused_gat_attention`` (``h``, ``s_src``,
``s_dst``) and GATv2's ``fused_gatv2_attention`` (``x_l``, ``x_r``, ``att``), forward and
forward + backward (gradients of every input), the ratio, and GATv2's peak memory of one
forward + backward above its inputs. Then GATv2 with other tiles
(:func:`fusegnn.kernels.gat_fused.tuning`: ``(block_e, num_warps)`` of the forward, pass
R and pass C) for the 1 x 16 and 1 x 48 cases. First, GATv2 (no dropout, 1 x 16) is
checked against the reference composition on the same graph.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

if "--device" in sys.argv and "cpu" in sys.argv:  # smoke run through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.measure import timed_ms  # noqa: E402
from fusegnn.datasets import generate_reddit_like  # noqa: E402
from fusegnn.kernels.gat_fused import fused_gat_attention, padded_channels, tuning  # noqa: E402
from fusegnn.kernels.gatv2_fused import fused_gatv2_attention, gatv2_config  # noqa: E402
from fusegnn.sparse import Graph, reference  # noqa: E402

P_DROP = 0.6
SLOPE = 0.2
CASES = ((1, 16), (1, 41), (8, 16))
#: (name, tuning overrides) tried for GATv2 at 1 x 16 and 1 x 41
VARIANTS = (
    ("fwd 2x edges", {"fwd": "double"}),
    ("fwd 1/2 edges", {"fwd": "half"}),
    ("bwd 2x edges", {"row": "double", "col": "double"}),
)


def _ms(fn, device: torch.device, repeat: int = 10) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` synchronised calls after two
    untimed ones (compilation, caches); one call off CUDA (interpreter smoke runs)."""
    fn()
    if device.type != "cuda":
        return timed_ms(fn, device, repeat=1)
    fn()
    times = []
    for _ in range(repeat):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def _fwd_bwd(op, inputs):
    def run():
        out = op(*inputs)
        torch.autograd.grad(out, inputs, out)  # grad_out = out: one tensor, no extra kernel
    return run


def _gat(graph: Graph, heads: int, channels: int):
    n, dev = graph.num_src_nodes, graph.device
    gen = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn((n, heads, channels), device=dev, generator=gen, requires_grad=True)
    s = [torch.randn((n, heads), device=dev, generator=gen, requires_grad=True) for _ in range(2)]

    def op(h, s_src, s_dst):
        return fused_gat_attention(graph, h, s_src, s_dst, SLOPE, P_DROP, seed=1, aggregation="gar")[0]
    return op, [h, *s]


def _gatv2(graph: Graph, heads: int, channels: int, p: float = P_DROP):
    n, dev = graph.num_src_nodes, graph.device
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = ((n, heads, channels), (n, heads, channels), (1, heads, channels))
    inputs = [torch.randn(s, device=dev, generator=gen).requires_grad_() for s in shapes]

    def op(x_l, x_r, att):
        return fused_gatv2_attention(graph, x_l, x_r, att, None, SLOPE, p, seed=1, aggregation="gar")
    return op, inputs


def _check(graph: Graph) -> None:
    op, inputs = _gatv2(graph, 1, 16, p=0.0)
    out = op(*inputs)
    ref, _ = reference.gatv2_attention(graph, *inputs, None, SLOPE)
    grads = torch.autograd.grad(out, inputs, out.detach())
    want = torch.autograd.grad(ref, inputs, out.detach())
    errs = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip((out, *grads), (ref, *want))]
    print("check vs reference (1x16, fp32, rel. max err of out, d x_l, d x_r, d att):",
          " ".join(f"{e:.1e}" for e in errs), "OK" if max(errs) < 1e-4 else "MISMATCH")


def _tile(graph: Graph, heads: int, channels: int, kernel: str, how: str) -> tuple[int, int]:
    """``(block_e, num_warps)`` of ``kernel`` (fwd, row, col) with GATv2's default
    ``block_e`` for this case doubled or halved (``how``)."""
    x = torch.empty((1, heads, padded_channels(channels)), device=graph.device)
    launch = getattr(gatv2_config(graph, x, x, SLOPE, P_DROP, 1, "gar"), kernel)
    block_e = launch.block_e * 2 if how == "double" else max(launch.block_e // 2, 2)
    return block_e, launch.num_warps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.2, help="fraction of Reddit's nodes")
    parser.add_argument("--avg-degree", type=float, default=430.0)
    parser.add_argument("--quick", action="store_true", help="1x16 and 1x41 only, no tile variants")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run through the interpreter")
    args = parser.parse_args()
    device = torch.device(args.device)
    data = generate_reddit_like(scale=args.scale, avg_degree=args.avg_degree, device=device)
    n = data.x.size(0)
    loops = torch.arange(n, device=device).expand(2, n)
    graph = Graph(torch.cat((data.edge_index, loops), 1), n)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}: {n} nodes, {graph.num_edges} edges (with self-loops), dropout {P_DROP}")
    _check(graph)
    cases = CASES[:2] if args.quick else CASES
    for heads, channels in cases:
        row = []
        for name, build in (("gat", _gat), ("gatv2", _gatv2)):
            op, inputs = build(graph, heads, channels)
            fwd = _ms(lambda: op(*inputs), device)
            peak = 0.0
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            both = _ms(_fwd_bwd(op, inputs), device)
            if device.type == "cuda":
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            row.append((name, fwd, both, peak))
        (_, gf, gb, _), (_, vf, vb, vpeak) = row
        print(f"{heads}x{channels}: GAT fwd {gf:.2f} fwd+bwd {gb:.2f} ms | GATv2 fwd {vf:.2f} fwd+bwd {vb:.2f} ms "
              f"(x{vf / gf:.2f}, x{vb / gb:.2f}), GATv2 peak +{vpeak:.0f} MiB")
        if args.quick or heads != 1:
            continue
        op, inputs = _gatv2(graph, heads, channels)
        for label, overrides in VARIANTS:
            tiles = {k: _tile(graph, heads, channels, k, how) for k, how in overrides.items()}
            with tuning(**tiles):
                fwd, both = _ms(lambda: op(*inputs), device), _ms(_fwd_bwd(op, inputs), device)
            print(f"    GATv2 {heads}x{channels} {label} {tiles}: fwd {fwd:.2f} fwd+bwd {both:.2f} ms")


if __name__ == "__main__":
    main()
