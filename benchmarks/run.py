"""The benchmark entry point.

    python -m benchmarks.run --suite paper              # GCN / GAT training steps
    python -m benchmarks.run --suite agg                # SpMM forward / backward
    python -m benchmarks.run --suite all --quick        # both, smaller paper grid
    python -m benchmarks.run --list                     # cases and backends, no run
    python -m benchmarks.run --suite attention --sweep calibrate   # a tuning sweep (benchmarks.sweeps)
    python -m benchmarks.run --suite overhead           # host microseconds per call (benchmarks.overhead)
    python -m benchmarks.run --suite sampled            # neighbour-sampled training (benchmarks.sampled)
    python -m benchmarks.run --suite dist               # full-graph training on 1..N GPUs (benchmarks.dist)
    python -m benchmarks.run --suite loss               # linear + cross-entropy heads (benchmarks.loss)
    python -m benchmarks.run --suite vector             # vector sparsity vs cuBLAS / cuSPARSE / flex (benchmarks.vector)

Writes ``<out>/<suite>/<gpu-slug>.json`` after every record, then ``.md`` and ``.png``,
and prints the markdown table last. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
# Set before CUDA initialises: fewer fragmentation OOMs when large cases follow each other.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from benchmarks.backends import registry, select_backends  # noqa: E402
from benchmarks.cases import SUITES, select_cases, suite_cases  # noqa: E402
from benchmarks.data import DataConfig, DatasetCache  # noqa: E402
from benchmarks.report import (  # noqa: E402
    ANCHORS,
    README,
    ResultFile,
    clean_number,
    environment,
    gpu_slug,
    render_outputs,
)
from benchmarks.runner import RunConfig, new_record, run_case  # noqa: E402
from benchmarks.sweeps import SWEEPS, run_sweep, suite_sweeps  # noqa: E402

__all__ = ["main", "parse_args"]


def _csv(text: str) -> list[str]:
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:  # an empty shell variable would otherwise select the whole grid
        raise argparse.ArgumentTypeError(f"{text!r} names nothing (leave the option out for all)")
    return parts


def default_data_root() -> str | None:
    """``$FUSEGNN_DATA``, else ``.carry/planetoid`` where it exists, else ``None`` (the
    loaders' own search: the cache, then a download)."""
    carried = _REPO / ".carry" / "planetoid"
    return os.environ.get("FUSEGNN_DATA") or (str(carried) if carried.is_dir() else None)


def _split_at_sweep(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(harness options, sweep options)``: what follows ``--sweep NAME`` (or
    ``--sweep=NAME``) belongs to the sweep, whose options may share the harness's names."""
    for k, token in enumerate(argv):
        if token.startswith("--sweep="):
            return argv[: k + 1], argv[k + 1 :]
        if token == "--sweep":
            return argv[: k + 2], argv[k + 2 :]
    return argv, []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=(*SUITES, "attention", "overhead", "sampled", "dist", "loss", "vector", "all"),
                   default="paper")
    p.add_argument("--out", type=Path, default=_REPO / "benchmarks" / "results",
                   help="results directory; files go to <out>/<suite>/<gpu-slug>.* (default benchmarks/results)")
    p.add_argument("--cases", type=_csv, help="comma-separated case names or globs, e.g. 'gcn-*,gat-cora-*'")
    p.add_argument("--backends", type=_csv,
                   help="comma-separated backend names or globs (default: every default backend that can run)")
    p.add_argument("--quick", action="store_true", help="smaller paper grid (small graphs + Reddit-like at 16/128), <= 3 warm-up steps")
    p.add_argument("--steps", type=int, default=10, help="timed steps per backend (median reported; default 10)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps at most (default 5)")
    p.add_argument("--warmup-s", type=float, default=3.0, help="stop warming up after this many seconds (>= 2 steps)")
    p.add_argument("--rtol", type=float, default=1e-4, help="max-norm relative tolerance of the correctness check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0,
                   help="size of the generated graphs (Reddit-like, arxiv-like) as a fraction of the real one's nodes")
    p.add_argument("--avg-degree", type=float, help="Reddit-like edges per node (default: Reddit's ~492)")
    p.add_argument("--data-root", default=default_data_root(),
                   help="Planetoid root (<root>/<Name>/raw); default $FUSEGNN_DATA or .carry/planetoid")
    p.add_argument("--device", default="cuda", help="'cuda', 'cuda:1', or 'cpu' (needs --allow-cpu)")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU when there is no GPU (smoke test)")
    p.add_argument("--no-launches", action="store_true", help="skip the profiled step that counts kernel launches")
    p.add_argument("--no-png", action="store_true")
    p.add_argument("--append", action="store_true",
                   help="keep the records of cases not run now from an existing results file")
    p.add_argument("--time-limit", type=float,
                   help="seconds; cases not started by then are recorded as not run, or with --append keep "
                        "their earlier records (JSON/MD/PNG still written)")
    p.add_argument("--update-readme", action="store_true", help="put the tables into benchmarks/README.md")
    p.add_argument("--list", action="store_true", help="list the cases, backends and sweeps, then exit")
    p.add_argument("--sweep", help="run this tuning sweep of --suite instead of its cases (see --list); "
                                   "the options after '--sweep NAME' are the sweep's ('--sweep NAME --help')")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    argv = list(sys.argv[1:] if argv is None else argv)
    harness_argv, sweep_argv = _split_at_sweep(argv)
    args = p.parse_args(harness_argv)
    if args.sweep is not None and args.suite == "all":
        with_sweeps = ", ".join(dict.fromkeys(s.suite for s in SWEEPS))
        p.error(f"--sweep needs one --suite ({with_sweeps})")
    args.sweep_args = sweep_argv
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    # A negative tolerance fails every row but the oracle; a negative time limit or
    # warm-up budget, or a non-positive graph size, is a typo, not a request.
    for flag, value, positive in (("--rtol", args.rtol, False), ("--warmup-s", args.warmup_s, False),
                                  ("--time-limit", args.time_limit, False), ("--scale", args.scale, True),
                                  ("--avg-degree", args.avg_degree, True)):
        if value is not None and not (value > 0 if positive else value >= 0):  # NaN fails both
            p.error(f"{flag} must be {'> 0' if positive else '>= 0'}, got {value:g}")
    if args.quick:
        args.warmup = min(args.warmup, 3)
    return args


def resolve_device(args: argparse.Namespace) -> torch.device:
    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise SystemExit(f"benchmarks: --device {args.device!r} is not a device ({err})") from None
    if device.type not in ("cuda", "cpu"):
        raise SystemExit(f"benchmarks: --device must be 'cuda', 'cuda:<index>' or 'cpu', got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        if not args.allow_cpu:
            raise SystemExit(
                "benchmarks: no CUDA device here. Pass --allow-cpu for a CPU smoke run "
                "(timings with time.perf_counter, no memory or launch figures)."
            )
        device = torch.device("cpu")
    if device.type == "cpu" and not args.allow_cpu:
        raise SystemExit("benchmarks: --device cpu needs --allow-cpu (a smoke run, not a benchmark)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def check_case_patterns(patterns: list[str] | None, suites: tuple[str, ...], quick: bool) -> None:
    """Exit naming ``--cases`` and the known cases when a pattern matches no case of
    ``suites`` (a typo in one of several patterns would otherwise drop it silently)."""
    known = [c.name for suite in suites for c in select_cases(suite, None, quick)]
    for pattern in patterns or ():
        if not any(fnmatch.fnmatchcase(name, pattern) for name in known):
            grid = " --quick" if quick else ""
            raise SystemExit(f"benchmarks: --cases {pattern!r} matches no{grid} case of "
                             f"{', '.join(suites)}; known: {', '.join(known)}")


def _names_a_backend(suite: str, patterns: list[str] | None) -> bool:
    """Whether ``patterns`` (all when ``None``) match a backend name of ``suite``."""
    return not patterns or any(fnmatch.fnmatchcase(name, p) for name in registry(suite) for p in patterns)


def _list_sweeps(suite: str) -> None:
    for sweep in suite_sweeps(suite).values():
        print(f"  sweep {sweep.name}: {sweep.what}")


def _list(args: argparse.Namespace, device: torch.device) -> None:
    for suite in SUITES if args.suite == "all" else (args.suite,):
        cases = select_cases(suite, args.cases, args.quick)
        print(f"suite {suite}: {len(cases)} of {len(suite_cases(suite))} cases")
        for case in cases:
            print(f"  {case.name:22s} {case.note}")
        runnable, unavailable = select_backends(suite, device, args.backends, strict=False)
        print("  backends:", ", ".join(b.name for b in runnable) or "none")
        for name, reason in unavailable.items():
            print(f"  not available: {name}: {reason}")
        print("  all backend names:", ", ".join(registry(suite)))
        _list_sweeps(suite)


def _clean(record: dict) -> dict:
    return {k: clean_number(v) if isinstance(v, float) else v for k, v in record.items()}


def run_suite(
    suite: str, args: argparse.Namespace, device: torch.device, started: float, data: DatasetCache
) -> str:
    """Run one suite; returns its markdown table. ``data`` is shared between suites so
    that ``--suite all`` generates Reddit-like once (paper ends with it, agg uses it)."""
    cases = select_cases(suite, args.cases, args.quick)
    if not cases:
        raise SystemExit(f"benchmarks: --cases {args.cases} matches no {suite} case (see --list)")
    backends, unavailable = select_backends(suite, device, args.backends, strict=args.suite != "all")
    header = environment(device)
    header.update(
        suite=suite,
        anchor=ANCHORS[suite],
        config=dict(
            steps=args.steps, warmup=args.warmup, warmup_s=args.warmup_s, rtol=args.rtol, seed=args.seed,
            scale=args.scale, avg_degree=args.avg_degree, quick=args.quick, launches=not args.no_launches,
            alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        ),
        cases={c.name: c.info() for c in cases},
        datasets={},
        unavailable=unavailable,
    )
    path = args.out / suite / f"{gpu_slug(device)}.json"
    try:
        results = ResultFile(path, header, append=args.append, rerun_cases=[c.name for c in cases])
    except ValueError as err:  # --append onto a file that is not a results file: left as it is
        raise SystemExit(f"benchmarks: --append: {err}") from None
    config = RunConfig(
        device=device, steps=args.steps, warmup=args.warmup, warmup_s=args.warmup_s,
        rtol=args.rtol, seed=args.seed, launches=not args.no_launches,
    )
    used = {c.dataset for c in cases}

    def note_datasets() -> None:
        results.doc["datasets"].update({k: v for k, v in data.sources.items() if k in used})

    def emit(record: dict) -> None:
        note_datasets()
        results.add(_clean(record))

    total = sum(sum(1 for b in backends if getattr(b, "applies", lambda c: True)(c)) for c in cases)
    bar = tqdm(total=total, desc=suite, file=sys.stderr, disable=True if args.quiet else None, dynamic_ncols=True)
    try:
        for case in cases:
            applicable = [b for b in backends if getattr(b, "applies", lambda c: True)(case)]
            if args.time_limit is not None and time.perf_counter() - started > args.time_limit:
                if results.restore(case.name):  # --append: the earlier measurements stand
                    bar.update(len(applicable))
                    continue
                for backend in applicable:
                    record = new_record(case, backend.name)
                    record["error"] = f"not run: --time-limit {args.time_limit:g} s reached"
                    emit(record)
                    bar.update()
                continue
            bar.set_description(f"{suite} {case.name}")
            done: set[str] = set()

            def emit_case(record: dict, done=done) -> None:
                done.add(record["backend"])
                emit(record)

            try:
                run_case(case, applicable, data, config, emit_case, tick=bar.update)
            except Exception as err:  # noqa: BLE001 - a harness bug in one case must not end the run
                for backend in applicable:
                    if backend.name not in done:
                        record = new_record(case, backend.name)
                        record["error"] = f"harness error: {type(err).__name__}: {err}"
                        emit(record)
    finally:
        bar.close()
        note_datasets()
        results.write()
    table, why = render_outputs(path, png=not args.no_png, readme=README if args.update_readme else None)
    print(f"wrote {path} (+ .md{'' if why else ', .png'})", file=sys.stderr)
    if why and not args.no_png:
        print(f"PNG not written: {why}", file=sys.stderr)
    return table


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sweep is not None:
        try:
            return run_sweep(args.suite, args.sweep, args.sweep_args, args.out, lambda: resolve_device(args))
        except ValueError as err:
            raise SystemExit(f"benchmarks: {err}") from None
    if args.suite == "attention":  # masked attention: its own grid, see benchmarks/attention.py
        from benchmarks.attention import main_from_harness

        cpu = args.list and not torch.cuda.is_available()
        code = main_from_harness(args, torch.device("cpu") if cpu else resolve_device(args))
        if args.list:
            _list_sweeps("attention")
        return code
    if args.suite == "dist":  # several GPUs: launches its own workers, see benchmarks/dist.py
        from benchmarks.dist import CASES, main_from_harness as dist_main

        if args.list:
            print("suite dist: " + ", ".join(CASES) + "; backends fusegnn-1gpu, fusegnn-2gpu, fusegnn-<N>gpu")
            return 0
        return dist_main(args, resolve_device(args))
    if args.suite == "overhead":  # host cost per call: its own probes, see benchmarks/overhead.py
        if args.list:
            print("suite overhead: host microseconds per call (primitives, spmm, layers, sparse_attention)")
            return 0
        from benchmarks.overhead import main_from_harness as overhead_main

        return overhead_main(args, resolve_device(args))
    if args.suite == "sampled":  # mini-batch training on sampled neighbourhoods, see benchmarks/sampled.py
        from benchmarks.sampled import main_from_harness as sampled_main

        return sampled_main(args, torch.device("cpu") if args.list else resolve_device(args))
    if args.suite == "loss":  # linear + cross-entropy heads: its own grid, see benchmarks/loss.py
        from benchmarks.loss import main_from_harness as loss_main

        cpu = args.list and not torch.cuda.is_available()
        return loss_main(args, torch.device("cpu") if cpu else resolve_device(args))
    if args.suite == "vector":  # vector sparsity against its baselines: its own grid, see benchmarks/vector.py
        from benchmarks.vector import main_from_harness as vector_main

        cpu = args.list and not torch.cuda.is_available()
        return vector_main(args, torch.device("cpu") if cpu else resolve_device(args))
    suites = SUITES if args.suite == "all" else (args.suite,)
    for pattern in args.backends or ():
        known = [name for suite in suites for name in registry(suite)]
        if not any(fnmatch.fnmatchcase(name, pattern) for name in known):
            raise SystemExit(f"benchmarks: --backends {pattern!r} matches no backend; known: {', '.join(known)}")
    if args.list:
        cpu = not torch.cuda.is_available()
        _list(args, torch.device("cpu") if cpu else resolve_device(args))
        return 0
    device = resolve_device(args)
    check_case_patterns(args.cases, suites, args.quick)
    # with --suite all, a suite none of whose cases or backends is asked for is left out
    # (not an error, and not a results file emptied of its records)
    suites = tuple(s for s in suites if select_cases(s, args.cases, args.quick) and _names_a_backend(s, args.backends))
    runnable = []  # a suite none of whose chosen backends runs here would write an empty file
    for suite in suites:
        backends, unavailable = select_backends(suite, device, args.backends, strict=False)
        if backends:
            runnable.append(suite)
            continue
        reasons = "; ".join(f"{name}: {why}" for name, why in unavailable.items()) or "none chosen"
        if len(suites) == 1:
            raise SystemExit(f"benchmarks: no {suite} backend of --backends can run here ({reasons})")
        print(f"benchmarks: suite {suite} left out, no backend of --backends can run here ({reasons})",
              file=sys.stderr)
    suites = tuple(runnable)
    started = time.perf_counter()
    data = DatasetCache(DataConfig(args.data_root, device, args.scale, args.avg_degree, args.seed))
    try:
        tables = [run_suite(suite, args, device, started, data) for suite in suites]
    finally:
        data.release()
    print("\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
