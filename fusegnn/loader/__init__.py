"""Mini-batch training on sampled neighbourhoods (GraphSAGE-style), sampled on the GPU.

* :class:`NeighborLoader` -- batches of seed nodes with their sampled multi-hop
  neighbourhoods, features and labels, in PyG's conventions (``n_id`` with the seeds
  first, local ``edge_index``, ``batch_size``) plus per-layer bipartite ``blocks``;
* :class:`NeighborSampler` -- the sampling core: uniform or weighted, with or without
  replacement, vectorised tensor ops on the graph's device (:mod:`fusegnn.loader.draws`);
* :class:`SampledSubgraph`, :class:`SampledBatch` -- what they return.

No compiled extension is needed (PyG's ``NeighborLoader`` needs ``pyg-lib`` or
``torch-sparse``).
"""

from fusegnn.loader.batch import SampledBatch
from fusegnn.loader.loader import NeighborLoader
from fusegnn.loader.sampler import NeighborSampler, SampledSubgraph

__all__ = ["NeighborLoader", "NeighborSampler", "SampledBatch", "SampledSubgraph"]
