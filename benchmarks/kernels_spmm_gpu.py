"""GPU check and timing of the fused SpMM kernels (GAS, GAR) against cuSPARSE.

Run on a CUDA machine from the repository root::

    PYTHONUNBUFFERED=1 python -m benchmarks.run --out $OUT --suite agg --sweep spmm [--stages ...]

(options after ``--sweep spmm`` are this sweep's).

Stages (all by default):

* ``check``   -- forward, grad_x and grad_w of GAS and GAR against the float64 reference
  on a 20k-node power-law graph (F in {16, 64, 602}, 8 heads x 8 features, bf16), with
  the caching allocator poisoned with NaN first so an unwritten output shows up; GAR
  run twice must be bitwise identical.
* ``build``   -- a Reddit-sized graph built on the GPU (232,965 nodes, 114,615,892 edges,
  Chung-Lu with lognormal node weights: heavy-tailed in- and out-degrees), coalesced
  (sorted by source, then target) like PyG's Reddit, int64 ids.
* ``convert`` -- COO -> CSR + CSC (degrees, ptr, perm, index) timed on the coalesced and on
  a shuffled copy of the edge list, against the previous stable int64 argsort; and the
  GAR work lists.
* ``spot``    -- GAS and GAR forward / backward on the big graph against ``torch.sparse.mm``
  with a CSR matrix (cuSPARSE), and GAR bitwise determinism there.
* ``sweep``   -- greedy tuning of the GAR / GAS launch parameters at F in {16, 64, 128,
  256} (one parameter at a time, keeping the best).
* ``time``    -- medians (``triton.testing.do_bench``) of forward and backward for gas,
  gar and cuSPARSE at F in {16, 64, 128, 256}, with the best configs found.
* ``calib``   -- the GAS / GAR crossover in average degree that ``aggregation="auto"``
  uses (random power-law graphs of 100k nodes, transductive: conversion excluded, and
  reported separately).

Prints a table at the end and writes everything to ``<out>/agg/spmm-<gpu>.json`` (harness
``--out``, default ``benchmarks/results``). ``--smoke`` runs every stage at toy sizes (also
on the CPU: ``TRITON_INTERPRET=1 python -m benchmarks.run --suite agg --allow-cpu --device
cpu --sweep spmm --smoke --stages check``) to check the sweep itself.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


from fusegnn.sparse import Graph, dispatch, reference, spmm
from fusegnn.kernels import spmm as fused
from fusegnn.kernels.partition import plan_for
from fusegnn.kernels.spmm_gar import GarConfig, gar_config, gar_reduce
from fusegnn.kernels.spmm_gas import GasConfig, gas_config, gas_scatter

RESULTS: dict = {}
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def log(*args):
    print(*args, flush=True)


def sync():
    if CUDA:
        torch.cuda.synchronize()


def bench(fn, rep_ms: float = 100.0) -> float:
    """Median milliseconds of ``fn``."""
    if CUDA:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    times = []
    for _ in range(2):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def wall(fn, reps: int = 3) -> float:
    """Median milliseconds of ``fn`` timed with a sync on both sides (for one-off work)."""
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


# ------------------------------------------------------------------------ graphs
def power_law_graph(num_nodes: int, num_edges: int, sigma: float, seed: int, coalesce: bool = True) -> Graph:
    """Chung-Lu: both endpoints drawn with probability proportional to a lognormal node
    weight; 1/16 of the nodes get weight 0 (isolated)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    weight = torch.exp(sigma * torch.randn(num_nodes, generator=gen, device=DEV))
    weight[torch.rand(num_nodes, generator=gen, device=DEV) < 1 / 16] = 0
    cdf = torch.cumsum(weight.double(), 0)
    cdf /= cdf[-1].clone()

    def draw():
        u = torch.rand(num_edges, generator=gen, device=DEV, dtype=torch.float64)
        return torch.searchsorted(cdf, u).clamp_(max=num_nodes - 1)

    src = draw()
    dst = draw()
    if coalesce:
        order = torch.sort(src * num_nodes + dst).indices
        src, dst = src[order], dst[order]
    return Graph(torch.stack([src, dst]), num_nodes, validate=False)


