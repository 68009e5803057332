"""Where the attention paths' time goes on a GPU: host overhead per call against GPU time.

    python -m benchmarks.attention_overhead_gpu --out $OUT      # ~2 min on an H200

For a few suite cases (B4 H12 D64 bf16; masks of :mod:`benchmarks.attention`) and modes
``fwd`` / ``fwdbwd``, per backend (``sdpa`` without a mask, ``sdpa-mask`` with the boolean
mask, ``flex`` compiled FlexAttention, ``auto`` = ``sparse_attention``, ``block`` =
``sparse_attention(aggregation="block")``, ``direct`` = ``block_sparse_attention`` on a
prebuilt layout; ``direct-slow`` the same with ``FUSEGNN_FAST_LAUNCH=0``, every launch
through Triton's binder, see :mod:`fusegnn.kernels._launch`):

* ``ms``: the suite's timing (:func:`benchmarks.measure.measure`: device synchronised
  before each step, CUDA events around it, median);
* ``host_us``: host microseconds per call in a loop that never waits for the GPU
  (launch-bound code shows ``host_us`` close to ``ms``);
* ``loop_us``: the same loop's microseconds per call including the final synchronise
  (the throughput a training loop would see).

Then a torch.profiler table of one ``fwdbwd`` step of ``direct`` and ``flex`` per case
(GPU kernel time per kernel) and host timings of the block kernel's pieces (``_forward``,
``_backward`` without autograd; one forward launch through Triton's binder and through the
cached relaunch). Every backend's output is checked against the dense
masked reference first (bf16 tolerance). Writes ``overhead.json`` and ``overhead.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.attention import GPU_SIZES, _compiled_flex, build_mask
from benchmarks.measure import measure
from benchmarks.tee import Tee

CASES = (("window", 1024), ("dilated", 1024), ("bigbird", 1024), ("window", 4096), ("dilated", 4096), ("window", 16384))


def _inputs(L: int):
    gen = torch.Generator(device="cpu").manual_seed(0)
    shape = (GPU_SIZES.batch, GPU_SIZES.heads, L, GPU_SIZES.head_dim)
    return [torch.randn(shape, generator=gen).to("cuda", GPU_SIZES.dtype) for _ in range(4)]


def _phases(fn, q, k, v, grad, mode):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if mode == "fwd":
        return lambda: fn(q, k, v)

    def step():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(grad)

    return step


def _host_us(step, n: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / n * 1e6


def _backends(mask, L):
    from torch.nn.attention.flex_attention import create_block_mask

    from fusegnn.kernels.block_attention import block_sparse_attention
    from fusegnn.sparse.sparse_attention import _layout_of, sparse_attention

    dense = mask.dense("cuda")
    layout = _layout_of(mask, None, torch.device("cuda"))
    block_mask = create_block_mask(mask.mask_mod, None, None, L, L, device="cuda")
    flex = _compiled_flex()
    return {
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v)),
        "sdpa-mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)),
        "flex": (lambda q, k, v: flex(q, k, v, block_mask=block_mask)),
        "auto": (lambda q, k, v: sparse_attention(q, k, v, mask)),
        "block": (lambda q, k, v: sparse_attention(q, k, v, mask, aggregation="block")),
        "direct": (lambda q, k, v: block_sparse_attention(q, k, v, layout)),
        "direct-slow": (lambda q, k, v: block_sparse_attention(q, k, v, layout)),
    }, dense, layout


#: environment of a backend's timing (restored afterwards)
_ENV = {"direct-slow": {"FUSEGNN_FAST_LAUNCH": "0"}}


class _Env:
    def __init__(self, values: dict) -> None:
        self.values, self.saved = values, {}

    def __enter__(self):
        for name, value in self.values.items():
            self.saved[name] = os.environ.get(name)
            os.environ[name] = value

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _check(fn, q, k, v, dense) -> float:
    ref = F.scaled_dot_product_attention(q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float(), attn_mask=dense)
    out = fn(q, k, v)[:1, :2].float()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _profile_table(step, label: str, emit) -> None:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    emit(f"--- profiler, 3 steps: {label}")
    emit(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


class _Bare(torch.autograd.Function):
    """The block path's autograd shape with no kernels: the forward allocates ``out`` and
    ``lse`` and saves five tensors, the backward allocates ``dq``, ``dk``, ``dv`` and
    ``delta`` -- the floor of a Python autograd.Function step."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _bare_function_step(q, k, v, grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def step():
        q.grad = k.grad = v.grad = None
        _Bare.apply(q, k, v)[0].backward(grad)

    return step


