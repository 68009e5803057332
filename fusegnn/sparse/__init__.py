"""Graphs, sparse formats and the public sparse ops (``spmm``, ``sddmm``, ``edge_softmax``,
``edge_aggregate``):
the GNN core. Transformer attention (masks, block layouts, ``sparse_attention``) builds on
it in :mod:`fusegnn.attention`.

Backends: ``reference`` (pure PyTorch, any device) is always registered; fused kernel
backends (``gas``, ``gar``, and the spmm-only row windows ``window``) register themselves
from :mod:`fusegnn.kernels` where they can run. See :mod:`fusegnn.sparse.dispatch`.

Importing this package also registers the ops as ``torch.library`` custom ops
(``torch.ops.fusegnn.*``, :mod:`fusegnn.sparse.library`), which ``torch.compile`` uses.
"""

from fusegnn.sparse import dispatch, kernel_backends, library, reference, reference_grads
from fusegnn.sparse.dispatch import (
    AGGREGATIONS,
    SPMM_AGGREGATIONS,
    Backend,
    available_backends,
    register_backend,
    resolve_aggregation,
)
from fusegnn.sparse.gat import gat_attention, gat_layer
from fusegnn.sparse.gatv2 import gatv2_attention
from fusegnn.sparse.graph import CompressedEdges, Graph
from fusegnn.sparse.halo import HaloGraph
from fusegnn.sparse.ops import as_graph, edge_aggregate, edge_index_of, edge_softmax, graph_arg, sddmm, spmm
from fusegnn.sparse.propagate import propagate
from fusegnn.sparse.vector_ops import prefers_dense, vsddmm, vspmm, window_spmm
from fusegnn.sparse.vector_sparse import RowWindows, TransposedVectorSparse, VectorSparse
from fusegnn.sparse.window_aggregation import graph_windows, window_tile_density
from fusegnn.sparse.processing import (
    add_remaining_self_loops,
    add_self_loops,
    gcn_norm,
    remove_self_loops,
)

register_backend(
    Backend(
        name="reference",
        spmm=reference.spmm,
        sddmm=reference.sddmm,
        edge_softmax=reference.edge_softmax,
        spmm_backward=reference_grads.spmm_backward,
        sddmm_backward=reference_grads.sddmm_backward,
        edge_softmax_backward=reference_grads.edge_softmax_backward,
        edge_aggregate=reference.edge_aggregate,
        edge_aggregate_backward=reference_grads.edge_aggregate_backward,
    )
)
dispatch.add_backend_loader(kernel_backends.register)

__all__ = [
    "AGGREGATIONS",
    "SPMM_AGGREGATIONS",
    "Backend",
    "CompressedEdges",
    "Graph",
    "HaloGraph",
    "add_remaining_self_loops",
    "add_self_loops",
    "as_graph",
    "edge_aggregate",
    "edge_index_of",
    "graph_arg",
    "available_backends",
    "edge_softmax",
    "gat_attention",
    "gat_layer",
    "gatv2_attention",
    "gcn_norm",
    "library",
    "propagate",
    "register_backend",
    "remove_self_loops",
    "resolve_aggregation",
    "RowWindows",
    "TransposedVectorSparse",
    "VectorSparse",
    "vsddmm",
    "vspmm",
    "prefers_dense",
    "window_spmm",
    "graph_windows",
    "window_tile_density",
    "sddmm",
    "spmm",
]

# Transformer attention moved to fusegnn.attention; these names stay importable from here
# (resolved on first use: fusegnn.attention imports this package, so importing it at the
# top would be an import circle).
_ATTENTION_NAMES = ("BlockLayout", "Mask", "explain_attention", "masks", "sparse_attention")


def __getattr__(name: str):
    if name in _ATTENTION_NAMES:
        import fusegnn.attention

        return getattr(fusegnn.attention, name)
    raise AttributeError(f"module 'fusegnn.sparse' has no attribute {name!r}")
