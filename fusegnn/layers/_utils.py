"""Helpers shared by the layers: argument checks and PyG-style initialisation."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusegnn.sparse import Graph, graph_arg


def glorot_(tensor: Tensor) -> Tensor:
    """Glorot / Xavier uniform init over the last two axes (PyG's ``glorot``)."""
    if tensor is None:
        return tensor
    stdv = math.sqrt(6.0 / (tensor.size(-2) + tensor.size(-1)))
    with torch.no_grad():
        return tensor.uniform_(-stdv, stdv)


def check_features(x: Tensor, in_channels: int, layer: str) -> None:
    """``x`` is a floating ``[N, in_channels]`` tensor."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{layer}: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{layer}: x must be a floating tensor, got dtype {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{layer}: x must have shape [num_nodes, in_channels], got {tuple(x.shape)}")
    if x.size(1) != in_channels:
        raise ValueError(
            f"{layer}: x has {x.size(1)} features per node but the layer was built with "
            f"in_channels={in_channels}"
        )


def graph_for(x: Tensor, edge_index_or_graph: Graph | Tensor, layer: str) -> Graph:
    """The square graph over ``x``'s nodes, checked against ``x``'s rows and device (under
    ``torch.compile`` a reference to it: :func:`fusegnn.sparse.graph_arg`)."""
    try:
        graph = graph_arg(edge_index_or_graph, x.size(0), name="edge_index_or_graph")
    except (TypeError, ValueError, IndexError) as err:
        raise type(err)(f"{layer}: {err}") from None
    if graph.is_bipartite or graph.num_nodes != x.size(0):
        raise ValueError(
            f"{layer}: the graph has {graph.num_src_nodes} x {graph.num_dst_nodes} nodes "
            f"but x has {x.size(0)} rows"
        )
    if graph.device != x.device:
        raise ValueError(
            f"{layer}: x is on {x.device} but the graph is on {graph.device}; "
            "move them to the same device"
        )
    return graph