# ------------------------------------------------------------------------ check
def stage_check(smoke: bool):
    n, e = (300, 4000) if smoke else (20_000, 400_000)
    graph = power_law_graph(n, e, 1.2, seed=1, coalesce=False)
    log(f"[check] graph {graph}, max in-degree {int(graph.in_degree.max())}")
    out = {}
    if CUDA:  # poison the caching allocator: unwritten outputs read NaN
        junk = torch.full((256 * 2**20,), float("nan"), device=DEV)
        del junk
    cases = [(16, None), (64, None), (602, None), (8, 8)]
    for feat, heads in cases:
        shape = (n, feat) if heads is None else (n, heads, feat)
        x = torch.randn(shape, device=DEV)
        w = torch.rand((e,) if heads is None else (e, heads), device=DEV) + 0.5
        x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
        ref = reference.spmm(graph, x64, w64)
        go = torch.randn_like(ref)
        rx, rw = torch.autograd.grad(ref, [x64, w64], go)
        for path in ("gas", "gar"):
            xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
            o = spmm(graph, xs, ws, aggregation=path)
            gx, gw = torch.autograd.grad(o, [xs, ws], go.float())
            errs = (rel(o, ref), rel(gx, rx), rel(gw, rw))
            ok = all(err < 1e-5 for err in errs) and not any(
                bool(t.isnan().any()) for t in (o, gx, gw)
            )
            out[f"{path}_F{feat}_H{heads or 1}"] = dict(out=errs[0], grad_x=errs[1], grad_w=errs[2], ok=ok)
            log(f"[check] {path} F={feat} H={heads or 1}: rel err out {errs[0]:.2e} gx {errs[1]:.2e} gw {errs[2]:.2e} {'OK' if ok else 'FAIL'}")
    x = torch.randn(n, 64, device=DEV)
    w = torch.rand(e, device=DEV) + 0.5
    ref = reference.spmm(graph, x.double(), w.double())
    for path in ("gas", "gar"):
        for dt in (torch.bfloat16, torch.float16):
            o = spmm(graph, x.to(dt), w.to(dt), aggregation=path)
            err = rel(o, ref)
            out[f"{path}_{dt}"] = dict(out=err, ok=err < 1e-2)
            log(f"[check] {path} {dt} F=64: rel err {err:.2e}")
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    runs = []
    for _ in range(2):
        with dispatch.deterministic():
            o = spmm(graph, xs, ws)
            out["deterministic_path"] = dispatch.last_backend()
        gx, gw = torch.autograd.grad(o, [xs, ws], torch.ones_like(o))
        runs.append((o, gx, gw))
    det = all(torch.equal(a, b) for a, b in zip(*runs))
    out["deterministic"] = det
    log(f"[check] deterministic GAR bitwise equal: {det}")
    RESULTS["check"] = out


# ------------------------------------------------------------------------ build / convert
def stage_build(smoke: bool) -> Graph:
    n, e = (200, 3000) if smoke else (232_965, 114_615_892)
    t = time.perf_counter()
    graph = power_law_graph(n, e, 1.2, seed=0, coalesce=True)
    sync()
    indeg, outdeg = graph.in_degree, graph.out_degree
    info = dict(
        num_nodes=n, num_edges=e, build_s=time.perf_counter() - t,
        max_in_degree=int(indeg.max()), max_out_degree=int(outdeg.max()),
        isolated=int(((indeg == 0) & (outdeg == 0)).sum()), avg_degree=graph.avg_degree,
        in_degree_p50=float(indeg.float().median()), in_degree_p99=float(indeg.float().quantile(0.99)),
    )
    log(f"[build] {info}")
    RESULTS["graph"] = info
    return graph


def _old_compress(group, other, counts):
    perm = torch.argsort(group, stable=True)
    ptr = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=group.device)
    torch.cumsum(counts, dim=0, out=ptr[1:])
    return ptr, other[perm], perm


