r"""How up to ``k`` incoming edges are drawn for each target of a sampling hop.

A hop samples, for each of ``T`` targets, some of the target's incoming edges. The edges
of target ``t`` are the positions ``start[t] : start[t] + deg[t]`` of the graph's
edges grouped by target (:attr:`fusegnn.sparse.Graph.csr`); every function here returns
``(row, pos)``: for each drawn edge the target's row in ``[0, T)`` and the edge's
position in that grouping, rows in increasing order (edges grouped by target).

All draws are tensor ops on the device of the inputs, vectorised over targets (no Python
loop over nodes), and come from one ``torch.Generator``: the same generator state gives
the same edges.

* :func:`uniform`: a uniformly random ``k``-subset of each target's
  edges (all of them when ``deg <= k``), by **Floyd's algorithm** on the positions
  ``0 .. deg - 1``: for ``i = 0 .. k - 1`` with ``j_i = deg - k + i``, draw
  :math:`r_i \sim U\{0, \dots, j_i\}` and take ``r_i``, or ``j_i`` if ``r_i`` was taken
  before. Work ``O(k^2)`` per target with ``deg > k``, independent of the degree (a hub
  of 17,000 edges costs what a node of 26 does); a target with ``deg <= k`` takes its
  ``deg`` edges without drawing. The sequential "taken before" test is resolved
  without a loop over ``i`` (see :func:`floyd_positions`).
  With ``replace=True``: ``k`` independent uniform draws per target with ``deg > 0``
  (PyG's ``replace=True``: exactly ``k`` edges, repeats possible).
* :func:`weighted_without_replacement`: Efraimidis-Spirakis: each edge gets the key
  :math:`E_e / w_e` with :math:`E_e \sim \mathrm{Exp}(1)`; the ``k`` smallest keys of a
  target are a weighted random sample without replacement (an edge is drawn first with
  probability :math:`w_e / \sum w`). Costs a sort of all edges of the targets; edges of
  weight 0 are never drawn.
* :func:`weighted_with_replacement`: ``k`` draws per target with probability
  :math:`w_e / \sum w` each, by inverse transform on each target's own running sum of
  its weights (:func:`segment_cumsum`, once per graph) and a binary search.
* :func:`all_edges`: every edge of each target (a fanout of ``-1``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "all_edges",
    "floyd_positions",
    "segment_cumsum",
    "uniform",
    "weighted_with_replacement",
    "weighted_without_replacement",
]


def all_edges(start: Tensor, deg: Tensor) -> tuple[Tensor, Tensor]:
    """Every edge of every target: ``row`` repeats each target ``deg`` times, ``pos``
    runs through ``start[t] .. start[t] + deg[t] - 1``. One host sync (the total)."""
    total = int(deg.sum())
    rows = torch.arange(deg.numel(), device=deg.device)
    row = torch.repeat_interleave(rows, deg, output_size=total)
    first = torch.cumsum(deg, 0) - deg  # where each target's run starts in the output
    pos = torch.arange(total, device=deg.device) - (first - start)[row]
    return row, pos


def floyd_positions(deg: Tensor, k: int, u: Tensor) -> Tensor:
    r"""``[T, k]`` distinct positions in ``[0, deg)`` per row with ``deg > k``: Floyd's
    algorithm driven by the uniforms ``u`` (``[T, k]`` in ``[0, 1)``). Rows with
    ``deg <= k`` hold arbitrary values (callers take every edge there).

    Floyd: for ``i = 0 .. k-1``, ``j_i = deg - k + i``, ``r_i = floor(u_i (j_i + 1))``;
    the pick is ``s_i = j_i`` if ``r_i`` is among ``s_0 .. s_{i-1}`` ("found"), else
    ``r_i``. As ``j_i`` exceeds every earlier ``r`` and ``j``,

    .. math::
        \text{found}_i = (\exists\, i' < i: r_{i'} = r_i) \;\lor\;
        (p_i = r_i - (\deg - k) \in [0, i) \land \text{found}_{p_i}),

    (``r_i`` is an earlier draw, or the earlier ``j`` that was picked in place of a
    repeat), a chain ``i > p_i > p_{p_i} > ...`` along which ``found`` is an OR of the
    repeat flags: pointer jumping computes it in ``ceil(log2 k)`` rounds of gathers,
    exactly the sequential algorithm's result.
    """
    base = (deg - k).unsqueeze(1)  # [T, 1]
    slots = torch.arange(k, device=deg.device)
    j = base + slots  # [T, k]
    r = (u * (j + 1).clamp(min=1)).to(torch.int64)
    r = torch.minimum(r, j)  # float rounding could reach j + 1
    earlier = slots.unsqueeze(1) > slots.unsqueeze(0)  # [k, k]: i' < i
    # an earlier r_i' == r_i; the [rows, k, k] comparison in chunks of ~2^24 entries
    rows = max(1, (1 << 24) // (k * k))
    repeat = torch.cat([
        ((part.unsqueeze(2) == part.unsqueeze(1)) & earlier).any(2) for part in r.split(rows)
    ]) if r.numel() else torch.zeros_like(r, dtype=torch.bool)
    parent = r - base
    has_parent = (parent >= 0) & (parent < slots)
    link = torch.where(has_parent, parent, slots.expand_as(parent))  # no parent: itself
    found = repeat
    for _ in range(max(1, math.ceil(math.log2(k))) if k > 1 else 0):
        found = found | found.gather(1, link)
        link = link.gather(1, link)
    return torch.where(found, j, r)


def uniform(
    start: Tensor, deg: Tensor, k: int, generator: torch.Generator | None, *, replace: bool = False
) -> tuple[Tensor, Tensor]:
    """Up to ``k`` distinct edges per target, uniformly (all of them when ``deg <= k``);
    with ``replace``, exactly ``k`` independent uniform draws per target with ``deg > 0``."""
    if replace:
        u = _uniforms(deg, k, generator)
        if u is None:
            return _empty(deg.device)
        high = deg.unsqueeze(1)
        offset = torch.minimum((u * high).to(torch.int64), (high - 1).clamp(min=0))
        return _flatten(start, offset, (high > 0).expand_as(offset))
    if k == 0 or deg.numel() == 0:
        return _empty(deg.device)
    # every edge of the targets with deg <= k; Floyd (O(k^2) each) only for the others, so
    # a fanout above most degrees costs the edges it returns, not T k^2
    row, slot = all_edges(torch.zeros_like(start), deg.clamp(max=k))
    over = torch.nonzero(deg > k).squeeze(1)
    if over.numel():
        u = torch.rand(over.numel(), k, generator=generator, device=deg.device, dtype=torch.float64)
        picks = floyd_positions(deg[over], k, u)  # [H, k]
        which = torch.full_like(deg, -1, dtype=torch.int64)
        which[over] = torch.arange(over.numel(), device=deg.device)
        hub = which[row]
        slot = torch.where(hub >= 0, picks[hub.clamp(min=0), slot], slot)
    return row, start[row] + slot


def weighted_without_replacement(
    start: Tensor, deg: Tensor, k: int, weight: Tensor, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Up to ``k`` distinct edges per target by Efraimidis-Spirakis keys ``Exp(1) / w``
    (``weight`` ``[E]`` in the grouped edge order); edges of weight 0 are never drawn,
    so a target with fewer than ``k`` positive edges gets all of those."""
    if k == 0 or deg.numel() == 0:
        return _empty(deg.device)
    row, pos = all_edges(start, deg)
    w = weight[pos]
    keep = w > 0
    row, pos, w = row[keep], pos[keep], w[keep]
    exp = torch.empty(pos.numel(), device=pos.device, dtype=torch.float64).exponential_(generator=generator)
    key = exp / w.to(torch.float64)
    order = torch.argsort(key)
    order = order[torch.argsort(row[order], stable=True)]  # by target, then key
    row, pos = row[order], pos[order]
    counts = torch.bincount(row, minlength=deg.numel())
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(row.numel(), device=row.device) - first[row]
    chosen = rank < k
    return row[chosen], pos[chosen]


