"""The graph container every sparse op and layer takes.

A :class:`Graph` holds a directed graph in COO form, the format fuseGNN takes as
input because it is the cheapest to build or modify:

* ``edge_index[0]`` are the **source** nodes ``j`` and ``edge_index[1]`` the **target**
  nodes ``i`` of the edges ``j -> i`` (PyG's ``source_to_target`` flow): messages flow
  from ``x[j]`` into ``out[i]``;
* the number of source and target nodes may differ (bipartite graphs, or a
  ``L_q x L_k`` attention mask): ``num_nodes=(num_src_nodes, num_dst_nodes)``.

Graph processing that several ops need is computed lazily, once, on the graph's device
and cached on the instance (a :class:`Graph` is immutable):

* ``in_degree`` / ``out_degree``: edges per target / per source;
* ``csr``: edges grouped by target (GAR forward), a :class:`CompressedEdges`
  ``(ptr, index, perm)`` with ``ptr`` of length ``num_dst_nodes + 1``, ``index`` the
  source of each grouped edge and ``perm`` its position in COO order, so that
  ``edge_index[0, perm] == index``;
* ``csc``: edges grouped by source (GAR backward), the same with roles swapped.

Within one group, edges keep their COO order (stable sort), so conversions are
deterministic.

A graph holds the tensors it is given, not copies: an ``edge_index`` changed in place
after a format was built leaves that format stale (build a new graph instead). Weights
changed in place are read as they are by the ops; the cached GCN normalisation
(:func:`fusegnn.sparse.processing.gcn_normalized`) notices the change and is recomputed.

**Handles.** Every graph gets a process-unique integer :attr:`Graph.uid` when it is built
and is listed under it in a weak registry (:func:`graph_by_uid`): the ``torch.library``
custom ops of :mod:`fusegnn.sparse.library` take that integer instead of the (non-tensor)
graph, so that ``torch.compile`` sees each sparse op as one opaque node, and look the
graph up when they run. The registry holds no reference: a graph lives as long as the
user (or a layer's cache) keeps it; a handle is never reused.
"""

from __future__ import annotations

import itertools
import numbers
import sys
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, TypeVar

import torch
from torch import Tensor

from fusegnn.sparse.reorder import inverse_permutation, locality_order

__all__ = ["Graph", "CompressedEdges", "as_graph", "check_edge_weight", "coerce_graph", "graph_by_uid"]

_INDEX_DTYPES = (torch.int32, torch.int64)

# Live graphs by handle (see "Handles" above). Handles count up from 1 and are never
# reused, so a stale handle can only miss, never find another graph.
_UIDS = itertools.count(1)
_REGISTRY: "weakref.WeakValueDictionary[int, Graph]" = weakref.WeakValueDictionary()


def graph_by_uid(uid: int) -> "Graph":
    """The live :class:`Graph` whose :attr:`Graph.uid` is ``uid``.

    Raises :class:`LookupError` when no such graph is alive (it was garbage collected,
    or the handle never belonged to a graph of this process)."""
    graph = _REGISTRY.get(uid)
    if graph is None:
        raise LookupError(
            f"no live fusegnn Graph has uid {uid}: the graph was garbage collected (keep a "
            "reference to it while ops or compiled models that use it run) or the handle "
            "comes from another process"
        )
    return graph


class CompressedEdges(NamedTuple):
    """Edges grouped by one endpoint (CSR by target or CSC by source).

    Attributes:
        ptr: ``[num_groups + 1]`` int64 offsets; the edges of group ``g`` are
            positions ``ptr[g]:ptr[g + 1]`` of ``index`` and ``perm``.
        index: ``[E]`` the other endpoint of each grouped edge.
        perm: ``[E]`` int64 position of each grouped edge in the COO edge order.
    """

    ptr: Tensor
    index: Tensor
    perm: Tensor


