"""GPU probe of the N:M block-attention kernels (issue 19): forward and backward of
``block_sparse_attention(..., nm=...)`` against the float64 reference, per dtype, block
size (16, 32, 64: the selection tiles' rows), N:M pattern and selection gate, with the
selection each kernel took.

    python3 benchmarks/nm_gpu_probe.py            # 11 variants in parallel processes, < 60 s on an H100
    python3 benchmarks/nm_gpu_probe.py --all      # every pattern, gate and forced chunks for every dtype
    TRITON_INTERPRET=1 python3 benchmarks/nm_gpu_probe.py --device cpu --max-L 256  # smoke run

``gate`` is the selection rule of the run: ``gate`` the kernels' own
(:func:`fusegnn.kernels.block_attention.nm_chunk_path`: the chunk path only on selection
tiles of >= ``NM_MIN_ROWS`` = 64 rows with chunks of >= ``NM_MIN_CHUNK`` = 8 columns),
``chunks`` the chunk path on every tile (``NM_MIN_ROWS = NM_MIN_CHUNK = 1``: the N:M
key-order kernels before the gate, which gave wrong 16-bit outputs on 16-row tiles on an
H100). ``paths`` is each kernel's selection (``C`` chunks, ``G`` grouped = key order) on
its tile: forward ``BM x BN``, dQ ``BM x SUB_N``, dK/dV ``SUB_M x BN``
(:func:`~fusegnn.kernels.block_attention.nm_selection_tiles`).

By default every dtype runs 2:4 through the gate at each block size, plus bfloat16 with
forced chunks at block 16 with 1:2 and at block 32 with 2:4 (8-column chunks: a control
that the probe still sees the failure, and whether 32-row tiles fail too); ``--all``
runs every pattern through both gates where they differ. The exit status is 1 when a
variant fails through the kernels' gate (forced-chunk failures are reported, not
counted). ``q`` and ``k`` are integer-valued (``q / 4``: exact float32 scores, so the
kept sets are the reference's, ties included); errors are the largest absolute
difference over the largest reference magnitude, for the output and each gradient. A
row fails above its dtype's bound (float32 1e-4, float16 1e-2, bfloat16 5e-2). Each
variant compiles its own three kernels, so the variants run in ``--jobs`` processes
(compilation is the time)."""

from __future__ import annotations

import argparse
import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's fusegnn first

import fusegnn.kernels.block_attention as ba  # noqa: E402
from fusegnn.attention.block_layout import BlockLayout  # noqa: E402
from fusegnn.attention.masks import bigbird  # noqa: E402
from fusegnn.attention.sparse_attention import masked_attention_reference  # noqa: E402
from fusegnn.kernels.nm_sparsity import NM_PATTERNS  # noqa: E402

BOUND = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
DTYPES = ("float32", "bfloat16", "float16")

#: block size -> (L, head dim, mask): the failing test's shape (16), a 32 x 32 layout,
#: the launch table's 64 x 64 (head dim 64: its sub-tiles and register caps); partial
#: and full blocks, a ragged last block at 1000
SHAPES = {
    16: (48, 16, lambda L: bigbird(L, 3, 4, 16, 0.15, seed=0)),
    32: (256, 64, lambda L: bigbird(L, 24, 16, 32, 0.1, seed=0)),
    64: (1000, 64, lambda L: bigbird(L, 100, 64, 64, 0.05, seed=0)),
}

#: gate name -> (NM_MIN_ROWS, NM_MIN_CHUNK)
GATES = {"gate": (ba.NM_MIN_ROWS, ba.NM_MIN_CHUNK), "chunks": (1, 1)}


#: the default run's forced-chunk controls (bfloat16): 16 rows with 8-column chunks (the
#: H100 failure that chunk width alone did not explain), 32 rows with 8-column chunks
CONTROLS = (("bfloat16", 16, (1, 2), "chunks"), ("bfloat16", 32, (2, 4), "chunks"))


def variants(all_variants: bool, max_L: int) -> list[tuple[str, int, tuple[int, int], str]]:
    """``(dtype, block, nm, gate)`` of the run. With ``all_variants`` every pattern of
    every dtype and block through both gates, skipping forced chunks where the gate
    gives the same kernels (every tile already on the chunk path); else 2:4 through the
    gate, plus :data:`CONTROLS`."""
    out = []
    for dtype in DTYPES:
        for block, (L, D, _) in SHAPES.items():
            for nm in NM_PATTERNS if all_variants else ((2, 4),):
                out.append((dtype, block, nm, "gate"))
                if all_variants and _paths(block, D, dtype, nm, "chunks") != _paths(block, D, dtype, nm, "gate"):
                    out.append((dtype, block, nm, "chunks"))
    if not all_variants:
        out += CONTROLS
    return [v for v in out if SHAPES[v[1]][0] <= max_L]


