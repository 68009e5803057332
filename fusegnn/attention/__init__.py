"""Masked (sparse) transformer attention on fusegnn's sparse core.

* :mod:`fusegnn.attention.masks` -- :class:`Mask`, exact predicates over (query, key)
  pairs, and their constructors (``causal``, ``sliding_window``, ``longformer``, ...);
* :mod:`fusegnn.attention.block_layout` -- :class:`BlockLayout`, a mask's block-sparse
  (BCSR) layout, the format of the fused block kernels
  (:mod:`fusegnn.kernels.block_attention`);
* :mod:`fusegnn.attention.sparse_attention` -- :func:`sparse_attention` and
  :func:`explain_attention`: the five paths (reference, element, block, vector, dense
  SDPA) and the ``"auto"`` rule;
* :mod:`fusegnn.attention.vector_windows` -- the vector path's structure (query windows
  with compacted key columns, :mod:`fusegnn.kernels.vector_attention`), cached per mask;
* :mod:`fusegnn.attention.cost_model` -- the calibrated cost model the ``"auto"`` rule
  compares the paths with;
* :mod:`fusegnn.attention.library` -- the block kernels as ``torch.library`` custom ops,
  for ``torch.compile``;
* :mod:`fusegnn.attention.handles` -- integer handles of masks and layouts for those ops.

The element path runs on the GNN ops of :mod:`fusegnn.sparse` (``sddmm`` ->
``edge_softmax`` -> ``spmm``); this package builds on that one, never the reverse.
"""

from fusegnn.attention import masks
from fusegnn.attention.block_layout import BlockLayout
from fusegnn.attention.masks import Mask
from fusegnn.attention.sparse_attention import explain_attention, sparse_attention

__all__ = ["BlockLayout", "Mask", "explain_attention", "masks", "sparse_attention"]
