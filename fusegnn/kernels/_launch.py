"""Relaunching a compiled Triton kernel with less host work per call.

``kernel[grid](*args, **meta)`` costs Triton's binder on every call: it classifies each
argument (a tensor's dtype and 16-byte alignment, an integer's ``== 1`` and divisibility
by 16, ...) into a specialisation key, hashes it, looks the compiled kernel up, checks the
kernel's globals and only then calls the launcher. For a short attention call on a GPU
that is a visible part of the call (the block-sparse kernels take about 40 arguments).

:func:`launch` keeps the compiled kernel of each **specialisation key the caller
supplies** and relaunches it through Triton's own launcher (``CompiledKernel.run``, the
call ``JITFunction.run`` ends with), skipping the binder. The caller's key must determine
everything Triton specialises on: the value of every integer argument, the dtype and
16-byte alignment of every tensor argument, and the constexpr / launch options (``meta``,
warps, stages, which the key always includes). Floats are not specialised.

It falls back to the ordinary launch, and stays correct, when:

* the key is new (the ordinary launch compiles, or finds, the kernel and it is cached);
* not on CUDA (the interpreter), a launch hook is installed (e.g. a profiler such as
  Proton), or the CUDA device is not the one the kernel was cached for (part of the key);
* this Triton's compiled kernel does not expose the launcher this module was written
  against (``run``, ``function``, ``packed_metadata``), or the launcher refuses the
  arguments (``TypeError``): the fast path is then switched off for the process.

``FUSEGNN_FAST_LAUNCH=0`` (or ``false``, ``no``, ``off``: :func:`~fusegnn.kernels._env.env_flag`)
switches it off too (for comparisons).

**Every kernel launches through here.** ``kernel[grid](*args, **options)`` on a
:class:`~fusegnn.kernels._triton.LazyKernel` (every fusegnn kernel is one) calls
:func:`launch_kernel`, which builds the specialisation key itself (:func:`spec_key`: every tensor's dtype and 16-byte alignment, every integer's
``== 1``, divisibility by 16 and width class, the kind of every other argument). That key
distinguishes at least every case Triton's binder does, so a relaunch never runs a kernel
compiled for another specialisation. Callers with a cheaper key of their own (the
block-attention plans) call :func:`launch` with it directly.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from fusegnn.kernels._env import env_flag

__all__ = ["launch", "launch_kernel", "spec_key", "fast_launch_enabled", "clear_cache"]

#: (kernel name, spec key, meta items, warps, stages, device) -> _Entry. Keys carry exact
#: sizes (a new sequence length is a new key, sharing Triton's compiled kernel), so the
#: cache is emptied when it reaches _MAX_ENTRIES (callers with ever-new shapes).
_CACHE: dict[tuple, "_Entry"] = {}
_MAX_ENTRIES = 4096
_STATE = {"broken": False}


def fast_launch_enabled() -> bool:
    """Whether relaunches may skip Triton's binder (not switched off by
    ``FUSEGNN_FAST_LAUNCH=0`` nor disabled by an incompatible Triton; another value than an
    on / off switch raises, :func:`~fusegnn.kernels._env.env_flag`)."""
    return not _STATE["broken"] and env_flag("FUSEGNN_FAST_LAUNCH", True)


def clear_cache() -> None:
    """Forget every cached compiled kernel (the next launch of each key is ordinary)."""
    _CACHE.clear()


def _active(hook) -> bool:
    """A launch hook that would run: set, and not an empty ``HookChain`` (newer Tritons
    always hold a chain, empty unless a profiler added itself)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


_HOOK_OWNER: list = []  # where this Triton keeps its launch hooks (found at first use)


def _hooks_installed() -> bool:
    if not _HOOK_OWNER:
        try:
            from triton import knobs

            _HOOK_OWNER.append(knobs.runtime)
        except ImportError:  # an older Triton keeps the hooks on CompiledKernel
            from triton.compiler import CompiledKernel

            _HOOK_OWNER.append(CompiledKernel)
    owner = _HOOK_OWNER[0]
    return _active(getattr(owner, "launch_enter_hook", None)) or _active(getattr(owner, "launch_exit_hook", None))


_SIGNATURES: dict = {}


def _constexpr_names(fn) -> tuple[str, ...] | None:
    """The kernel's ``tl.constexpr`` parameters, when they all follow the runtime ones
    (the only order :func:`launch` rebuilds); ``None`` otherwise."""
    if fn not in _SIGNATURES:
        _SIGNATURES[fn] = _read_constexpr_names(fn)
    return _SIGNATURES[fn]


def _read_constexpr_names(fn) -> tuple[tuple[str, ...], int] | None:
    params = list(inspect.signature(fn).parameters.values())
    is_const = ["constexpr" in str(p.annotation) for p in params]
    first = is_const.index(True) if True in is_const else len(params)
    if not all(is_const[first:]):
        return None
    return tuple(p.name for p in params[first:]), len(params)


class _Entry:
    __slots__ = ("run", "function", "packed", "constexprs", "compiled", "n_args")

    def __init__(self, compiled, constexprs: tuple, n_args: int) -> None:
        self.compiled = compiled
        self.run = compiled.run
        self.function = compiled.function
        self.packed = compiled.packed_metadata
        self.constexprs = constexprs
        self.n_args = n_args


