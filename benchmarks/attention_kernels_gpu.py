"""Per-kernel launch sweep of the block-sparse attention kernels on a GPU.

    python -m benchmarks.run --out $OUT --suite attention --sweep kernels   # ~2-3 min on an H200

(options after ``--sweep kernels`` are this sweep's, below).

For suite masks (B4 H12 D64 bf16, 64 x 64 layout; :mod:`benchmarks.attention`), each of
the three kernels is timed on its own with ``triton.testing.do_bench`` (median over
repeats, GPU-bound sizes):

* ``fwd``: ``_forward`` at ``num_warps`` x ``num_stages``;
* ``dq``: ``_backward(need_dq=True, need_dkdv=False)`` = the dq kernel (it also computes
  Delta) at its own warps x stages x ``dq_sub_n``;
* ``dkdv``: ``_backward(need_dq=False, need_dkdv=True)`` = the Delta preprocess (same in
  every row) + the dK/dV kernel at warps x stages x ``dkdv_sub_m``;

each with Triton's ``maxnreg`` register cap (:class:`LaunchConfig` ``*_maxnreg``).

``--table-only`` times only the launch table's configuration; ``--bands both`` times each
kernel with the diagonal-band masking of partial blocks and with loaded element patterns
(``FUSEGNN_BAND_PATTERNS``, see :mod:`fusegnn.kernels.block_attention`; ``on`` / ``off``:
one of them). Every configuration's outputs are checked against float32 SDPA with the dense mask on
batch 0, heads 0-1 first (``rel_err``; a failed check is reported and not timed). The
compiled kernel's registers and spills are printed. Writes ``<out>/attention/kernels-<gpu>.json``
and ``<out>/attention/raw/kernels-<gpu>.log`` (harness ``--out``, default ``benchmarks/results``); the last lines are the best configuration per kernel (geometric mean of
``ms / best ms`` over the cases) and the table's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.attention import GPU_SIZES, build_mask
from benchmarks.tee import Tee

CASES = (("window", 16384), ("dilated", 16384), ("longformer", 16384), ("bigbird", 16384), ("window", 4096))
# fwd (num_warps, num_stages, maxnreg); dq and dkdv (num_warps, num_stages, sub-tile,
# maxnreg). 8 warps on 64 x 64 tiles ran 1.7-3.7x slower in the first sweep
# (benchmarks/results/attention/kernels-sweep1-nvidia-h200.log), dkdv sub-tiles of 16
# and 2 stages 1.1-1.4x slower in the second (kernels-sweep2-nvidia-h200.log).
FWD = [(4, s, r) for s in (2, 3) for r in (None, 96, 80)]
DQ = [(4, s, n, r) for (s, n) in ((2, 64), (4, 32)) for r in (None, 112, 96)]
DKDV = [(4, s, 32, r) for s in (3, 4) for r in (None, 128, 112, 96)]


def _rel(x, ref) -> float:
    return ((x.float() - ref).abs().max() / ref.abs().max()).item()


def sweep_main(argv: list[str], out_dir: Path, device: Callable[[], torch.device]) -> int:
    """``python -m benchmarks.run --suite attention --sweep kernels [options]`` (see
    :mod:`benchmarks.sweeps`)."""
    import triton.testing

    from fusegnn.kernels import block_attention as ba
    from fusegnn.attention.block_layout import BlockLayout

    parser = argparse.ArgumentParser(prog="python -m benchmarks.run --suite attention --sweep kernels",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(f"{m}-{L}" for m, L in CASES))
    parser.add_argument("--rtol", type=float, default=0.03)
    parser.add_argument("--table-only", action="store_true", help="time the launch table's configuration only")
    parser.add_argument("--bands", choices=("on", "off", "both"), default="on",
                        help="band masking of partial blocks (FUSEGNN_BAND_PATTERNS)")
    args = parser.parse_args(argv)
    dev = device()
    if dev.type != "cuda":
        raise SystemExit("--sweep kernels times compiled GPU kernels: it needs a CUDA device")
    from benchmarks.report import gpu_slug

    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    result_json = out_dir / f"kernels-{gpu_slug(dev)}.json"
    emit = Tee(out_dir / "raw" / f"kernels-{gpu_slug(dev)}.log")

    compiled: list = []
    original_launch = ba._launch

    def recording_launch(*a, **kw):
        c = original_launch(*a, **kw)
        compiled.append(c)
        return c

    ba._launch = recording_launch
    emit(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    base = ba.launch_config(64, 64, 64)
    emit(f"table (64x64, D64): {base}")
    records = []
    flags = {"on": ["1"], "off": ["0"], "both": ["1", "0"]}[args.bands]
    for spec, flag in ((spec, flag) for spec in args.cases.split(",") for flag in flags):
        name, L = spec.rsplit("-", 1)
        L = int(L)
        mask = build_mask(name, L)
        os.environ["FUSEGNN_BAND_PATTERNS"] = flag
        layout = BlockLayout.from_mask(mask, 64, 64, dev)  # fresh: its kernel arrays follow the flag
        bands = layout.prepared(dev).all_bands
        emit(f"{spec}: band masking {'on' if bands else 'off'} (FUSEGNN_BAND_PATTERNS={flag})")
        gen = torch.Generator(device="cpu").manual_seed(0)
        shape = (GPU_SIZES.batch, GPU_SIZES.heads, L, GPU_SIZES.head_dim)
        q, k, v, g = (torch.randn(shape, generator=gen).to(dev, GPU_SIZES.dtype) for _ in range(4))
        scale = 1 / math.sqrt(q.shape[-1])
        dense = mask.dense(dev)
        sl = [t[:1, :2].float().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*sl, attn_mask=dense)
        ref.backward(g[:1, :2].float())
        ref_grads = [t.grad for t in sl]
        out, lse = ba._forward(q, k, v, layout, scale, "tf32", base)

        def cfg(fwd=None, dq=None, dkdv=None):
            return ba.LaunchConfig(
                fwd[0] if fwd else base.fwd_warps, fwd[1] if fwd else base.fwd_stages,
                dkdv[0] if dkdv else base.bwd_warps, dkdv[1] if dkdv else base.bwd_stages,
                dq_warps=dq[0] if dq else base.dq[0], dq_stages=dq[1] if dq else base.dq[1],
                dkdv_sub_m=dkdv[2] if dkdv else base.dkdv_sub_m,
                dq_sub_n=dq[2] if dq else base.dq_sub_n,
                fwd_maxnreg=fwd[2] if fwd else base.fwd_maxnreg,
                dq_maxnreg=dq[3] if dq else base.dq_maxnreg,
                dkdv_maxnreg=dkdv[3] if dkdv else base.dkdv_maxnreg,
            )

        def run(kernel, c):
            if kernel == "fwd":
                return lambda: ba._forward(q, k, v, layout, scale, "tf32", c)
            need_dq = kernel == "dq"
            return lambda: ba._backward(g, q, k, v, out, lse, layout, scale, "tf32", need_dq, not need_dq, c)

        def check(kernel, c) -> float:
            if kernel == "fwd":
                o, _ = run(kernel, c)()
                return _rel(o[:1, :2], ref.detach())
            dq, dk, dv = run(kernel, c)()
            if kernel == "dq":
                return _rel(dq[:1, :2], ref_grads[0])
            return max(_rel(dk[:1, :2], ref_grads[1]), _rel(dv[:1, :2], ref_grads[2]))

        for kernel, space in (("fwd", FWD), ("dq", DQ), ("dkdv", DKDV)):
            for point in ([None] if args.table_only else space):
                c = cfg(**{kernel: point})
                compiled.clear()
                try:
                    err = check(kernel, c)
                except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                    emit(f"{spec:18s} {kernel:5s} {point} error {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                regs = [(getattr(x, "n_regs", None), getattr(x, "n_spills", None)) for x in compiled]
                if not err < args.rtol:
                    emit(f"{spec:18s} {kernel:5s} {point} WRONG rel_err {err:.2e}")
                    records.append(dict(case=spec, kernel=kernel, config=point and list(point), ms=None, rel_err=err,
                                        bands=bands))
                    continue
                ms = triton.testing.do_bench(run(kernel, c), warmup=25, rep=100, return_mode="median")
                records.append(dict(case=spec, kernel=kernel, config=point and list(point), ms=ms, rel_err=err,
                                    regs=regs, bands=bands))
                emit(f"{spec:18s} {kernel:5s} {str(point or 'table'):14s} {ms:8.4f} ms  err {err:.1e}  "
                     f"regs/spills {regs}  bands {bands}")
        del q, k, v, g, out, lse
        torch.cuda.empty_cache()

    if args.table_only:
        result_json.write_text(json.dumps({"records": records}, indent=1))
        ba._launch = original_launch
        return 0
    emit("--- best per kernel (geometric mean of ms / case best)")
    summary = {}
    for kernel in ("fwd", "dq", "dkdv"):
        rows = [r for r in records if r["kernel"] == kernel and r["ms"] is not None]
        best_case = {}
        for r in rows:
            best_case[r["case"]] = min(best_case.get(r["case"], math.inf), r["ms"])
        scores = {}
        for point in {tuple(r["config"]) for r in rows}:
            ratios = [r["ms"] / best_case[r["case"]] for r in rows if tuple(r["config"]) == point]
            if len(ratios) == len(best_case):
                scores[point] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        ranked = sorted(scores.items(), key=lambda kv: kv[1])
        summary[kernel] = [[list(p), s] for p, s in ranked]
        emit(f"{kernel}: " + ", ".join(f"{p} {s:.3f}" for p, s in ranked[:5]))
    result_json.write_text(json.dumps({"records": records, "summary": summary}, indent=1))
    ba._launch = original_launch
    return 0

