r"""The graph isomorphism network layer (Xu et al., ICLR 2019), drop-in for PyG's ``GINConv``."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fusegnn.layers._utils import layer_inputs, project_before_aggregating, reset_module
from fusegnn.sparse import Graph, spmm
from fusegnn.sparse.dispatch import check_aggregation

__all__ = ["GINConv", "check_root_width", "eps_parameter"]


def eps_parameter(layer: nn.Module, train_eps: bool) -> None:
    r"""GIN's :math:`\epsilon` on ``layer``: a parameter ``eps`` ``[1]`` when learnt, else a
    buffer of that name (as PyG's); filled by ``reset_parameters``."""
    if train_eps:
        layer.eps = torch.nn.Parameter(torch.empty(1))
    else:
        layer.register_buffer("eps", torch.empty(1))


def check_root_width(x_src: Tensor, x_dst: Tensor | None, layer: str) -> None:
    r"""The root term :math:`(1 + \epsilon) x_i` is added to the sum of the :math:`x_j`:
    ``x_dst`` has ``x_src``'s width."""
    if x_dst is not None and x_dst.size(1) != x_src.size(1):
        raise ValueError(
            f"{layer}: x_dst has {x_dst.size(1)} features per node but x_src has "
            f"{x_src.size(1)} (the root term (1 + eps) x_i is added to the sum of the x_j)"
        )


def _leading_linear(module) -> nn.Linear | None:
    """The ``nn.Linear`` that ``module`` (an ``nn.Sequential``) starts with, else ``None``."""
    if isinstance(module, nn.Sequential) and len(module) > 0 and type(module[0]) is nn.Linear:
        return module[0]
    return None


class GINConv(nn.Module):
    r"""The graph isomorphism operator.

    .. math::
        \mathbf{x}'_i = h_{\mathbf{\Theta}} \Big( (1 + \epsilon) \cdot \mathbf{x}_i
        + \sum_{j \in \mathcal{N}(i)} \mathbf{x}_j \Big)
        \qquad\text{i.e.}\qquad
        \mathbf{X}' = h_{\mathbf{\Theta}}\big( (\mathbf{A} + (1 + \epsilon) \mathbf{I}) \mathbf{X} \big)

    with :math:`h_{\mathbf{\Theta}}` the given module ``nn`` (e.g. an MLP) and the sum over
    the incoming edges :math:`j \to i` (weighted by the graph's edge weights where it has
    any: a float ``adj_t``'s values, as on PyG's sparse-matrix path). For a bipartite pair
    ``(x_src, x_dst)`` the root term uses ``x_dst`` (same width as ``x_src``) and is left
    out when ``x_dst`` is ``None``.

    When ``nn`` is an ``nn.Sequential`` that starts with a narrowing ``nn.Linear``
    (``out_features < in_features``), that map is applied before the sum (it commutes with
    it: :math:`W((1 + \epsilon) x_i + \sum_j x_j) + b = (1 + \epsilon) W x_i + \sum_j W x_j + b`),
    so the aggregation runs at the narrower width, with the bias as its epilogue -- except
    in an eager CUDA training step on a small graph whose input needs no gradient, where
    the sum of the raw input has no backward to launch
    (:func:`~fusegnn.layers._utils.project_before_aggregating`).

    Args:
        nn: the module applied to the aggregated features (its ``reset_parameters``, or its
            children's, run on :meth:`reset_parameters`, as PyG's ``reset``).
        eps: initial :math:`\epsilon`.
        train_eps: learn :math:`\epsilon` (a parameter ``eps`` of shape ``[1]``; else a
            buffer of that name, as PyG's).
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"``
            (see :mod:`fusegnn.sparse.dispatch`).

    Shapes:
        ``x`` ``[N, F]`` or ``(x_src [N_src, F], x_dst [N_dst, F] or None)`` of ``eps``'s
        dtype; ``edge_index`` an ``edge_index``, a
        :class:`~fusegnn.sparse.Graph` or a ``torch.sparse`` ``adj_t`` ``[N_dst, N_src]``;
        ``size`` PyG's optional ``(N_src, N_dst)`` -> ``nn``'s output on ``[N_dst, F]``.
    """

    def __init__(self, nn: Callable[[Tensor], Tensor], eps: float = 0.0, train_eps: bool = False,
                 aggregation: str = "auto") -> None:
        super().__init__()
        if not callable(nn):
            raise TypeError(f"GINConv: nn must be a module or callable, got {type(nn).__name__}")
        self.nn = nn
        self.initial_eps = eps
        self.aggregation = check_aggregation(aggregation)
        eps_parameter(self, train_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_module(self.nn)
        with torch.no_grad():
            self.eps.fill_(self.initial_eps)

    def forward(
        self, x: Tensor | tuple[Tensor, Tensor | None], edge_index: Graph | Tensor,
        size: tuple[int, int] | None = None,
    ) -> Tensor:
        x_src, x_dst, graph = layer_inputs(self, x, edge_index, size, dtype=self.eps.dtype)
        check_root_width(x_src, x_dst, type(self).__name__)
        first = _leading_linear(self.nn)
        if (first is not None and x_src.size(1) == first.in_features
                and project_before_aggregating(graph, x_src, first.in_features, first.out_features, "sum",
                                               self.aggregation)):
            # nn starts with a narrowing Linear W: W((1 + eps) x_i + sum_j x_j) + b is
            # (1 + eps) x_i W^T + sum_j x_j W^T + b, so aggregate at the narrower width
            h_src = F.linear(x_src, first.weight)
            h_dst = None if x_dst is None else h_src if x_dst is x_src else F.linear(x_dst, first.weight)
            out = spmm(graph, h_src, bias=first.bias, aggregation=self.aggregation)
            if h_dst is not None:
                out = out + (1 + self.eps) * h_dst
            return self.nn[1:](out)
        out = spmm(graph, x_src, aggregation=self.aggregation)
        if x_dst is not None:
            out = out + (1 + self.eps) * x_dst
        return self.nn(out)

    def extra_repr(self) -> str:
        return f"aggregation={self.aggregation!r}"
