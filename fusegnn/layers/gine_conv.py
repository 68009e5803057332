r"""GIN with edge features (Hu et al., ICLR 2020), drop-in for PyG's ``GINEConv``."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from fusegnn.layers._utils import check_edge_features, layer_inputs, reset_module
from fusegnn.layers.gin_conv import check_root_width, eps_parameter
from fusegnn.sparse import Graph, edge_aggregate
from fusegnn.sparse.dispatch import check_aggregation

__all__ = ["GINEConv"]


def _input_width(module: Callable[[Tensor], Tensor]) -> int:
    """The input width of ``nn`` (of its first module for an ``nn.Sequential``), as PyG reads it."""
    first = module[0] if isinstance(module, nn.Sequential) and len(module) > 0 else module
    for attribute in ("in_features", "in_channels"):
        width = getattr(first, attribute, None)
        if isinstance(width, int) and width > 0:
            return width
    raise ValueError(
        "GINEConv: could not infer the input width from nn (its first module has no in_features / "
        "in_channels); edge_dim needs it to size the edge transform"
    )


class GINEConv(nn.Module):
    r"""The graph isomorphism operator with edge features.

    .. math::
        \mathbf{x}'_i = h_{\mathbf{\Theta}} \Big( (1 + \epsilon) \cdot \mathbf{x}_i
        + \sum_{j \in \mathcal{N}(i)} \mathrm{ReLU}(\mathbf{x}_j + \mathbf{e}_{ji}) \Big)

    with :math:`\mathbf{e}_{ji}` the edge features, first mapped to the node width by a
    linear layer ``lin`` (with bias) when ``edge_dim`` is given, else used as they are (of
    the node width). The sum over each target's incoming edges is one fused
    :func:`~fusegnn.sparse.edge_aggregate` (``activation="relu"``): the messages
    :math:`\mathrm{ReLU}(\mathbf{x}_j + \mathbf{e}_{ji})` are formed on chip, never as an
    ``[E, F]`` tensor, and so are their gradients.

    Args:
        nn: the module applied to the aggregated features.
        eps: initial :math:`\epsilon`.
        train_eps: learn :math:`\epsilon` (a parameter ``eps``; else a buffer).
        edge_dim: edge feature width, mapped to ``nn``'s input width by ``lin``; ``None``:
            the edge features already have the node width.
        aggregation: ``"auto"``, ``"gas"``, ``"gar"`` or ``"reference"``.

    Shapes:
        ``x`` ``[N, F]`` or a pair ``(x_src, x_dst or None)``; ``edge_index`` as
        for :class:`~fusegnn.layers.GINConv`; ``edge_attr`` ``[E, edge_dim]`` (or
        ``[E, F]``) in the graph's edge order -> ``nn``'s output on ``[N_dst, F]``.
    """

    def __init__(self, nn: Callable[[Tensor], Tensor], eps: float = 0.0, train_eps: bool = False,
                 edge_dim: int | None = None, aggregation: str = "auto") -> None:
        super().__init__()
        if not callable(nn):
            raise TypeError(f"GINEConv: nn must be a module or callable, got {type(nn).__name__}")
        self.nn = nn
        self.initial_eps = eps
        self.aggregation = check_aggregation(aggregation)
        eps_parameter(self, train_eps)
        if edge_dim is not None:
            if isinstance(edge_dim, bool) or not isinstance(edge_dim, int) or edge_dim <= 0:
                raise ValueError(f"GINEConv: edge_dim must be a positive int or None, got {edge_dim!r}")
            self.lin = torch.nn.Linear(edge_dim, _input_width(nn))
        else:
            self.lin = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_module(self.nn)
        with torch.no_grad():
            self.eps.fill_(self.initial_eps)
        if self.lin is not None:
            self.lin.reset_parameters()

    def forward(
        self, x: Tensor | tuple[Tensor, Tensor | None], edge_index: Graph | Tensor,
        edge_attr: Tensor | None = None, size: tuple[int, int] | None = None,
    ) -> Tensor:
        name = type(self).__name__
        x_src, x_dst, graph = layer_inputs(self, x, edge_index, size, dtype=self.eps.dtype)
        check_root_width(x_src, x_dst, name)
        if edge_attr is None:
            raise ValueError(f"{name}: edge_attr is required (the messages are ReLU(x_j + e_ji))")
        if self.lin is not None:
            check_edge_features(edge_attr, self.lin, graph, name)
            edge_attr = self.lin(edge_attr)
        elif not isinstance(edge_attr, Tensor) or edge_attr.dim() != 2 or edge_attr.size(1) != x_src.size(1):
            raise ValueError(
                f"{name}: edge_attr must be [E, {x_src.size(1)}] (the node width) without edge_dim, got "
                f"{tuple(getattr(edge_attr, 'shape', ()))}; set edge_dim to transform the edge features"
            )
        if edge_attr.dtype != x_src.dtype and torch.is_autocast_enabled(x_src.device.type):
            # the messages x_j + e_ji in torch's promoted dtype (PyG's): float32 for float32
            # x and the half edge rows of lin under autocast (edge_aggregate takes one dtype)
            common = torch.promote_types(x_src.dtype, edge_attr.dtype)
            x_src, edge_attr = x_src.to(common), edge_attr.to(common)
        out = edge_aggregate(graph, x_src, edge_attr, activation="relu", aggregation=self.aggregation)
        if x_dst is not None:
            out = out + (1 + self.eps) * x_dst
        return self.nn(out)

    def extra_repr(self) -> str:
        return f"aggregation={self.aggregation!r}"
