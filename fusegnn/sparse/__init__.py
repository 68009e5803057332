"""Graphs, sparse formats and the public sparse ops (``spmm``, ``sddmm``, ``edge_softmax``).

Backends: ``reference`` (pure PyTorch, any device) is always registered; fused kernel
backends (``gas``, ``gar``) register themselves from :mod:`fusegnn.kernels` where they
can run. See :mod:`fusegnn.sparse.dispatch`.

Importing this package also registers the ops as ``torch.library`` custom ops
(``torch.ops.fusegnn.*``, :mod:`fusegnn.sparse.library`), which ``torch.compile`` uses.
"""

from fusegnn.sparse import dispatch, kernel_backends, library, reference, reference_grads
from fusegnn.sparse.dispatch import (
    AGGREGATIONS,
    Backend,
    available_backends,
    register_backend,
    resolve_aggregation,
)
from fusegnn.sparse.attention import gat_attention, gat_layer
from fusegnn.sparse.graph import CompressedEdges, Graph
from fusegnn.sparse.ops import as_graph, edge_index_of, edge_softmax, graph_arg, sddmm, spmm
from fusegnn.sparse.processing import (
    add_remaining_self_loops,
    add_self_loops,
    gcn_norm,
    remove_self_loops,
)
from fusegnn.sparse import masks
from fusegnn.sparse.block_layout import BlockLayout
from fusegnn.sparse.masks import Mask
from fusegnn.sparse.sparse_attention import explain_attention, sparse_attention

register_backend(
    Backend(
        name="reference",
        spmm=reference.spmm,
        sddmm=reference.sddmm,
        edge_softmax=reference.edge_softmax,
        spmm_backward=reference_grads.spmm_backward,
        sddmm_backward=reference_grads.sddmm_backward,
        edge_softmax_backward=reference_grads.edge_softmax_backward,
    )
)
dispatch.add_backend_loader(kernel_backends.register)

__all__ = [
    "AGGREGATIONS",
    "Backend",
    "BlockLayout",
    "CompressedEdges",
    "Graph",
    "Mask",
    "add_remaining_self_loops",
    "add_self_loops",
    "as_graph",
    "edge_index_of",
    "graph_arg",
    "available_backends",
    "edge_softmax",
    "explain_attention",
    "gat_attention",
    "gat_layer",
    "gcn_norm",
    "library",
    "masks",
    "register_backend",
    "remove_self_loops",
    "resolve_aggregation",
    "sddmm",
    "sparse_attention",
    "spmm",
]
