r"""Graph aggregation through Jigsaw row windows: the ``"window"`` path of :func:`fusegnn.sparse.spmm`.

The aggregation matrix :math:`A` of a :class:`~fusegnn.sparse.Graph` (``[N_dst, N_src]``,
:math:`A_{ij} = \sum_{e: j \to i} w_e`) is cut into windows of :data:`WINDOW_ROWS`
consecutive target rows; per window the sources with an edge into it are compacted
into a column list and the weights into a dense ``[W, n]`` tile
(:class:`~fusegnn.sparse.vector_sparse.RowWindows`), so that

.. math::
    \mathrm{out} = A X \quad\text{runs as}\quad
    \mathrm{out}[\text{window}] = \mathrm{tile} \cdot X[\text{columns}]

on tensor cores (:func:`fusegnn.sparse.vector_ops.vspmm`), each gathered row of
:math:`X` serving the window's ``W`` rows.

**What is cached on the graph.** The structure (:func:`graph_windows`: the windows'
column lists and ``slot[e]``, the position of edge ``e`` in the flattened tiles) is built
once per edge structure (``Graph.cached(..., structural=True)``: a re-weighted copy
from :meth:`~fusegnn.sparse.Graph.with_edge_weight`, such as GCN's normalised graph,
shares it), and so are the windows of :math:`A^\top` (windows of source rows, for the
backward), on the first backward. New weights only scatter into the tiles
(``values.flat[slot] += w``, one device op; duplicated edges add up); the tiles of a
weight tensor that needs no gradient are memoised on the graph while it comes back
unchanged (transductive training scatters once per side).

**Gradients.** :math:`\partial X = A^\top G` by the same tensor-core kernel over the
windows of :math:`A^\top` (rather than a CUDA-core reduction over the forward tiles'
columns, :func:`~fusegnn.kernels.vector_spmm.vspmm_t`, which would also multiply every
zero of the tiles), and :math:`\partial w_e = \langle x_{j}, g_{i} \rangle` for edge :math:`e: j \to i` (an
SDDMM, one dot product per edge: the Triton SDDMM of :mod:`fusegnn.kernels.sddmm` or
the reference's gather). The backward is not differentiable again (double backward
raises); use ``aggregation="reference"`` for higher-order gradients.

The products run the Triton kernels where :func:`~fusegnn.sparse.vector_library.use_kernel`
allows (float16 / bfloat16 / float32 on CUDA or the interpreter) and their pure-PyTorch
references otherwise (float64 included). :func:`window_tile_density` is the exact tile
density; ``aggregation="auto"`` reads a sampled estimate of it
(:func:`~fusegnn.sparse.tile_density.estimate_tile_density`, see :mod:`fusegnn.sparse.dispatch`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor
from fusegnn.kernels._autograd import differentiable_once

from fusegnn.sparse import reference
from fusegnn.sparse.graph import Graph, cache_value, is_integer, type_name
from fusegnn.sparse.tile_density import WINDOW_ROWS
from fusegnn.sparse.vector_library import use_kernel
from fusegnn.sparse.vector_ops import vspmm
from fusegnn.sparse.vector_sparse import RowWindows, vector_structure

__all__ = [
    "WINDOW_ROWS",
    "GraphWindows",
    "graph_windows",
    "window_aggregate",
    "window_aggregate_backward",
    "window_tile_density",
    "window_values",
]



class GraphWindows(NamedTuple):
    """The row-window structure of a graph's aggregation matrix.

    ``pattern``: a :class:`~fusegnn.sparse.vector_sparse.RowWindows` whose values are a
    stride-0 placeholder (``pattern.with_values(tiles)`` gives the matrix; the copies
    share its cached column-sorted index); ``slot``: ``int64 [E]``, edge ``e``'s entry in
    the flattened ``[nnz_v * W]`` tiles."""

    pattern: RowWindows
    slot: Tensor

    @property
    def num_entries(self) -> int:
        """Entries of the flattened tiles (``nnz_v * W``)."""
        return self.pattern.num_vectors * self.pattern.W


def _check_rows(W: int) -> int:
    """``W`` as an ``int`` (a NumPy integer too; not a float, bool or tensor: it also keys the caches)."""
    if not is_integer(W) or int(W) not in RowWindows.VECTOR_SIZES:
        raise ValueError(f"W must be one of {RowWindows.VECTOR_SIZES}, got {W!r}")
    return int(W)


def graph_windows(graph: Graph, W: int = WINDOW_ROWS, *, transposed: bool = False) -> GraphWindows:
    """The :class:`GraphWindows` of ``graph``'s aggregation matrix :math:`A` (``W`` rows per
    window), or with ``transposed`` of :math:`A^\top` (windows of ``W`` source rows, what
    the backward runs on), built once per edge structure and cached on the graph (shared
    by its re-weighted copies)."""
    if not isinstance(graph, Graph):
        raise TypeError(f"graph must be a fusegnn.sparse.Graph, got {type_name(graph)}")
    W = _check_rows(W)
    if transposed:
        rows, cols, shape = graph.src, graph.dst, (graph.num_src_nodes, graph.num_dst_nodes)
    else:
        rows, cols, shape = graph.dst, graph.src, (graph.num_dst_nodes, graph.num_src_nodes)

    def build() -> GraphWindows:
        row_ptr, col_idx, vector = vector_structure(rows, cols, shape, W)
        placeholder = torch.zeros((), device=graph.device).expand(col_idx.numel(), W)
        pattern = RowWindows(row_ptr, col_idx, placeholder, shape, validate=False)
        pattern.index()  # what vspmm reads, computed once
        return GraphWindows(pattern, vector * W + rows.long() % W)

    return graph.cached(f"row_windows{'_t' if transposed else ''}:{W}", build, structural=True)


def window_tile_density(graph: Graph, W: int = WINDOW_ROWS, *, transposed: bool = False) -> float:
    r"""Fraction of the graph's row-window tile entries that hold an edge: distinct
    ``(target, source)`` pairs over :math:`\mathrm{nnz}_v W` (1 for a graph whose windows
    are dense blocks; the window kernel spends :math:`1 / d` multiply-adds per useful one).
    ``transposed``: of the backward's windows of :math:`A^\top`. Cached with the structure."""
    windows = graph_windows(graph, W, transposed=transposed)

    def density() -> float:
        return torch.unique(windows.slot).numel() / max(windows.num_entries, 1)

    return graph.cached(f"row_window_density{'_t' if transposed else ''}:{W}", density, structural=True)