class Graph:
    r"""A directed graph (or sparsity pattern) in COO form with cached derived formats.

    Args:
        edge_index: ``[2, E]`` integer tensor (int32 or int64); row 0 holds the
            source node of each edge, row 1 its target. Kept as given (not copied)
            when contiguous, else stored as a contiguous copy.
        num_nodes: number of nodes, or ``(num_src_nodes, num_dst_nodes)`` for a
            bipartite graph. Inferred as ``max(edge_index) + 1`` when omitted.
        edge_weight: optional ``[E]`` or ``[E, H]`` floating tensor of per-edge
            (per-head) weights, stored with the graph for layers that use it.
        validate: check ids and shapes (on by default; the checks need one
            device-to-host sync).

    Duplicate edges and self-loops are kept as given; processing that removes or adds
    them (see :mod:`fusegnn.sparse.processing`) returns a new graph.
    """

    def __init__(
        self,
        edge_index: Tensor,
        num_nodes: int | tuple[int, int] | None = None,
        edge_weight: Tensor | None = None,
        *,
        validate: bool = True,
    ) -> None:
        if (validate or num_nodes is None) and torch.compiler.is_compiling():
            # checking the ids, or counting the nodes, reads them back to the host: a data-dependent
            # guard that Dynamo refuses with a message about symbols. The layers take an edge_index
            # under compile (fusegnn.sparse.library)
            raise RuntimeError(
                "fusegnn.sparse.Graph(...) cannot be built inside a torch.compile'd function: build the "
                "Graph once before the compiled call and pass it in, or pass the edge_index tensor "
                "itself to the layers (they accept it under torch.compile)"
            )
        if not isinstance(edge_index, Tensor):
            raise TypeError(
                f"edge_index must be a torch.Tensor of shape [2, E], got {type_name(edge_index)}"
            )
        if edge_index.dtype not in _INDEX_DTYPES:
            raise TypeError(
                f"edge_index must hold int32 or int64 node ids, got dtype {edge_index.dtype}"
            )
        if edge_index.dim() != 2 or edge_index.size(0) != 2:
            raise ValueError(
                f"edge_index must have shape [2, E], got {tuple(edge_index.shape)}"
            )
        if edge_index.is_sparse or edge_index.layout != torch.strided:
            raise TypeError("edge_index must be a dense (strided) tensor; use Graph.from_sparse")
        # The fused kernels read the rows src / dst as flat [E] buffers (stride 1); a view
        # such as the transpose of an [E, 2] tensor is copied once here (a no-op otherwise).
        edge_index = edge_index.contiguous()
        self._edge_index = edge_index
        num_src, num_dst = self._resolve_num_nodes(edge_index, num_nodes)
        self._num_src = num_src
        self._num_dst = num_dst
        # meta tensors hold no values: there are no ids to check
        if validate and edge_index.numel() > 0 and edge_index.device.type != "meta":
            self._check_ids(edge_index, num_src, num_dst)
        if edge_weight is not None:
            edge_weight = check_edge_weight(edge_weight, self, "edge_weight")
        self._edge_weight = edge_weight
        self._cache: dict[str, Any] = {}
        self._register()

    def _register(self) -> None:
        """Give this graph a fresh handle (see :attr:`uid`) and list it in the registry."""
        self._uid = next(_UIDS)
        _REGISTRY[self._uid] = self

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_uid"]  # a handle belongs to one live object of one process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.copy / deepcopy / pickle: the copy is a graph of its own, with its own handle
        self.__dict__.update(state)
        self._register()

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _resolve_num_nodes(
        edge_index: Tensor, num_nodes: int | tuple[int, int] | None
    ) -> tuple[int, int]:
        if num_nodes is None:
            if edge_index.numel() == 0:
                return 0, 0
            if edge_index.device.type == "meta":
                raise ValueError(
                    "num_nodes must be given for an edge_index on the meta device "
                    "(it holds no ids to infer it from)"
                )
            n = int(edge_index.max()) + 1
            return n, n
        if isinstance(num_nodes, (tuple, list)):
            if len(num_nodes) != 2:
                raise ValueError(
                    f"num_nodes must be an int or a pair (num_src_nodes, num_dst_nodes), got {num_nodes!r}"
                )
            num_src, num_dst = (_as_count(n, "num_nodes") for n in num_nodes)
            return num_src, num_dst
        n = _as_count(num_nodes, "num_nodes")
        return n, n

    @staticmethod
    def _check_ids(edge_index: Tensor, num_src: int, num_dst: int) -> None:
        mins = edge_index.amin(dim=1).tolist()
        maxs = edge_index.amax(dim=1).tolist()
        for row, name, bound in ((0, "source", num_src), (1, "target", num_dst)):
            if mins[row] < 0:
                raise IndexError(
                    f"edge_index has a negative {name} node id ({mins[row]}); node ids must be >= 0"
                )
            if maxs[row] >= bound:
                raise IndexError(
                    f"edge_index has {name} node id {maxs[row]} but num_nodes gives only "
                    f"{bound} {name} nodes (ids must be < {bound})"
                )

    @classmethod
    def from_sparse(cls, adj: Tensor, *, transpose: bool = False) -> "Graph":
        """Build a graph from a ``torch.sparse`` COO or CSR matrix.

        By default the matrix is read as an **aggregation** matrix ``A`` with
        ``out = A @ x``: entry ``A[i, j]`` is the edge ``j -> i`` with weight ``A[i, j]``
        (rows are targets). ``transpose=True`` reads it as an adjacency matrix with rows
        as sources instead. Stored values become ``edge_weight``; edges are listed in
        row-major order. The values are copied (the graph holds no view of ``adj``).
        """
        if not isinstance(adj, Tensor) or adj.layout not in (torch.sparse_coo, torch.sparse_csr):
            raise TypeError(
                "adj must be a torch.sparse COO or CSR tensor, got "
                f"{getattr(adj, 'layout', type(adj).__name__)}"
            )
        if adj.dim() != 2:
            raise ValueError(f"adj must be a 2-D sparse matrix, got shape {tuple(adj.shape)}")
        if adj.layout == torch.sparse_csr:
            crow, col, values = adj.crow_indices(), adj.col_indices(), adj.values()
            counts = crow[1:] - crow[:-1]
            row = torch.repeat_interleave(torch.arange(adj.size(0), device=crow.device), counts)
        else:
            adj = adj.coalesce()
            row, col = adj.indices()
            values = adj.values()
        n_rows, n_cols = adj.shape
        if transpose:
            edge_index = torch.stack([row, col]).to(torch.int64)
            num_nodes = (n_rows, n_cols)
        else:
            edge_index = torch.stack([col, row]).to(torch.int64)
            num_nodes = (n_cols, n_rows)
        if num_nodes[0] == num_nodes[1]:
            num_nodes = num_nodes[0]
        # a copy: a view of the values would keep ``adj`` alive as long as the graph, and
        # torch.compile cannot take a view of a sparse tensor as an input
        weight = values.clone() if values.is_floating_point() else None
        return cls(edge_index, num_nodes, weight, validate=False)

    @classmethod
    def from_networkx(
        cls,
        nx_graph: Any,
        *,
        weight: str | None = None,
        device: torch.device | str | None = None,
    ) -> "Graph":
        """Build a graph from a networkx graph.

        Nodes are numbered in ``nx_graph.nodes`` order. An undirected graph gives both
        directions of each edge (a self-loop once); a directed one gives its edges as
        they are. ``weight`` names an edge attribute to use as ``edge_weight``
        (missing values count as 1.0).
        """
        import networkx as nx

        if not isinstance(nx_graph, nx.Graph):
            raise TypeError(
                f"nx_graph must be a networkx graph (networkx.Graph or a subclass), got {type_name(nx_graph)}"
            )
        ids = {node: k for k, node in enumerate(nx_graph.nodes)}
        pairs, weights = [], []
        for u, v, data in nx_graph.edges(data=True):
            w = float(data.get(weight, 1.0)) if weight is not None else 1.0
            pairs.append((ids[u], ids[v]))
            weights.append(w)
            if not nx_graph.is_directed() and u != v:
                pairs.append((ids[v], ids[u]))
                weights.append(w)
        edge_index = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).t().contiguous()
        edge_weight = torch.tensor(weights, dtype=torch.float32) if weight is not None else None
        graph = cls(edge_index, nx_graph.number_of_nodes(), edge_weight, validate=False)
        return graph.to(device) if device is not None else graph

    # ------------------------------------------------------------------ basic facts
    @property
    def uid(self) -> int:
        """Process-unique integer handle of this graph (never reused); the custom ops of
        :mod:`fusegnn.sparse.library` take it in place of the graph (:func:`graph_by_uid`)."""
        return self._uid

    @property
    def edge_index(self) -> Tensor:
        """``[2, E]`` COO edge list (row 0 sources, row 1 targets)."""
        return self._edge_index

    @property
    def src(self) -> Tensor:
        """``[E]`` source node of each edge."""
        return self._edge_index[0]

    @property
    def dst(self) -> Tensor:
        """``[E]`` target node of each edge."""
        return self._edge_index[1]

    @property
    def edge_weight(self) -> Tensor | None:
        """Per-edge weights stored with the graph, or ``None``."""
        return self._edge_weight

    @property
    def num_edges(self) -> int:
        return self._edge_index.size(1)

    @property
    def num_src_nodes(self) -> int:
        return self._num_src

    @property
    def num_dst_nodes(self) -> int:
        return self._num_dst

    @property
    def num_nodes(self) -> int:
        """Number of nodes; only defined for a square (non-bipartite) graph."""
        return square_node_count(self._num_src, self._num_dst)

    @property
    def is_bipartite(self) -> bool:
        return self._num_src != self._num_dst

    @property
    def device(self) -> torch.device:
        return self._edge_index.device

    @property
    def index_dtype(self) -> torch.dtype:
        return self._edge_index.dtype

    @property
    def avg_degree(self) -> float:
        """Average in-degree ``E / num_dst_nodes`` (the GAS / GAR rule reads the smaller of
        the in- and out-degree: :func:`fusegnn.sparse.dispatch.smaller_side_degree`)."""
        return self.num_edges / max(self._num_dst, 1)

    def __repr__(self) -> str:
        size = (
            f"num_nodes={self._num_src}"
            if not self.is_bipartite
            else f"num_nodes=({self._num_src}, {self._num_dst})"
        )
        weighted = ", weighted" if self._edge_weight is not None else ""
        return f"Graph({size}, num_edges={self.num_edges}{weighted}, device={self.device})"

    # ------------------------------------------------------------------ derived, cached
    def _cached(self, key: str, compute):
        if key not in self._cache:
            self._cache[key] = cache_value(compute, self.device)
        return self._cache[key]

    @property
    def in_degree(self) -> Tensor:
        """``[num_dst_nodes]`` int64 number of incoming edges of each target."""
        return self._cached(
            "in_degree", lambda: torch.bincount(self.dst, minlength=self._num_dst)
        )

    @property
    def out_degree(self) -> Tensor:
        """``[num_src_nodes]`` int64 number of outgoing edges of each source."""
        return self._cached(
            "out_degree", lambda: torch.bincount(self.src, minlength=self._num_src)
        )

    @property
    def csr(self) -> CompressedEdges:
        """Edges grouped by target: ``index`` holds sources (GAR forward)."""
        return self._cached("csr", lambda: self._group("in_degree", self.dst, self.src, self._num_dst))

    @property
    def csc(self) -> CompressedEdges:
        """Edges grouped by source: ``index`` holds targets (GAR backward)."""
        return self._cached("csc", lambda: self._group("out_degree", self.src, self.dst, self._num_src))

    def _group(self, degree_key: str, group: Tensor, other: Tensor, num_groups: int) -> CompressedEdges:
        """:func:`_compress`, reusing cached degrees or else caching the ones it finds
        (``bincount`` is slow on sorted ids, where every atomic hits one counter)."""
        compressed = _compress(group, other, self._cache.get(degree_key), num_groups)
        if degree_key not in self._cache:
            self._cache[degree_key] = cache_value(lambda: compressed.ptr[1:] - compressed.ptr[:-1], self.device)
        return compressed

    def cached(self, key: str, compute, *, structural: bool = False):
        """Cache ``compute()`` on this graph under ``key`` (for graph processing results
        shared between layers, e.g. a normalised copy). Returns the cached value.

        ``structural=True`` declares that the value depends on the edges only, not on the
        edge weights: :meth:`with_edge_weight` then shares it with the re-weighted graph
        (GAR work lists, self-loop graphs, ...), so re-normalising does not rebuild it."""
        prefix = "struct:" if structural else "user:"
        return self._cached(prefix + key, compute)

    def peek_cached(self, key: str, *, structural: bool = False):
        """What :meth:`cached` holds under ``key`` (``None`` if nothing: computes nothing)."""
        return self._cache.get(("struct:" if structural else "user:") + key)

    # ------------------------------------------------------------------ transforms
    def to(self, device: torch.device | str) -> "Graph":
        """The same graph on ``device`` (cached formats are recomputed there lazily)."""
        device = torch.device(device)
        if device == self.device:
            return self
        weight = self._edge_weight.to(device) if self._edge_weight is not None else None
        return Graph(
            self._edge_index.to(device),
            (self._num_src, self._num_dst),
            weight,
            validate=False,
        )

    def with_edge_weight(self, edge_weight: Tensor | None) -> "Graph":
        """The same edges with other weights; cached formats are shared, not recomputed.
        A subclass's copy is of that subclass, with its attributes."""
        graph = object.__new__(type(self))
        graph.__dict__.update(self.__dict__)  # the edges, and a subclass's own attributes
        graph._edge_weight = (
            check_edge_weight(edge_weight, self, "edge_weight") if edge_weight is not None else None
        )
        structural = ("in_degree", "out_degree", "csr", "csc")
        graph._cache = {
            k: v for k, v in self._cache.items() if k in structural or k.startswith("struct:")
        }
        graph._register()
        return graph

    def reversed(self) -> "Graph":
        r"""The graph with every edge reversed, :math:`j \to i` becoming :math:`i \to j`, in
        the same edge order and with the same edge weights (the transposed aggregation
        matrix :math:`A^\top`: ``spmm(graph.reversed(), g)`` is the gradient of
        ``spmm(graph, x)`` with respect to ``x``).

        Cached: the edge structure once per structure (shared with :meth:`with_edge_weight`
        copies, like the other formats), the weighted graph once per graph."""
        bare = self._cached(
            "struct:reversed",
            lambda: Graph(self._edge_index.flip(0), (self._num_dst, self._num_src), validate=False),
        )
        if self._edge_weight is None:
            return bare
        return self._cached("reversed", lambda: bare.with_edge_weight(self._edge_weight))

    def reorder(self, method: str = "rcm", **options: Any) -> "tuple[Graph, Tensor]":
        """``(reordered graph, perm)``, new node ``i`` = old node ``perm[i]``: a locality
        ordering (``"rcm"``, ``"degree"``, ``"metis"``); see :func:`fusegnn.sparse.reorder.locality_order`.
        Same edge order and weights; ``x[perm]`` are the reordered graph's features."""
        if self.is_bipartite:
            raise ValueError("reorder needs a square graph (num_src_nodes == num_dst_nodes)")
        perm = locality_order(self.src, self.dst, self._num_src, method, **options)
        edge_index = inverse_permutation(perm)[self._edge_index.long()].to(self.index_dtype)
        return Graph(edge_index, self._num_src, self._edge_weight, validate=False), perm

    def to_dense(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """Dense ``[num_dst_nodes, num_src_nodes]`` aggregation matrix ``A`` with
        ``A[i, j] = sum of the weights of edges j -> i`` (1 per edge when unweighted),
        so that ``spmm(graph, x) == A @ x``. Meant for tests and small graphs."""
        if self._edge_weight is not None and self._edge_weight.dim() != 1:
            raise ValueError("to_dense needs a 1-D edge_weight (one weight per edge)")
        values = (
            self._edge_weight.to(dtype)
            if self._edge_weight is not None
            else torch.ones(self.num_edges, dtype=dtype, device=self.device)
        )
        dense = torch.zeros(self._num_dst, self._num_src, dtype=dtype, device=self.device)
        dense.index_put_((self.dst.long(), self.src.long()), values, accumulate=True)
        return dense


def _compress(
    group: Tensor, other: Tensor, counts: Tensor | None = None, num_groups: int | None = None
) -> CompressedEdges:
    """Group edges by ``group`` with a stable sort: all tensor ops, on the graph's device.

    ``perm`` stably sorts ``group`` (:func:`_stable_group_sort`), so edges of one group
    keep their COO order and the result is the same on every run and device. ``ptr`` is
    the cumulative sum of ``counts`` (the group sizes) when given, else it is read off
    the sorted ids with a binary search per group.
    """
    if num_groups is None:
        if counts is None:
            raise ValueError("_compress needs counts or num_groups")
        num_groups = counts.numel()
    perm, keys = _stable_group_sort(group, num_groups)
    if counts is not None:
        ptr = torch.zeros(num_groups + 1, dtype=torch.int64, device=group.device)
        torch.cumsum(counts, dim=0, out=ptr[1:])
    else:
        if num_groups >= torch.iinfo(keys.dtype).max:
            keys = keys.to(torch.int64)
        bounds = torch.arange(num_groups + 1, dtype=keys.dtype, device=group.device)
        ptr = torch.searchsorted(keys, bounds)
    index = other.clone() if perm is None else other[perm]
    if perm is None:
        perm = torch.arange(group.numel(), dtype=torch.int64, device=group.device)
    return CompressedEdges(ptr=ptr, index=index, perm=perm)


def _stable_group_sort(group: Tensor, num_groups: int) -> tuple[Tensor | None, Tensor]:
    """``(perm, group[perm])`` for a stable sort of ``group`` (ids in ``[0, num_groups)``);
    ``perm`` is ``None`` when ``group`` is already sorted (the identity).

    Two shortcuts over a plain ``argsort(stable=True)`` (on an H200 with 114.6M edges:
    stable int64 sort 10.1 ms, int32 4.7 ms, see ``benchmarks/NOTES-spmm.md``):

    * a ``group`` that is already sorted (a coalesced ``edge_index`` grouped by this
      endpoint) needs no sort (one pass to check);
    * otherwise the keys are sorted as int32 when the ids fit, which halves the radix
      passes of the GPU's stable (radix) sort.
    """
    num_edges = group.numel()
    on_meta = group.device.type == "meta"  # holds no values to inspect
    if num_edges <= 1 or (not on_meta and bool((group[1:] >= group[:-1]).all())):
        return None, group
    if group.dtype != torch.int32 and num_groups <= torch.iinfo(torch.int32).max:
        group = group.to(torch.int32)
    keys, perm = torch.sort(group, stable=True)
    return perm, keys


def _stable_group_perm(group: Tensor, num_groups: int) -> Tensor:
    """int64 permutation that stably sorts ``group`` (see :func:`_stable_group_sort`)."""
    perm, _ = _stable_group_sort(group, num_groups)
    if perm is None:
        return torch.arange(group.numel(), dtype=torch.int64, device=group.device)
    return perm


def _as_count(value: Any, name: str) -> int:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a single integer, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            import numpy as np

            if isinstance(value, np.integer):
                value = int(value)
        except ImportError:  # pragma: no cover - numpy is a dependency
            pass
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


_T = TypeVar("_T")
_CACHE_BUILDER: list[ThreadPoolExecutor] = []
_CACHE_BUILDER_LOCK = threading.Lock()


def outside_graph_pools(compute: Callable[[], _T], device: torch.device) -> _T:
    """``compute()`` with its CUDA memory taken from the ordinary allocator, never from a
    CUDA-graph memory pool, so that what it returns can be cached across graph replays.

    ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees) routes every allocation
    of the *thread* that warms up or records a graph into that graph's private pool, which
    later replays overwrite; a per-graph cache (a normalised graph, a CSR, a work list)
    built inside a compiled op would live there. So on CUDA, and when not capturing
    (where a cache cannot be built anyway: it reads sizes back to the host), the cache is
    computed by a helper thread on the caller's stream, and the caller waits for it: the
    same work in the same stream order, with memory of the ordinary allocator. Cache
    misses are rare (once per graph and kind), so the hand-over costs nothing per step.
    """
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return compute()
    stream = torch.cuda.current_stream(device)

    def on_stream() -> _T:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            return compute()

    with _CACHE_BUILDER_LOCK:
        if not _CACHE_BUILDER:
            _CACHE_BUILDER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="fusegnn-cache"))
        builder = _CACHE_BUILDER[0]
    if threading.current_thread().name.startswith("fusegnn-cache"):
        return compute()  # a cache built while building another: already on the helper thread
    return builder.submit(on_stream).result()


