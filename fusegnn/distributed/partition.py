r"""Split a graph's nodes into ``P`` parts for partition-parallel training.

The cost of a partition is the **edge cut** (edges whose endpoints lie in different parts:
each is a halo row moved per layer) and the **balance** (the largest part over the mean:
the slowest worker sets the step time). Two methods:

* ``"metis"``: METIS's multilevel k-way partitioning (``pymetis``, an optional extra),
  which minimises the cut under a balance constraint: equal node counts, or with
  ``balance_on="edges"`` equal incoming edges (each node weighted by its in-degree + 1);
* ``"contiguous"``: the dependency-free fallback. Nodes are put in a locality order --
  reverse Cuthill-McKee (:func:`scipy.sparse.csgraph.reverse_cuthill_mckee`), a
  breadth-first order that keeps neighbours close -- and the order is cut into ``P``
  consecutive runs of (nearly) equal incoming edge count (``balance_on="edges"``, the
  default) or node count (``"nodes"``).

``"auto"`` is METIS when ``pymetis`` imports, else contiguous. Both are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from fusegnn.sparse.graph import integer_index, is_integer

__all__ = ["Partition", "partition_graph", "METHODS"]

METHODS = ("auto", "metis", "contiguous")


@dataclass(frozen=True)
class Partition:
    """A node partition.

    Attributes:
        parts: ``[N]`` int64 part of each node.
        perm: ``[N]`` int64 node ids ordered by part (and, inside a part, by the method's
            order): part ``p``'s nodes are ``perm[offsets[p]:offsets[p + 1]]``.
        offsets: ``[P + 1]`` int64 start of each part in ``perm``.
        edge_cut: edges ``j -> i`` with ``parts[j] != parts[i]`` (each direction counted).
        balance: largest part size over the mean part size (1.0 is perfect).
        method: ``"metis"`` or ``"contiguous"`` (what ran).
        balanced_on: ``"edges"`` or ``"nodes"``: what the parts were balanced on (what
            ran: METIS falls back to nodes where edge weights leave a part empty).
    """

    parts: Tensor
    perm: Tensor
    offsets: Tensor
    edge_cut: int
    balance: float
    method: str
    balanced_on: str = "nodes"

    @property
    def num_parts(self) -> int:
        return self.offsets.numel() - 1

    def sizes(self) -> list[int]:
        """Nodes per part."""
        return (self.offsets[1:] - self.offsets[:-1]).tolist()

    def nodes(self, part: int) -> Tensor:
        """The (global) ids of ``part``'s nodes, in partition order: a new tensor (a view
        of ``perm`` let an in-place shuffle of one part's ids reorder the partition itself,
        and shares built from it afterwards disagree with the other workers' on the order
        of that part's rows)."""
        index = integer_index(part)  # numpy / 0-d tensor ints too
        if index is None or not 0 <= index < self.num_parts:
            # (a negative part slices offsets from the end: -1 gave an empty tensor)
            raise ValueError(f"part must be an int in [0, {self.num_parts}), got {part!r}")
        return self.perm[self.offsets[index]:self.offsets[index + 1]].clone()


def partition_graph(graph, num_parts: int, method: str = "auto", *, balance_on: str = "edges",
                    seed: int = 0) -> Partition:
    """Partition ``graph``'s nodes into ``num_parts`` parts (see the module docstring).

    Args:
        graph: a square :class:`~fusegnn.sparse.Graph` or an ``edge_index`` ``[2, E]``
            (with ``N = max id + 1``); read on the host.
        num_parts: ``P >= 1``.
        method: ``"auto"``, ``"metis"`` (needs ``pymetis``) or ``"contiguous"``.
        balance_on: what the parts balance: ``"nodes"`` or ``"edges"`` (incoming edges
            per part, plus one per node). A worker's full-graph aggregation time and most
            of its memory (its CSR / CSC and per-edge buffers) follow its edges, so
            ``"edges"`` (the default) evens the slowest worker; ``Partition.balance``
            still reports node counts. Where METIS can balance the edges only by leaving
            a part empty (a hub heavier than a part's share, on a small graph), it
            balances node counts instead. On four H100s (Reddit-sized graph, METIS) it
            made the GCN h128 / GAT 8x16 steps 2.7 / 3.0 % faster than ``"nodes"``
            (8.64 / 22.04 against 8.88 / 22.71 ms; ``benchmarks/NOTES-dist.md``).
        seed: METIS's seed (its result is deterministic for a given seed).
    """
    from fusegnn.sparse.graph import as_graph

    graph = as_graph(graph, name="graph")
    if graph.is_bipartite:
        raise ValueError(f"graph must be square to be partitioned, got {graph!r}")
    if not is_integer(num_parts) or num_parts < 1:
        raise ValueError(f"num_parts must be a positive int, got {num_parts!r}")
    num_parts = int(num_parts)  # a NumPy int (a count computed with NumPy) is taken as one
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if balance_on not in ("nodes", "edges"):
        raise ValueError(f"balance_on must be 'nodes' or 'edges', got {balance_on!r}")
    n = graph.num_nodes
    if num_parts > max(n, 1):
        raise ValueError(f"num_parts={num_parts} exceeds the graph's {n} nodes")
    src = graph.src.detach().cpu().numpy().astype(np.int64)
    dst = graph.dst.detach().cpu().numpy().astype(np.int64)
    if method == "auto":
        method = "metis" if _has_pymetis() else "contiguous"
    if num_parts == 1:
        parts = np.zeros(n, dtype=np.int64)
        order = np.arange(n, dtype=np.int64)
    elif method == "metis":
        weights = np.bincount(dst, minlength=n) + 1 if balance_on == "edges" else None
        parts = _metis_parts(src, dst, n, num_parts, seed, weights)
        if weights is not None and np.unique(parts).size < num_parts:
            # a hub heavier than a part's share of the edges: no edge balance keeps every part
            parts = _metis_parts(src, dst, n, num_parts, seed)
            balance_on = "nodes"
        order = np.arange(n, dtype=np.int64)
    else:
        order = locality_order(src, dst, n)
        parts = _contiguous_parts(order, np.bincount(dst, minlength=n), num_parts, balance_on)
    return _partition_of(parts, order, src, dst, num_parts, method, balance_on)


