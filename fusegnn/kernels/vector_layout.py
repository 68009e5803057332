r"""The vector-sparse layout's index arithmetic in plain torch (no Triton), shared by the
kernels (:mod:`fusegnn.kernels.vector_spmm`: references and the dense fallback) and the
op layer (:class:`fusegnn.sparse.VectorSparse`).

A vector-sparse ``[M, K]`` matrix stores vectors of ``V`` consecutive rows: the vectors of
row group :math:`g` (rows :math:`gV .. gV + V - 1`) are ``row_ptr[g] .. row_ptr[g + 1] - 1``,
vector :math:`i` sits in column ``cols[i]`` and holds ``values[i, 0:V]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["densify_vectors", "vector_groups"]


def vector_groups(row_ptr: Tensor, num_vectors: int) -> Tensor:
    """The row group of each of the ``num_vectors`` stored vectors (``int64``): one
    ``searchsorted`` on the device, no host sync."""
    vectors = torch.arange(num_vectors, device=row_ptr.device, dtype=torch.int64)
    return torch.searchsorted(row_ptr.long(), vectors, right=True) - 1


def densify_vectors(values: Tensor, groups: Tensor, cols: Tensor, num_rows: int, num_cols: int) -> Tensor:
    r"""The dense ``[num_rows, num_cols]`` matrix holding vector ``values[i]`` (``[nnz_v, V]``)
    at row group ``groups[i]``, column ``cols[i]``: :math:`A[g_i V + r, c_i] \mathrel{+}=
    \mathrm{values}[i, r]` (vectors at one position add, as in the kernels' products).
    Written in place of a ``[G, V, K]`` zero tensor (no permuted copy); differentiable in
    ``values`` (its gradient gathers the dense gradient at the vectors)."""
    V = values.size(1)
    G = -(-num_rows // V)
    rows = groups.long()[:, None] * V + torch.arange(V, device=values.device)  # [nnz_v, V]
    flat = (rows * num_cols + cols.long()[:, None]).reshape(-1)
    dense = values.new_zeros(G * V * num_cols).index_add_(0, flat, values.reshape(-1))
    return dense.view(G * V, num_cols)[:num_rows]
