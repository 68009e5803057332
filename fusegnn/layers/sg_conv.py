r"""Simple graph convolution (Wu et al., ICML 2019), drop-in for PyG's ``SGConv``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.layers._utils import (
    check_linear_input, input_linear, linear_bias, normalized_graph, project_before_aggregating,
)
from fusegnn.sparse import Graph
from fusegnn.sparse.graph import outside_inference_mode
from fusegnn.sparse.dispatch import check_aggregation
from fusegnn.sparse.propagate import check_propagation, propagate

__all__ = ["SGConv"]


class SGConv(nn.Module):
    r"""The simple graph convolutional operator.

    .. math::
        \mathbf{X}' = \big( \hat{\mathbf{D}}^{-1/2} \hat{\mathbf{A}}
        \hat{\mathbf{D}}^{-1/2} \big)^K \mathbf{X} \mathbf{\Theta} + \mathbf{b}

    with :math:`\hat{\mathbf{A}} = \mathbf{A} + \mathbf{I}` (self-loops added to the nodes
    that have none, unless ``add_self_loops=False``; edge weights as given) and
    :math:`\hat{D}_{ii} = \sum_j \hat{A}_{ij}`: GCN's normalisation
    (:func:`~fusegnn.sparse.processing.gcn_normalized`). The K propagations run as one
    :func:`~fusegnn.sparse.propagate` op (no K copies of the features in autograd), at the
    narrower of ``in_channels`` and ``out_channels`` (:math:`\mathbf{\Theta}` commutes with
    them) unless ``cached`` (or the step is an eager CUDA training step on a small graph
    whose input needs no gradient: :func:`~fusegnn.layers._utils.project_before_aggregating`). ``lin``
    (weight and bias) has PyG's name, shape and initialisation (``nn.Linear``'s).

    Args:
        in_channels: input width, or ``-1`` to infer it at the first forward.
        out_channels: output width.
        K: number of hops (``>= 0``).
        cached: as PyG's, keep the propagated features :math:`\hat{A}^K X` of the first
            call and reuse them (detached: no gradient reaches ``x`` from later calls;
            a first call under ``torch.inference_mode()`` stores a normal tensor, so training may follow)
            whatever ``x`` and graph come next (transductive learning on one fixed graph
            and input); with ``K=0`` nothing is cached, as in PyG. Under
            ``torch.compile`` the features are not stored (a compiled call propagates
            again; the normalised graph is cached on the input graph); features an eager
            call stored are used.
        add_self_loops: add the remaining self-loops before normalising.
        bias: learn an additive bias.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"``, ``"window"`` or ``"reference"``
            (see :mod:`fusegnn.sparse.dispatch`).

    Shapes:
        ``x`` ``[N, in_channels]``; ``edge_index`` an ``edge_index``, a
        :class:`~fusegnn.sparse.Graph` or a ``torch.sparse`` ``adj_t`` (rows are targets;
        float values are edge weights); ``edge_weight`` ``[E]`` (optional)
        -> ``[N, out_channels]``.

    A ``torch.sparse`` ``adj_t`` is normalised like an ``edge_index``: self-loops are added
    to the nodes that have none. (PyG's sparse-matrix path adds :math:`I` to every node,
    so the two differ on nodes that already have a self-loop.)
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        K: int = 1,
        cached: bool = False,
        add_self_loops: bool = True,
        bias: bool = True,
        aggregation: str = "auto",
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.K, _ = check_propagation(K, 0.0, name)
        self.cached = cached
        self.add_self_loops = add_self_loops
        self.aggregation = check_aggregation(aggregation, "spmm")
        self.lin = input_linear(in_channels, out_channels, name, bias=bias)
        self._cached_x: Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.lin.reset_parameters()
        self._cached_x = None

    def forward(
        self, x: Tensor, edge_index: Graph | Tensor, edge_weight: Tensor | None = None
    ) -> Tensor:
        check_linear_input(x, self.lin, self, glorot=False)
        cached_x = self._cached_x
        if cached_x is not None and cached_x.dtype == x.dtype and cached_x.device == x.device:
            return self.lin(cached_x)  # (moved by .to() / .double() since: propagated again below)
        graph = normalized_graph(
            self, x, edge_index, edge_weight, cached=False, add_self_loops=self.add_self_loops
        )
        weight, bias = self.lin.weight, self.lin.bias
        if self.cached and self.K > 0 and not torch.compiler.is_compiling():  # PyG caches after a step
            h = propagate(graph, x, self.K, aggregation=self.aggregation)
            # kept beyond this call: a normal tensor even when the first call ran under inference_mode
            # (an inference tensor here would make every later training step fail in lin's backward)
            self._cached_x = outside_inference_mode(h.clone) if h.is_inference() else h.detach()
            return F.linear(h, weight, bias)
        if project_before_aggregating(graph, x, weight.size(1), weight.size(0), "sum", self.aggregation):
            out = propagate(graph, F.linear(x, weight), self.K, aggregation=self.aggregation)
            return out if bias is None else out + linear_bias(bias, out)
        return F.linear(propagate(graph, x, self.K, aggregation=self.aggregation), weight, bias)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, K={self.K}, aggregation={self.aggregation!r}"
