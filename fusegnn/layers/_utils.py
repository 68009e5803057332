"""Helpers shared by the layers: argument checks, graph inputs and PyG-style (lazy) initialisation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from fusegnn.sparse import Graph, graph_arg, spmm
from fusegnn.sparse.dispatch import needs_grad, takes_host_bound_reference
from fusegnn.sparse.processing import gcn_normalized
from fusegnn.sparse.halo import HaloGraph


def glorot_(tensor: Tensor) -> Tensor:
    """Glorot / Xavier uniform init over the last two axes (PyG's ``glorot``); a lazy
    parameter not yet materialised is left alone (it is initialised when it is)."""
    if tensor is None or is_lazy(tensor):
        return tensor
    stdv = math.sqrt(6.0 / (tensor.size(-2) + tensor.size(-1)))
    with torch.no_grad():
        return tensor.uniform_(-stdv, stdv)


def input_linear(in_channels: int, out_features: int, layer: str, *, bias: bool = False) -> nn.Linear:
    """A layer's input transform: ``nn.Linear(in_channels, out_features, bias=bias)`` (bias-free
    by default), or for ``in_channels=-1`` (PyG's lazy initialisation) an ``nn.LazyLinear``
    whose weight :func:`check_features` (Glorot) or :func:`check_linear_input` (``nn.Linear``'s
    own init, PyG's ``Linear`` default) materialises at the first forward. ``in_channels``
    must be a positive int or -1."""
    if isinstance(in_channels, bool) or not isinstance(in_channels, int):
        raise TypeError(
            f"{layer}: in_channels must be an int (a feature width, or -1 to infer it at the first "
            f"forward), got {type(in_channels).__name__}"
        )
    if in_channels == -1:
        return nn.LazyLinear(out_features, bias=bias)
    if in_channels <= 0:
        raise ValueError(
            f"{layer}: in_channels must be positive, or -1 to infer it from x at the first forward, "
            f"got {in_channels}"
        )
    return nn.Linear(in_channels, out_features, bias=bias)


def check_features(x: Tensor, layer: nn.Module) -> None:
    """``x`` is a floating ``[N, layer.in_channels]`` tensor of the dtype of ``layer.lin``'s
    weight (autocast, which casts inside the layer's ops, excepted).

    A lazy layer (``in_channels=-1``) is initialised here at its first forward, as PyG's
    are: ``lin.weight`` is materialised to ``[out, x.size(1)]`` with its own dtype and device
    (those it was given by ``.to()`` before) and Glorot-initialised, and ``in_channels``
    becomes ``x.size(1)`` (or the width of a weight that ``load_state_dict`` brought in).
    Optimizers are therefore created after that first forward, as with PyG."""
    name = type(layer).__name__
    check_node_features(x, name)
    if layer.in_channels == -1:
        _initialize_lazy(layer, x)
    if x.size(1) != layer.in_channels:
        raise ValueError(
            f"{name}: x has {x.size(1)} features per node but the layer was built with "
            f"in_channels={layer.in_channels}"
        )
    check_dtype(x, layer.lin.weight.dtype, name)


def check_node_features(x: Tensor, layer: str, what: str = "x") -> None:
    """``x`` is a floating ``[num_nodes, in_channels]`` tensor (``[num_edges, edge_dim]`` for
    ``what="edge_attr"``; errors name ``layer`` and ``what``)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{layer}: {what} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{layer}: {what} must be a floating tensor, got dtype {x.dtype}")
    if x.dim() != 2:
        shape = "[num_edges, edge_dim]" if what == "edge_attr" else "[num_nodes, in_channels]"
        raise ValueError(f"{layer}: {what} must have shape {shape}, got {tuple(x.shape)}")


def check_dtype(x: Tensor, dtype: torch.dtype, layer: str, what: str = "x") -> None:
    """``x`` has the layer's parameter dtype ``dtype`` (autocast, which casts inside the
    layer's ops, excepted)."""
    if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{layer}: {what} has dtype {x.dtype} but the layer's parameters are {dtype}; convert one "
            f"of them ({what}.to({dtype}) or layer.to({x.dtype}))"
        )


def channel_pair(in_channels: int | tuple[int, int], layer: str) -> tuple[int, int]:
    """PyG's ``in_channels`` of a layer with source and target inputs: one int for both,
    or a pair ``(in_src, in_dst)`` (either ``-1``: inferred at the first forward)."""
    if isinstance(in_channels, (tuple, list)):
        if len(in_channels) != 2:
            raise ValueError(
                f"{layer}: in_channels must be an int or a pair (in_src, in_dst), got {in_channels!r}"
            )
        return in_channels[0], in_channels[1]
    return in_channels, in_channels


_REDUCE_OF_AGGR = {"add": "sum", "sum": "sum", "mean": "mean", "max": "max"}


def check_reduce(aggr: str, layer: str) -> str:
    """The :func:`~fusegnn.sparse.spmm` ``reduce`` of PyG's ``aggr`` string (``"add"`` is
    ``"sum"``)."""
    if not isinstance(aggr, str) or aggr not in _REDUCE_OF_AGGR:
        raise ValueError(f"{layer}: aggr must be one of {tuple(_REDUCE_OF_AGGR)}, got {aggr!r}")
    return _REDUCE_OF_AGGR[aggr]


def reset_module(module) -> None:
    """PyG's ``reset``: ``module.reset_parameters()``, else that of each child in turn."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif isinstance(module, nn.Module):
        for child in module.children():
            reset_module(child)


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


def check_linear_input(
    x: Tensor, lin: nn.Linear, layer: nn.Module | str, name: str = "x", *, glorot: bool = True
) -> None:
    """``x`` is a floating ``[N, lin.in_features]`` tensor of ``lin.weight``'s dtype
    (autocast excepted), the input of one of a layer's transforms (``x_src`` of
    ``lin_src``, ``edge_attr`` of ``lin_edge``, ...); errors name ``layer`` (a layer or
    its name) and ``name``.

    A lazy ``lin`` (an ``nn.LazyLinear`` of ``in_channels=-1``) is materialised to
    ``x.size(1)`` input features here with ``nn.Linear``'s initialisation (that of PyG's
    ``Linear`` without a ``weight_initializer``), the weight then Glorot-initialised with
    ``glorot`` (PyG's ``weight_initializer='glorot'``, as in :func:`check_features`);
    ``glorot=False`` keeps ``nn.Linear``'s (PyG's ``Linear`` default: Kaiming-uniform weight,
    uniform bias). Create the optimizer after that first call."""
    if not isinstance(layer, str):
        layer = type(layer).__name__
    check_node_features(x, layer, name)
    if isinstance(lin.weight, nn.parameter.UninitializedParameter):  # (is_lazy, which Dynamo can trace)
        if torch.compiler.is_compiling():
            raise RuntimeError(
                f"{layer} with in_channels=-1 is initialised at its first forward, which torch.compile "
                "cannot trace: run one eager forward (or load a state dict) before compiling"
            )
        lin.in_features = x.size(1)
        with torch.no_grad():
            lin.weight.materialize((lin.out_features, x.size(1)))
            if lin.bias is not None and is_lazy(lin.bias):
                lin.bias.materialize((lin.out_features,))
        if glorot:  # PyG's draws: the Glorot weight, then the bias uniform in +-1/sqrt(in)
            glorot_(lin.weight)
            if lin.bias is not None:
                bound = 1.0 / math.sqrt(lin.in_features)
                with torch.no_grad():
                    lin.bias.uniform_(-bound, bound)
        else:
            lin.reset_parameters()
    if lin.in_features != lin.weight.size(1):  # (nn.Module.__setattr__ costs microseconds per call)
        lin.in_features = lin.weight.size(1)
    if x.size(1) != lin.in_features:
        per = "edge" if name == "edge_attr" else "node"
        raise ValueError(
            f"{layer}: {name} has {x.size(1)} features per {per} but the layer takes {lin.in_features}"
        )
    check_dtype(x, lin.weight.dtype, layer, name)


def check_attention_args(layer: str, heads: int, dropout: float, edge_dim: int | None) -> None:
    """The constructor arguments the attention layers share: ``heads >= 1``, ``dropout``
    in ``[0, 1)``, ``edge_dim`` a positive int or ``None``."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"{layer}: heads must be >= 1 (an int), got {heads!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"{layer}: dropout must be in [0, 1), got {dropout}")
    if edge_dim is not None and (isinstance(edge_dim, bool) or not isinstance(edge_dim, int) or edge_dim < 1):
        raise ValueError(f"{layer}: edge_dim must be a positive int or None, got {edge_dim!r}")


