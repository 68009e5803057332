"""Helpers shared by the layers: argument checks, graph inputs and PyG-style (lazy) initialisation."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from fusegnn.sparse import Graph, graph_arg
from fusegnn.sparse.halo import HaloGraph


def glorot_(tensor: Tensor) -> Tensor:
    """Glorot / Xavier uniform init over the last two axes (PyG's ``glorot``); a lazy
    parameter not yet materialised is left alone (it is initialised when it is)."""
    if tensor is None or is_lazy(tensor):
        return tensor
    stdv = math.sqrt(6.0 / (tensor.size(-2) + tensor.size(-1)))
    with torch.no_grad():
        return tensor.uniform_(-stdv, stdv)


def input_linear(in_channels: int, out_features: int, layer: str) -> nn.Linear:
    """A layer's bias-free input transform ``lin``: ``nn.Linear(in_channels, out_features)``,
    or for ``in_channels=-1`` (PyG's lazy initialisation) an ``nn.LazyLinear`` whose weight
    :func:`check_features` materialises at the first forward. ``in_channels`` must be a
    positive int or -1."""
    if isinstance(in_channels, bool) or not isinstance(in_channels, int):
        raise TypeError(
            f"{layer}: in_channels must be an int (a feature width, or -1 to infer it at the first "
            f"forward), got {type(in_channels).__name__}"
        )
    if in_channels == -1:
        return nn.LazyLinear(out_features, bias=False)
    if in_channels <= 0:
        raise ValueError(
            f"{layer}: in_channels must be positive, or -1 to infer it from x at the first forward, "
            f"got {in_channels}"
        )
    return nn.Linear(in_channels, out_features, bias=False)


def check_features(x: Tensor, layer: nn.Module) -> None:
    """``x`` is a floating ``[N, layer.in_channels]`` tensor of the dtype of ``layer.lin``'s
    weight (autocast, which casts inside the layer's ops, excepted).

    A lazy layer (``in_channels=-1``) is initialised here at its first forward, as PyG's
    are: ``lin.weight`` is materialised to ``[out, x.size(1)]`` with its own dtype and device
    (those it was given by ``.to()`` before) and Glorot-initialised, and ``in_channels``
    becomes ``x.size(1)`` (or the width of a weight that ``load_state_dict`` brought in).
    Optimizers are therefore created after that first forward, as with PyG."""
    name = type(layer).__name__
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: x must be a floating tensor, got dtype {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name}: x must have shape [num_nodes, in_channels], got {tuple(x.shape)}")
    if layer.in_channels == -1:
        _initialize_lazy(layer, x)
    if x.size(1) != layer.in_channels:
        raise ValueError(
            f"{name}: x has {x.size(1)} features per node but the layer was built with "
            f"in_channels={layer.in_channels}"
        )
    dtype = layer.lin.weight.dtype
    if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{name}: x has dtype {x.dtype} but the layer's parameters are {dtype}; convert one "
            f"of them (x.to({dtype}) or layer.to({x.dtype}))"
        )


def _initialize_lazy(layer: nn.Module, x: Tensor) -> None:
    """The first forward of a layer built with ``in_channels=-1`` (see :func:`check_features`)."""
    if torch.compiler.is_compiling():
        raise RuntimeError(
            f"{type(layer).__name__}(in_channels=-1) is initialised at its first forward, which "
            "torch.compile cannot trace: run one eager forward (or load a state dict) before compiling"
        )
    lin = layer.lin
    if is_lazy(lin.weight):
        with torch.no_grad():
            lin.weight.materialize((lin.out_features, x.size(1)))
        glorot_(lin.weight)
    lin.in_features = layer.in_channels = lin.weight.size(1)


def graph_for(x: Tensor, edge_index_or_graph: Graph | Tensor, layer: str) -> Graph:
    """The square graph over ``x``'s nodes, checked against ``x``'s rows and device: any
    graph input :func:`~fusegnn.sparse.graph.coerce_graph` accepts (an ``edge_index``, a
    :class:`~fusegnn.sparse.Graph`, a ``torch.sparse`` adjacency, a networkx graph, the
    latter built on ``x``'s device); under ``torch.compile`` a reference to it
    (:func:`fusegnn.sparse.graph_arg`). On a :class:`fusegnn.distributed.DistGraph` it
    is the worker's :class:`~fusegnn.sparse.halo.HaloGraph` and ``x`` holds the owned
    nodes' rows: the ops fetch the halo rows they aggregate, so the layer runs unchanged."""
    if torch.compiler.is_compiling():  # its errors as they are (see coerce_graph)
        graph = graph_arg(edge_index_or_graph, x.size(0), name="edge_index_or_graph", device=x.device)
    else:
        try:
            graph = graph_arg(edge_index_or_graph, x.size(0), name="edge_index_or_graph", device=x.device)
        except (TypeError, ValueError, IndexError) as err:
            raise type(err)(f"{layer}: {err}") from None
    if isinstance(graph, HaloGraph):  # a worker's share of a distributed graph: x holds its owned nodes
        if graph.num_own != x.size(0):
            raise ValueError(
                f"{layer}: this worker owns {graph.num_own} nodes of the distributed graph but x has "
                f"{x.size(0)} rows (pass the owned nodes' rows)"
            )
    elif graph.is_bipartite or graph.num_nodes != x.size(0):
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
