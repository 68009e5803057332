"""GPU check and timing of the fused GAT attention kernels against the reference composition
and PyG's ``GATConv``.

Run on a CUDA machine from the repository root::

    PYTHONUNBUFFERED=1 python benchmarks/kernels_gat_gpu.py --out $OUT [--stages check,sweep,time,layer]

Stages (all by default):

* ``check`` -- forward, alpha and the gradients of ``h``, ``score_src``, ``score_dst`` of the
  fused ``gar`` and ``gas`` paths against the float64 reference composition on a 20k-node
  power-law graph with self-loops (H x C in {1 x 16, 8 x 8}), with dropout through the
  explicit keep mask, bf16 forward; the caching allocator poisoned with NaN first so an
  unwritten output shows up; ``gar`` run twice must be bitwise identical.
* ``sweep`` -- fused ``gar`` forward + backward on the PubMed- and Reddit-sized graphs over
  ``block_e`` x ``num_warps`` x ``chunk`` (:func:`fusegnn.kernels.gat_fused.tuning`),
  against the default launch parameters; prints the best of each shape.
* ``time``  -- the attention op alone (``out = sum_j alpha_ji h_j`` from ``h``, ``score_src``,
  ``score_dst``), forward + backward, medians of ``triton.testing.do_bench``: fused
  ``gar`` / ``gas``, the reference composition (sddmm -> leaky_relu -> edge_softmax ->
  dropout -> spmm), and PyG's ``GATConv`` edge_updater + propagate on the same
  edge_index (self-loops already in). Extra peak memory (``max_memory_allocated`` above
  what was allocated before the step). Graphs: Cora-, PubMed- and Reddit-sized (232,965
  nodes, 114,615,892 edges, heavy-tailed Chung-Lu degrees, built with torch ops on the
  GPU), H x C in {1 x 16, 8 x 8}, dropout 0.6 in training mode; plus bf16 ``h`` on Reddit.
* ``layer`` -- one full ``GATConv`` layer (input width of the dataset: 1433 / 500 / 602),
  forward + backward, fusegnn (``gar``, ``gas``) vs PyG ``GATConv`` (which adds the
  self-loops on every call; fusegnn caches its processed graph on the ``Graph``).

Prints tables at the end and writes everything to ``$OUT/gat_gpu.json``. The whole run
takes several minutes on an H100 (the sweep alone 3-5); under a 10-minute limit run
``--stages check,time,layer`` and ``--stages sweep`` separately. Out-of-memory
cases are recorded as ``"OOM"``. ``--smoke`` runs every stage at toy sizes (also on the CPU
through ``TRITON_INTERPRET=1``) to check the script itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch.nn.functional as F  # noqa: E402

from fusegnn.kernels import gat_fused  # noqa: E402
from fusegnn.kernels.gat_fused import dropout_keep_mask, fused_gat_attention  # noqa: E402
from fusegnn.layers import GATConv  # noqa: E402
from fusegnn.sparse import Graph, add_self_loops, dispatch, gat_attention, remove_self_loops  # noqa: E402
from fusegnn.sparse import edge_softmax, sddmm, spmm  # noqa: E402

RESULTS: dict = {}
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
SLOPE = 0.2
DROPOUT = 0.6


def log(*args):
    print(*args, flush=True)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def bench(fn, rep_ms: float = 200.0) -> float:
    """Median milliseconds of ``fn``."""
    if CUDA:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    t = time.perf_counter()  # CPU (smoke run): one call
    fn()
    return (time.perf_counter() - t) * 1e3


def peak_extra_mb(fn) -> float:
    """Peak memory allocated by ``fn`` above what was allocated before it (MiB)."""
    if not CUDA:
        fn()
        return float("nan")
    sync()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def free():
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------ graphs
def power_law_graph(num_nodes: int, num_edges: int, sigma: float, seed: int) -> Graph:
    """Chung-Lu on the device: both endpoints drawn with probability proportional to a
    lognormal node weight (heavy-tailed in- and out-degrees); 1/16 of the nodes isolated.
    Then GAT's processing: self-loops removed and one added per node."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    weight = torch.exp(sigma * torch.randn(num_nodes, generator=gen, device=DEV))
    weight[torch.rand(num_nodes, generator=gen, device=DEV) < 1 / 16] = 0
    cdf = torch.cumsum(weight.double(), 0)
    cdf /= cdf[-1].clone()

    def draw():
        u = torch.rand(num_edges, generator=gen, device=DEV, dtype=torch.float64)
        return torch.searchsorted(cdf, u).clamp_(max=num_nodes - 1)

    src, dst = draw(), draw()
    order = torch.sort(src * num_nodes + dst).indices  # coalesced order, like PyG datasets
    graph = Graph(torch.stack([src[order], dst[order]]), num_nodes, validate=False)
    return add_self_loops(remove_self_loops(graph))


