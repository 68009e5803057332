"""The object every node-classification loader returns."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from fusegnn.sparse.graph import Graph

__all__ = ["NodeDataset"]


@dataclass
class NodeDataset:
    """One graph with node features, labels and a train / validation / test split.

    Attributes:
        name: data set name (``"Cora"``, ``"Reddit"``, ``"ogbn-arxiv"``, ...).
        x: ``[N, F]`` float32 node features.
        y: ``[N]`` int64 labels.
        edge_index: ``[2, E]`` int64 edges, row 0 sources, row 1 targets.
        train_mask, val_mask, test_mask: ``[N]`` bool split masks.
        num_classes: number of label classes.
        extra: loader-specific extras (e.g. an OGB ``Evaluator``).
    """

    name: str
    x: Tensor
    y: Tensor
    edge_index: Tensor
    train_mask: Tensor
    val_mask: Tensor
    test_mask: Tensor
    num_classes: int
    extra: dict[str, Any] = field(default_factory=dict)
    _graph: Graph | None = field(default=None, repr=False, compare=False)

    @property
    def num_nodes(self) -> int:
        return self.x.size(0)

    @property
    def num_edges(self) -> int:
        return self.edge_index.size(1)

    @property
    def num_features(self) -> int:
        return self.x.size(1)

    @property
    def graph(self) -> Graph:
        """The data set's :class:`~fusegnn.sparse.Graph` (built once, cached)."""
        if self._graph is None:
            self._graph = Graph(self.edge_index, self.num_nodes)
        return self._graph

    def to(self, device: torch.device | str) -> "NodeDataset":
        """A copy with every tensor on ``device`` (the cached graph moves too)."""
        device = torch.device(device)
        moved = replace(
            self,
            x=self.x.to(device),
            y=self.y.to(device),
            edge_index=self.edge_index.to(device),
            train_mask=self.train_mask.to(device),
            val_mask=self.val_mask.to(device),
            test_mask=self.test_mask.to(device),
            extra={k: v.to(device) if isinstance(v, Tensor) else v for k, v in self.extra.items()},
            _graph=None,
        )
        moved._graph = Graph(moved.edge_index, moved.num_nodes, validate=False)
        return moved

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, num_nodes={self.num_nodes}, "
            f"num_edges={self.num_edges}, num_features={self.num_features}, "
            f"num_classes={self.num_classes}, train/val/test="
            f"{int(self.train_mask.sum())}/{int(self.val_mask.sum())}/{int(self.test_mask.sum())})"
        )
