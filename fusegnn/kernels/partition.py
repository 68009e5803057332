r"""Load-balanced work list for the row-parallel (GAR) kernels.

fuseGNN's GAR kernel gives every target row one thread block. On a power-law graph that
serialises the largest rows: Reddit's heaviest targets have tens of thousands of edges,
and the block that owns one runs long after the rest of the GPU has gone idle. Here the
edges of every group (a CSR row, or a CSC column for the backward pass) are cut into
**segments** of at most ``seg_len`` edges, and each segment is one unit of work:

* a row with ``d`` edges gets :math:`\max(1, \lceil d / K \rceil)` segments (an empty row
  keeps one empty segment, so the kernel writes its zeros and no memset is needed);
* a segment that covers its whole row writes the row's result straight to the output
  (``seg_slot == -1``);
* the segments of a *split* row write partial sums to consecutive rows ("slots") of an
  accumulation buffer, and a second pass adds each split row's slots **in slot order**
  and writes the row. The combine has a fixed order, so results are bitwise identical
  from run to run (no atomics).

The plan is built with tensor ops on the graph's device (a few passes over the row
pointer plus one host sync for the sizes) and cached on the :class:`~fusegnn.sparse.Graph`
(:meth:`~fusegnn.sparse.Graph.cached`), so transductive training builds it once per
direction.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from fusegnn.kernels._edge_utils import check_not_capturing
from fusegnn.sparse.graph import CompressedEdges, Graph

__all__ = ["SegmentPlan", "build_plan", "plan_for"]

_INT32_MAX = torch.iinfo(torch.int32).max


class SegmentPlan(NamedTuple):
    """Segments of one grouped edge order (CSR or CSC) and the arrays the kernels read.

    Attributes:
        seg_row: ``[S]`` int32, the group (output row) of each segment.
        seg_start: ``[S]`` first edge position of each segment in grouped order
            (int32, or int64 when there are ``2**31`` edges or more).
        seg_end: ``[S]`` one past its last edge position (same dtype).
        seg_slot: ``[S]`` int32, ``-1`` when the segment is its row's only one, else
            its row in the partial-sum buffer.
        split_rows: ``[R]`` int32, the rows cut into several segments.
        slot_ptr: ``[R + 1]`` int64; split row ``r`` owns slots
            ``slot_ptr[r]:slot_ptr[r + 1]``.
        num_slots: number of partial-sum rows (``slot_ptr[-1]``).
        max_row_slots: the most slots of one split row (0 when none is split).
        seg_len: the segment length ``K`` the plan was built with.
        index: ``[E]`` the other endpoint of each grouped edge, int32 when node ids
            fit (halves the bytes the kernels stream), else int64.
        perm: ``[E]`` the COO position of each grouped edge, int32 when ``E`` fits.
    """

    seg_row: Tensor
    seg_start: Tensor
    seg_end: Tensor
    seg_slot: Tensor
    split_rows: Tensor
    slot_ptr: Tensor
    num_slots: int
    max_row_slots: int
    seg_len: int
    index: Tensor
    perm: Tensor

    @property
    def num_segments(self) -> int:
        return self.seg_row.numel()


def build_plan(compressed: CompressedEdges, seg_len: int, num_other: int) -> SegmentPlan:
    """Cut the groups of ``compressed`` into segments of at most ``seg_len`` edges.

    Args:
        compressed: a graph's ``csr`` or ``csc``.
        seg_len: the most edges one segment (one kernel program) handles, ``K >= 1``.
        num_other: number of nodes on the other side (the range of ``compressed.index``),
            to decide whether ``index`` fits int32.
    """
    if seg_len < 1:
        raise ValueError(f"seg_len must be >= 1, got {seg_len}")
    ptr = compressed.ptr
    check_not_capturing(ptr, "the GAR segment plan")
    device = ptr.device
    num_rows = ptr.numel() - 1
    num_edges = compressed.index.numel()
    pos_dtype = torch.int32 if num_edges <= _INT32_MAX - seg_len else torch.int64

    deg = ptr[1:] - ptr[:-1]
    nseg = torch.clamp_min(torch.div(deg + (seg_len - 1), seg_len, rounding_mode="floor"), 1)
    num_segments = num_rows and int(nseg.sum())
    rows = torch.arange(num_rows, device=device, dtype=torch.int64)
    seg_row = torch.repeat_interleave(rows, nseg, output_size=num_segments)
    first = torch.cumsum(nseg, 0) - nseg  # first segment of each row
    local = torch.arange(num_segments, device=device, dtype=torch.int64) - first[seg_row]
    seg_start = ptr[seg_row] + local * seg_len
    seg_end = torch.minimum(seg_start + seg_len, ptr[seg_row + 1])

    split_seg = nseg[seg_row] > 1
    seg_slot = torch.where(
        split_seg,
        torch.cumsum(split_seg, 0, dtype=torch.int64) - 1,
        torch.full_like(seg_row, -1),
    )
    split = nseg > 1
    split_nseg = nseg[split]
    slot_ptr = torch.zeros(split_nseg.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(split_nseg, 0, out=slot_ptr[1:])
    num_slots = int(slot_ptr[-1])
    max_row_slots = int(split_nseg.max()) if split_nseg.numel() else 0

    index = compressed.index
    if index.dtype != torch.int32 and num_other <= _INT32_MAX:
        index = index.to(torch.int32)
    perm = compressed.perm
    if num_edges <= _INT32_MAX:
        perm = perm.to(torch.int32)
    return SegmentPlan(
        seg_row=seg_row.to(torch.int32),
        seg_start=seg_start.to(pos_dtype),
        seg_end=seg_end.to(pos_dtype),
        seg_slot=seg_slot.to(torch.int32),
        split_rows=rows[split].to(torch.int32),
        slot_ptr=slot_ptr,
        num_slots=num_slots,
        max_row_slots=max_row_slots,
        seg_len=seg_len,
        index=index,
        perm=perm,
    )


def plan_for(graph: Graph, order: str, seg_len: int) -> SegmentPlan:
    """The cached :class:`SegmentPlan` of ``graph``'s ``"csr"`` (grouped by target,
    GAR forward) or ``"csc"`` (grouped by source, GAR backward) edge order."""
    if order == "csr":
        return graph.cached(
            f"gar_plan:csr:{seg_len}",
            lambda: build_plan(graph.csr, seg_len, graph.num_src_nodes),
            structural=True,
        )
    if order == "csc":
        return graph.cached(
            f"gar_plan:csc:{seg_len}",
            lambda: build_plan(graph.csc, seg_len, graph.num_dst_nodes),
            structural=True,
        )
    raise ValueError(f"order must be 'csr' or 'csc', got {order!r}")