def cache_value(compute: Callable[[], _T], device: torch.device) -> _T:
    """``compute()`` made to be kept across calls: its memory outside CUDA-graph pools
    (:func:`outside_graph_pools`) and its tensors normal ones even when the first call runs
    under ``torch.inference_mode()``. A graph outlives the inference block that first
    processed it, and an inference tensor in its cache would break every later use that
    autograd records (it cannot be saved for a backward) or that reads its version counter
    (the kernels' weight memos)."""
    return outside_graph_pools(lambda: outside_inference_mode(compute), device)


def outside_inference_mode(compute: Callable[[], _T]) -> _T:
    """``compute()`` with ``torch.inference_mode`` off: for a value kept beyond the call (a
    graph's or a mask's cache), whose tensors must stay normal ones (see :func:`cache_value`)."""
    if torch.is_inference_mode_enabled():
        with torch.inference_mode(False):
            return compute()
    return compute()


def square_node_count(num_src: int, num_dst: int) -> int:
    """The node count of a square graph with these sizes (a ``ValueError`` if bipartite)."""
    if num_src != num_dst:
        raise ValueError(
            f"graph is bipartite ({num_src} source x {num_dst} target nodes); use num_src_nodes / num_dst_nodes"
        )
    return num_src


def check_edge_weight(edge_weight: Tensor, graph: Graph, name: str = "edge_weight") -> Tensor:
    """Validate a per-edge (per-head) weight tensor against ``graph``; returns it."""
    if not isinstance(edge_weight, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(edge_weight).__name__}")
    if not edge_weight.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {edge_weight.dtype}")
    if edge_weight.dim() not in (1, 2) or edge_weight.size(0) != graph.num_edges:
        raise ValueError(
            f"{name} must have shape [E] or [E, H] with E = {graph.num_edges} edges, "
            f"got {tuple(edge_weight.shape)}"
        )
    if edge_weight.device != graph.device:
        raise ValueError(
            f"{name} is on {edge_weight.device} but the graph is on {graph.device}; "
            "move them to the same device"
        )
    return edge_weight


