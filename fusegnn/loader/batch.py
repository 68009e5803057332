"""One mini-batch of :class:`~fusegnn.loader.NeighborLoader`, with PyG's field names."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from torch import Tensor

from fusegnn.loader.sampler import SampledSubgraph
from fusegnn.sparse.graph import Graph

__all__ = ["SampledBatch"]


@dataclass
class SampledBatch:
    """A sampled subgraph with its nodes' features and its seeds' labels.

    PyG-style loops run on it unchanged::

        out = model(batch.x, batch.edge_index)[:batch.batch_size]
        loss = F.cross_entropy(out, batch.y[:batch.batch_size])

    and layer-wise models on the bipartite blocks::

        h = batch.x
        for conv, block in zip(convs, batch.blocks):
            h = conv((h, h[:block.num_dst_nodes]), block)

    Attributes:
        subgraph: the sampler's output (``n_id``, ``edge_index``, ``e_id``, counts).
        x: ``[len(n_id), F]`` features of the subgraph's nodes (``None`` without features).
        y: ``[batch_size]`` labels of the seeds (``None`` without labels).
        input_id: ``[batch_size]`` positions of the seeds in the loader's ``input_nodes``.
    """

    subgraph: SampledSubgraph
    x: Tensor | None
    y: Tensor | None
    input_id: Tensor

    @property
    def n_id(self) -> Tensor:
        """Global ids of the subgraph's nodes, the seeds first."""
        return self.subgraph.n_id

    @property
    def batch_size(self) -> int:
        return self.subgraph.batch_size

    @property
    def edge_index(self) -> Tensor:
        """``[2, E]`` sampled edges in local ids (row 0 sources, row 1 targets), hop by hop."""
        return self.subgraph.edge_index

    @property
    def e_id(self) -> Tensor:
        """Position of each sampled edge in the full graph's ``edge_index``."""
        return self.subgraph.e_id

    @property
    def num_sampled_nodes(self) -> list[int]:
        return self.subgraph.num_sampled_nodes

    @property
    def num_sampled_edges(self) -> list[int]:
        return self.subgraph.num_sampled_edges

    @property
    def num_nodes(self) -> int:
        return self.subgraph.n_id.numel()

    @property
    def blocks(self) -> list[Graph]:
        """Bipartite graph per layer, from the input layer (see :class:`SampledSubgraph`)."""
        return self.subgraph.blocks

    @cached_property
    def graph(self) -> Graph:
        """The merged subgraph over ``n_id`` as a square :class:`Graph`."""
        return Graph(self.edge_index, self.num_nodes, validate=False)

    def __repr__(self) -> str:
        width = "" if self.x is None else f", x=[{self.num_nodes}, {self.x.size(1) if self.x.dim() > 1 else 1}]"
        return (
            f"{type(self).__name__}(batch_size={self.batch_size}, num_nodes={self.num_nodes}, "
            f"num_edges={self.edge_index.size(1)}, num_sampled_nodes={self.num_sampled_nodes}{width})"
        )