def _pieces(q, k, v, grad, layout, emit) -> dict:
    """Host microseconds of the block kernel's forward and backward launches alone, and
    of one forward launch with and without Triton's binder."""
    from fusegnn.kernels import _launch as fl
    from fusegnn.kernels import block_attention as ba

    scale = q.shape[-1] ** -0.5
    out, lse = ba._forward(q, k, v, layout, scale, "tf32")
    ba._backward(grad, q, k, v, out, lse, layout, scale, "tf32", True, True)
    res = {}
    for env in ("1", "0"):
        with _Env({"FUSEGNN_FAST_LAUNCH": env}):
            tag = "" if env == "1" else " (binder)"
            res["_forward" + tag] = _host_us(lambda: ba._forward(q, k, v, layout, scale, "tf32"), 200)
            res["_backward" + tag] = _host_us(
                lambda: ba._backward(grad, q, k, v, out, lse, layout, scale, "tf32", True, True), 200
            )
    prep = ba._prepare(layout, q.device)
    (spec, *_), plan = next((key, p) for key, p in prep.plans.items() if key[0][0] == "fwd")
    args = (q, k, v, out, lse, *plan.args)

    def binder():
        ba._fwd[plan.grid](*args, **plan.meta, num_warps=plan.warps, num_stages=plan.stages)

    def cached():
        fl.launch(ba._fwd, plan.grid, args, plan.meta, plan.warps, plan.stages, spec, q.device)

    res["one fwd launch, Triton's binder"] = _host_us(binder, 200)
    res["one fwd launch, cached relaunch"] = _host_us(cached, 200)
    res["torch.empty_like x3"] = _host_us(lambda: [torch.empty_like(q) for _ in range(3)], 200)
    res["autograd.Function fwd+bwd, no kernels"] = _host_us(_bare_function_step(q, k, v, grad), 200)
    for name, (h, t) in res.items():
        emit(f"  {name:36s} host {h:8.1f} us   loop {t:8.1f} us")
    emit(f"  fast launch enabled: {fl.fast_launch_enabled()}, cached kernels: {len(fl._CACHE)}")
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cases", nargs="*", default=None,
                        help="mask-L names to run (e.g. window-1024 dilated-4096); default: all")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    emit = Tee(args.out / "overhead.log")

    emit(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    import triton

    emit(f"triton {triton.__version__}")
    records = []
    for name, L in CASES:
        if args.cases and f"{name}-{L}" not in args.cases:
            continue
        mask = build_mask(name, L)
        q, k, v, grad = _inputs(L)
        fns, dense, layout = _backends(mask, L)
        for backend, fn in fns.items():
            err = None if backend == "sdpa" else _check(fn, q, k, v, dense)
            for mode in ("fwd", "fwdbwd"):
                step = _phases(fn, q, k, v, grad, mode)
                with _Env(_ENV.get(backend, {})):
                    ms = measure([step], torch.device("cuda"), steps=args.steps, warmup=5, launches=False).ms[0]
                    host, loop = _host_us(step, 50)
                rec = dict(case=f"{name}-L{L}-{mode}", backend=backend, ms=ms, host_us=host, loop_us=loop, rel_err=err)
                records.append(rec)
                emit(f"{rec['case']:22s} {backend:10s} ms {ms:8.3f}  host_us {host:8.1f}  loop_us {loop:8.1f}"
                     + (f"  err {err:.1e}" if err is not None else ""))
        if L in (1024, 16384) and name == "window":
            for backend in ("direct", "flex", "sdpa-mask"):
                _profile_table(_phases(fns[backend], q, k, v, grad, "fwdbwd"), f"{name}-L{L} fwdbwd {backend}", emit)
            emit(f"--- block kernel pieces, {name}-L{L} (no autograd)")
            records.append(dict(case=f"{name}-L{L}", pieces=_pieces(q, k, v, grad, layout, emit)))
        del fns
        torch.cuda.empty_cache()
    (args.out / "overhead.json").write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