# ----------------------------------------------------------------------------- graph inputs
GRAPH_INPUTS = (
    "a fusegnn.sparse.Graph or an edge_index tensor ([2, E] int32 / int64 node ids), "
    "a torch.sparse adjacency matrix (COO or CSR, rows = targets) or a networkx.Graph"
)

# Graphs converted from torch.sparse adjacencies, by id(adj): (weak reference to adj, its
# version counter when converted, the graph). See _graph_of_sparse.
_SPARSE_GRAPHS: dict[int, tuple[weakref.ref, int, Graph]] = {}


def coerce_graph(graph: Any, name: str = "graph", *, device: torch.device | str | None = None) -> Graph | Tensor:
    """``graph`` as a :class:`Graph`, or the dense ``edge_index`` tensor it is (left to the
    caller, which builds a graph from it or, under ``torch.compile``, refers to it).

    The one place where every graph input of the ops and layers is recognised:

    * a :class:`Graph` is returned as it is, a strided tensor (an ``edge_index``) too;
    * an object whose type defines ``__fusegnn_graph__`` (a
      :class:`fusegnn.distributed.DistGraph`) gives the graph that method returns;
    * a ``torch.sparse`` COO or CSR matrix is read as PyG reads one: as ``adj_t``, the
      **aggregation** matrix with rows as targets, ``adj[i, j] != 0`` the edge ``j -> i``
      (:meth:`Graph.from_sparse`); float values become the graph's ``edge_weight``, and a
      COO matrix is coalesced (duplicate entries summed). The graph is cached per
      adjacency tensor (by identity, checked against its version counter, so changing
      its values in place converts it again) for as long as that tensor lives;
    * a networkx graph (:meth:`Graph.from_networkx`) becomes a graph on ``device``, nodes
      numbered in ``G.nodes`` order, the edge attribute ``"weight"`` its ``edge_weight``
      when any edge has one (networkx's own convention, as in ``nx.to_scipy_sparse_array``;
      edges without it weigh 1). It is converted on every call: a networkx graph can change
      without a trace, so a graph used more than once is better converted once by
      :meth:`Graph.from_networkx`.

    Under ``torch.compile`` neither conversion can be traced (Dynamo refuses sparse tensors
    as inputs and would unroll networkx's Python loops), so there anything but a
    :class:`Graph` or an ``edge_index`` is a :class:`TypeError` that says to build the
    :class:`Graph` before the compiled call. Any other type is a :class:`TypeError` naming
    ``name`` and listing the accepted inputs.
    """
    if isinstance(graph, Graph):
        return graph
    if isinstance(graph, Tensor) and graph.layout == torch.strided:
        return graph
    own_graph = getattr(type(graph), "__fusegnn_graph__", None)
    if own_graph is not None:  # an object that holds a graph, e.g. a fusegnn.distributed.DistGraph
        held = own_graph(graph)
        if not isinstance(held, Graph):
            raise TypeError(f"{name}: {type_name(graph)}.__fusegnn_graph__() must return a fusegnn.sparse.Graph, "
                            f"got {type_name(held)}")
        return held
    if torch.compiler.is_compiling():
        # A constant message: older Dynamo reports an exception raised while tracing with
        # its arguments unrendered, so a formatted one would reach the user as a blank.
        raise TypeError(
            "under torch.compile the graph must be a fusegnn.sparse.Graph or an edge_index tensor: "
            "build the graph once before the compiled call (Graph.from_sparse(adj_t) for a "
            "torch.sparse adjacency, Graph.from_networkx(G) for a networkx.Graph) and pass the Graph"
        )
    if isinstance(graph, Tensor):
        if graph.layout not in (torch.sparse_coo, torch.sparse_csr):
            raise TypeError(
                f"{name}: a torch.sparse adjacency must be COO or CSR, got layout {graph.layout} "
                "(convert it with adj.to_sparse_csr())"
            )
        try:
            return _graph_of_sparse(graph)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{name}: {err}") from None
    nx = sys.modules.get("networkx")  # not imported: the input cannot be a networkx graph
    if nx is not None and isinstance(graph, nx.Graph):
        weighted = any("weight" in data for _, _, data in graph.edges(data=True))
        return Graph.from_networkx(graph, weight="weight" if weighted else None, device=device)
    hint = ""
    if type(graph).__module__.startswith("torch_sparse"):
        hint = " (convert a torch_sparse.SparseTensor adj_t with adj_t.to_torch_sparse_csr_tensor())"
    raise TypeError(f"{name} must be {GRAPH_INPUTS}, got {type_name(graph)}{hint}")


