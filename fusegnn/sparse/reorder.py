r"""Locality orderings of a graph's nodes (neighbours get nearby ids), for
:meth:`fusegnn.sparse.Graph.reorder`.

:func:`locality_order` returns ``perm`` with new node :math:`i` = old node ``perm[i]``;
the reordered graph has edge :math:`\pi^{-1}(j) \to \pi^{-1}(i)` for every edge
:math:`j \to i` (same edge order, same weights), so that with ``x_new = x[perm]``,
``spmm(new, x_new) == spmm(graph, x)[perm]``. Close ids make the rows of a row window
(:class:`~fusegnn.sparse.vector_sparse.RowWindows`) share columns -- denser tiles -- and
keep the rows a segment gathers in L2 for every kernel.

Methods:

* ``"rcm"``: SciPy's reverse Cuthill-McKee on the symmetrised adjacency (bandwidth);
* ``"degree"``: by total degree, highest first (ties by id);
* ``"metis"``: METIS parts (through ``pymetis``, where it imports), nodes ordered by
  part, ids kept in order within a part.

This module works on edge tensors only (it does not import :class:`Graph`, which calls it).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["REORDER_METHODS", "inverse_permutation", "locality_order"]

REORDER_METHODS = ("rcm", "degree", "metis")


def inverse_permutation(perm: Tensor) -> Tensor:
    """``inv`` with ``inv[perm[i]] = i`` (int64, on ``perm``'s device)."""
    inverse = torch.empty(perm.numel(), dtype=torch.long, device=perm.device)
    inverse[perm.long()] = torch.arange(perm.numel(), device=perm.device)
    return inverse


def _symmetric_csr(src: Tensor, dst: Tensor, n: int):
    import scipy.sparse as sp

    src = src.long().cpu().numpy()
    dst = dst.long().cpu().numpy()
    # int32 counts: duplicates are summed when the matrix is built, and int8 would wrap to 0
    # at 256 copies of an edge (dropping it from the graph METIS partitions)
    adj = sp.coo_matrix((np.ones(src.size, dtype=np.int32), (dst, src)), shape=(n, n)).tocsr()
    return (adj + adj.T).tocsr()


def _metis_order(src: Tensor, dst: Tensor, n: int, parts: int) -> Tensor:
    try:
        import pymetis
    except ImportError as exc:
        raise ImportError("method='metis' needs pymetis (pip install pymetis)") from exc
    adj = _symmetric_csr(src, dst, n)
    adj.setdiag(0)
    adj.eliminate_zeros()
    _, membership = pymetis.part_graph(parts, xadj=adj.indptr.tolist(), adjncy=adj.indices.tolist())
    return torch.from_numpy(np.argsort(np.asarray(membership), kind="stable"))


def locality_order(src: Tensor, dst: Tensor, num_nodes: int, method: str = "rcm", *, parts: int = 64) -> Tensor:
    """The ``int64`` permutation (on ``src``'s device) of ``method`` for the graph with
    edges ``src -> dst`` over ``num_nodes`` nodes; ``parts`` is METIS's part count.
    Computed on the host (SciPy / pymetis)."""
    if not isinstance(method, str) or method not in REORDER_METHODS:
        raise ValueError(f"method must be one of {REORDER_METHODS}, got {method!r}")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive int, got {parts!r}")
    n = int(num_nodes)
    if n == 0:  # SciPy's RCM fails on an empty matrix; every method orders nothing
        perm = torch.zeros(0, dtype=torch.long)
    elif method == "rcm":
        from scipy.sparse.csgraph import reverse_cuthill_mckee

        order = reverse_cuthill_mckee(_symmetric_csr(src, dst, n), symmetric_mode=True)
        perm = torch.from_numpy(order.astype(np.int64))
    elif method == "degree":
        degree = torch.bincount(src.long(), minlength=n) + torch.bincount(dst.long(), minlength=n)
        perm = torch.sort(-degree.cpu(), stable=True).indices
    else:
        perm = _metis_order(src, dst, n, min(parts, n))
    return perm.to(src.device)
