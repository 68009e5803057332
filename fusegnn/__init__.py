"""fusegnn: GNN training and sparse attention on fused GPU sparse kernels.

The package is split the way a GNN layer is (fuseGNN, Chen et al. 2020):

* :mod:`fusegnn.sparse` -- graphs, sparse formats and the public sparse ops
  (``spmm``, ``sddmm``, ``edge_softmax``) with their GAS / GAR / reference dispatch;
* :mod:`fusegnn.attention` -- masked (sparse) transformer attention on that core: masks,
  block layouts, ``sparse_attention`` and its cost model;
* :mod:`fusegnn.kernels` -- Triton kernels, each beside the PyTorch reference it must match;
* :mod:`fusegnn.layers` -- ``nn.Module`` layers (``GCNConv``, ``GATConv``, ...);
* :mod:`fusegnn.losses` -- fused losses (``linear_cross_entropy``: no logits in memory);
* :mod:`fusegnn.datasets` -- data loaders and offline generators;
* :mod:`fusegnn.capture` -- :func:`graphed_step`: a whole training step captured into a
  CUDA graph and replayed (small graphs are bound by kernel launches).
"""

from fusegnn import attention, capture, datasets, layers, losses, sparse
from fusegnn.capture import CaptureError, GraphedStep, graphed_step
from fusegnn.sparse import Graph

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "Graph",
    "GraphedStep",
    "attention",
    "capture",
    "datasets",
    "graphed_step",
    "layers",
    "losses",
    "sparse",
    "__version__",
]