def check_edge_features(edge_attr: Tensor, lin_edge: nn.Linear, graph: Graph, layer: str) -> None:
    """``edge_attr`` is ``[E, lin_edge.in_features]`` (:func:`check_linear_input`) with one
    row per edge of ``graph`` (not checked while the count is unknown, under compilation)
    on its device."""
    check_linear_input(edge_attr, lin_edge, layer, "edge_attr")
    if graph.num_edges >= 0 and edge_attr.size(0) != graph.num_edges:
        raise ValueError(f"{layer}: edge_attr has {edge_attr.size(0)} rows but the graph has {graph.num_edges} edges")
    if edge_attr.device != graph.device:
        raise ValueError(f"{layer}: edge_attr is on {edge_attr.device} but the graph is on {graph.device}")


def graph_for(x: Tensor, edge_index_or_graph: Graph | Tensor, layer: str) -> Graph:
    """The square graph over ``x``'s nodes, checked against ``x``'s rows and device: any
    graph input :func:`~fusegnn.sparse.graph.coerce_graph` accepts (an ``edge_index``, a
    :class:`~fusegnn.sparse.Graph`, a ``torch.sparse`` adjacency, a networkx graph, the
    latter built on ``x``'s device); under ``torch.compile`` a reference to it
    (:func:`fusegnn.sparse.graph_arg`). On a :class:`fusegnn.distributed.DistGraph` it
    is the worker's :class:`~fusegnn.sparse.halo.HaloGraph` and ``x`` holds the owned
    nodes' rows: the ops fetch the halo rows they aggregate, so the layer runs unchanged."""
    if torch.compiler.is_compiling():  # its errors as they are (see coerce_graph)
        graph = graph_arg(edge_index_or_graph, x.size(0), name="edge_index", device=x.device)
    else:
        try:
            graph = graph_arg(edge_index_or_graph, x.size(0), name="edge_index", device=x.device)
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