def as_graph(
    graph: Any,
    num_nodes: int | tuple[int, int] | None = None,
    name: str = "graph",
    *,
    device: torch.device | str | None = None,
) -> Graph:
    """``graph`` as a :class:`Graph`: itself, one built from an ``edge_index`` tensor (with
    ``num_nodes`` as for :class:`Graph`), or one converted from a ``torch.sparse``
    adjacency or a networkx graph (see :func:`coerce_graph`, which also says where a
    networkx graph is built: ``device``)."""
    graph = coerce_graph(graph, name, device=device)
    return graph if isinstance(graph, Graph) else Graph(graph, num_nodes)


def _graph_of_sparse(adj: Tensor) -> Graph:
    """:meth:`Graph.from_sparse` of ``adj``, converted once per adjacency tensor (and again
    after an in-place change, which moves its version counter)."""
    if adj.requires_grad:  # its values carry a gradient: a graph of this call's values
        return Graph.from_sparse(adj)
    key = id(adj)
    hit = _SPARSE_GRAPHS.get(key)
    if hit is not None and hit[0]() is adj and hit[1] == adj._version:
        return hit[2]
    graph = Graph.from_sparse(adj)  # holds no view of adj, which would keep it (and this entry) alive
    # the entry leaves with adj (a weak reference's callback runs before its id can be reused)
    ref = weakref.ref(adj, lambda _ref, key=key: _SPARSE_GRAPHS.pop(key, None))
    _SPARSE_GRAPHS[key] = (ref, adj._version, graph)
    return graph


