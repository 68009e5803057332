"""``nn.Module`` layers built on :mod:`fusegnn.sparse` (never on kernels directly)."""

from fusegnn.layers.attention import SparseMultiheadAttention, SparseTransformerEncoderLayer
from fusegnn.layers.gat_conv import GATConv
from fusegnn.layers.gcn_conv import GCNConv
from fusegnn.layers.transformer_conv import TransformerConv

__all__ = ["GCNConv", "GATConv", "TransformerConv", "SparseMultiheadAttention", "SparseTransformerEncoderLayer"]
