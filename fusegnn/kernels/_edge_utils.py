"""Small helpers shared by the edge kernels (``sddmm``, ``edge_softmax``, fused GAT,
GAR's partition); the Triton helpers every kernel shares are in :mod:`fusegnn.kernels._triton`.

* :func:`acc_dtype` -- the accumulation dtype of an input dtype;
* :func:`check_not_capturing` -- a clear error for per-graph work built during a CUDA
  graph capture;
* :func:`chunk_schedule` -- the work list that splits long CSR/CSC rows into chunks so
  that a hub row does not serialise one program;
* :func:`padded_channels`, :func:`pad_heads`, :func:`unpad_heads` -- the aligned width the
  gathering kernels run a head of features at, and the copies in and out of it.

This module imports only ``torch``; ``triton`` is imported by the kernel modules.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "ChunkSchedule",
    "acc_dtype",
    "check_not_capturing",
    "chunk_schedule",
    "pad_heads",
    "padded_channels",
    "unpad_heads",
]

#: rows of a multiple of this many elements are what the gathering kernels load with
#: vector loads: Triton specialises an integer argument (a row stride) on divisibility
#: by 16, and only then knows every gathered row starts 16-element aligned
ALIGN_CHANNELS = 16


def padded_channels(channels: int) -> int:
    """The per-head width the gathering kernels run at: ``channels`` rounded up to a
    multiple of :data:`ALIGN_CHANNELS` when it is above 16 and not a multiple of it;
    unchanged otherwise (narrow rows stay as they are: padding 3 columns to 16 would
    move five times the bytes).

    A row of, say, 41 floats starts at an arbitrary 4-byte offset: no vectorised gathers,
    and each gathered row touches an extra sector. Reddit-sized graph (115M edges),
    forward + backward: the fused GAT op took 206 ms at 41 channels and 61 ms at 48 (H200,
    one head, dropout 0.6); GAR spmm 8.1 ms at 41 columns and 6.0 ms padded to 48, 20.5 ms
    at 100 and 16.1 ms padded to 112 (H100, ``benchmarks/NOTES-spmm.md``, session 17).
    Padding costs a copy of the gathered rows (and GAS spmm, whose atomics bound it, gains
    nothing: it does not pad)."""
    if channels <= ALIGN_CHANNELS or channels % ALIGN_CHANNELS == 0:
        return channels
    return -(-channels // ALIGN_CHANNELS) * ALIGN_CHANNELS


def pad_heads(t: Tensor, heads: int, channels: int) -> Tensor:
    """``t`` (``[N, heads * F]``) with each head's ``F`` columns zero-padded to
    ``channels`` (``[N, heads * channels]``); ``t`` itself when ``channels == F``."""
    feat = t.size(1) // max(heads, 1)
    if channels == feat:
        return t
    n = t.size(0)
    return torch.nn.functional.pad(t.view(n, heads, feat), (0, channels - feat)).view(n, heads * channels)


def unpad_heads(t: Tensor, heads: int, feat: int) -> Tensor:
    """The first ``feat`` columns of each head of ``t`` (``[N, heads * channels]``) as a
    contiguous ``[N, heads * feat]`` of its own storage; ``t`` itself when nothing was
    padded. (Always a copy: for one head ``reshape`` would return a strided view that keeps
    the padded buffer alive and gives callers a non-contiguous result.)"""
    channels = t.size(1) // max(heads, 1)
    if channels == feat:
        return t
    n = t.size(0)
    kept = t.view(n, heads, channels)[:, :, :feat]
    # copied as [N, heads, feat]: a reshape of the strided slice would copy it once more
    return torch.empty((n, heads, feat), dtype=t.dtype, device=t.device).copy_(kept).view(n, heads * feat)


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