def node_pair(x: Tensor | tuple, layer: str) -> tuple[Tensor, Tensor | None]:
    """``x`` as PyG's layers take it: one ``[N, F]`` tensor (the same nodes are sources and
    targets: ``(x, x)``) or a bipartite pair ``(x_src, x_dst)``, ``x_dst`` possibly ``None``
    (target nodes without features of their own). Returns ``(x_src, x_dst)``."""
    if isinstance(x, Tensor):
        return x, x
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{layer}: x must be a tensor or a pair (x_src, x_dst), got {len(x)} items")
        x_src, x_dst = x
        if not isinstance(x_src, Tensor):
            raise TypeError(f"{layer}: x_src (x[0]) must be a torch.Tensor, got {type(x_src).__name__}")
        if x_dst is not None and not isinstance(x_dst, Tensor):
            raise TypeError(f"{layer}: x_dst (x[1]) must be a torch.Tensor or None, got {type(x_dst).__name__}")
        return x_src, x_dst
    raise TypeError(f"{layer}: x must be a torch.Tensor or a pair (x_src, x_dst), got {type(x).__name__}")


def bipartite_graph_for(
    x_src: Tensor, num_dst: int | None, edge_index_or_graph: Graph | Tensor, layer: str
) -> Graph:
    """The graph from ``x_src``'s rows (sources) to ``num_dst`` targets, checked against
    them and ``x_src``'s device: any input :func:`graph_for` takes, where a
    :class:`~fusegnn.sparse.Graph` or a sparse ``adj_t`` ``[N_dst, N_src]`` carries its own
    sizes and an ``edge_index`` gets ``num_nodes=(x_src.size(0), num_dst)``. ``num_dst``
    ``None`` (no target features: PyG's ``(x_src, None)``) takes the graph's own target
    count, or ``x_src.size(0)`` for an ``edge_index``."""
    if num_dst is None and isinstance(edge_index_or_graph, Tensor) and edge_index_or_graph.layout == torch.strided:
        num_dst = x_src.size(0)
    num_nodes = (x_src.size(0), num_dst) if num_dst is not None else None
    if torch.compiler.is_compiling():
        graph = graph_arg(edge_index_or_graph, num_nodes, name="edge_index", device=x_src.device)
    else:
        try:
            graph = graph_arg(edge_index_or_graph, num_nodes, name="edge_index", device=x_src.device)
        except (TypeError, ValueError, IndexError) as err:
            raise type(err)(f"{layer}: {err}") from None
    if graph.num_src_nodes != x_src.size(0) or (num_dst is not None and graph.num_dst_nodes != num_dst):
        expected = f"{x_src.size(0)} x {num_dst if num_dst is not None else '?'}"
        raise ValueError(
            f"{layer}: the graph has {graph.num_src_nodes} x {graph.num_dst_nodes} (source x target) "
            f"nodes but the features give {expected}"
        )
    if graph.device != x_src.device:
        raise ValueError(
            f"{layer}: x is on {x_src.device} but the graph is on {graph.device}; move them to the same device"
        )
    return graph