def graph_info(graph: Graph) -> dict:
    indeg = graph.in_degree
    return dict(
        num_nodes=graph.num_nodes, num_edges=graph.num_edges, avg_degree=round(graph.avg_degree, 2),
        max_in_degree=int(indeg.max()), max_out_degree=int(graph.out_degree.max()),
        in_degree_p99=float(indeg.float().quantile(0.99)) if indeg.numel() < 2**24 else None,
    )


SIZES = {  # name: (nodes, edges before self-loops, lognormal sigma, input width)
    "cora": (2_708, 10_556, 0.9, 1433),
    "pubmed": (19_717, 88_648, 0.9, 500),
    "reddit": (232_965, 114_615_892, 1.2, 602),
}
SMOKE_SIZES = {"cora": (24, 80, 0.9, 20), "pubmed": (30, 100, 0.9, 12), "reddit": (40, 400, 1.2, 16)}


def inputs(graph: Graph, heads: int, channels: int, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    n = graph.num_nodes
    h = torch.randn(n, heads, channels, generator=gen, device=DEV).to(dtype)
    s = torch.randn(n, heads, generator=gen, device=DEV)
    t = torch.randn(n, heads, generator=gen, device=DEV)
    return [v.requires_grad_() for v in (h, s, t)]


# ------------------------------------------------------------------------ the three paths
def reference_attention(graph, h, s, t, p, training=True, keep=None):
    scores = F.leaky_relu(sddmm(graph, s, t, "add", aggregation="reference"), SLOPE)
    alpha = edge_softmax(graph, scores, aggregation="reference")
    if keep is not None:
        alpha = alpha * keep.to(alpha.dtype) / (1 - p)
    else:
        alpha = F.dropout(alpha, p=p, training=training)
    return spmm(graph, h, alpha, aggregation="reference"), alpha


def pyg_attention_factory(graph: Graph, heads: int, channels: int, p: float):
    """PyG GATConv's attention part (edge_updater + propagate) on the same edge_index."""
    from torch_geometric.nn import GATConv as PygGAT

    conv = PygGAT(channels, channels, heads=heads, dropout=p, add_self_loops=False).to(DEV).train()
    ei = graph.edge_index

    def run(h, s, t):
        alpha = conv.edge_updater(ei, alpha=(s, t), edge_attr=None, size=None)
        return conv.propagate(ei, x=(h, h), alpha=alpha, size=None)

    return run


# ------------------------------------------------------------------------ check
def stage_check(smoke: bool):
    n, e = (40, 240) if smoke else (20_000, 400_000)
    graph = power_law_graph(n, e, 1.2, seed=1)
    log(f"[check] {graph} {graph_info(graph)}")
    out = {}
    if CUDA:  # poison the caching allocator: unwritten outputs read NaN
        junk = torch.full((256 * 2**20,), float("nan"), device=DEV)
        del junk
    for heads, channels in ((1, 16), (8, 8)):
        for p in (0.0, 0.5):
            h, s, t = inputs(graph, heads, channels, seed=heads)
            keep = dropout_keep_mask(graph.num_edges, heads, p, 1234, DEV) if p else None
            h64, s64, t64 = (v.detach().double().requires_grad_() for v in (h, s, t))
            ref, ref_alpha = reference_attention(graph, h64, s64, t64, p, keep=keep)
            go = torch.randn_like(ref)
            rgrads = torch.autograd.grad(ref, (h64, s64, t64), go)
            for path in ("gar", "gas"):
                o, a = fused_gat_attention(graph, h, s, t, SLOPE, p, seed=1234, return_alpha=True, variant=path)
                grads = torch.autograd.grad(o, (h, s, t), go.float())
                errs = [rel(o, ref), rel(a, ref_alpha)] + [rel(g, r) for g, r in zip(grads, rgrads)]
                ok = all(x < 1e-5 for x in errs) and not any(bool(v.isnan().any()) for v in (o, a, *grads))
                key = f"{path}_H{heads}_C{channels}_p{p}"
                out[key] = dict(out=errs[0], alpha=errs[1], grad_h=errs[2], grad_src=errs[3], grad_dst=errs[4], ok=ok)
                log(f"[check] {key}: rel err out {errs[0]:.1e} alpha {errs[1]:.1e} gh {errs[2]:.1e} "
                    f"gs {errs[3]:.1e} gt {errs[4]:.1e} {'OK' if ok else 'FAIL'}")
    h, s, t = inputs(graph, 8, 8, seed=3)
    ref = reference_attention(graph, h.detach().double(), s.detach().double(), t.detach().double(), 0.0)[0]
    o = gat_attention(graph, h.detach().bfloat16(), s.detach(), t.detach(), aggregation="gar")
    out["bf16"] = dict(out=rel(o, ref), ok=rel(o, ref) < 1e-2)
    log(f"[check] bf16 h: rel err {out['bf16']['out']:.1e}")
    runs = []
    for _ in range(2):
        o = fused_gat_attention(graph, h, s, t, SLOPE, 0.5, seed=7, variant="gar")[0]
        runs.append(torch.autograd.grad(o, (h, s, t), torch.ones_like(o)))
    out["deterministic"] = all(torch.equal(a, b) for a, b in zip(*runs))
    log(f"[check] gar bitwise reproducible: {out['deterministic']}")
    RESULTS["check"] = out


# ------------------------------------------------------------------------ attention op timing
def time_case(graph: Graph, name: str, heads: int, channels: int, dtype=torch.float32) -> list[dict]:
    rows = []
    h, s, t = inputs(graph, heads, channels, dtype=dtype)
    grad = torch.randn(graph.num_nodes, heads, channels, device=DEV, dtype=dtype)
    pyg = pyg_attention_factory(graph, heads, channels, DROPOUT)
    paths = {
        "fused_gar": lambda: gat_attention(graph, h, s, t, dropout=DROPOUT, training=True, aggregation="gar"),
        "fused_gas": lambda: gat_attention(graph, h, s, t, dropout=DROPOUT, training=True, aggregation="gas"),
        "reference": lambda: reference_attention(graph, h, s, t, DROPOUT)[0],
        "pyg": lambda: pyg(h, s, t),
    }
    if dtype != torch.float32:
        paths = {k: v for k, v in paths.items() if k.startswith("fused")}
    for path, fwd in paths.items():
        row = dict(graph=name, H=heads, C=channels, dtype=str(dtype).replace("torch.", ""), path=path)
        try:
            def step(fwd=fwd):
                out = fwd()
                torch.autograd.grad(out, (h, s, t), grad)

            row["fwd_ms"] = bench(lambda fwd=fwd: fwd())
            row["fwd_bwd_ms"] = bench(step)
            row["peak_extra_MiB"] = peak_extra_mb(step)
        except Exception as err:  # noqa: BLE001 - record OOM and go on
            if not is_oom(err):
                raise
            row["fwd_bwd_ms"] = "OOM"
            row["peak_extra_MiB"] = "OOM"
        free()
        log(f"[time] {row}")
        rows.append(row)
    return rows


def stage_time(graphs: dict, smoke: bool) -> list[dict]:
    rows = []
    for name, graph in graphs.items():
        for heads, channels in ((1, 16), (8, 8)):
            rows += time_case(graph, name, heads, channels)
        if name == "reddit":
            rows += time_case(graph, name, 1, 16, dtype=torch.bfloat16)
    RESULTS["time"] = rows
    return rows


# ------------------------------------------------------------------------ launch sweep
def stage_sweep(graphs: dict, smoke: bool) -> dict:
    out = {}
    for name in ("pubmed", "reddit"):
        if name not in graphs:
            continue
        graph = graphs[name]
        for heads, channels in ((1, 16), (8, 8)):
            h, s, t = inputs(graph, heads, channels)
            grad = torch.randn(graph.num_nodes, heads, channels, device=DEV)

            def step():
                o = fused_gat_attention(graph, h, s, t, SLOPE, DROPOUT, variant="gar")[0]
                torch.autograd.grad(o, (h, s, t), grad)

            cfg = gat_fused._Config(graph, h, s.dtype, SLOPE, DROPOUT, 0, "gar", gat_fused.DEFAULT_CHUNK)
            default = dict(fwd=tuple(cfg.fwd), row=tuple(cfg.row), col=tuple(cfg.col), chunk=gat_fused.DEFAULT_CHUNK)
            results = [dict(default, ms=bench(step), default=True)]
            block_es = (16, 64) if smoke else (16, 32, 64, 128)
            warps = (4,) if smoke else (4, 8)
            chunks = (gat_fused.DEFAULT_CHUNK,) if smoke else (1024, 4096)
            for be in block_es:
                if be * cfg.block_h * cfg.block_c > 8192:
                    continue
                for nw in warps:
                    for ch in chunks:
                        with gat_fused.tuning(block_e=be, num_warps=nw, chunk=ch):
                            try:
                                ms = bench(step)
                            except Exception as err:  # noqa: BLE001 - e.g. out of registers
                                log(f"[sweep] {name} H{heads} C{channels} be={be} nw={nw} chunk={ch}: {type(err).__name__}")
                                continue
                        results.append(dict(block_e=be, num_warps=nw, chunk=ch, ms=ms))
            best = min(results, key=lambda r: r["ms"])
            key = f"{name}_H{heads}_C{channels}"
            out[key] = dict(default=results[0], best=best, all=results)
            log(f"[sweep] {key}: default {results[0]['ms']:.3f} ms {default}; best {best['ms']:.3f} ms {best}")
            free()
    RESULTS["sweep"] = out
    return out


# ------------------------------------------------------------------------ full layer
def stage_layer(graphs: dict, sizes: dict) -> list[dict]:
    from torch_geometric.nn import GATConv as PygGAT

    rows = []
    for name, graph in graphs.items():
        in_channels = sizes[name][3]
        raw_ei = remove_self_loops(graph).edge_index  # PyG adds the loops itself
        x = torch.randn(graph.num_nodes, in_channels, device=DEV)
        for heads, channels in ((1, 16), (8, 8)):
            layers = {
                "fusegnn_gar": GATConv(in_channels, channels, heads=heads, dropout=DROPOUT, aggregation="gar"),
                "fusegnn_gas": GATConv(in_channels, channels, heads=heads, dropout=DROPOUT, aggregation="gas"),
                "pyg": PygGAT(in_channels, channels, heads=heads, dropout=DROPOUT),
            }
            user_graph = Graph(raw_ei, graph.num_nodes, validate=False)
            for path, layer in layers.items():
                layer = layer.to(DEV).train()
                arg = raw_ei if path == "pyg" else user_graph
                row = dict(graph=name, H=heads, C=channels, in_channels=in_channels, path=path)
                try:
                    def step(layer=layer, arg=arg):
                        out = layer(x, arg)
                        out.backward(torch.ones_like(out))

                    step()  # first call: graph processing (cached by fusegnn)
                    row["fwd_bwd_ms"] = bench(step)
                    row["peak_extra_MiB"] = peak_extra_mb(step)
                except Exception as err:  # noqa: BLE001
                    if not is_oom(err):
                        raise
                    row["fwd_bwd_ms"] = row["peak_extra_MiB"] = "OOM"
                del layer
                free()
                log(f"[layer] {row}")
                rows.append(row)
    RESULTS["layer"] = rows
    return rows


# ------------------------------------------------------------------------ main
def _table(rows: list[dict], title: str):
    if not rows:
        return
    log(f"\n{title}")
    log(f"{'graph':>7} | {'H x C':>6} | {'dtype':>8} | {'path':>12} | {'fwd ms':>8} | {'fwd+bwd ms':>10} | {'x vs pyg':>8} | {'peak MiB':>9}")
    pyg = {(r["graph"], r["H"], r["C"]): r["fwd_bwd_ms"] for r in rows if r["path"] == "pyg"}
    for r in rows:
        t = r["fwd_bwd_ms"]
        base = pyg.get((r["graph"], r["H"], r["C"]))
        speed = f"{base / t:8.1f}" if isinstance(t, float) and isinstance(base, float) else f"{'-':>8}"
        fwd = r.get("fwd_ms", "-")
        fwd = f"{fwd:8.3f}" if isinstance(fwd, float) else f"{fwd:>8}"
        tt = f"{t:10.3f}" if isinstance(t, float) else f"{t:>10}"
        pk = r["peak_extra_MiB"]
        pk = f"{pk:9.1f}" if isinstance(pk, float) else f"{pk:>9}"
        log(f"{r['graph']:>7} | {r['H']:>2} x {r['C']:<2} | {r.get('dtype', 'float32'):>8} | {r['path']:>12} | {fwd} | {tt} | {speed} | {pk}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--stages", default="check,sweep,time,layer")
    parser.add_argument("--graphs", default="cora,pubmed,reddit")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, to test the script")
    args = parser.parse_args()
    stages = args.stages.split(",")
    import triton

    RESULTS["env"] = dict(
        device=torch.cuda.get_device_name() if CUDA else platform.processor() or "cpu",
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        dropout=DROPOUT,
    )
    log(f"[env] {RESULTS['env']}")
    sizes = SMOKE_SIZES if args.smoke else SIZES
    t0 = time.perf_counter()
    time_rows = layer_rows = []
    try:
        if "check" in stages:
            stage_check(args.smoke)
        graphs = {}
        if any(stage in stages for stage in ("sweep", "time", "layer")):
            RESULTS["graphs"] = {}
            for name in args.graphs.split(","):
                n, e, sigma, _ = sizes[name]
                t = time.perf_counter()
                graph = power_law_graph(n, e, sigma, seed=0)
                sync()
                build = time.perf_counter() - t
                t = time.perf_counter()
                graph.csr, graph.csc  # noqa: B018 - format conversion, cached on the graph
                sync()
                info = graph_info(graph) | dict(build_s=build, csr_csc_s=time.perf_counter() - t)
                RESULTS["graphs"][name] = info
                log(f"[graph] {name}: {info}")
                graphs[name] = graph
        if "sweep" in stages:
            stage_sweep(graphs, args.smoke)
        if "time" in stages:
            time_rows = stage_time(graphs, args.smoke)
        if "layer" in stages:
            layer_rows = stage_layer(graphs, sizes)
    finally:
        RESULTS["elapsed_s"] = time.perf_counter() - t0
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gat_gpu.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    for key, res in RESULTS.get("sweep", {}).items():
        log(f"sweep {key}: default {res['default']['ms']:.3f} ms, best {res['best']['ms']:.3f} ms with {res['best']}")
    _table(time_rows, "attention op (h, score_src, score_dst -> out), forward + backward, dropout 0.6")
    _table(layer_rows, "GATConv layer, forward + backward, dropout 0.6")
    log(f"elapsed {RESULTS['elapsed_s']:.0f} s; auto picks {dispatch.GAR_MIN_AVG_DEGREE=}")


if __name__ == "__main__":
    main()
