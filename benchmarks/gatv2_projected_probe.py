"""GPU probe of GATv2's in-kernel projection (session 18): one ``GATv2Conv`` layer's
forward + backward on a Reddit-like graph with the narrow input projected inside the
fused kernels against the same layer with the projected rows gathered.

    python3 benchmarks/gatv2_projected_probe.py                       # GATv2Conv(16, 41), Reddit-like, H100
    python3 benchmarks/gatv2_projected_probe.py --precision ieee,tf32x3 --values 512,1024,2048
    python3 benchmarks/gatv2_projected_probe.py --heads 8 --out 16 --in 64 --ratio 1.0
    TRITON_INTERPRET=1 python3 benchmarks/gatv2_projected_probe.py --device cpu --scale 0.0005 --avg-degree 20 --steps 1

The layer is the paper suite's GATv2 output layer on Reddit (``--in 16``: 1 head x 16
hidden; ``--out 41`` classes; attention dropout 0.6, training mode, ``--aggregation gar``
by default, as ``auto`` takes on this graph). Before timing, every variant's output and
gradients (input, ``lin_l`` / ``lin_r`` weights and biases, ``att``, the layer's bias)
are checked against the gathered variant's under the same dropout seed (largest absolute
difference over the largest magnitude, bound ``--rtol``); a variant that misses it is
reported and not timed. ``gathered`` is the layer with projection off
(``PROJECTION_MAX_RATIO = 0``); ``projected`` rows sweep the ``tl.dot`` precision
(``gatv2_fused.PROJECTION_PRECISION``), the projected tiles' values per warp
(``GATV2_PROJECTED_VALUES``; 16 edges a step at least) and, with ``--ratio``, the
dispatch threshold. Times are medians of ``--steps`` CUDA-event timings (ms) after
``--warmup`` steps, of the forward alone and of forward + backward.

The two-layer training steps of the paper suite run as::

    python3 -m benchmarks.run --suite paper --cases 'gat-reddit-1x16,gatv2-reddit-1x16' \\
        --backends fusegnn,fusegnn-graphed

(``fusegnn-compiled`` keeps the gathered rows: under ``torch.compile`` the layer runs the
``fusegnn::gatv2_attention`` custom op.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fusegnn first

import fusegnn.kernels.gatv2_fused as gatv2_fused  # noqa: E402
import fusegnn.sparse.gatv2 as gatv2_op  # noqa: E402
from fusegnn.datasets.synthetic import generate_reddit_like  # noqa: E402
from fusegnn.layers import GATv2Conv  # noqa: E402


def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--scale", type=float, default=1.0, help="Reddit-like size (fraction of Reddit's nodes)")
    p.add_argument("--avg-degree", type=float, help="edges per node (default Reddit's ~492)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--in", dest="in_channels", type=int, default=16, help="layer input width K")
    p.add_argument("--out", type=int, default=41, help="channels per head C")
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--dropout", type=float, default=0.6)
    p.add_argument("--aggregation", default="gar", choices=("gar", "gas", "auto"))
    p.add_argument("--share-weights", action="store_true")
    p.add_argument("--precision", type=_csv, default=["ieee"], help="tl.dot precisions to sweep (ieee, tf32x3)")
    p.add_argument("--values", type=_csv, default=[str(gatv2_fused.GATV2_PROJECTED_VALUES)],
                   help="GATV2_PROJECTED_VALUES to sweep (values of a projected tile per warp)")
    p.add_argument("--ratio", type=float, default=gatv2_op.PROJECTION_MAX_RATIO,
                   help="PROJECTION_MAX_RATIO for the projected rows (raise it to force a wider input)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rtol", type=float, default=1e-4)
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


class _Variant:
    """A setting of the projection knobs, applied around a call."""

    def __init__(self, name: str, ratio: float, precision: str = "ieee", values: int | None = None) -> None:
        self.name, self.ratio, self.precision = name, ratio, precision
        self.values = gatv2_fused.GATV2_PROJECTED_VALUES if values is None else values

    def __enter__(self):
        self._saved = (gatv2_op.PROJECTION_MAX_RATIO, gatv2_fused.PROJECTION_PRECISION,
                       gatv2_fused.GATV2_PROJECTED_VALUES)
        gatv2_op.PROJECTION_MAX_RATIO = self.ratio
        gatv2_fused.PROJECTION_PRECISION = self.precision
        gatv2_fused.GATV2_PROJECTED_VALUES = self.values
        return self

    def __exit__(self, *exc):
        ratio, precision, values = self._saved
        gatv2_op.PROJECTION_MAX_RATIO = ratio
        gatv2_fused.PROJECTION_PRECISION = precision
        gatv2_fused.GATV2_PROJECTED_VALUES = values


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    args = _args(argv)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    data = generate_reddit_like(args.scale, args.seed, device, avg_degree=args.avg_degree)
    graph = data.graph
    n = data.num_nodes
    del data
    gen = torch.Generator(device=device).manual_seed(args.seed)
    x = torch.randn(n, args.in_channels, generator=gen, device=device).requires_grad_()
    torch.manual_seed(args.seed)
    layer = GATv2Conv(args.in_channels, args.out, heads=args.heads, dropout=args.dropout,
                      aggregation=args.aggregation, share_weights=args.share_weights).to(device).train()
    layer(x, graph)  # self-loops, formats and schedules built once, outside the timings
    _sync(device)
    grad = torch.randn(n, args.heads * args.out, generator=gen, device=device)
    params = [x, *layer.parameters()]
    print(f"graph: {graph.num_nodes:,} nodes, {graph.num_edges:,} edges ({time.perf_counter() - t0:.1f} s to build); "
          f"GATv2Conv({args.in_channels}, {args.out}, heads={args.heads}), dropout {args.dropout}, "
          f"aggregation {args.aggregation}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    print(f"rule: project a side when K <= {args.ratio} x H x padded C; would project: "
          f"{args.in_channels <= args.ratio * args.heads * gatv2_fused.padded_channels(args.out)}")

    def run(seed: int = 1234):
        torch.manual_seed(seed)  # the dropout seed the layer draws
        out = layer(x, graph)
        return out, torch.autograd.grad(out, params, grad)

    variants = [_Variant("gathered", 0.0)]
    variants += [_Variant(f"projected {prec} v{v}", args.ratio, prec, int(v))
                 for prec in args.precision for v in args.values]
    with variants[0]:
        want_out, want_grads = run()
    failed = 0
    print(f"{'variant':<28} {'max rel err (out, grads)':>26} {'fwd ms':>9} {'fwd+bwd ms':>11}")
    for variant in variants:
        with variant:
            calls = []
            fn = gatv2_fused.fused_gatv2_projected_attention

            def spy(*a, **kw):
                calls.append((kw["project_l"], kw["project_r"]))
                return fn(*a, **kw)

            gatv2_fused.fused_gatv2_projected_attention = spy
            try:
                out, grads = run()
            finally:
                gatv2_fused.fused_gatv2_projected_attention = fn
            errs = [_rel(out, want_out)] + [_rel(a, b) for a, b in zip(grads, want_grads)]
            sides = "none" if not calls else "+".join(s for s, f in zip(("l", "r"), calls[0]) if f)
            if max(errs) > args.rtol:
                failed += 1
                print(f"{variant.name:<28} MISMATCH {max(errs):.2e} (projected sides: {sides}); not timed")
                continue

            def forward():
                with torch.no_grad():
                    layer(x, graph)

            def step():
                out = layer(x, graph)
                torch.autograd.grad(out, params, grad)

            fwd = _median_ms(forward, device, args.steps, args.warmup)
            both = _median_ms(step, device, args.steps, args.warmup)
            print(f"{variant.name + ' [' + sides + ']':<28} {max(errs):>26.2e} {fwd:>9.3f} {both:>11.3f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
