"""Shared inputs of the op tests of ``reduce="max"`` and ``edge_aggregate``
(``tests/test_spmm_max.py``, ``tests/test_ops_edge_messages.py``): random graphs with a hub
row, float64 random tensors on the test device, and short GAR segments so that the hub row
(and several others) are split and their partial results combined."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from fusegnn.sparse import Graph
from tests.graphs import random_graph

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F64 = torch.float64
PATHS = ("gas", "gar")
SEG_LEN = 8

__all__ = [
    "DEVICE", "F64", "PATHS", "SEG_LEN", "KernelRecorder", "aligned_width", "hub_graph", "owns_its_storage",
    "randn", "record_edge_aggregate_launches", "short_segments",
]


def hub_graph(n: int = 14, e: int = 90, seed: int = 1, hub: int = 40, num_dst: int | None = None) -> Graph:
    """:func:`tests.graphs.random_graph` (isolated nodes, self-loops, duplicates, a hub of
    in-degree ``hub``) on the test device; bipartite with ``num_dst`` targets."""
    ei = random_graph(n, e, seed, hub_degree=hub, num_dst_nodes=num_dst)
    return Graph(ei.to(DEVICE), n if num_dst is None else (n, num_dst))


def randn(*shape: int, seed: int, dtype: torch.dtype = F64) -> torch.Tensor:
    """Standard normal values drawn in float64 from ``seed``, on the test device in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64).to(DEVICE, dtype)


@contextlib.contextmanager
def short_segments() -> Iterator[None]:
    """GAR segments of :data:`SEG_LEN` edges inside the block (needs Triton)."""
    from fusegnn.kernels import spmm as fused
    from fusegnn.kernels.spmm_gar import gar_config

    with fused.tuning(gar=lambda feat, es, dot: gar_config(feat, es, dot=dot)._replace(seg_len=SEG_LEN)):
        yield


class KernelRecorder:
    """Stands in for a lazily jitted kernel (``kernel[grid](*args)``): records the head width
    and the row stride it is launched with (the arguments at ``at`` and ``at + 1``) and the
    widths of its first two tensor arguments, then launches it."""

    def __init__(self, kernel, at: int):
        self.kernel, self.at, self.seen = kernel, at, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def record(*args, **kwargs):
            self.seen.append((args[self.at], args[self.at + 1], args[0].size(1), args[1].size(1)))
            return launch(*args, **kwargs)

        return record


def record_edge_aggregate_launches(monkeypatch) -> tuple[KernelRecorder, KernelRecorder]:
    """Recorders in place of :mod:`fusegnn.kernels.edge_aggregate`'s forward and backward
    kernels (``num_feat, row_stride`` are their arguments 14, 15 and 16, 17; their first two
    tensors are ``x`` (or the edge rows, or the output gradient) and the edge rows (or ``x``))."""
    from fusegnn.kernels import edge_aggregate as fused_ea

    forward = KernelRecorder(fused_ea._ea_forward, 14)
    backward = KernelRecorder(fused_ea._ea_backward, 16)
    monkeypatch.setattr(fused_ea, "_ea_forward", forward)
    monkeypatch.setattr(fused_ea, "_ea_backward", backward)
    return forward, backward


def aligned_width(per_head: int) -> int:
    """The head width the GAR kernels run at (``padded_channels``), written out: a multiple of
    16 above 16, else unchanged."""
    return per_head if per_head <= 16 else -(-per_head // 16) * 16


def owns_its_storage(t: torch.Tensor) -> bool:
    """``t`` is contiguous and holds no hidden storage (a slice of a padded buffer would keep
    the whole buffer alive)."""
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