def stage_convert(graph: Graph, smoke: bool):
    ei = graph.edge_index
    n = graph.num_nodes
    gen = torch.Generator(device=DEV).manual_seed(5)
    shuffled = ei[:, torch.randperm(ei.size(1), generator=gen, device=DEV)]
    out = {}
    for name, edge_index in (("coalesced", ei), ("shuffled", shuffled), ("shuffled_int32", shuffled.int())):
        def new():
            g = Graph(edge_index, n, validate=False)
            g.csr, g.csc  # noqa: B018 - computes both

        def old():
            _old_compress(edge_index[1], edge_index[0], torch.bincount(edge_index[1], minlength=n))
            _old_compress(edge_index[0], edge_index[1], torch.bincount(edge_index[0], minlength=n))

        out[name] = dict(new_ms=wall(new), argsort_ms=wall(old))
        log(f"[convert] {name}: csr+csc {out[name]['new_ms']:.1f} ms (stable int64 argsort: {out[name]['argsort_ms']:.1f} ms)")
    graph.csr, graph.csc  # noqa: B018
    g = Graph(shuffled, n, validate=False)
    g.csr, g.csc  # noqa: B018
    ref_ptr, ref_idx, ref_perm = _old_compress(shuffled[1], shuffled[0], torch.bincount(shuffled[1], minlength=n))
    out["same_as_argsort"] = bool(
        torch.equal(g.csr.perm, ref_perm) and torch.equal(g.csr.index, ref_idx) and torch.equal(g.csr.ptr, ref_ptr)
    )
    for seg_len in (1024, 4096):
        def plans():
            g2 = graph.with_edge_weight(None)  # shares csr/csc, not the cached plans
            plan_for(g2, "csr", seg_len), plan_for(g2, "csc", seg_len)

        out[f"plans_K{seg_len}_ms"] = wall(plans)
        log(f"[convert] GAR work lists (csr + csc) K={seg_len}: {out[f'plans_K{seg_len}_ms']:.1f} ms")
    log(f"[convert] same result as argsort: {out['same_as_argsort']}")
    del shuffled
    RESULTS["convert"] = out


# ------------------------------------------------------------------------ big-graph pieces
class Big:
    """The big graph's operands, in every order the paths need."""

    def __init__(self, graph: Graph, cusparse: bool = True):
        self.graph = graph
        n, e = graph.num_nodes, graph.num_edges
        gen = torch.Generator(device=DEV).manual_seed(3)
        deg = graph.in_degree.clamp(min=1).float()
        # GCN-like weights 1/sqrt(d_i d_j), positive and O(1/d)
        self.w = (deg[graph.src].rsqrt() * deg[graph.dst].rsqrt()) * (
            0.5 + torch.rand(e, generator=gen, device=DEV)
        )
        self.w2 = self.w.reshape(-1, 1)
        self.w_csr = self.w2[graph.csr.perm].contiguous()
        self.w_csc = self.w2[graph.csc.perm].contiguous()
        self.src = graph.src.contiguous()
        self.dst = graph.dst.contiguous()
        self.cusparse = {}
        for idx in (torch.int32, torch.int64) if cusparse else ():
            csr, csc = graph.csr, graph.csc
            self.cusparse[idx] = (
                torch.sparse_csr_tensor(csr.ptr.to(idx), csr.index.to(idx), self.w[csr.perm], (n, n)),
                torch.sparse_csr_tensor(csc.ptr.to(idx), csc.index.to(idx), self.w[csc.perm], (n, n)),
            )

    def x(self, feat: int, seed: int = 0) -> torch.Tensor:
        gen = torch.Generator(device=DEV).manual_seed(seed)
        return torch.randn(self.graph.num_nodes, feat, generator=gen, device=DEV)


def gar_fwd(big: Big, x, cfg: GarConfig):
    plan = plan_for(big.graph, "csr", cfg.seg_len)
    return gar_reduce(plan, x, big.w_csr, big.graph.num_nodes, 1, x.dtype, config=cfg)[0]


def gar_bwd(big: Big, g, cfg: GarConfig, x=None):
    plan = plan_for(big.graph, "csc", cfg.seg_len)
    return gar_reduce(plan, g, big.w_csc, big.graph.num_nodes, 1, g.dtype, dot_with=x,
                      gw_dtype=torch.float32, config=cfg)


def gas_fwd(big: Big, x, cfg: GasConfig):
    return gas_scatter(x, big.src, big.dst, big.w2, big.graph.num_nodes, 1, config=cfg)[0]


def gas_bwd(big: Big, g, cfg: GasConfig, x=None):
    return gas_scatter(g, big.dst, big.src, big.w2, big.graph.num_nodes, 1, dot_with=x, config=cfg)


