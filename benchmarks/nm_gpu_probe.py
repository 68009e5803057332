"""GPU probe of the N:M block-attention kernels (issue 19): forward and backward of
``block_sparse_attention(..., nm=...)`` against the float64 reference, per dtype, length,
block size, N:M pattern and selection path.

    python3 benchmarks/nm_gpu_probe.py           # about 20 compiled variants, < 60 s on an H100
    python3 benchmarks/nm_gpu_probe.py --all     # every pattern for every dtype
    TRITON_INTERPRET=1 python3 benchmarks/nm_gpu_probe.py --device cpu --max-L 256  # smoke run

``min_chunk`` is ``fusegnn.kernels.block_attention.NM_MIN_CHUNK`` for the run: ``1`` is
the chunk path everywhere (the N:M key-order kernels before the fix, which gave wrong
16-bit outputs with 16-key tiles on an H100), ``8`` the default (tiles whose chunks
would be narrower than 8 columns select in key order). Where both give the same kernels
(every chunk >= 8 columns) only ``8`` runs. ``q`` and ``k`` are integer-valued (``q /
4``: exact float32 scores, so the kept sets are the reference's, ties included); errors
are the largest absolute difference over the largest reference magnitude, for the
output and each gradient. A row fails above its dtype's bound (float32 1e-4, float16
1e-2, bfloat16 5e-2)."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fusegnn first

import fusegnn.kernels.block_attention as ba  # noqa: E402
from fusegnn.attention.block_layout import BlockLayout  # noqa: E402
from fusegnn.attention.masks import bigbird, sliding_window  # noqa: E402
from fusegnn.attention.sparse_attention import masked_attention_reference  # noqa: E402
from fusegnn.kernels.nm_sparsity import NM_PATTERNS  # noqa: E402

BOUND = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}

#: (L, head dim, block size, mask): the failing test's shape, a 32 x 32 layout, the suite's
SHAPES = [
    (48, 16, 16, lambda L: bigbird(L, 3, 4, 16, 0.15, seed=0)),
    (256, 64, 32, lambda L: bigbird(L, 24, 16, 32, 0.1, seed=0)),
    (1024, 64, 64, lambda L: sliding_window(L, L)),
]


def _chunks(block: int, m: int, launch: ba.LaunchConfig) -> set[int]:
    """The chunk widths (columns) of the kernels' N:M tiles for ``block x block`` layouts."""
    return {block // m, launch.sub_n(block) // m}


def _inputs(L: int, D: int, dtype: torch.dtype, device: torch.device, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randint(-1, 2, (1, 2, L, D), generator=gen).float() for _ in range(2))
    v, g = (torch.randn(1, 2, L, D, generator=gen) for _ in range(2))
    q = q / 4  # exact: the scores stay exact, the softmax less peaked
    return [t.to(device, dtype) for t in (q, k, v, g)]


def _run_case(L, D, block, mask, nm, dtype, device) -> list[float]:
    q, k, v, g = _inputs(L, D, dtype, device)
    layout = BlockLayout.from_mask(mask, block, block, device)  # fresh: plans built with NM_MIN_CHUNK
    q2, k2, v2 = (t.detach().requires_grad_() for t in (q, k, v))
    out = ba.block_sparse_attention(q2, k2, v2, layout, nm=nm, allow_tf32=False)
    out.backward(g)
    qd, kd, vd = (t.detach().cpu().double().requires_grad_() for t in (q, k, v))
    ref = masked_attention_reference(qd, kd, vd, mask.dense(), 1.0 / math.sqrt(D), nm)
    ref.backward(g.cpu().double())
    errors = []
    for got, want in ((out, ref), (q2.grad, qd.grad), (k2.grad, kd.grad), (v2.grad, vd.grad)):
        scale = want.abs().max().item() or 1.0
        errors.append((got.detach().cpu().double() - want.detach()).abs().max().item() / scale)
    return errors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every N:M pattern for every dtype")
    parser.add_argument("--max-L", type=int, default=1024, help="skip longer shapes (CPU smoke runs)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (needs TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    print(f"# {name} torch {torch.__version__}")
    print(f"{'dtype':9} {'L':>5} {'block':>5} {'nm':>4} {'min_chunk':>9} {'chunks':>7} "
          f"{'out':>9} {'dq':>9} {'dk':>9} {'dv':>9}  verdict")
    failed = 0
    start = time.perf_counter()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for L, D, block, make_mask in (s for s in SHAPES if s[0] <= args.max_L):
            mask = make_mask(L)
            patterns = NM_PATTERNS if (args.all or dtype == torch.bfloat16) else ((2, 4),)
            for nm in patterns:
                launch = ba.launch_config(block, block, D, dtype, nm)
                chunks = _chunks(block, nm[1], launch)
                for min_chunk in (1, 8) if min(chunks) < 8 else (8,):
                    ba.NM_MIN_CHUNK = min_chunk
                    try:
                        errors = _run_case(L, D, block, mask, nm, dtype, device)
                        ok = max(errors) < BOUND[dtype]
                        row = " ".join(f"{e:9.2e}" for e in errors)
                    except Exception as exc:  # a compile error is a result too
                        ok, row = False, f"{type(exc).__name__}: {exc}"[:80]
                    failed += not ok
                    chunk_text = ",".join(map(str, sorted(chunks)))
                    print(f"{str(dtype).replace('torch.', ''):9} {L:5d} {block:5d} {nm[0]}:{nm[1]:<2} {min_chunk:9d} "
                          f"{chunk_text:>7} {row}  {'ok' if ok else 'FAIL'}", flush=True)
    ba.NM_MIN_CHUNK = 8
    print(f"# {failed} failed, {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