def layer_inputs(
    layer: nn.Module,
    x: Tensor | tuple,
    edge_index_or_graph,
    size: tuple[int, int] | None = None,
    *,
    lin_src: nn.Linear | None = None,
    lin_dst: nn.Linear | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None, Graph]:
    """``(x_src, x_dst, graph)`` of a layer taking PyG's node input :func:`node_pair`, checked.

    Each of ``x_src`` and ``x_dst`` (when not ``None``) is checked against the linear map
    it feeds (:func:`check_linear_input`, which also materialises a lazy one), else as a
    floating ``[N, F]`` tensor of ``dtype`` (unless ``None``). The graph is the square
    graph over one tensor ``x`` (:func:`graph_for`), or the bipartite graph of a pair
    (:func:`bipartite_graph_for`; ``size`` ``(N_src, N_dst)``, PyG's ``size``, gives the
    target count when ``x_dst`` is ``None``). Errors name the layer and ``x`` (one
    tensor) or ``x_src`` / ``x_dst`` (a pair)."""
    name = type(layer).__name__
    x_src, x_dst = node_pair(x, name)
    pair = not isinstance(x, Tensor)
    for t, lin, what in ((x_src, lin_src, "x_src" if pair else "x"), (x_dst, lin_dst, "x_dst" if pair else "x")):
        if t is None:
            continue
        if lin is not None:
            check_linear_input(t, lin, layer, what, glorot=False)
        else:
            check_node_features(t, name, what)
            if dtype is not None:
                check_dtype(t, dtype, name, what)
    if size is not None:
        if not (isinstance(size, (tuple, list)) and len(size) == 2):
            raise ValueError(f"{name}: size must be a pair (num_src_nodes, num_dst_nodes), got {size!r}")
        if size[0] is not None and size[0] != x_src.size(0):
            raise ValueError(f"{name}: size[0] = {size[0]} but x_src has {x_src.size(0)} rows")
        if x_dst is not None and size[1] is not None and size[1] != x_dst.size(0):
            raise ValueError(f"{name}: size[1] = {size[1]} but x_dst has {x_dst.size(0)} rows")
    if not pair and size is None:
        return x_src, x_dst, graph_for(x, edge_index_or_graph, name)
    num_dst = x_dst.size(0) if x_dst is not None else (size[1] if size is not None else None)
    return x_src, x_dst, bipartite_graph_for(x_src, num_dst, edge_index_or_graph, name)


def normalized_graph(
    layer: nn.Module,
    x: Tensor,
    edge_index_or_graph: Graph | Tensor,
    edge_weight: Tensor | None,
    *,
    cached: bool,
    normalize: bool = True,
    improved: bool = False,
    add_self_loops: bool = True,
) -> Graph:
    """The graph a GCN-style layer aggregates over: ``edge_weight`` (if given) replacing the
    graph's weights, then, with ``normalize``, :func:`~fusegnn.sparse.processing.gcn_normalized`
    in ``x``'s dtype. With ``cached`` the first result is stored on the layer
    (``layer._cached_graph``) and returned from then on; under ``torch.compile`` the
    normalisation runs (and is cached on the input graph) inside the ``fusegnn::spmm`` op, so
    nothing is stored, and a graph an eager call stored is used as it is. A stored graph
    on another device or, normalised, in another dtype than ``x`` (the layer moved by
    ``.to()`` / ``.double()`` since) is built again. Normalised from edge weights that
    require grad, the graph serves this call with their gradient and is stored detached
    (as PyG's values: later calls reuse the first call's weights, and no gradient reaches
    the weights from them), so that a later backward never runs into this call's freed
    autograd graph."""
    stored = layer._cached_graph if cached else None
    if stored is not None and _fits(stored, x, normalize):
        return stored
    graph = graph_for(x, edge_index_or_graph, type(layer).__name__)
    if edge_weight is not None:
        graph = graph.with_edge_weight(edge_weight)
    if normalize:
        graph = gcn_normalized(graph, improved=improved, add_self_loops=add_self_loops, dtype=x.dtype)
    if cached and isinstance(graph, Graph):  # under torch.compile the op caches it on the graph
        weight = graph.edge_weight
        if weight is not None and weight.requires_grad:
            graph_kept = graph.with_edge_weight(weight.detach())
        else:
            graph_kept = graph
        layer._cached_graph = graph_kept
    return graph


