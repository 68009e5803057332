r"""Personalised-PageRank propagation (Gasteiger et al., ICLR 2019), drop-in for PyG's ``APPNP``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.layers._utils import check_node_features, normalized_graph
from fusegnn.sparse import Graph, spmm
from fusegnn.sparse.dispatch import check_aggregation
from fusegnn.sparse.graph_ref import GraphRef
from fusegnn.sparse.propagate import check_propagation, propagate

__all__ = ["APPNP"]


class APPNP(nn.Module):
    r"""The approximate personalised propagation of neural predictions.

    .. math::
        \mathbf{X}^{(0)} = \mathbf{X}, \qquad
        \mathbf{X}^{(k)} = (1 - \alpha) \hat{\mathbf{D}}^{-1/2} \hat{\mathbf{A}}
        \hat{\mathbf{D}}^{-1/2} \mathbf{X}^{(k-1)} + \alpha \mathbf{X}^{(0)}, \qquad
        \mathbf{X}' = \mathbf{X}^{(K)}

    with GCN's normalisation (:func:`~fusegnn.sparse.processing.gcn_normalized`:
    :math:`\hat{\mathbf{A}} = \mathbf{A} + \mathbf{I}`, self-loops added to the nodes that
    have none unless ``add_self_loops=False``); with ``normalize=False`` the edge weights
    as given (1 when there are none) instead. The layer has no parameters. The K steps run
    as one :func:`~fusegnn.sparse.propagate` op, which keeps no copy of the features for
    the backward.

    **Edge dropout** (``dropout > 0``, training only), as PyG's: before each step the
    (normalised) edge weights go through ``F.dropout``, and the dropped weights carry over
    to the next step, so step :math:`k` uses :math:`w \prod_{m \le k} \mathrm{mask}_m /
    (1-p)`. That draws the same masks as PyG's layer under the same seed, in the same edge
    order. Those steps run as K :func:`~fusegnn.sparse.spmm` calls under plain autograd
    (each step has its own weights); they cannot be compiled (the normalised weights exist
    only inside the compiled op): under ``torch.compile`` a training-mode call with dropout
    and ``normalize=True`` is a ``RuntimeError`` (unless an eager call cached the graph).

    Args:
        K: number of iterations (``>= 0``).
        alpha: teleport probability :math:`\alpha \in [0, 1]`.
        dropout: edge dropout probability in ``[0, 1)``.
        cached: keep the normalised graph of the first call and reuse it (transductive
            learning on one fixed graph), as ``GCNConv`` does.
        add_self_loops: add the remaining self-loops before normalising.
        normalize: apply the symmetric normalisation.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"``, ``"window"`` or ``"reference"``
            (see :mod:`fusegnn.sparse.dispatch`).

    Shapes:
        ``x`` ``[N, F]``; ``edge_index`` an ``edge_index``, a
        :class:`~fusegnn.sparse.Graph` or a ``torch.sparse`` ``adj_t`` (rows are targets;
        float values are edge weights); ``edge_weight`` ``[E]`` (optional) -> ``[N, F]``.

    A ``torch.sparse`` ``adj_t`` is normalised like an ``edge_index``: self-loops are added
    to the nodes that have none. (PyG's sparse-matrix path adds :math:`I` to every node,
    so the two differ on nodes that already have a self-loop.)
    """

    def __init__(
        self,
        K: int,
        alpha: float,
        dropout: float = 0.0,
        cached: bool = False,
        add_self_loops: bool = True,
        normalize: bool = True,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.K, self.alpha = check_propagation(K, alpha, name)
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"{name}: dropout must be in [0, 1), got {dropout!r}")
        self.dropout = float(dropout)
        self.cached = cached
        self.add_self_loops = add_self_loops
        self.normalize = normalize
        self.aggregation = check_aggregation(aggregation, "spmm")
        self._cached_graph: Graph | None = None

    def reset_parameters(self) -> None:
        self._cached_graph = None

    def forward(
        self, x: Tensor, edge_index: Graph | Tensor, edge_weight: Tensor | None = None
    ) -> Tensor:
        check_node_features(x, type(self).__name__)
        graph = normalized_graph(
            self, x, edge_index, edge_weight, cached=self.cached,
            normalize=self.normalize, add_self_loops=self.add_self_loops,
        )
        if self.dropout > 0.0 and self.training and self.K > 0:
            return self._propagate_with_edge_dropout(graph, x)
        return propagate(graph, x, self.K, self.alpha, aggregation=self.aggregation)

    def _propagate_with_edge_dropout(self, graph: Graph | GraphRef, x: Tensor) -> Tensor:
        if isinstance(graph, GraphRef) and graph.transform:
            raise RuntimeError(
                "APPNP(dropout > 0) in training mode cannot be compiled: its edge dropout needs the "
                "normalised edge weights, which exist only inside the compiled op; compile the model "
                "in eval mode or with dropout=0"
            )
        weight = graph.edge_weight
        if weight is None:
            weight = torch.ones(graph.num_edges, dtype=x.dtype, device=x.device)
        out = x
        for _ in range(self.K):
            weight = F.dropout(weight, p=self.dropout)
            out = spmm(graph, out, weight, aggregation=self.aggregation) * (1.0 - self.alpha) + self.alpha * x
        return out

    def extra_repr(self) -> str:
        return f"K={self.K}, alpha={self.alpha}, aggregation={self.aggregation!r}"
