"""The object every node-classification loader returns."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from fusegnn._tensor_tree import map_tensors
from fusegnn.sparse.graph import Graph
from fusegnn.sparse.reorder import inverse_permutation

__all__ = ["NODE_ID_EXTRAS", "NodeDataset"]

#: Keys of :attr:`NodeDataset.extra` whose tensors hold node *ids* (OGB's ``split_idx``:
#: a dict of id tensors) rather than one value per node: :meth:`NodeDataset.reorder`
#: renumbers their ids instead of permuting their rows.
NODE_ID_EXTRAS = frozenset({"split_idx"})


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
    # the edge_index _graph was built from: a data set given another one (assigned, or
    # through dataclasses.replace, which copies _graph too) builds a new graph
    _graph_of: Tensor | None = field(default=None, repr=False, compare=False)

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
        """The data set's :class:`~fusegnn.sparse.Graph` (built once, cached).

        Built again when ``edge_index`` is another tensor or the node count changed
        since (``data.edge_index = ...``, ``dataclasses.replace(data, x=...)``); an
        ``edge_index`` modified in place is not noticed (see :class:`Graph`)."""
        graph = self._graph
        if graph is None or self._graph_of is not self.edge_index or graph.num_nodes != self.num_nodes:
            self._keep_graph(Graph(self.edge_index, self.num_nodes))
        return self._graph

    def _keep_graph(self, graph: Graph) -> "NodeDataset":
        """Cache ``graph`` as the graph of the current ``edge_index``; returns ``self``."""
        self._graph, self._graph_of = graph, self.edge_index
        return self

    def to(self, device: torch.device | str) -> "NodeDataset":
        """A copy with every tensor on ``device``, also those in :attr:`extra`'s dicts,
        lists and tuples (OGB's ``split_idx``); the cached graph moves too."""
        device = torch.device(device)
        moved = replace(
            self,
            x=self.x.to(device),
            y=self.y.to(device),
            edge_index=self.edge_index.to(device),
            train_mask=self.train_mask.to(device),
            val_mask=self.val_mask.to(device),
            test_mask=self.test_mask.to(device),
            extra={key: _to_device(value, device) for key, value in self.extra.items()},
            _graph=None,
            _graph_of=None,
        )
        return moved._keep_graph(Graph(moved.edge_index, moved.num_nodes, validate=False))

    def reorder(self, method: str = "rcm", **options: Any) -> "NodeDataset":
        """A copy with the nodes renumbered in a locality order, so that neighbours get
        nearby ids and the fused kernels' row gathers hit the L2 cache more often.

        ``method`` and ``options`` are :meth:`fusegnn.sparse.Graph.reorder`'s (``"rcm"``:
        SciPy's reverse Cuthill-McKee; ``"degree"``; ``"metis"``: needs ``pymetis``,
        ``parts=64``). New node ``i`` is old node ``perm[i]``: ``x``, ``y``, the masks and
        every tensor of :attr:`extra` whose first dimension is the node count are taken
        at ``perm`` (when the edge count equals the node count, a key with ``"edge"`` in
        it names a per-edge tensor, as in PyG's ``Data.is_edge_attr``, and is kept as it
        is, since the edge order is), the node ids of the extras named in :data:`NODE_ID_EXTRAS`
        (``split_idx``) are renumbered (same order, so they name the same nodes as the
        masks), ``edge_index`` is renumbered (same edge order), and
        ``extra["node_order"]`` holds the ids of the original data set (composed over
        repeated reorders), so ``out_original[node_order] = out`` maps results back.
        The data set itself is not modified.

        The graph is the same, so training gives the same results up to the dropout
        draws. Reddit-sized graph, H100 (``benchmarks/NOTES-spmm.md``, session 19): a GCN
        h128 training step 25.7 -> 22.9 ms with ``"metis"`` (24.8 with ``"rcm"``), GAT
        1 x 16 16.9 -> 15.9 ms, GATv2 1 x 16 42.0 -> 37.8 ms. Finding the order runs on
        the host: RCM took 12 s, METIS 51 s on that graph (115M edges), so the order pays
        back after some 13,000 (RCM) to 18,000 (METIS) such GCN steps, 12,000 GATv2 steps and
        50,000 GAT steps with METIS -- for long or repeated training on one graph.
        ``"degree"`` made the GCN and GAT steps slower there (26.1 and 17.2 ms).
        """
        graph, perm = self.graph.reorder(method, **options)
        n = self.num_nodes

        def per_node(value: Any) -> Any:
            if isinstance(value, Tensor) and value.dim() >= 1 and value.size(0) == n:
                return value.index_select(0, perm.to(value.device))
            return value

        inverse = inverse_permutation(perm)

        def reordered_extra(key: str, value: Any) -> Any:
            if key in NODE_ID_EXTRAS:
                return _renumber_ids(value, inverse)
            if self.num_edges == n and "edge" in str(key):  # per edge: the edge order is kept
                return value
            return per_node(value)

        extra = {key: reordered_extra(key, value) for key, value in self.extra.items() if key != "node_order"}
        earlier = self.extra.get("node_order")
        extra["node_order"] = perm if earlier is None else earlier.index_select(0, perm.to(earlier.device))
        edge_index = graph.edge_index.to(self.edge_index.dtype)
        reordered = replace(
            self,
            x=per_node(self.x),
            y=per_node(self.y),
            edge_index=edge_index,
            train_mask=per_node(self.train_mask),
            val_mask=per_node(self.val_mask),
            test_mask=per_node(self.test_mask),
            extra=extra,
            _graph=None,
            _graph_of=None,
        )
        return reordered._keep_graph(Graph(edge_index, n, validate=False))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, num_nodes={self.num_nodes}, "
            f"num_edges={self.num_edges}, num_features={self.num_features}, "
            f"num_classes={self.num_classes}, train/val/test="
            f"{int(self.train_mask.sum())}/{int(self.val_mask.sum())}/{int(self.test_mask.sum())})"
        )


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` with its tensors on ``device`` (so a nested id tensor can index the moved data)."""
    return map_tensors(value, lambda tensor: tensor.to(device))


def _renumber_ids(value: Any, inverse: Tensor) -> Any:
    """``value``'s node ids in the new numbering (``inverse[old id]``), same order and dtype."""
    return map_tensors(value, lambda ids: inverse.to(ids.device)[ids.long()].to(ids.dtype))
