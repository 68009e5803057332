"""``nn.Module`` layers built on :mod:`fusegnn.sparse` (never on kernels directly)."""

from fusegnn.layers.attention import SparseMultiheadAttention, SparseTransformerEncoderLayer
from fusegnn.layers.gat_conv import GATConv
from fusegnn.layers.gatv2_conv import GATv2Conv
from fusegnn.layers.gcn_conv import GCNConv

__all__ = ["GCNConv", "GATConv", "GATv2Conv", "SparseMultiheadAttention", "SparseTransformerEncoderLayer"]