def weighted_with_replacement(
    start: Tensor, deg: Tensor, k: int, cumulative: Tensor, generator: torch.Generator | None, max_degree: int
) -> tuple[Tensor, Tensor]:
    """Exactly ``k`` draws per target of positive total weight, edge ``e`` with
    probability ``w_e / sum(w)``. ``cumulative`` is ``[E]`` float64, each target's running
    sum of its own weights in the grouped edge order (:func:`segment_cumsum`);
    ``max_degree`` bounds ``deg`` (the binary search's rounds).

    A draw is the first edge ``e`` of its target with ``cumulative[e] > u * total``: a
    binary search within the target's edges, ``O(k log deg)`` per target. The sums are the
    target's own, so a target's draws do not depend on the weights of other targets (a
    running sum over all edges loses the light edges of a target that follows heavy
    ones: at 1e12, float64 steps by 1e-4)."""
    u = _uniforms(deg, k, generator)
    if u is None or cumulative.numel() == 0:
        return _empty(deg.device)
    end = start + deg
    total = torch.where(deg > 0, cumulative[(end - 1).clamp(min=0)], 0.0)
    level = u * total.unsqueeze(1)
    # u < 1, but u * total can round up to total: stay below it (the last positive edge)
    level = torch.minimum(level, torch.nextafter(total, torch.zeros_like(total)).unsqueeze(1))
    low, high = start.unsqueeze(1).expand_as(level), end.unsqueeze(1).expand_as(level)
    last = cumulative.numel() - 1
    for _ in range(max(int(max_degree), 0).bit_length()):
        mid = (low + high) // 2
        searching = low < high
        right = cumulative[mid.clamp(max=last)] <= level
        low = torch.where(searching & right, mid + 1, low)
        high = torch.where(searching & ~right, mid, high)
    valid = (total > 0).unsqueeze(1).expand_as(low)
    return _flatten(torch.zeros_like(start), low, valid)


