r"""The ``(edge_index, alpha)`` that the attention layers return with
``return_attention_weights``, in the form PyG's layers give for each graph input."""

from __future__ import annotations

import torch
from torch import Tensor

from fusegnn.sparse import Graph, edge_index_of

__all__ = ["attention_weights"]


def _is_sparse(value) -> bool:
    return isinstance(value, Tensor) and value.layout in (torch.sparse_coo, torch.sparse_csr)


def attention_weights(
    edge_index_or_graph, graph: Graph, alpha: Tensor, *, alpha_valued: bool = True
) -> tuple[Tensor, Tensor]:
    r"""The attention layers' second output for ``return_attention_weights``.

    For an ``edge_index`` or a :class:`~fusegnn.sparse.Graph` input: ``(edge_index,
    alpha)`` of the processed ``graph`` (its edge order; self-loops included).

    For a ``torch.sparse`` ``adj_t`` input, PyG's form. With ``alpha_valued`` (GAT,
    GATv2): ``(adj, alpha)`` with ``adj`` the processed graph as a coalesced sparse
    matrix of the input's layout (COO or CSR), ``[N_dst, N_src, H]`` (rows are targets)
    holding ``alpha`` as its values, and ``alpha`` ``[E, H]`` in that matrix's
    (row-major) order, so ``adj.values()`` is ``alpha``. Without (TransformerConv, which
    processes nothing): ``(adj_t, alpha)``, the input matrix itself and ``alpha`` in the
    order of its stored entries (that of ``graph``'s edges).

    ``graph``'s edges are unique for a sparse input (a coalesced matrix, self-loops
    replaced by one per node), so the row-major order is a permutation of them.
    """
    if not _is_sparse(edge_index_or_graph):
        return edge_index_of(graph), alpha
    if not alpha_valued:
        return edge_index_or_graph, alpha
    src, dst = graph.edge_index.long()
    n_src, n_dst = graph.num_src_nodes, graph.num_dst_nodes
    order = torch.argsort(dst * n_src + src, stable=True)  # row-major: by target, then source
    src, dst, alpha = src[order], dst[order], alpha[order]
    size = (n_dst, n_src) + tuple(alpha.shape[1:])
    if edge_index_or_graph.layout == torch.sparse_coo:
        adj = torch.sparse_coo_tensor(torch.stack([dst, src]), alpha, size, is_coalesced=True)
    else:
        crow = torch.zeros(n_dst + 1, dtype=torch.int64, device=dst.device)
        crow[1:] = torch.cumsum(torch.bincount(dst, minlength=n_dst), 0)
        adj = torch.sparse_csr_tensor(crow, src, alpha, size)
    return adj, alpha
