r"""Graph convolution (Kipf & Welling, ICLR 2017), drop-in for PyG's ``GCNConv``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fusegnn.layers._utils import check_features, glorot_, input_linear, linear_then_bias, normalized_graph
from fusegnn.sparse import Graph, spmm
from fusegnn.sparse.dispatch import check_aggregation

__all__ = ["GCNConv"]


class GCNConv(nn.Module):
    r"""The graph convolutional operator.

    .. math::
        \mathbf{X}' = \hat{\mathbf{D}}^{-1/2} \hat{\mathbf{A}} \hat{\mathbf{D}}^{-1/2}
        \mathbf{X} \mathbf{\Theta} + \mathbf{b}

    where :math:`\hat{\mathbf{A}} = \mathbf{A} + \lambda\mathbf{I}` adds a self-loop
    (weight :math:`\lambda = 1`, or 2 when ``improved``) to every node that has none and
    :math:`\hat{D}_{ii} = \sum_j \hat{A}_{ij}` is the weighted in-degree. Node-wise:

    .. math::
        \mathbf{x}'_i = \mathbf{\Theta}^{\top} \sum_{j \in \mathcal{N}(i) \cup \{ i \}}
        \frac{w_{ji}}{\sqrt{\hat{d}_j \hat{d}_i}} \mathbf{x}_j + \mathbf{b}

    Combination (:math:`\mathbf{X}\mathbf{\Theta}`, a dense GEMM) and aggregation commute,
    so the layer aggregates at the narrower of ``in_channels`` and ``out_channels``.

    Args:
        in_channels: input feature width, or ``-1`` to infer it from ``x`` at the first
            forward (PyG's lazy initialisation: the weight is materialised and
            Glorot-initialised then; create the optimizer after that call).
        out_channels: output feature width.
        improved: self-loops of weight 2 (:math:`\hat{A} = A + 2I`), with or without edge
            weights. (PyG 2.8's ``gcn_norm`` gives the new loops weight 1 when no edge
            weights are passed, i.e. :math:`A + I`; it matches this layer once all-ones
            weights are passed.)
        cached: keep the normalised graph of the first call and reuse it
            (transductive learning on one fixed graph). Without it, graph processing
            runs on every call (inductive). Edge weights that require grad get their
            gradient from the first call; later calls reuse its normalised weights
            detached (as PyG's values; no gradient reaches the weights from them).
        add_self_loops: add the remaining self-loops before normalising; ``None`` (the
            default, as PyG's) means ``normalize``. The loops are part of the
            normalisation, so ``add_self_loops=True`` with ``normalize=False`` is a
            ``ValueError`` (as in PyG: the loops would silently not be added).
        normalize: apply the symmetric normalisation (else aggregate with the given
            edge weights, or 1).
        bias: learn an additive bias.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"``, ``"window"`` (row windows on tensor
            cores; the normalised graph's windows are built once and cached on it) or
            ``"reference"`` (see :mod:`fusegnn.sparse.dispatch`).

    Shapes:
        ``x`` ``[N, in_channels]`` (of the layer's dtype, else a ``TypeError``),
        ``edge_index`` (see below), ``edge_weight`` ``[E]`` (optional)
        -> ``[N, out_channels]``.

    The graph argument ``edge_index`` (PyG's name, so that keyword calls work unchanged)
    is any of (converted by
    :func:`~fusegnn.sparse.graph.coerce_graph`):

    * an ``edge_index`` ``[2, E]`` (row 0 sources, row 1 targets) or a
      :class:`~fusegnn.sparse.Graph` (whose ``edge_weight``, if any, is used);
    * a ``torch.sparse`` COO or CSR ``[N, N]`` matrix in PyG's ``adj_t`` orientation:
      **rows are targets**, ``adj_t[i, j] != 0`` is the edge ``j -> i``
      (``adj_t = A^T`` for an adjacency ``A`` with rows as sources; for an undirected
      graph both are the same). As with PyG's ``GCNConv(x, adj_t)``, float values are the
      edge weights (normalised like ``edge_weight``); a bool or integer matrix is
      unweighted. It is normalised like an ``edge_index``: self-loops are added to the
      nodes that have none (PyG adds :math:`I` to every node of a sparse matrix, so the
      two differ on nodes that already have a self-loop);
    * a networkx graph (nodes in ``G.nodes`` order, ``x`` row ``k`` the ``k``-th node);
      the edge attribute ``"weight"``, when any edge has one, gives the edge weights
      (networkx's convention; edges without it weigh 1).

    An ``edge_weight`` given to ``forward`` replaces the graph's weights; it follows the
    graph's edge order (for a sparse matrix: its stored entries in row-major order). The
    sparse and networkx forms are converted eagerly only; under ``torch.compile`` pass
    the :class:`~fusegnn.sparse.Graph` built from them.

    Under ``torch.compile`` the same code runs on a graph reference: the normalisation
    runs inside the ``fusegnn::spmm`` custom op (:mod:`fusegnn.sparse.library`, transform
    ``gcn_norm``), so the traced forward has no
    data-dependent code: the normalised graph is cached on the input
    :class:`~fusegnn.sparse.Graph` (one per graph and normalisation), which serves
    ``cached=True`` too; a normalised graph that an eager call already stored on the
    layer (``cached=True``) is used as it is. Edge weights that require grad (given to
    ``forward`` or stored on the graph) are normalised on every call, and their gradient
    flows.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        improved: bool = False,
        cached: bool = False,
        add_self_loops: bool | None = None,
        normalize: bool = True,
        bias: bool = True,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        if add_self_loops is None:
            add_self_loops = normalize
        if add_self_loops and not normalize:
            raise ValueError(
                "GCNConv: add_self_loops=True needs normalize=True (the self-loops are added by the "
                "normalisation); add them to the graph beforehand to aggregate over them unnormalised"
            )
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.improved = improved
        self.cached = cached
        self.add_self_loops = add_self_loops
        self.normalize = normalize
        self.aggregation = check_aggregation(aggregation, "spmm")
        self.lin = input_linear(in_channels, out_channels, type(self).__name__)
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self._cached_graph: Graph | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        glorot_(self.lin.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        self._cached_graph = None

    def _processed_graph(self, x: Tensor, edge_index, edge_weight: Tensor | None) -> Graph:
        return normalized_graph(
            self, x, edge_index, edge_weight, cached=self.cached,
            normalize=self.normalize, improved=self.improved, add_self_loops=self.add_self_loops,
        )

    def forward(
        self, x: Tensor, edge_index: Graph | Tensor, edge_weight: Tensor | None = None
    ) -> Tensor:
        check_features(x, self)
        graph = self._processed_graph(x, edge_index, edge_weight)
        if self.in_channels < self.out_channels:
            # the bias after the product, as on the other order (its dtype under autocast)
            return linear_then_bias(spmm(graph, x, aggregation=self.aggregation), self.lin.weight, self.bias)
        # the bias is the aggregation's epilogue (one autograd node for the sparse part)
        return spmm(graph, self.lin(x), bias=self.bias, aggregation=self.aggregation)

    def head_inputs(
        self, x: Tensor, edge_index: Graph | Tensor, edge_weight: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        r"""The layer's output as a linear map of aggregated inputs, ``(a, W, b)`` with
        ``forward(x) == a @ W.T + b`` and :math:`a = \hat{A} X` (aggregated at the input
        width): what a fused classification loss
        (:func:`fusegnn.losses.linear_cross_entropy`) takes, so that an output layer's
        logits are never written. Same checks and graph processing as :meth:`forward`."""
        check_features(x, self)
        graph = self._processed_graph(x, edge_index, edge_weight)
        return spmm(graph, x, aggregation=self.aggregation), self.lin.weight, self.bias

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggregation={self.aggregation!r}"