def is_integer(value: Any) -> bool:
    """``value`` is an integer scalar (a Python or NumPy int), not a bool: the one test of
    the integer arguments fusegnn checks (counts, seeds, sizes)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer_index(value: Any) -> int | None:
    """``value`` as a Python int when it is one integer: an integer scalar
    (:func:`is_integer`) or a 0-d integer tensor (``parts[i]``, ``dist.get_rank()`` kept in
    a tensor); else ``None`` -- a bool or bool tensor, a float, a tensor of more dimensions
    (``operator.index`` takes ``True`` and ``tensor([1])``, so it is no such test)."""
    if is_integer(value):
        return int(value)
    if isinstance(value, Tensor) and value.dim() == 0 and not (
        value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool
    ):
        return int(value)
    return None


def check_seed(seed: Any) -> int:
    """``seed`` as the int ``torch.Generator.manual_seed`` takes (any 64-bit value, signed or
    not; NumPy integers too). A float or a bool is refused: ``int()`` would turn 1.5 into 1
    and True into 1, another seed's draws under the value the caller passed."""
    if not is_integer(seed):
        raise TypeError(f"seed must be an int, got {type_name(seed)} {seed!r}")
    if not -(2**63) <= int(seed) < 2**64:
        raise ValueError(f"seed must fit in 64 bits, got {seed}")
    return int(seed)


def type_name(value: Any) -> str:
    """``value``'s type, qualified by its module unless built in, so that ``networkx.Graph``
    (``networkx.classes.graph.Graph``) and ``fusegnn.sparse.graph.Graph`` read apart."""
    kind = type(value)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"