def _fits(graph: Graph, x: Tensor, normalized: bool) -> bool:
    """Whether a stored graph serves ``x``: on its device, and with normalised weights in its dtype."""
    weight = graph.edge_weight
    return graph.device == x.device and not (normalized and weight is not None and weight.dtype != x.dtype)


def project_before_aggregating(
    graph: Graph, x: Tensor, in_features: int, out_features: int, reduce: str, aggregation: str,
    edge_weight: Tensor | None = None,
) -> bool:
    r"""Whether :math:`\mathrm{lin}(\bigoplus_j w_{ji} x_j)` is computed as
    :math:`\bigoplus_j w_{ji} \mathrm{lin}(x_j)` (a sum or a mean commutes with a linear map).

    Projecting first aggregates at ``out_features`` instead of ``in_features``: less GPU
    work, less memory and, on a distributed graph, a narrower halo exchange, whenever
    ``out_features < in_features``. It costs one thing: when neither ``x`` nor the edge
    weights need a gradient (a model's input features), the aggregation of a projected
    ``x`` has a backward, and the aggregation of ``x`` itself has none. In an eager
    training step on a small graph, which the host bounds (PyG's GIN and SAGE aggregate
    first), those backward launches cost more than the wider aggregation (H100, Cora and
    PubMed: ``benchmarks/NOTES-overhead.md``). So the input is aggregated first exactly
    when that aggregation would run the ATen reference as a host-bound op of a training
    step with no backward (:func:`fusegnn.sparse.dispatch.takes_host_bound_reference`:
    ``"auto"`` on CUDA, eager, edges x ``in_features`` below
    :data:`~fusegnn.sparse.dispatch.HOST_BOUND_FORWARD_WORK`); otherwise -- on the CPU,
    under ``no_grad``, ``torch.compile`` or a capture, with an explicit kernel, on a
    :class:`~fusegnn.sparse.halo.HaloGraph` (every worker must take the same order, and
    their local edge counts differ) -- every narrowing projection comes first.
    """
    if reduce == "max" or out_features >= in_features:
        return False
    if isinstance(graph, HaloGraph) or torch.compiler.is_compiling():
        return True
    weight = edge_weight if edge_weight is not None else graph.edge_weight
    if not torch.is_grad_enabled() or needs_grad(x, weight):
        return True
    return not takes_host_bound_reference(graph, x, aggregation, records_backward=False)


def aggregate_linear(
    graph: Graph, x: Tensor, lin: nn.Linear, reduce: str, aggregation: str, edge_weight: Tensor | None = None
) -> Tensor:
    r""":math:`\mathrm{lin}(\bigoplus_{j \to i} w_{ji} x_j)`: for a sum or a mean, which
    commute with the linear map, at the narrower of its input and output widths (the
    bias then in the aggregation's epilogue) when :func:`project_before_aggregating` says
    so; otherwise (a max, a widening map, a small eager graph's input) aggregating ``x`` first."""
    weight, bias = lin.weight, lin.bias
    if project_before_aggregating(graph, x, weight.size(1), weight.size(0), reduce, aggregation, edge_weight):
        h = F.linear(x, weight)
        return spmm(graph, h, edge_weight, reduce, bias=linear_bias(bias, h), aggregation=aggregation)
    return F.linear(spmm(graph, x, edge_weight, reduce, aggregation=aggregation), weight, bias)


def linear_bias(bias: Tensor | None, h: Tensor) -> Tensor | None:
    """``bias`` as ``F.linear`` adds it to its product ``h = F.linear(x, W)``: in ``h``'s
    dtype. A linear's bias moved after its product (into an aggregation's epilogue) must
    not change the result's dtype: under ``torch.autocast`` the linear casts its bias to
    half with its other inputs, whereas ``h + bias`` would promote to the float32 bias's."""
    return bias if bias is None or bias.dtype == h.dtype else bias.to(h.dtype)


def linear_then_bias(a: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``F.linear(a, weight) + bias``, the bias added in its own dtype (torch's promotion:
    float32 under ``torch.autocast`` for a float32 bias, as PyG's layers that add their
    bias after the aggregation give), fused into the GEMM where that changes nothing."""
    if bias is None or not torch.is_autocast_enabled(a.device.type):
        return F.linear(a, weight, bias)
    return F.linear(a, weight) + bias
