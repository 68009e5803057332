"""``nn.Module`` layers built on :mod:`fusegnn.sparse` (never on kernels directly)."""

from fusegnn.layers.appnp import APPNP
from fusegnn.layers.attention import SparseMultiheadAttention, SparseTransformerEncoderLayer
from fusegnn.layers.gat_conv import GATConv
from fusegnn.layers.gatv2_conv import GATv2Conv
from fusegnn.layers.gcn_conv import GCNConv
from fusegnn.layers.gin_conv import GINConv
from fusegnn.layers.gine_conv import GINEConv
from fusegnn.layers.graph_conv import GraphConv
from fusegnn.layers.sage_conv import SAGEConv
from fusegnn.layers.semi_structured_linear import SemiStructuredLinear
from fusegnn.layers.sg_conv import SGConv
from fusegnn.layers.transformer_conv import TransformerConv
from fusegnn.layers.vector_sparse_linear import VectorSparseLinear

__all__ = [
    "APPNP",
    "GCNConv",
    "GATConv",
    "GATv2Conv",
    "GINConv",
    "GINEConv",
    "GraphConv",
    "SAGEConv",
    "SGConv",
    "SemiStructuredLinear",
    "TransformerConv",
    "SparseMultiheadAttention",
    "SparseTransformerEncoderLayer",
    "VectorSparseLinear",
]