def _paths(block: int, D: int, dtype: str, nm: tuple[int, int], gate: str) -> str:
    """Each kernel's selection under ``gate`` (``fwd:C dq:C dkdv:G``)."""
    saved = ba.NM_MIN_ROWS, ba.NM_MIN_CHUNK
    ba.NM_MIN_ROWS, ba.NM_MIN_CHUNK = GATES[gate]
    try:
        cfg = ba.launch_config(block, block, D, getattr(torch, dtype), nm)
        paths = ba.nm_paths(block, block, cfg, nm)
    finally:
        ba.NM_MIN_ROWS, ba.NM_MIN_CHUNK = saved
    return " ".join(f"{k}:{v[0].upper()}" for k, v in paths.items())


def _inputs(L: int, D: int, dtype: torch.dtype, device: torch.device, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randint(-1, 2, (1, 2, L, D), generator=gen).float() for _ in range(2))
    v, g = (torch.randn(1, 2, L, D, generator=gen) for _ in range(2))
    q = q / 4  # exact: the scores stay exact, the softmax less peaked
    return [t.to(device, dtype) for t in (q, k, v, g)]


def run_variant(dtype_name: str, block: int, nm: tuple[int, int], gate: str, device_name: str) -> tuple[list[float] | None, str]:
    """``(errors of out, dq, dk, dv, or None; error text)`` of one variant."""
    L, D, make_mask = SHAPES[block]
    dtype, device = getattr(torch, dtype_name), torch.device(device_name)
    saved = ba.NM_MIN_ROWS, ba.NM_MIN_CHUNK
    ba.NM_MIN_ROWS, ba.NM_MIN_CHUNK = GATES[gate]
    try:
        mask = make_mask(L)
        q, k, v, g = _inputs(L, D, dtype, device)
        layout = BlockLayout.from_mask(mask, block, block, device)  # fresh: plans built with the gate
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
        return errors, ""
    except Exception as exc:  # a compile error is a result too
        return None, f"{type(exc).__name__}: {exc}"[:80]
    finally:
        ba.NM_MIN_ROWS, ba.NM_MIN_CHUNK = saved


def _row(variant, result) -> tuple[bool, str]:
    dtype, block, nm, gate = variant
    errors, text = result
    ok = errors is not None and max(errors) < BOUND[dtype]
    cells = " ".join(f"{e:9.2e}" for e in errors) if errors is not None else text
    L, D, _ = SHAPES[block]
    verdict = "ok" if ok else ("FAIL" if gate == "gate" else "FAIL (forced chunks, not the kernels' gate)")
    return ok, (f"{dtype:9} {L:5d} {block:5d} {nm[0]}:{nm[1]:<2} {gate:6} {_paths(block, D, dtype, nm, gate):18} "
                f"{cells}  {verdict}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="every N:M pattern and both gates for every dtype")
    parser.add_argument("--max-L", type=int, default=1000, help="skip longer shapes (CPU smoke runs)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (needs TRITON_INTERPRET=1)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes (default: 8 on a GPU, capped by the CPU count; 1 on the CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU (or --device cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    jobs = args.jobs or (min(8, multiprocessing.cpu_count()) if device.type == "cuda" else 1)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    todo = variants(args.all, args.max_L)
    print(f"# {name} torch {torch.__version__}; {len(todo)} variants, {jobs} processes; "
          f"gate: NM_MIN_ROWS={ba.NM_MIN_ROWS} NM_MIN_CHUNK={ba.NM_MIN_CHUNK}; paths C = chunks, G = grouped")
    print(f"{'dtype':9} {'L':>5} {'block':>5} {'nm':>4} {'gate':6} {'paths':18} "
          f"{'out':>9} {'dq':>9} {'dk':>9} {'dv':>9}  verdict", flush=True)
    failed = {"gate": 0, "chunks": 0}
    start = time.perf_counter()
    if jobs == 1:
        results = ((v, run_variant(*v, args.device)) for v in todo)
    else:  # spawn: CUDA in every worker; rows print as they finish (a cut run keeps them)
        pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
        futures = {pool.submit(run_variant, *v, args.device): v for v in todo}
        results = ((futures[f], f.result()) for f in as_completed(futures))
    for variant, result in results:
        ok, line = _row(variant, result)
        failed[variant[3]] += not ok
        print(line, flush=True)
    if jobs != 1:
        pool.shutdown()
    print(f"# {failed['gate']} failed with the kernels' gate ({failed['chunks']} with forced chunks), "
          f"{time.perf_counter() - start:.1f} s")
    return 1 if failed["gate"] else 0


if __name__ == "__main__":
    sys.exit(main())