def segment_cumsum(values: Tensor, ptr: Tensor) -> Tensor:
    """Running sums of ``values`` (``[E]``) restarting at each segment ``ptr[t] : ptr[t + 1]``,
    in float64: a segmented Hillis-Steele scan, ``ceil(log2(max segment))`` rounds over
    ``E``; each sum adds values of its own segment only."""
    out = values.to(torch.float64, copy=True)
    if out.numel() == 0:
        return out
    sizes = ptr[1:] - ptr[:-1]
    segment = torch.repeat_interleave(torch.arange(sizes.numel(), device=ptr.device), sizes, output_size=out.numel())
    longest = int(sizes.max())
    step = 1
    while step < longest:
        same = segment[step:] == segment[:-step]
        out = torch.cat([out[:step], out[step:] + torch.where(same, out[:-step], 0.0)])
        step *= 2
    return out


def _uniforms(deg: Tensor, k: int, generator: torch.Generator | None) -> Tensor | None:
    """``[T, k]`` float64 uniforms in ``[0, 1)``, one per slot; ``None`` when there is no slot."""
    if k == 0 or deg.numel() == 0:
        return None
    return torch.rand(deg.numel(), k, generator=generator, device=deg.device, dtype=torch.float64)


def _flatten(start: Tensor, offset: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """The valid entries of a ``[T, k]`` table of offsets, row-major: ``(row, start[row] + offset)``."""
    row, col = valid.nonzero(as_tuple=True)
    return row, start[row] + offset[row, col]


def _empty(device: torch.device) -> tuple[Tensor, Tensor]:
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return empty, empty
