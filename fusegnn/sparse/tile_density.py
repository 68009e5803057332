r"""An estimate of a graph's row-window tile density, cheap enough for ``aggregation="auto"``.

The row windows of :mod:`fusegnn.sparse.window_aggregation` cut the aggregation matrix
:math:`A` (``[N_dst, N_src]``) into windows of ``W`` target rows; a window stores one
``W``-row tile column per distinct source among its edges. The tile density is

.. math::
    d = \frac{\#\{\text{distinct } (t, s) \text{ edges}\}}{W \cdot \#\{\text{distinct } (\lfloor t / W \rfloor, s)\}},

the fraction of tile entries that hold an edge (1: every window a dense block; about
``1 / W`` on a random sparse graph). :func:`~fusegnn.sparse.window_aggregation.window_tile_density`
computes it exactly from the built windows; building them costs a sort of all edges and
tile memory of :math:`1 / d` entries per edge, which ``auto`` must not pay on a graph it
then runs on GAR. :func:`estimate_tile_density` counts the same ratio on the edges of a
random sample of windows (all of them on a graph of at most ``windows`` windows: exact):
one pass over the target ids, in chunks, and two small sorts. It is cached on the
graph's structure.
"""

from __future__ import annotations

import torch

from fusegnn.sparse.graph import Graph, is_integer

__all__ = ["WINDOW_ROWS", "estimate_tile_density"]

#: Rows per window: the smallest ``tl.dot`` tile height, so no tensor-core row is padding
#: and the tiles are as dense as windows get (32 would reuse each gathered row twice as often
#: on denser graphs; the ``vector`` benchmarks compare both).
WINDOW_ROWS = 16

_CHUNK = 1 << 24  # edges per pass: bounds the temporaries on a 100M-edge graph


def estimate_tile_density(graph: Graph, W: int = WINDOW_ROWS, *, windows: int = 4096, seed: int = 0,
                          cached_only: bool = False) -> float | None:
    """The row-window tile density of ``graph``'s :math:`A` (``W`` rows per window),
    counted on ``windows`` windows drawn at random (exact when the graph has no more);
    ``0.0`` for a graph without edges. Cached on the graph's structure; ``cached_only``
    returns ``None`` instead of computing it (inside a CUDA-graph capture, where its
    sorts' host syncs are not allowed)."""
    if not all(is_integer(n) and n >= 1 for n in (W, windows)):
        raise ValueError(f"W and windows must be ints >= 1, got {W!r} and {windows!r}")
    W, windows = int(W), int(windows)
    key = f"row_window_density_estimate:{W}:{windows}:{seed}"
    if cached_only:
        return graph.peek_cached(key, structural=True)

    def compute() -> float:
        if graph.num_edges == 0:
            return 0.0
        device = graph.device
        num_windows = -(-graph.num_dst_nodes // W)
        chosen = torch.ones(num_windows, dtype=torch.bool, device=device)
        if num_windows > windows:
            gen = torch.Generator(device=device).manual_seed(seed)
            picked = torch.randperm(num_windows, generator=gen, device=device)[:windows]
            chosen = torch.zeros(num_windows, dtype=torch.bool, device=device)
            chosen[picked] = True
        dst_parts, src_parts = [], []
        for start in range(0, graph.num_edges, _CHUNK):
            dst = graph.dst[start:start + _CHUNK]
            keep = chosen[dst // W]
            dst_parts.append(dst[keep].long())
            src_parts.append(graph.src[start:start + _CHUNK][keep].long())
        dst, src = torch.cat(dst_parts), torch.cat(src_parts)
        n_src = graph.num_src_nodes
        edges = torch.unique(dst * n_src + src).numel()
        columns = torch.unique((dst // W) * n_src + src).numel()
        return edges / (columns * W)

    return graph.cached(key, compute, structural=True)
