"""Small helpers shared by the edge kernels (``sddmm``, ``edge_softmax``, fused GAT).

* :class:`LazyKernel` -- ``triton.jit`` applied at the first launch instead of at import,
  so whether the Triton interpreter runs a kernel (``TRITON_INTERPRET=1``) is decided
  when it is first used, not by whichever module happened to import it first;
* :func:`fused_can_run` -- whether Triton kernels can run on a tensor (a CUDA tensor, or a
  CPU tensor with the interpreter enabled);
* :func:`chunk_schedule` -- the work list that splits long CSR/CSC rows into chunks so
  that a hub row does not serialise one program.

This module imports only ``torch``; ``triton`` is imported by the kernel modules.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable, NamedTuple

import torch
from torch import Tensor

from fusegnn.kernels._launch import _Bound

__all__ = [
    "LazyKernel",
    "ChunkSchedule",
    "acc_dtype",
    "check_not_capturing",
    "chunk_schedule",
    "fused_can_run",
    "interpreter_enabled",
    "next_pow2",
    "triton_available",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def triton_available() -> bool:
    """``triton`` can be imported (it is an optional dependency of fusegnn)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels run on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


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


def check_not_capturing(tensor: Tensor, what: str) -> None:
    """Raise a clear error if ``what`` -- per-graph work built on first use, which reads
    sizes back to the host -- is about to be built while ``tensor``'s CUDA stream is being
    captured into a CUDA graph (the read would break the capture, and a replay could
    not rebuild it anyway). Callers cache the result on the graph, so one eager call
    before the capture builds it."""
    if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{what} is built on the first use of a graph and reads its size back to the host, "
            "which a CUDA graph capture cannot record: run the step once eagerly with the same "
            "Graph object before capturing it (fusegnn.graphed_step does), so that it is cached"
        )


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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


def _jit_helpers(kernel_fn: Callable) -> None:
    import triton

    namespace = kernel_fn.__globals__
    for name, helper in _HELPERS.get(kernel_fn.__module__, {}).items():
        if namespace.get(name) is helper:
            namespace[name] = triton.jit(helper)


class LazyKernel:
    """A Triton kernel jitted at its first launch: ``kernel[grid](*args, **meta)``
    (together with the :func:`kernel_helper` functions of its module)."""

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
    """Triton's own ``@triton.jit`` helpers (``tl.zeros``, ``tl.sum``, ``tl.rand``) are
    built when ``triton`` is first imported; if that happened before
    ``TRITON_INTERPRET=1`` was set, the interpreter cannot call them."""
    import triton.language.standard as standard

    if type(standard.zeros).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton had been imported (some import, e.g. "
            "torch_geometric, loads triton), so Triton's interpreter cannot run these "
            "kernels; set TRITON_INTERPRET=1 before anything imports triton (for pytest: "
            "in conftest.py)"
        )


class ChunkSchedule(NamedTuple):
    """Work items over the groups of a CSR/CSC, each at most ``chunk`` edges long.

    Attributes:
        item_group: ``[T]`` int64 group (row) of each work item.
        item_start: ``[T]`` int64 first edge position of each item (its end is
            ``min(start + chunk, ptr[group + 1])``).
        item_slot: ``[T]`` int64 index of the item's partial result among the items of
            split groups, or ``-1`` when its group is a single item (written directly).
        split_groups: ``[S]`` int64 groups that span more than one item.
        slot_ptr: ``[S + 1]`` int64; the partials of ``split_groups[s]`` are slots
            ``slot_ptr[s]:slot_ptr[s + 1]``.
        num_slots: number of partial slots (``slot_ptr[-1]``).
        chunk: the chunk length in edges.
    """

    item_group: Tensor
    item_start: Tensor
    item_slot: Tensor
    split_groups: Tensor
    slot_ptr: Tensor
    num_slots: int
    chunk: int


def chunk_schedule(ptr: Tensor, chunk: int) -> ChunkSchedule | None:
    """Split every group ``ptr[g]:ptr[g+1]`` into items of at most ``chunk`` edges.

    Returns ``None`` when no group is longer than ``chunk`` (then one program per group
    covers everything and no work list is needed). Empty groups get one (empty) item so
    that their outputs are still written. All tensor ops on ``ptr``'s device; one
    device-to-host sync for the item count (callers cache the result on the graph).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    check_not_capturing(ptr, "the chunk schedule of a fused GAT pass")
    deg = ptr[1:] - ptr[:-1]
    if deg.numel() == 0:
        return None
    nchunks = torch.div(deg + (chunk - 1), chunk, rounding_mode="floor").clamp_(min=1)
    num_items = int(nchunks.sum())
    if num_items == deg.numel():
        return None
    device = ptr.device
    groups = torch.arange(deg.numel(), device=device)
    item_group = torch.repeat_interleave(groups, nchunks, output_size=num_items)
    first_item = torch.cumsum(nchunks, 0) - nchunks
    k = torch.arange(num_items, device=device) - first_item.index_select(0, item_group)
    item_start = ptr.index_select(0, item_group) + k * chunk
    split = nchunks > 1
    split_item = split.index_select(0, item_group)
    item_slot = torch.where(
        split_item, torch.cumsum(split_item.to(torch.int64), 0) - 1, torch.full_like(k, -1)
    )
    split_groups = torch.nonzero(split).flatten()
    slot_ptr = torch.zeros(split_groups.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(nchunks.index_select(0, split_groups), 0, out=slot_ptr[1:])
    num_slots = int(slot_ptr[-1])
    return ChunkSchedule(item_group, item_start, item_slot, split_groups, slot_ptr, num_slots, chunk)