def stage_spot(big: Big):
    out = {}
    x = big.x(64)
    a, at = big.cusparse[torch.int64]
    ref = torch.sparse.mm(a, x)
    ref_t = torch.sparse.mm(at, x)
    for path, fwd, bwd, cfg in (
        ("gar", gar_fwd, gar_bwd, gar_config(64, 4)),
        ("gas", gas_fwd, gas_bwd, gas_config(64, 4)),
    ):
        o = fwd(big, x, cfg)
        gx = bwd(big, x, cfg)[0]
        out[path] = dict(fwd=rel(o, ref), bwd=rel(gx, ref_t))
        log(f"[spot] {path} vs cuSPARSE F=64: fwd {out[path]['fwd']:.2e} bwd {out[path]['bwd']:.2e}")
    cfg = gar_config(64, 4)
    out["gar_bitwise"] = bool(torch.equal(gar_fwd(big, x, cfg), gar_fwd(big, x, cfg))) and bool(
        torch.equal(gar_bwd(big, x, cfg)[0], gar_bwd(big, x, cfg)[0])
    )
    g = big.x(64, seed=1)
    gx, gw = gar_bwd(big, g, gar_config(64, 4, dot=True), x)
    gx2, gw2 = gas_bwd(big, g, gas_config(64, 4), x)
    out["grad_w_gar_vs_gas"] = rel(gw, gw2)
    # public API on the big graph (memoised CSR-order weights, autograd)
    o = spmm(big.graph, x, big.w, aggregation="gar")
    out["public_gar"] = rel(o, ref)
    log(f"[spot] GAR bitwise {out['gar_bitwise']}, grad_w gar vs gas {out['grad_w_gar_vs_gas']:.2e}, public gar {out['public_gar']:.2e}")
    RESULTS["spot"] = out


# ------------------------------------------------------------------------ sweep
FEATS = (16, 64, 128, 256)


_DEADLINE = [math.inf]  # the sweep stops trying variants after this (perf_counter seconds)


def _greedy(name, start, space, measure, valid=lambda c: True):
    best, best_t = start, measure(start)
    trials = [dict(config=start._asdict(), ms=best_t)]
    for field, values in space:
        for v in values:
            if time.perf_counter() > _DEADLINE[0]:
                trials.append(dict(skipped=f"{field}={v}: out of sweep time"))
                continue
            cand = best._replace(**{field: v})
            if cand == best or not valid(cand):
                continue
            try:
                t = measure(cand)
            except Exception as err:  # a config Triton cannot compile: record and skip
                trials.append(dict(config=cand._asdict(), error=repr(err)[:200]))
                continue
            trials.append(dict(config=cand._asdict(), ms=t))
            if t < best_t:
                best, best_t = cand, t
    log(f"[sweep] {name}: best {best_t:.3f} ms with {best}")
    return best, best_t, trials


def _tile_space(feat):
    fs = [f for f in (16, 32, 64, 128, 256) if f <= triton_next_pow2(feat)]
    return fs


def triton_next_pow2(n):
    return 1 << (max(n, 1) - 1).bit_length()