def locality_order(src: np.ndarray, dst: np.ndarray, n: int) -> np.ndarray:
    """Reverse Cuthill-McKee order of the symmetrised graph (self-loops dropped): a
    breadth-first order from a low-degree node that keeps neighbours close together."""
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    return np.asarray(reverse_cuthill_mckee(_symmetric_adjacency(src, dst, n), symmetric_mode=True), dtype=np.int64)


def _symmetric_adjacency(src: np.ndarray, dst: np.ndarray, n: int):
    """The ``[N, N]`` scipy CSR pattern of the undirected graph, without self-loops or
    duplicate edges."""
    import scipy.sparse as sp

    keep = src != dst
    rows = np.concatenate([src[keep], dst[keep]])
    cols = np.concatenate([dst[keep], src[keep]])
    adj = sp.csr_matrix((np.ones(rows.size, dtype=np.int8), (rows, cols)), shape=(n, n))
    adj.sum_duplicates()
    return adj


def _contiguous_parts(order: np.ndarray, in_degree: np.ndarray, num_parts: int, balance_on: str) -> np.ndarray:
    """Cut ``order`` into ``num_parts`` consecutive runs of near-equal weight (node count,
    or incoming edges + 1 per node so that edge-free nodes are spread too): each cut where
    the running weight is nearest its share, the node that crosses it on the nearer side."""
    n = order.size
    if balance_on == "nodes":
        bounds = (np.arange(num_parts + 1, dtype=np.int64) * n) // num_parts
    else:
        weight = np.cumsum(in_degree[order].astype(np.float64) + 1.0)
        cuts = [0]
        for k in range(1, num_parts):  # where the running weight is nearest k/P of it; every part non-empty
            share = weight[-1] * k / num_parts
            crossing = int(np.searchsorted(weight, share, side="left"))  # the node that reaches the share
            before = weight[crossing - 1] if crossing else 0.0
            cut = crossing + 1 if weight[crossing] - share <= share - before else crossing
            cuts.append(min(max(cut, cuts[-1] + 1), n - (num_parts - k)))
        bounds = np.asarray(cuts + [n], dtype=np.int64)
    parts = np.empty(n, dtype=np.int64)
    parts[order] = np.repeat(np.arange(num_parts, dtype=np.int64), np.diff(bounds))
    return parts


def _has_pymetis() -> bool:
    try:
        import pymetis  # noqa: F401
    except ImportError:
        return False
    return True


def _metis_parts(src: np.ndarray, dst: np.ndarray, n: int, num_parts: int, seed: int,
                 weights: np.ndarray | None = None) -> np.ndarray:
    """METIS k-way parts of the symmetrised graph (no self-loops or duplicate edges),
    balancing the sum of ``weights`` (one positive integer per node; ``None``: node counts)."""
    try:
        import pymetis
    except ImportError as err:
        raise ImportError("method='metis' needs pymetis (pip install pymetis); method='contiguous' "
                          "needs nothing") from err
    adj = _symmetric_adjacency(src, dst, n)
    options = pymetis.Options(seed=seed) if hasattr(pymetis, "Options") else None
    kwargs = {"options": options} if options is not None else {}
    if weights is not None:
        kwargs["vweights"] = weights.astype(np.int64)
    _, membership = pymetis.part_graph(num_parts, xadj=adj.indptr, adjncy=adj.indices, **kwargs)
    return np.asarray(membership, dtype=np.int64)


def _partition_of(parts: np.ndarray, order: np.ndarray, src: np.ndarray, dst: np.ndarray, num_parts: int,
                  method: str, balanced_on: str = "nodes") -> Partition:
    """The :class:`Partition` of ``parts``, nodes of a part in ``order``."""
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    perm = np.lexsort((rank, parts))  # by part, then by the order
    sizes = np.bincount(parts, minlength=num_parts)
    if (sizes == 0).any() and parts.size:  # (a graph without nodes has its one part empty)
        raise ValueError(f"the {method} partition left part(s) {np.flatnonzero(sizes == 0).tolist()} empty")
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    edge_cut = int((parts[src] != parts[dst]).sum())
    balance = float(sizes.max() / sizes.mean()) if parts.size else 1.0
    return Partition(
        parts=torch.from_numpy(parts.astype(np.int64)), perm=torch.from_numpy(perm.astype(np.int64)),
        offsets=torch.from_numpy(offsets.astype(np.int64)), edge_cut=edge_cut, balance=balance, method=method,
        balanced_on=balanced_on,
    )