def _entry_for(kernel, compiled, args: Sequence, meta: dict) -> _Entry | None:
    if compiled is None or not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    fn = getattr(kernel, "fn", None)
    found = _constexpr_names(fn) if fn is not None else None
    if found is None:
        return None
    names, n_params = found
    if any(n not in meta for n in names) or len(args) + len(names) != n_params:
        return None
    return _Entry(compiled, tuple(meta[n] for n in names), len(args))


def launch(
    kernel,
    grid: tuple[int, ...],
    args: Sequence[Any],
    meta: dict[str, Any],
    warps: int,
    stages: int,
    spec_key: Hashable | None = None,
    device: torch.device | None = None,
):
    """``kernel[grid](*args, **meta, num_warps=warps, num_stages=stages)``, relaunched
    without Triton's binder when ``spec_key`` (see the module docstring) was seen before.
    ``kernel`` is a :class:`~fusegnn.kernels._triton.LazyKernel`; ``meta`` holds its
    constexprs and Triton options (e.g. ``maxnreg``). Without ``spec_key`` (or a CUDA
    ``device``) it is the ordinary launch. Returns Triton's compiled kernel."""
    fast = (spec_key is not None and device is not None and device.type == "cuda" and fast_launch_enabled()
            and type(grid) is tuple)
    if fast:
        dev = torch.cuda.current_device()
        key = (kernel, spec_key, tuple(meta.items()), warps, stages, dev)
        entry = _CACHE.get(key)
        if entry is not None and len(args) == entry.n_args and not _hooks_installed():
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1
            stream = torch._C._cuda_getCurrentRawStream(dev)
            try:
                entry.run(grid[0], g1, g2, stream, entry.function, entry.packed, None, None, None,
                          *args, *entry.constexprs)
                return entry.compiled
            except TypeError:  # this Triton's launcher takes other arguments: never again
                _STATE["broken"] = True
                _CACHE.clear()
    ordinary = getattr(kernel, "triton_launcher", None)
    launcher = ordinary(grid) if ordinary is not None else kernel[grid]
    if stages is None:
        compiled = launcher(*args, **meta, num_warps=warps)
    else:
        compiled = launcher(*args, **meta, num_warps=warps, num_stages=stages)
    if fast and not _STATE["broken"]:
        entry = _entry_for(kernel, compiled, args, meta)
        if entry is not None:
            if len(_CACHE) >= _MAX_ENTRIES:
                _CACHE.clear()
            _CACHE[key] = entry
    return compiled


_INT32 = (-(2**31), 2**31)


def _arg_key(arg: Any) -> Hashable:
    """What Triton's binder may specialise on for one runtime argument (a superset)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() & 15 == 0
    if isinstance(arg, bool):
        return bool, arg
    if isinstance(arg, int):
        return int, arg == 1, arg % 16 == 0, _INT32[0] <= arg < _INT32[1], arg >= 2**63
    if isinstance(arg, float):
        return float
    return arg  # None, a dtype, a string: its value (unhashable values fail loudly)


def spec_key(args: Sequence[Any]) -> tuple:
    """The specialisation key of ``args`` (see the module docstring)."""
    return tuple(_arg_key(a) for a in args)


def launch_kernel(kernel, grid, args: Sequence[Any], options: dict[str, Any]):
    """``kernel[grid](*args, **options)`` through :func:`launch`, keyed by
    :func:`spec_key` (``options`` holds the constexprs and Triton's launch options:
    ``num_warps`` (default 4), ``num_stages``, ``maxnreg``, ...).

    A relaunch is the hot path of every fused op on a small graph, where the host is the
    bottleneck: it is written out here (one key, one look-up, the launcher) rather than
    going through :func:`launch`'s general checks."""
    warps = options.pop("num_warps", 4)
    stages = options.pop("num_stages", None)
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or not first.is_cuda:
        return launch(kernel, grid, args, options, warps, stages)
    spec = tuple(map(_arg_key, args))
    if type(grid) is tuple and not _STATE["broken"] and not _hooks_installed():
        dev = torch._C._cuda_getDevice()
        entry = _CACHE.get((kernel, spec, tuple(options.items()), warps, stages, dev))
        if entry is not None and len(args) == entry.n_args and fast_launch_enabled():
            try:
                entry.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                          torch._C._cuda_getCurrentRawStream(dev), entry.function, entry.packed, None, None, None,
                          *args, *entry.constexprs)
                return entry.compiled
            except TypeError:  # this Triton's launcher takes other arguments: never again
                _STATE["broken"] = True
                _CACHE.clear()
    return launch(kernel, grid, args, options, warps, stages, spec, first.device)


class _Bound:
    """``kernel[grid]``, waiting for its arguments."""

    __slots__ = ("kernel", "grid")

    def __init__(self, kernel, grid) -> None:
        self.kernel, self.grid = kernel, grid

    def __call__(self, *args: Any, **options: Any):
        return launch_kernel(self.kernel, self.grid, args, options)
