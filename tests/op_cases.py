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

__all__ = ["DEVICE", "F64", "PATHS", "SEG_LEN", "hub_graph", "randn", "short_segments"]


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