def _scatter(windows: GraphWindows, weight: Tensor | None, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The ``[nnz_v, W]`` tiles holding ``weight`` (1 per edge when ``None``)."""
    source = torch.ones(windows.slot.numel(), dtype=dtype, device=device) if weight is None else weight.to(dtype)
    flat = torch.zeros(windows.num_entries, dtype=dtype, device=device)
    return flat.index_put_((windows.slot,), source, accumulate=True).view(-1, windows.pattern.W)


def window_values(graph: Graph, weight: Tensor | None, dtype: torch.dtype, W: int = WINDOW_ROWS, *,
                  transposed: bool = False) -> Tensor:
    """The tiles of ``graph``'s windows (``transposed``: of :math:`A^\top`'s) holding
    ``weight`` (``[E]``, or ``None`` for 1 per edge) in ``dtype``, detached. Memoised on the
    graph (one entry per dtype and side) while the same weight tensor comes back unchanged
    (its storage, shape, strides and version). An in-place change through ``weight.data``
    does not bump ``weight``'s version and is not seen: change weights in place on the
    tensor itself (``weight.mul_``, an optimizer step) or pass a new tensor. A weight made
    under ``torch.inference_mode()`` has no version counter: its tiles are scattered afresh."""
    windows = graph_windows(graph, W, transposed=transposed)
    if weight is not None and weight.is_inference():
        return _scatter(windows, weight.detach(), dtype, graph.device)
    if weight is None:
        key: tuple = ("ones",)
    else:
        key = (weight.data_ptr(), tuple(weight.shape), weight.stride(), weight.dtype, weight._version)
    memo = graph.cached(f"row_window_values:{W}", dict)
    hit = memo.get((dtype, transposed))
    if hit is not None and hit[0] == key:
        return hit[2]
    weight = weight.detach() if weight is not None else None
    tiles = cache_value(lambda: _scatter(windows, weight, dtype, graph.device), graph.device)
    memo[(dtype, transposed)] = (key, weight, tiles)  # the detached weight keeps its storage (and data_ptr) alive
    return tiles


def _product(graph: Graph, weight: Tensor | None, b: Tensor, W: int, transposed: bool, memoise: bool) -> Tensor:
    """:math:`A b` (``transposed``: :math:`A^\top b`) on tensor cores over the windows of
    that matrix; the tiles memoised (:func:`window_values`) or, for a weight that changes
    every call, scattered afresh."""
    windows = graph_windows(graph, W, transposed=transposed)
    if memoise:
        tiles = window_values(graph, weight, b.dtype, W, transposed=transposed)
    else:
        tiles = _scatter(windows, weight, b.dtype, graph.device)
    return vspmm(windows.pattern.with_values(tiles), b)


def _as_matrix(t: Tensor) -> Tensor:
    """``t`` (``[N, *S]``) as ``[N, prod(S)]`` (``reshape(N, -1)`` fails for ``N = 0``)."""
    return t.reshape(t.size(0), math.prod(t.shape[1:]))


def _edge_dots(graph: Graph, x: Tensor, grad: Tensor) -> Tensor:
    r""":math:`\langle x_j, g_i \rangle` for every edge :math:`j \to i` (``[E]``)."""
    if use_kernel("auto", x, grad):
        from fusegnn.kernels.sddmm import sddmm

        return sddmm(graph, x, grad, "dot")
    return reference.sddmm(graph, x, grad, "dot")


def window_aggregate_backward(
    graph: Graph, grad: Tensor, x: Tensor | None, weight: Tensor | None, need_x: bool, need_w: bool,
    W: int = WINDOW_ROWS, *, memoise: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    r"""Backward of :func:`window_aggregate` as a plain function: ``(grad_x, grad_w)``,
    :math:`A^\top G` over the windows of :math:`A^\top` and one dot product per edge,
    each ``None`` unless needed (``x`` is read only for ``grad_w``). ``grad`` is ``[N_dst, *S]``;
    ``memoise``: keep the tiles of :math:`A^\top` (:func:`window_values`), not for a weight
    that changes every call."""
    grad2 = _as_matrix(grad)
    grad_x = grad_w = None
    if need_x:
        grad_x = _product(graph, weight, grad2, W, True, memoise)
        grad_x = grad_x.reshape((graph.num_src_nodes,) + tuple(grad.shape[1:]))
    if need_w:
        if x is None:
            raise ValueError("the edge weights' gradient needs the forward's x")
        grad_w = _edge_dots(graph, _as_matrix(x).to(grad.dtype), grad2).to(weight.dtype)
    return grad_x, grad_w


class _WindowAggregate(torch.autograd.Function):
    """``A @ x`` over the windows, differentiable in ``x`` and in ``weight`` (given in
    ``x``'s dtype; ``None`` for 1 per edge)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, graph: Graph, W: int) -> Tensor:  # type: ignore[override]
        memoise = weight is None or not ctx.needs_input_grad[1]
        ctx.graph, ctx.W, ctx.memoise = graph, W, memoise
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        return _product(graph, weight, x, W, False, memoise)

    @staticmethod
    @differentiable_once
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x, grad_w = window_aggregate_backward(ctx.graph, grad.contiguous(), x, weight, *ctx.needs_input_grad[:2],
                                                   ctx.W, memoise=ctx.memoise)
        return grad_x, grad_w, None, None


def window_aggregate(graph: Graph, x: Tensor, weight: Tensor | None = None, W: int = WINDOW_ROWS) -> Tensor:
    r""":math:`\mathrm{out}_i = \sum_{e: j \to i} w_e x_j` over ``graph``'s row windows
    (``x`` ``[N_src, *S]``, ``weight`` ``[E]`` or ``None`` for 1 per edge; duplicated edges
    add up): ``[N_dst, *S]`` in ``x``'s dtype, differentiable in ``x`` and ``weight``.
    Inputs are assumed validated (see :func:`fusegnn.sparse.spmm`)."""
    W = _check_rows(W)
    if weight is not None and weight.dtype != x.dtype:
        weight = weight.to(x.dtype)  # differentiable: the gradient comes back in weight's dtype
    out = _WindowAggregate.apply(_as_matrix(x), weight, graph, W)
    return out.reshape((graph.num_dst_nodes,) + tuple(x.shape[1:]))
