r"""Vector-sparse matrices: VecSparse's CVSE format (thesis ch.3) and Jigsaw's row windows.

A :class:`VectorSparse` ``[M, K]`` matrix :math:`A` stores ``V``-row column vectors:
the rows are cut into :math:`G = \lceil M / V \rceil` groups of ``V`` consecutive rows
(the last group may be partial), and each stored vector :math:`v` is the slice
:math:`A[g_v V : g_v V + V,\ \mathrm{col\_idx}[v]]`:

* ``row_ptr`` ``[G + 1]``: the vectors of group :math:`g` are ``row_ptr[g] .. row_ptr[g+1]-1``,
  sorted by column;
* ``col_idx`` ``[nnz_v]``: each vector's column;
* ``values`` ``[nnz_v, V]``: ``values[v, r] = A[g_v V + r, col_idx[v]]`` (rows past ``M`` are 0).

Every gathered row of a dense right operand is then reused by ``V`` output rows on
tensor cores (:mod:`fusegnn.kernels.vector_spmm`). :meth:`VectorSparse.transpose` gives
:math:`A^\top` through a cached column-sorted index of the same vectors (what the
backward runs on). :class:`RowWindows` is Jigsaw's row-window form: windows of ``W = 16``
or ``32`` rows with the window's non-empty columns compacted into a dense ``[W, n]``
tile -- the same layout with ``V = W``, where ``tl.dot`` needs no padding rows.
"""

from __future__ import annotations

import operator
from fractions import Fraction
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fusegnn.kernels.vector_layout import densify_vectors, vector_groups
from fusegnn.sparse.graph import Graph, type_name

__all__ = ["RowWindows", "TransposedVectorSparse", "VectorIndex", "VectorSparse", "transpose_index", "vector_structure"]


class VectorIndex(NamedTuple):
    """The structure the kernels take: ``(row_ptr, col_idx, t_ptr, t_vec, t_group,
    num_rows, max_vectors)`` (``t_*``: the vectors sorted by column, their row groups)."""

    row_ptr: Tensor
    col_idx: Tensor
    t_ptr: Tensor
    t_vec: Tensor
    t_group: Tensor
    num_rows: int
    max_vectors: int


def _check_matrix(matrix: Any, name: str) -> Tensor:
    if not isinstance(matrix, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type_name(matrix)}")
    if matrix.dim() != 2:
        raise ValueError(f"{name} must be 2-D [M, K], got shape {tuple(matrix.shape)}")
    if not matrix.is_floating_point():
        raise TypeError(f"{name} must be floating point, got dtype {matrix.dtype}")
    return matrix


def _shape_pair(shape: Any) -> tuple[int, int]:
    """``(M, K)`` from a pair of integers (Python, NumPy, 0-d integer tensors, SymInts)."""
    try:
        M, K = (int(s) if isinstance(s, torch.SymInt) else operator.index(s) for s in shape)
    except (TypeError, ValueError):
        raise ValueError(f"shape must be a pair of ints (M, K), got {shape!r}") from None
    return M, K


def _ptr(counts: Tensor) -> Tensor:
    ptr = torch.zeros(counts.numel() + 1, dtype=torch.int64, device=counts.device)
    ptr[1:] = torch.cumsum(counts, 0)
    return ptr


