"""``nn.Module`` layers built on :mod:`fusegnn.sparse` (never on kernels directly).

Under ``torch.autocast`` each GNN layer returns the dtype PyG's layer of the same name
returns under the same autocast, on every backend and whichever order of aggregation
and projection it takes: half where its last op is a linear (``SAGEConv``, ``GraphConv``,
``SGConv``, ``GINConv``, ``GINEConv``), float32 where a float32 bias is added after the
aggregation (``GCNConv``, ``GATConv``, ``GATv2Conv``; without a bias these return half,
where PyG's float32 edge weights or coefficients promote the messages: fusegnn aggregates
in the features' dtype, accumulating in float32). ``TransformerConv`` returns float32
under CUDA autocast (its coefficients come out of a softmax, which CUDA autocast runs in
float32: :func:`fusegnn.sparse.edge_softmax`) and half under CPU autocast.
Parameter gradients are float32.
"""

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
