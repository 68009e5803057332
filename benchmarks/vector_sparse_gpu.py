"""GPU check and timing of the vector-sparse kernels (issue #17), under a minute on an H100.

Run from the repository root on a CUDA machine::

    PYTHONUNBUFFERED=1 python -m benchmarks.vector_sparse_gpu [--out benchmarks/results]

Cases (bf16, medians of CUDA-event timings after a warm-up; every output checked against
a float32 reference first):

* ``linear-4096x4096-n256-s90-v8``: ``A @ B`` with ``A`` 4096 x 4096 magnitude-pruned to
  90% in V = 8 vectors, ``B`` 4096 x 256: ``vspmm`` (forward, and its backward: dB and
  dvalues), ``window_spmm`` (the same matrix as row windows of 16 / 32 rows),
  ``torch.sparse.mm`` on CSR (cuSPARSE) and dense ``torch.mm`` (cuBLAS);
* ``agg-reddit0.1-f{128,256}[-rcm]``: ``A @ X`` on ``generate_reddit_like(scale=0.1)``
  (``--feats``, default F = 128 and 256), original and reverse-Cuthill-McKee ordering:
  ``window_spmm`` (W = 16 / 32), ``fusegnn.sparse.spmm`` (automatic aggregation, and
  ``aggregation="gar"`` / ``"window"``) and cuSPARSE, the reordering and window build
  times reported apart; then forward + backward (``dX``) of ``spmm`` with ``"window"`` /
  ``"gar"`` against cuSPARSE (``A`` and ``A^T`` as CSR), with the graph's
  :func:`~fusegnn.sparse.window_tile_density` (the input of the future automatic choice
  of ``"window"``, :mod:`fusegnn.sparse.dispatch`).

Prints a table; writes ``<out>/vector_sparse/<gpu-slug>.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.report import gpu_slug
from fusegnn.datasets import generate_reddit_like
from fusegnn.sparse import Graph, RowWindows, VectorSparse, spmm, vsddmm, vspmm, window_spmm, window_tile_density


def median_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def check(case: str, backend: str, out: torch.Tensor, ref: torch.Tensor, tol: float = 2e-2) -> None:
    err = rel_err(out, ref)
    if not err <= tol:
        raise AssertionError(f"{case} / {backend}: relative error {err:.3g} > {tol}")


def linear_case(rows: list, dev: torch.device) -> None:
    case = "linear-4096x4096-n256-s90-v8"
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(4096, 4096, device=dev, generator=g)
    A32 = VectorSparse.prune(w, 0.9, 8)
    dense32 = A32.to_dense()
    A = A32.to(dtype=torch.bfloat16)
    b = torch.randn(4096, 256, device=dev, generator=g).bfloat16()
    ref = dense32 @ b.float()
    dense = dense32.bfloat16()
    windows = {W: RowWindows.from_dense(dense, W) for W in (16, 32)}
    csr = dense.to_sparse_csr()
    fns = {
        "vspmm": lambda: vspmm(A, b),
        "window16": lambda: window_spmm(windows[16], b),
        "window32": lambda: window_spmm(windows[32], b),
        "cublas": lambda: dense @ b,
    }
    try:
        fns["cusparse"] = lambda: torch.sparse.mm(csr, b)
        fns["cusparse"]()
    except RuntimeError as exc:  # bf16 CSR SpMM not in this build
        print(f"cusparse bf16 skipped: {exc}")
        fns.pop("cusparse")
    for name, fn in fns.items():
        check(case, name, fn(), ref)
        rows.append({"case": case, "backend": name, "ms": median_ms(fn)})
    # backward of vspmm: dB = A^T G (vspmm_t) and dvalues = vsddmm(G, B)
    go = torch.randn(4096, 256, device=dev, generator=g).bfloat16()
    check(case, "vspmm-dB", vspmm(A.T, go), dense32.t() @ go.float())
    check(case, "vspmm-dvalues", A.with_values(vsddmm(go, b, A)).to_dense(), (go.float() @ b.float().t()) * A.mask())
    rows.append({"case": case, "backend": "vspmm-dB", "ms": median_ms(lambda: vspmm(A.T, go))})
    rows.append({"case": case, "backend": "vspmm-dvalues", "ms": median_ms(lambda: vsddmm(go, b, A))})
    rows.append({"case": case, "backend": "cublas-bwd(2 mm)", "ms": median_ms(lambda: (dense.t() @ go, go @ b.t()))})


def graph_case(rows: list, dev: torch.device, feat: int = 128) -> None:
    data = generate_reddit_like(scale=0.1, device=dev)
    base = Graph(data.edge_index, data.num_nodes) if hasattr(data, "edge_index") else data.graph
    t0 = time.perf_counter()
    rcm, perm = base.reorder("rcm")
    reorder_s = time.perf_counter() - t0
    x = torch.randn(base.num_nodes, feat, device=dev).bfloat16()
    for label, graph, xx in (("", base, x), ("-rcm", rcm, x[perm])):
        case = f"agg-reddit0.1-f{feat}{label}"
        adj = graph.to_dense()
        ref = adj @ xx.float()
        csr = adj.to_sparse_csr()
        del adj
        fns = {"fusegnn-spmm": lambda g=graph, v=xx: spmm(g, v)}
        for aggregation in ("gar", "window"):
            fns[f"spmm-{aggregation}"] = lambda g=graph, v=xx, a=aggregation: spmm(g, v, aggregation=a)
        for W in (16, 32):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            win = RowWindows.from_graph(graph, W, dtype=torch.bfloat16)
            torch.cuda.synchronize()
            rows.append({"case": case, "backend": f"window{W}-build", "ms": 1e3 * (time.perf_counter() - t0),
                         "tile_density": win.tile_density, "vectors": win.num_vectors})
            fns[f"window{W}"] = lambda w=win, v=xx: window_spmm(w, v)
        try:
            csr_bf = csr.to(torch.bfloat16)
            torch.sparse.mm(csr_bf, xx)
            fns["cusparse"] = lambda c=csr_bf, v=xx: torch.sparse.mm(c, v)
        except RuntimeError:
            fns["cusparse-fp32"] = lambda c=csr, v=xx.float(): torch.sparse.mm(c, v)
        for name, fn in fns.items():
            check(case, name, fn(), ref)
            rows.append({"case": case, "backend": name, "ms": median_ms(fn)})
        del ref
        rows.append({"case": case, "backend": "window-tile-density", "ms": 0.0,
                     "tile_density": window_tile_density(graph)})
        training_rows(rows, case, graph, xx)
    rows.append({"case": f"agg-reddit0.1-f{feat}-rcm", "backend": "rcm-reorder(host)", "ms": 1e3 * reorder_s})


def training_rows(rows: list, case: str, graph: Graph, x: torch.Tensor) -> None:
    """Forward + backward (``dX = A^T G``) of ``spmm`` with ``"window"`` and ``"gar"`` (in
    ``x``'s dtype), and of the ``agg`` suite's cuSPARSE op (``A`` and ``A^T`` as float32 CSR)."""
    from benchmarks.backends import AGG_BACKENDS

    go = torch.randn_like(x)
    ref = spmm(graph.reversed(), go.float(), aggregation="gar")
    cusparse = AGG_BACKENDS["cusparse"].prepare(graph)
    fns = {f"fwd+bwd spmm-{a}": (lambda v, a=a: spmm(graph, v, aggregation=a), x) for a in ("window", "gar")}
    fns["fwd+bwd cusparse-fp32"] = (cusparse, x.float())
    for name, (op, v) in fns.items():
        v = v.detach().clone().requires_grad_(True)

        def step(op=op, v=v):
            v.grad = None
            op(v).backward(go.to(v.dtype))

        step()
        check(case, name + " dX", v.grad, ref)
        rows.append({"case": case, "backend": name, "ms": median_ms(step)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--feats", default="128,256", help="feature widths of the graph cases (comma-separated)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")
    dev = torch.device("cuda")
    start = time.perf_counter()
    rows: list = []
    linear_case(rows, dev)
    for feat in (int(f) for f in args.feats.split(",")):
        graph_case(rows, dev, feat)
    print(f"{'case':34s} {'backend':22s} {'ms':>10s}  extra")
    for r in rows:
        extra = {k: v for k, v in r.items() if k not in ("case", "backend", "ms")}
        print(f"{r['case']:34s} {r['backend']:22s} {r['ms']:10.4f}  {extra if extra else ''}")
    path = Path(args.out) / "vector_sparse" / f"{gpu_slug(dev)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                                "rows": rows, "wall_s": time.perf_counter() - start}, indent=1))
    print(f"wrote {path} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
