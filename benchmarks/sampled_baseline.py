"""The ``torch`` backend of suite ``sampled``: neighbour sampling as one writes it with
plain torch ops and no sampling library.

Per hop, every incoming edge of every target is enumerated (``repeat_interleave`` of
the degrees), given a random key and sorted by ``(target, key)``; the first ``fanout``
of each target are kept (a uniform subset without replacement). New nodes are numbered
through a dense ``[N]`` node-to-local map. The work of a hop is the **total degree of
its targets** (on Reddit's second hop, tens of millions of edges per batch: hubs are
reached often), where :mod:`fusegnn.loader` draws ``O(fanout)`` per target. Same
conventions and outputs as :class:`fusegnn.loader.NeighborLoader` (seeds first,
bipartite blocks), on the same device, so that the two differ only in how they sample.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from fusegnn.sparse import Graph

__all__ = ["SortingLoader", "PlainBatch"]


@dataclass
class PlainBatch:
    n_id: Tensor
    x: Tensor
    y: Tensor
    blocks: list[Graph]
    batch_size: int


class SortingLoader:
    """Batches of ``batch_size`` seeds from ``input_nodes`` (shuffled), sampled by sorting."""

    def __init__(self, graph: Graph, x: Tensor, y: Tensor, input_nodes: Tensor, num_neighbors: list[int],
                 batch_size: int, seed: int = 0) -> None:
        csr = graph.csr
        self.ptr, self.sources = csr.ptr, csr.index.long()
        self.x, self.y, self.input_nodes = x, y, input_nodes
        self.num_neighbors, self.batch_size = num_neighbors, batch_size
        self.device = graph.device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.local = torch.full((graph.num_nodes,), -1, dtype=torch.int64, device=self.device)

    def __len__(self) -> int:
        return math.ceil(self.input_nodes.numel() / self.batch_size)

    def __iter__(self) -> Iterator[PlainBatch]:
        order = torch.randperm(self.input_nodes.numel(), generator=self.generator, device=self.device)
        for k in range(len(self)):
            seeds = self.input_nodes[order[k * self.batch_size : (k + 1) * self.batch_size]]
            yield self.batch(seeds)

    def batch(self, seeds: Tensor) -> PlainBatch:
        nodes = [seeds]
        self.local[seeds] = torch.arange(seeds.numel(), device=self.device)
        count = seeds.numel()
        sizes, src_parts, dst_parts = [count], [], []
        targets_from = 0
        for fanout in self.num_neighbors:
            targets = torch.cat(nodes)[targets_from:]
            row, edge = self._hop(targets, fanout)
            src = self.sources[edge]
            fresh = torch.unique(src[self.local[src] < 0])
            self.local[fresh] = torch.arange(count, count + fresh.numel(), device=self.device)
            src_parts.append(self.local[src])
            dst_parts.append(row + targets_from)
            targets_from = count
            count += fresh.numel()
            nodes.append(fresh)
            sizes.append(fresh.numel())
        n_id = torch.cat(nodes)
        self.local[n_id] = -1  # ready for the next batch
        edge_counts = [s.numel() for s in src_parts]
        edge_index = torch.stack([torch.cat(src_parts), torch.cat(dst_parts)])
        blocks = []
        hops = len(self.num_neighbors)
        for layer in range(hops):
            depth = hops - layer
            blocks.append(Graph(edge_index[:, : sum(edge_counts[:depth])],
                                (sum(sizes[: depth + 1]), sum(sizes[:depth])), validate=False))
        return PlainBatch(n_id, self.x[n_id], self.y[seeds], blocks, seeds.numel())

    def _hop(self, targets: Tensor, fanout: int) -> tuple[Tensor, Tensor]:
        """(target row, edge position) of up to ``fanout`` random edges per target."""
        start = self.ptr[targets]
        deg = self.ptr[targets + 1] - start
        row = torch.repeat_interleave(torch.arange(targets.numel(), device=self.device), deg)
        run_start = torch.cumsum(deg, 0) - deg
        rank_in_run = torch.arange(row.numel(), device=self.device) - run_start[row]
        edge = start[row] + rank_in_run
        key = torch.rand(row.numel(), generator=self.generator, device=self.device)
        order = torch.argsort(key)
        order = order[torch.argsort(row[order], stable=True)]
        row, edge = row[order], edge[order]
        keep = rank_in_run < fanout  # rank_in_run is a rank again after the sort: rows kept their runs
        return row[keep], edge[keep]
