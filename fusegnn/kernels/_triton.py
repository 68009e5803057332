"""The one home of what every Triton kernel module shares.

* :func:`interpreter_enabled` -- the one reading of ``TRITON_INTERPRET`` (as Triton reads
  it: ``1``, ``true``, ``yes``, ``on``, ``y``, any case), and :func:`interpreter_usable`:
  enabled, and Triton imported with it (or not imported yet);
* :data:`FLOAT_DTYPES` / :data:`BLOCK_ATTENTION_DTYPES` -- the table of floating dtypes the
  kernels take;
* :class:`LazyKernel` / :func:`kernel_helper` -- a kernel (and its device helpers) jitted
  at its first launch instead of at import, so whether the interpreter runs it is decided
  when it is first used, not by whichever module happened to be imported first; launches
  go through :mod:`fusegnn.kernels._launch` (relaunch without Triton's binder);
* :func:`fused_can_run`, :func:`triton_available`, :func:`next_pow2`.

This module imports only ``torch`` (``triton`` is optional and imported at the first
launch), so the op layer may ask it where the kernels can run without loading Triton.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Callable

import torch
from torch import Tensor

from fusegnn.kernels._env import ON_VALUES
from fusegnn.kernels._launch import _Bound

__all__ = [
    "BLOCK_ATTENTION_DTYPES",
    "FLOAT_DTYPES",
    "LazyKernel",
    "fused_can_run",
    "interpreter_enabled",
    "interpreter_usable",
    "kernel_helper",
    "next_pow2",
    "shared_kernel_helper",
    "triton_available",
]

#: floating dtypes of the edge kernels (SpMM, SDDMM, edge softmax, GCN normalisation,
#: fused GAT); they accumulate in float32 (float64 for float64 inputs)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: floating dtypes of the block-sparse attention kernels (tensor-core products: no float64)
BLOCK_ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)



#: whether ``triton`` is installed, looked up once at import: the op layer asks in code that
#: ``torch.compile`` traces, and Dynamo refuses ``importlib.util.find_spec`` there (torch 2.11)
#: where it reads a module global as a constant
_TRITON_FOUND = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """``triton`` can be imported (it is an optional dependency of fusegnn; looked up once,
    when this module is imported)."""
    return _TRITON_FOUND


@torch.compiler.assume_constant_result
def interpreter_enabled() -> bool:
    """``TRITON_INTERPRET`` asks for Triton's CPU interpreter (read now, every call; in code
    that ``torch.compile`` traces, read once while tracing and kept as a constant: the
    compiled code never reads the environment)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ON_VALUES


def _triton_interprets() -> bool:
    """Triton's own jitted helpers (``tl.zeros``, ``tl.sum``, ...) are interpreter
    functions, or Triton is not imported yet. They are built when ``triton`` is first
    imported; if that happened before ``TRITON_INTERPRET=1`` was set, the interpreter
    cannot run any kernel that calls them."""
    standard = sys.modules.get("triton.language.standard")
    return standard is None or type(standard.zeros).__name__ == "InterpretedFunction"


def interpreter_usable() -> bool:
    """The kernels run (or will run) through the CPU interpreter: it is enabled and
    Triton was imported with it (see :func:`_triton_interprets`)."""
    return interpreter_enabled() and _triton_interprets()


def fused_can_run(*tensors: Tensor) -> bool:
    """Triton kernels can run on these tensors: all on CUDA (or all on the CPU with the
    interpreter enabled), all in a supported floating dtype, and triton importable."""
    if not triton_available():
        return False
    for t in tensors:
        if t.is_floating_point() and t.dtype not in FLOAT_DTYPES:
            return False
        if t.device.type == "cuda":
            continue
        if t.device.type == "cpu" and interpreter_enabled():
            continue
        return False
    return True


def next_pow2(n: int) -> int:
    """Smallest power of two ``>= max(n, 1)`` (Triton block shapes are powers of two)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


# module name -> helper name -> plain function, for kernel_helper / LazyKernel
_HELPERS: dict[str, dict[str, Callable]] = {}


def kernel_helper(fn: Callable) -> Callable:
    """Mark ``fn`` as a device function (``@triton.jit`` helper) of the kernels in its
    module. Like the kernels, it stays a plain function until the first launch of a
    :class:`LazyKernel` of that module, which jits it (with the interpreter when
    ``TRITON_INTERPRET=1``) and binds the jitted version to its name in the module, where
    the kernels' calls find it."""
    _HELPERS.setdefault(fn.__module__, {})[fn.__name__] = fn
    return fn


def shared_kernel_helper(module: str, name: str, into: str) -> Callable:
    """The :func:`kernel_helper` ``name`` of kernel module ``module`` made a helper of the
    kernels of module ``into`` as well (bind the result to ``name`` there): the plain
    function, which ``into``'s first launch jits and rebinds in ``into``'s namespace. (A
    plain ``from module import name`` would not do: the name could be bound to either the
    plain function or, once ``module`` launched, its jitted version there, and ``into``'s
    launches only jit the helpers registered for ``into`` -- and, in their own modules,
    the helpers of the modules it shares from, which a shared helper's calls resolve in.)"""
    fn = _HELPERS[module][name]
    _HELPERS.setdefault(into, {})[name] = fn
    return fn


def _jit_helpers(kernel_fn: Callable) -> None:
    """Jit the helpers of ``kernel_fn``'s module in its namespace, and those of every module
    it shares helpers from in theirs (a shared helper resolves the helpers it calls in
    its own module)."""
    import triton

    namespaces = {kernel_fn.__module__: kernel_fn.__globals__}
    for helper in _HELPERS.get(kernel_fn.__module__, {}).values():
        namespaces.setdefault(helper.__module__, helper.__globals__)
    for module, namespace in namespaces.items():
        for name, helper in _HELPERS.get(module, {}).items():
            if namespace.get(name) is helper:
                namespace[name] = triton.jit(helper)


class LazyKernel:
    """A Triton kernel jitted at its first launch: ``kernel[grid](*args, **meta)``
    (together with the :func:`kernel_helper` functions of its module). Every fusegnn
    kernel is one."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._kernel = None

    def triton_launcher(self, grid):
        """Triton's own launch of the jitted kernel (its binder on every call)."""
        if self._kernel is None:
            import triton

            if interpreter_enabled():
                _check_interpreter_usable()
            _jit_helpers(self.fn)
            self._kernel = triton.jit(self.fn)
        return self._kernel[grid]

    def __getitem__(self, grid):
        """``kernel[grid](*args, **options)``, relaunched without Triton's binder once
        compiled (:func:`fusegnn.kernels._launch.launch_kernel`)."""
        return _Bound(self, grid)


def _check_interpreter_usable() -> None:
    if not _triton_interprets():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton had been imported (some import, e.g. "
            "torch_geometric, loads triton), so Triton's interpreter cannot run these "
            "kernels; set TRITON_INTERPRET=1 before anything imports triton (for pytest: "
            "in conftest.py)"
        )