def stage_sweep(big: Big, smoke: bool, budget_s: float):
    """Greedy search from the defaults: the strip width, the tile height, the segment
    length, L2 eviction hints, index prefetch. Each candidate is timed twice and the
    faster median kept (GAR timings are bimodal from one do_bench call to the next).
    (Source bands, tried in the third H200 run, lost everywhere: benchmarks/NOTES-spmm.md.)"""
    out = {}
    best = {}
    feats = (16,) if smoke else FEATS
    for feat in feats:
        _DEADLINE[0] = time.perf_counter() + budget_s / len(feats)
        x = big.x(feat)
        g = big.x(feat, seed=1)
        start = gar_config(feat, 4)
        space = [("block_f", [128])] if feat >= 128 else []
        space += [
            ("block_e", [max(start.block_e // 2, 1), start.block_e * 2]),
            ("seg_len", [4096]),
            ("hints", [True]),
            ("prefetch", [True]),
        ]
        if smoke:
            space = [("hints", [True])]

        def gar_measure(cfg, x=x):
            return min(bench(lambda: gar_fwd(big, x, cfg)) for _ in range(2))

        b, t, trials = _greedy(f"gar fwd F={feat}", start, space, gar_measure)
        best[f"gar_{feat}"] = b
        out[f"gar_fwd_F{feat}"] = dict(best=b._asdict(), ms=t, trials=trials)
        start = gar_config(feat, 4, dot=True)
        space = [("block_e", [max(start.block_e // 2, 1)])] if not smoke else []
        bd, td, trials = _greedy(
            f"gar bwd+dot F={feat}", start, space,
            lambda cfg: min(bench(lambda: gar_bwd(big, g, cfg, x)) for _ in range(2)),
        )
        best[f"gar_dot_{feat}"] = bd
        out[f"gar_bwd_dot_F{feat}"] = dict(best=bd._asdict(), ms=td, trials=trials)
    RESULTS["sweep"] = out
    return best


# ------------------------------------------------------------------------ time
def stage_time(big: Big, best: dict, smoke: bool, rounds: int = 3):
    """Medians of ``rounds`` interleaved do_bench medians (drift hits every variant alike)."""
    out = {}
    rows = []
    feats = (16,) if smoke else FEATS
    a32, at32 = big.cusparse[torch.int32]
    a64, at64 = big.cusparse[torch.int64]
    for feat in feats:
        x = big.x(feat)
        g = big.x(feat, seed=1)
        xb, gb = x.to(torch.bfloat16), g.to(torch.bfloat16)
        gar_cfg = best.get(f"gar_{feat}", gar_config(feat, 4))
        gar_dot = best.get(f"gar_dot_{feat}", gar_config(feat, 4, dot=True))
        gas_cfg = gas_config(feat, 4)
        w = big.w
        fns = {
            "cusparse_fwd_i32": lambda: torch.sparse.mm(a32, x),
            "cusparse_fwd_i64": lambda: torch.sparse.mm(a64, x),
            "gar_fwd": lambda: gar_fwd(big, x, gar_cfg),
            "gar_fwd_default": lambda: gar_fwd(big, x, gar_config(feat, 4)),
            "cusparse_bwd_i32": lambda: torch.sparse.mm(at32, g),
            "cusparse_bwd_i64": lambda: torch.sparse.mm(at64, g),
            "gar_bwd": lambda: gar_bwd(big, g, gar_cfg),
            "gar_bwd_dot": lambda: gar_bwd(big, g, gar_dot, x),
            "gas_fwd": lambda: gas_fwd(big, x, gas_cfg),
            "gas_bwd": lambda: gas_bwd(big, g, gas_cfg),
            "gas_bwd_runs": lambda: gas_bwd(big, g, gas_cfg._replace(runs=True)),
            "gas_bwd_dot_runs": lambda: gas_bwd(big, g, gas_cfg._replace(runs=True), x),
            "public_gar_fwd": lambda: spmm(big.graph, x, w, aggregation="gar"),
            "gar_fwd_bf16": lambda: gar_fwd(big, xb, gar_config(feat, 2)),
            "gar_bwd_bf16": lambda: gar_bwd(big, gb, gar_config(feat, 2)),
            "gar_fwd_bf16_best": lambda: gar_fwd(big, xb, gar_cfg._replace(block_f=min(2 * gar_cfg.block_f, triton_next_pow2(feat)))),
        }
        if smoke:
            fns = {k: v for k, v in fns.items() if "gas" not in k or k == "gas_fwd"}
        samples = {k: [] for k in fns}
        for _ in range(1 if smoke else rounds):
            for k, fn in fns.items():
                try:
                    samples[k].append(bench(fn))
                except RuntimeError as err:  # e.g. cuSPARSE refusing int32 indices
                    log(f"[time] {k} failed: {err}")
                    samples[k].append(math.inf)
        r = dict(F=feat, gar_config=gar_cfg._asdict(), samples=samples)
        r.update({k: statistics.median(v) for k, v in samples.items()})
        r["gar_fwd_min"] = min(samples["gar_fwd"])
        r["gar_bwd_min"] = min(samples["gar_bwd"])
        r["cusparse_fwd"] = min(r["cusparse_fwd_i32"], r["cusparse_fwd_i64"])
        r["cusparse_bwd"] = min(r["cusparse_bwd_i32"], r["cusparse_bwd_i64"])
        r["speedup_fwd"] = r["cusparse_fwd"] / r["gar_fwd"]
        r["speedup_bwd"] = r["cusparse_bwd"] / r["gar_bwd"]
        r.setdefault("gas_bwd", math.nan)
        rows.append(r)
        log(f"[time] F={feat}: " + ", ".join(
            f"{k} {v:.3f}" for k, v in r.items() if isinstance(v, float)
        ))
    out["rows"] = rows
    RESULTS["time"] = out
    return rows


# ------------------------------------------------------------------------ calibration
def stage_calib(smoke: bool, degrees=None):
    """GAS vs GAR, forward + backward (grad_x), transductive (formats and weights in
    grouped order prepared once), on coalesced power-law graphs of growing degree."""
    out = []
    n = 100 if smoke else 100_000
    degrees = degrees or ((2, 8) if smoke else (1, 2, 4, 8, 16, 32, 64, 128))
    feats = (16,) if smoke else (16, 64, 256)
    for d in degrees:
        graph = power_law_graph(n, n * d, 1.2, seed=d, coalesce=True)
        conv = wall(lambda: (lambda gg: (gg.csr, gg.csc))(Graph(graph.edge_index, n, validate=False)))
        big = Big(graph, cusparse=False)
        avg = graph.avg_degree
        for feat in feats:
            x = big.x(feat)
            g = big.x(feat, seed=1)
            gas_cfg = gas_config(feat, 4)
            t = dict(
                gas_fwd=bench(lambda: gas_fwd(big, x, gas_cfg), rep_ms=40),
                gas_bwd=bench(lambda: gas_bwd(big, g, gas_cfg), rep_ms=40),
                gas_bwd_runs=bench(lambda: gas_bwd(big, g, gas_cfg._replace(runs=True)), rep_ms=40),
                gar_fwd=bench(lambda: gar_fwd(big, x, gar_config(feat, 4)), rep_ms=40),
                gar_bwd=bench(lambda: gar_bwd(big, g, gar_config(feat, 4)), rep_ms=40),
                gar_fwd_low=bench(lambda: gar_fwd(big, x, gar_config(feat, 4, avg_degree=avg)), rep_ms=40),
                gar_bwd_low=bench(lambda: gar_bwd(big, g, gar_config(feat, 4, avg_degree=avg)), rep_ms=40),
            )
            gas = t["gas_fwd"] + min(t["gas_bwd"], t["gas_bwd_runs"])
            gar = t["gar_fwd_low"] + t["gar_bwd_low"] if avg < 32 else t["gar_fwd"] + t["gar_bwd"]
            out.append(dict(avg_degree=avg, F=feat, convert_ms=conv, gas_ms=gas, gar_ms=gar, **t))
            log(f"[calib] deg {avg:.1f} F={feat}: gas {gas:.3f} gar {gar:.3f} ms | " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()) + f" | conversion {conv:.2f} ms")
    RESULTS["calib"] = out


# ------------------------------------------------------------------------ conversion breakdown
def stage_convert_parts(graph: Graph):
    n = graph.num_nodes
    out = {}
    gen = torch.Generator(device=DEV).manual_seed(5)
    shuffled = graph.edge_index[:, torch.randperm(graph.num_edges, generator=gen, device=DEV)]
    for name, ei in (("coalesced", graph.edge_index), ("shuffled", shuffled)):
        src, dst = ei[0], ei[1]
        dst32 = dst.to(torch.int32)
        perm = torch.sort(dst32, stable=True).indices
        keys = dst32[perm]
        parts = dict(
            bincount_dst=wall(lambda: torch.bincount(dst, minlength=n)),
            bincount_src=wall(lambda: torch.bincount(src, minlength=n)),
            sorted_check=wall(lambda: bool((src[1:] >= src[:-1]).all())),
            to_int32=wall(lambda: dst.to(torch.int32)),
            sort_int32_stable=wall(lambda: torch.sort(dst32, stable=True)),
            sort_int64_stable=wall(lambda: torch.sort(dst, stable=True)),
            sort_int32_unstable=wall(lambda: torch.sort(dst32)),
            gather_other=wall(lambda: src[perm]),
            degrees_by_searchsorted=wall(lambda: torch.diff(torch.searchsorted(
                keys, torch.arange(n + 1, device=DEV, dtype=torch.int32)))),
            graph_csr=wall(lambda: Graph(ei, n, validate=False).csr),
            graph_csc=wall(lambda: Graph(ei, n, validate=False).csc),
        )
        out[name] = parts
        log(f"[convert parts] {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    RESULTS["convert_parts"] = out


# ------------------------------------------------------------------------ main
def stage_ncu(smoke: bool):
    """Run the GAR forward once without and once with L2 eviction hints at F=128 and
    F=256 (for ncu to profile)."""
    graph = stage_build(smoke)
    big = Big(graph, cusparse=False)
    for feat in (128, 256):
        x = big.x(feat)
        gar_fwd(big, x, gar_config(feat, 4))
        gar_fwd(big, x, gar_config(feat, 4)._replace(hints=True))
    sync()


def print_table(rows) -> None:
    log("\n  F | cuSPARSE fwd | GAR fwd | x     | cuSPARSE bwd | GAR bwd | x     | GAR bwd+dW | GAS fwd | GAS bwd (runs)")
    for r in rows:
        log(
            f"{r['F']:>3} | {r['cusparse_fwd']:12.3f} | {r['gar_fwd']:7.3f} | {r['speedup_fwd']:5.2f} | "
            f"{r['cusparse_bwd']:12.3f} | {r['gar_bwd']:7.3f} | {r['speedup_bwd']:5.2f} | "
            f"{r['gar_bwd_dot']:10.3f} | {r['gas_fwd']:7.3f} | {r['gas_bwd']:7.3f} ({r.get('gas_bwd_runs', math.nan):.3f})"
        )
    if "convert" in RESULTS:
        c = RESULTS["convert"]
        log("conversion csr+csc (ms): " + ", ".join(
            f"{k} {v['new_ms']:.1f} (argsort {v['argsort_ms']:.1f})" for k, v in c.items() if isinstance(v, dict)
        ))


def save(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(RESULTS, indent=1, default=str))


def sweep_main(argv: list[str], out_dir: Path, device: Callable[[], torch.device]) -> int:
    """``python -m benchmarks.run --suite agg --sweep spmm [options]`` (see :mod:`benchmarks.sweeps`)."""
    from benchmarks.report import gpu_slug

    parser = argparse.ArgumentParser(prog="python -m benchmarks.run --suite agg --sweep spmm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="check,build,convert,spot,sweep,time,calib")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, to test the script")
    parser.add_argument("--sweep-budget", type=float, default=150.0, help="seconds for the whole sweep")
    parser.add_argument("--calib-degrees", default="", help="comma-separated average degrees for calib")
    args = parser.parse_args(argv)
    stages = args.stages.split(",")
    dev = device()
    if dev.type != DEV.type:
        raise SystemExit(f"--sweep spmm runs on {DEV} here (the default CUDA device when there is one), not {dev}")
    if dev.type != "cuda" and not args.smoke:
        raise SystemExit("--sweep spmm times GPU kernels: it needs a CUDA device (--smoke runs on the CPU)")
    args.out = out_dir / f"spmm-{gpu_slug(dev)}.json"
    import triton

    RESULTS["env"] = dict(
        device=torch.cuda.get_device_name() if CUDA else platform.processor() or "cpu",
        sms=torch.cuda.get_device_properties(0).multi_processor_count if CUDA else None,
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
    )
    log(f"[env] {RESULTS['env']}")
    if CUDA:
        a = torch.empty(2**28, dtype=torch.float32, device=DEV)
        ms = bench(lambda: a.clone())
        RESULTS["env"]["copy_GBps"] = 2 * a.numel() * 4 / ms / 1e6
        log(f"[env] device-to-device copy {RESULTS['env']['copy_GBps']:.0f} GB/s (read + write)")
        del a
    t0 = time.perf_counter()
    try:
        if "check" in stages:
            stage_check(args.smoke)
            save(args.out)
        big = best = None
        if any(s in stages for s in ("build", "convert", "spot", "sweep", "time")) and "ncu" not in stages:
            graph = stage_build(args.smoke)
            if "convert" in stages:
                stage_convert(graph, args.smoke)
                stage_convert_parts(graph)
                save(args.out)
            big = Big(graph)
        if "spot" in stages:
            stage_spot(big)
            save(args.out)
        best = {}
        if "sweep" in stages:
            best = stage_sweep(big, args.smoke, args.sweep_budget)
            save(args.out)
        rows = stage_time(big, best, args.smoke) if "time" in stages else []
        save(args.out)
        print_table(rows)
        del big
        if "calib" in stages:
            stage_calib(args.smoke, tuple(int(d) for d in args.calib_degrees.split(",")) if args.calib_degrees else None)
        if "ncu" in stages:
            stage_ncu(args.smoke)
    finally:
        RESULTS["elapsed_s"] = time.perf_counter() - t0
        save(args.out)
    log(f"elapsed {RESULTS['elapsed_s']:.0f} s")
    return 0