def vector_structure(rows: Tensor, cols: Tensor, shape: tuple[int, int], V: int) -> tuple[Tensor, Tensor, Tensor]:
    """The vectors holding COO entries ``(rows, cols)`` of an ``[M, K]`` matrix:
    ``(row_ptr, col_idx, vector)`` with ``vector[e]`` the stored vector of entry ``e``
    (duplicates share one), so that entry ``e`` sits at ``values[vector[e], rows[e] % V]``.
    All tensor ops on the entries' device (one sort), int64."""
    M, K = shape
    rows, cols = rows.long(), cols.long()
    key = (rows // V) * max(K, 1) + cols
    uniq, vector = torch.unique(key, sorted=True, return_inverse=True)
    row_ptr = _ptr(torch.bincount(uniq // max(K, 1), minlength=-(-M // V)))
    return row_ptr, uniq % max(K, 1), vector


def transpose_index(row_ptr: Tensor, col_idx: Tensor, num_cols: int) -> tuple[Tensor, Tensor, Tensor]:
    """The column-sorted half of a :class:`VectorIndex`: ``t_ptr`` (``[num_cols + 1]``,
    the vectors of column ``k`` are ``t_vec[t_ptr[k] .. t_ptr[k + 1] - 1]``), ``t_vec``
    (the vectors in column order, stable) and ``t_group`` (their row groups), all int32."""
    order = torch.argsort(col_idx.long(), stable=True)
    t_ptr = _ptr(torch.bincount(col_idx.long(), minlength=num_cols))
    return t_ptr.to(torch.int32), order.to(torch.int32), vector_groups(row_ptr, col_idx.numel())[order].to(torch.int32)


class VectorSparse:
    """A vector-sparse ``[M, K]`` matrix (see the module docstring).

    Build one with :meth:`from_dense`, :meth:`from_graph`, :meth:`from_mask` or
    :meth:`prune`; :meth:`with_values` swaps the values (trainable ones included)
    keeping the structure and its cached transpose index.
    """

    #: the vector lengths this class accepts
    VECTOR_SIZES: tuple[int, ...] = (2, 4, 8, 16)
    _size_name = "V"

    def __init__(
        self,
        row_ptr: Tensor,
        col_idx: Tensor,
        values: Tensor,
        shape: tuple[int, int],
        *,
        validate: bool = True,
    ) -> None:
        for name, t in (("row_ptr", row_ptr), ("col_idx", col_idx)):
            if not isinstance(t, Tensor) or t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{name} must be a 1-D int32 or int64 tensor")
        if not isinstance(values, Tensor) or values.dim() != 2 or not values.is_floating_point():
            raise TypeError("values must be a 2-D floating tensor [nnz_vectors, V]")
        V = values.size(1)
        self._check_size(V)
        M, K = _shape_pair(shape)
        if M < 0 or K < 0:
            raise ValueError(f"shape must be non-negative, got {shape}")
        G = -(-M // V)
        if row_ptr.numel() != G + 1:
            raise ValueError(f"row_ptr must have ceil(M / V) + 1 = {G + 1} entries, got {row_ptr.numel()}")
        if values.size(0) != col_idx.numel():
            raise ValueError(
                f"values must have one row per stored vector ({col_idx.numel()}), got {values.size(0)}"
            )
        if validate and row_ptr.device.type != "meta":
            if int(row_ptr[0]) != 0 or int(row_ptr[-1]) != col_idx.numel() or bool((row_ptr[1:] < row_ptr[:-1]).any()):
                raise ValueError("row_ptr must start at 0, be non-decreasing and end at the number of vectors")
            if col_idx.numel() and (int(col_idx.min()) < 0 or int(col_idx.max()) >= K):
                raise IndexError(f"col_idx must lie in [0, {K})")
        if col_idx.numel() * V >= 2**31:
            raise ValueError("too many stored values for int32 indices (nnz_vectors * V must be < 2**31)")
        self.row_ptr = row_ptr.to(torch.int32)
        self.col_idx = col_idx.to(torch.int32)
        self.values = values
        self.shape = (M, K)
        self._cache: dict[str, Any] = {}

    @classmethod
    def _check_size(cls, V: Any) -> int:
        if isinstance(V, bool) or not isinstance(V, int) or V not in cls.VECTOR_SIZES:
            raise ValueError(f"{cls._size_name} must be one of {cls.VECTOR_SIZES}, got {V!r}")
        return V

    # ------------------------------------------------------------------ builders
    @classmethod
    def _from_entries(
        cls, rows: Tensor, cols: Tensor, vals: Tensor, shape: tuple[int, int], V: int
    ) -> "VectorSparse":
        """From COO entries (duplicates add up); every entry's vector is stored."""
        row_ptr, col_idx, vector = vector_structure(rows, cols, shape, V)
        values = torch.zeros(col_idx.numel(), V, dtype=vals.dtype, device=vals.device)
        values.index_put_((vector, rows.long() % V), vals, accumulate=True)
        return cls(row_ptr, col_idx, values, shape, validate=False)

    @classmethod
    def from_dense(cls, matrix: Tensor, V: int) -> "VectorSparse":
        """The vectors of ``matrix`` (``[M, K]``) holding at least one non-zero."""
        V = cls._check_size(V)
        matrix = _check_matrix(matrix, "matrix")
        rows, cols = matrix.nonzero(as_tuple=True)
        return cls._from_entries(rows, cols, matrix[rows, cols], tuple(matrix.shape), V)

    @classmethod
    def from_graph(cls, graph: Graph, V: int, dtype: torch.dtype = torch.float32) -> "VectorSparse":
        """The aggregation matrix of ``graph`` (``[num_dst, num_src]``, rows = targets, the
        edge weights or 1 as values, duplicate edges added): ``Graph.to_dense``'s matrix."""
        V = cls._check_size(V)
        if not isinstance(graph, Graph):
            raise TypeError(f"graph must be a fusegnn.sparse.Graph, got {type_name(graph)}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        weight = graph.edge_weight
        if weight is not None and weight.dim() != 1:
            raise ValueError("from_graph needs a 1-D edge_weight (one weight per edge)")
        vals = weight.to(dtype) if weight is not None else torch.ones(graph.num_edges, dtype=dtype, device=graph.device)
        return cls._from_entries(graph.dst, graph.src, vals, (graph.num_dst_nodes, graph.num_src_nodes), V)

    @classmethod
    def from_mask(
        cls, mask: Any, V: int, head: int | None = None, device: torch.device | str | None = None
    ) -> "VectorSparse":
        """An attention mask (:class:`fusegnn.attention.Mask`, ``[L_q, L_k]``) with 1 at
        every allowed pair (through ``mask.to_graph``; a per-head mask needs ``head``)."""
        if not callable(getattr(mask, "to_graph", None)) or not hasattr(mask, "num_heads"):
            raise TypeError(f"mask must be a fusegnn.attention.Mask, got {type_name(mask)}")
        if mask.num_heads > 1 and head is None:
            raise ValueError(f"mask has {mask.num_heads} heads: pass head=h to pick one")
        return cls.from_graph(mask.to_graph(head=head, device=device), V)

    @classmethod
    def prune(cls, weight: Tensor, sparsity: float, V: int) -> "VectorSparse":
        r"""Magnitude pruning: of the :math:`G K` vectors of ``weight`` (``[M, K]``), keep
        the :math:`\mathrm{round}((1 - s) G K)` (exactly, on the decimal ``s``; halves to even) of largest L2 norm (ties: the first in
        row-group-major order, group :math:`g` column :math:`k` at :math:`g K + k`; the
        norms in float32, float64 for a float64 ``weight``); the values are a copy of
        ``weight``'s (detached)."""
        V = cls._check_size(V)
        weight = _check_matrix(weight, "weight").detach()
        if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
            raise ValueError(f"sparsity must be a number in [0, 1), got {sparsity!r}")
        M, K = weight.shape
        G = -(-M // V)
        padded = torch.cat([weight, weight.new_zeros(G * V - M, K)]).view(G, V, K)
        # float32 at least (half-precision squares overflow), float64 kept: a float32 norm
        # would tie (and drop by position) float64 vectors whose norms differ
        norm_dtype = torch.promote_types(weight.dtype, torch.float32)
        norms = torch.linalg.vector_norm(padded.to(norm_dtype), dim=1).flatten()  # [G * K]
        # the count in exact arithmetic on the decimal the caller wrote: (1 - 0.3) * 5 is 3.4999...
        # in floats, which would round to 3 where round(3.5) keeps 4
        density = 1 - Fraction(float(sparsity)).limit_denominator(10**9)
        keep = int(round(density * G * K))
        # a stable descending sort keeps the first of equal norms (topk's choice among ties is unspecified)
        idx = torch.sort(norms, descending=True, stable=True).indices[:keep].sort().values
        groups, cols = idx // K, idx % K
        values = padded[groups, :, cols].clone()  # [keep, V]
        row_ptr = _ptr(torch.bincount(groups, minlength=G))
        return cls(row_ptr, cols, values, (M, K), validate=False)

    # ------------------------------------------------------------------ properties
    @property
    def V(self) -> int:
        """The vector length."""
        return self.values.size(1)

    @property
    def num_vectors(self) -> int:
        return self.col_idx.numel()

    @property
    def num_groups(self) -> int:
        return self.row_ptr.numel() - 1

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def density(self) -> float:
        """Stored values over ``M K`` (padding rows of the last group included)."""
        M, K = self.shape
        return self.num_vectors * self.V / max(M * K, 1)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shape={self.shape}, {self._size_name}={self.V}, "
                f"vectors={self.num_vectors}, density={self.density:.4f}, dtype={self.dtype})")

    # ------------------------------------------------------------------ derived
    def _cached(self, key: str, compute):
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def vector_groups(self) -> Tensor:
        """The row group of each stored vector (``int64 [nnz_v]``)."""
        return self._cached("groups", lambda: vector_groups(self.row_ptr, self.num_vectors))

    def index(self) -> VectorIndex:
        """The kernels' :class:`VectorIndex` (the column-sorted half computed once, cached)."""
        def compute() -> VectorIndex:
            counts = self.row_ptr[1:] - self.row_ptr[:-1]
            max_vectors = int(counts.max()) if counts.numel() else 0
            return VectorIndex(self.row_ptr, self.col_idx, *transpose_index(self.row_ptr, self.col_idx, self.shape[1]),
                               self.shape[0], max_vectors)
        return self._cached("index", compute)

    def cached_index(self) -> VectorIndex | None:
        """The :meth:`index` if it was computed already, else ``None`` (what compiled code
        reads: computing it there sorts and syncs)."""
        return self._cache.get("index")

    def transpose(self) -> "TransposedVectorSparse":
        """:math:`A^\\top` (``[K, M]``) over the same vectors, through the cached
        column-sorted index (``vspmm(A.transpose(), B)`` is ``A^T @ B``)."""
        return TransposedVectorSparse(self)

    @property
    def T(self) -> "TransposedVectorSparse":
        return self.transpose()

    def with_values(self, values: Tensor) -> "VectorSparse":
        """The same structure (and cached index) with other ``values`` ``[nnz_v, V]``."""
        if not isinstance(values, Tensor) or values.shape != self.values.shape or not values.is_floating_point():
            raise ValueError(
                f"values must be a floating tensor of shape {tuple(self.values.shape)}, "
                f"got {type_name(values) if not isinstance(values, Tensor) else tuple(values.shape)}"
            )
        other = object.__new__(type(self))
        # attribute by attribute: torch 2.11's Dynamo cannot trace ``__dict__.update``
        other.row_ptr, other.col_idx, other.shape, other._cache = self.row_ptr, self.col_idx, self.shape, self._cache
        other.values = values
        return other

    def to(self, device: torch.device | str | torch.dtype | None = None,
           dtype: torch.dtype | None = None) -> "VectorSparse":
        """A copy on ``device`` / with values in ``dtype`` (the index is recomputed there);
        like ``Tensor.to``, ``A.to(torch.float64)`` takes a lone dtype as ``dtype``."""
        if isinstance(device, torch.dtype) and dtype is None:
            device, dtype = None, device
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        device = torch.device(device) if device is not None else self.device
        return type(self)(self.row_ptr.to(device), self.col_idx.to(device),
                          self.values.to(device=device, dtype=dtype or self.dtype), self.shape, validate=False)

    def to_dense(self) -> Tensor:
        """The dense ``[M, K]`` matrix (differentiable in ``values``; vectors stored twice
        at one position add, as in the products)."""
        M, K = self.shape
        return densify_vectors(self.values, self.vector_groups(), self.col_idx, M, K)

    def mask(self) -> Tensor:
        """Boolean ``[M, K]``: the stored positions (whole vectors)."""
        return self.with_values(torch.ones_like(self.values, dtype=torch.float32)).to_dense().bool()


class TransposedVectorSparse:
    """:math:`A^\\top` of a :class:`VectorSparse` ``A``: ``[K, M]``, its ``base``'s vectors
    read by column (no copy; the column-sorted index is cached on ``base``)."""

    def __init__(self, base: VectorSparse) -> None:
        self.base = base
        self.shape = (base.shape[1], base.shape[0])

    def transpose(self) -> VectorSparse:
        return self.base

    @property
    def T(self) -> VectorSparse:
        return self.base

    def to_dense(self) -> Tensor:
        return self.base.to_dense().t()

    def __repr__(self) -> str:
        return f"TransposedVectorSparse({self.base!r})"


class RowWindows(VectorSparse):
    """Jigsaw's row windows: per window of ``W`` (16 or 32) consecutive rows, the columns
    where the window has a non-zero (compacted, sorted) and a dense ``[W, n_cols]`` tile
    of values. As a layout it is :class:`VectorSparse` with ``V = W`` (a compacted column
    is a stored vector), so the SpMM runs ``[W, BLOCK_K] x [BLOCK_K, BN]`` ``tl.dot``
    tiles with ``B`` rows gathered by the compacted column list and no padding rows.
    ``tile_density`` is the fraction of non-zeros in the tiles (reordering the rows,
    :meth:`fusegnn.Graph.reorder`, raises it)."""

    VECTOR_SIZES = (16, 32)
    _size_name = "W"

    @property
    def W(self) -> int:
        return self.V

    def window_columns(self, window: int) -> Tensor:
        """The compacted column list of window ``window``."""
        if not 0 <= window < self.num_groups:
            raise IndexError(f"window must lie in [0, {self.num_groups}), got {window}")
        return self.col_idx[int(self.row_ptr[window]):int(self.row_ptr[window + 1])]

    @property
    def tile_density(self) -> float:
        """Non-zeros over stored tile entries."""
        return int((self.values != 0).sum()) / max(self.values.numel(), 1)
