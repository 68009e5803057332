"""Reusable random graphs and independent dense oracles for the test suite.

Import from any test module (``tests/conftest.py`` puts the repository root on
``sys.path``)::

    from tests.graphs import random_graph, dense_matrix

:func:`random_graph` builds an ``edge_index`` with every case that breaks sparse code:
isolated nodes (no edge at all), nodes with outgoing but no incoming edges, self-loops,
duplicated edges (including a duplicated self-loop), an optional hub target with a large
in-degree, and edges in random (unsorted) COO order. Everything is deterministic in
``seed`` and built with a private ``torch.Generator`` (the global RNG is not touched).

The dense helpers here are written with Python loops over the edge list, independently of
:mod:`fusegnn` (in particular of ``Graph.to_dense``), so they can serve as oracles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "GraphSpec",
    "random_graph",
    "random_weights",
    "dense_matrix",
    "dense_mask",
    "nasty_specs",
]


def _randint(gen: torch.Generator, high: int, size: int) -> Tensor:
    return torch.randint(0, high, (size,), generator=gen, dtype=torch.int64)


def random_graph(
    num_nodes: int,
    num_edges: int,
    seed: int = 0,
    *,
    self_loops: bool = True,
    duplicates: bool = True,
    isolated: bool = True,
    hub_degree: int = 0,
    num_dst_nodes: int | None = None,
    dtype: torch.dtype = torch.int64,
    device: torch.device | str = "cpu",
) -> Tensor:
    """A random ``edge_index`` ``[2, num_edges]`` (row 0 sources, row 1 targets).

    Args:
        num_nodes: number of nodes (of source nodes when ``num_dst_nodes`` is given).
        num_edges: exact number of edges returned.
        seed: RNG seed; the same arguments always give the same tensor.
        self_loops: include at least one self-loop ``i -> i`` (square graphs only);
            when ``False`` the graph has none.
        duplicates: include repeated edges (the first repeat copies a self-loop when
            there is one); when ``False`` every edge is unique... as far as the random
            draw allows: duplicates are then removed and redrawn.
        isolated: leave about 1/8 of the nodes (at least one when ``num_nodes >= 3``)
            without any edge, and one further node with outgoing edges only (no
            incoming edge).
        hub_degree: number of incoming edges of one "hub" target (0: no hub).
        num_dst_nodes: build a bipartite graph with this many target nodes.
        dtype: ``torch.int64`` or ``torch.int32``.
        device: device of the result.
    """
    if num_edges < 0 or num_nodes < 0:
        raise ValueError("num_nodes and num_edges must be >= 0")
    bipartite = num_dst_nodes is not None
    num_dst = num_dst_nodes if bipartite else num_nodes
    gen = torch.Generator().manual_seed(seed)
    if num_edges == 0:
        return torch.empty(2, 0, dtype=dtype, device=device)
    if num_nodes == 0 or num_dst == 0:
        raise ValueError("a graph with edges needs nodes")

    # Nodes that take part in edges. Isolated ones are left out entirely; one more node
    # ("sink-less") only sends.
    order_src = torch.randperm(num_nodes, generator=gen)
    order_dst = order_src if not bipartite else torch.randperm(num_dst, generator=gen)
    n_iso = max(1, num_nodes // 8) if (isolated and num_nodes >= 3) else 0
    n_iso_dst = n_iso if not bipartite else (max(1, num_dst // 8) if (isolated and num_dst >= 3) else 0)
    active_src = order_src[n_iso:]
    active_dst = order_dst[n_iso_dst:]
    if isolated and active_dst.numel() >= 2:
        active_dst = active_dst[1:] if bipartite else active_src[1:]  # active_src[0] only sends
    if not bipartite and not self_loops and active_src.numel() < 2:
        raise ValueError("a graph without self-loops needs at least two connected nodes")

    def draw(count: int) -> tuple[Tensor, Tensor]:
        src = active_src[_randint(gen, active_src.numel(), count)]
        dst = active_dst[_randint(gen, active_dst.numel(), count)]
        if not bipartite and not self_loops:
            # redraw the source of every accidental self-loop among the other nodes
            for k in torch.nonzero(src == dst).flatten().tolist():
                choices = active_src[active_src != dst[k]]
                src[k] = choices[int(_randint(gen, choices.numel(), 1))]
        return src, dst

    srcs, dsts = [], []
    remaining = num_edges
    if hub_degree > 0:
        take = min(hub_degree, remaining)
        hub = active_dst[0]
        src, _ = draw(take)
        if not bipartite and not self_loops:
            src = torch.where(src == hub, active_src[active_src != hub][0], src)
        srcs.append(src)
        dsts.append(hub.repeat(take))
        remaining -= take
    if not bipartite and self_loops and remaining > 0:
        # self-loops only on nodes that receive edges anyway (keeps isolated ones isolated)
        take = min(max(1, num_edges // 10), remaining)
        loops = active_dst[_randint(gen, active_dst.numel(), take)]
        srcs.append(loops)
        dsts.append(loops.clone())
        remaining -= take
    n_dup = min(max(1, num_edges // 10), remaining) if (duplicates and num_edges >= 2) else 0
    if sum(s.numel() for s in srcs) == 0 and n_dup == remaining:
        n_dup = remaining - 1  # something must exist to be duplicated
    src, dst = draw(remaining - n_dup)
    srcs.append(src)
    dsts.append(dst)
    src, dst = torch.cat(srcs), torch.cat(dsts)
    if not duplicates:
        src, dst = _make_unique(src, dst, gen, draw, num_edges)
    elif n_dup > 0:
        pick = _randint(gen, src.numel(), n_dup)
        loops = torch.nonzero(src == dst).flatten()
        if loops.numel() > 0:
            pick[0] = loops[0]
        src, dst = torch.cat([src, src[pick]]), torch.cat([dst, dst[pick]])
    perm = torch.randperm(num_edges, generator=gen)
    return torch.stack([src[perm], dst[perm]]).to(dtype=dtype, device=device)


def _make_unique(src: Tensor, dst: Tensor, gen: torch.Generator, draw, num_edges: int):
    """Drop repeated edges and redraw until ``num_edges`` unique ones exist."""
    seen: dict[tuple[int, int], None] = {}
    for s, d in zip(src.tolist(), dst.tolist()):
        seen.setdefault((s, d))
    for _ in range(1000):
        if len(seen) >= num_edges:
            break
        s, d = draw(num_edges)
        for pair in zip(s.tolist(), d.tolist()):
            if len(seen) < num_edges:
                seen.setdefault(pair)
    if len(seen) < num_edges:
        raise ValueError(f"cannot draw {num_edges} unique edges among these nodes")
    pairs = torch.tensor(list(seen), dtype=torch.int64)
    return pairs[:, 0].clone(), pairs[:, 1].clone()


def random_weights(
    num_edges: int, seed: int, *, heads: int | None = None, dtype: torch.dtype = torch.float64,
    positive: bool = True,
) -> Tensor:
    """Random edge weights ``[E]`` (or ``[E, heads]``), in ``[0.5, 1.5)`` when ``positive``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_edges,) if heads is None else (num_edges, heads)
    w = torch.rand(shape, generator=gen, dtype=torch.float64)
    w = w + 0.5 if positive else 2 * w - 1
    return w.to(dtype)


def dense_matrix(
    edge_index: Tensor,
    num_src: int,
    num_dst: int | None = None,
    edge_weight: Tensor | None = None,
) -> Tensor:
    """Float64 aggregation matrix ``A[dst, src] = sum of weights of edges src -> dst``,
    built with a Python loop (``out = A @ x`` is the sum aggregation). With ``[E, H]``
    weights the result is ``[H, num_dst, num_src]``."""
    num_dst = num_src if num_dst is None else num_dst
    ei = edge_index.detach().cpu().tolist()
    if edge_weight is None:
        weights = [[1.0]] * len(ei[0])
        heads = None
    else:
        w = edge_weight.detach().cpu().double()
        heads = None if w.dim() == 1 else w.size(1)
        weights = w.reshape(len(ei[0]), heads or 1).tolist()
    n_heads = heads or 1
    dense = torch.zeros(n_heads, num_dst, num_src, dtype=torch.float64)
    for e, (s, d) in enumerate(zip(ei[0], ei[1])):
        for h in range(n_heads):
            dense[h, d, s] += weights[e][h]
    return dense[0] if heads is None else dense


def dense_mask(edge_index: Tensor, num_src: int, num_dst: int | None = None) -> Tensor:
    """Boolean ``[num_dst, num_src]``: whether at least one edge ``src -> dst`` exists."""
    return dense_matrix(edge_index, num_src, num_dst) > 0


@dataclass(frozen=True)
class GraphSpec:
    """Arguments of :func:`random_graph` with a readable test id."""

    num_nodes: int
    num_edges: int
    seed: int
    hub_degree: int = 0
    self_loops: bool = True
    duplicates: bool = True
    isolated: bool = True

    def build(self, dtype: torch.dtype = torch.int64) -> Tensor:
        return random_graph(
            self.num_nodes,
            self.num_edges,
            self.seed,
            self_loops=self.self_loops,
            duplicates=self.duplicates,
            isolated=self.isolated,
            hub_degree=self.hub_degree,
            dtype=dtype,
        )

    def __str__(self) -> str:
        flags = "".join(
            c for c, on in (("L", self.self_loops), ("D", self.duplicates), ("I", self.isolated)) if on
        )
        hub = f"-hub{self.hub_degree}" if self.hub_degree else ""
        return f"N{self.num_nodes}-E{self.num_edges}-s{self.seed}-{flags}{hub}"


def nasty_specs() -> list[GraphSpec]:
    """A small family of graphs for parametrised tests (all with loops, repeats and
    isolated nodes; one with a hub; one clean)."""
    return [
        GraphSpec(9, 30, seed=1),
        GraphSpec(17, 60, seed=2, hub_degree=12),
        GraphSpec(5, 4, seed=3),
        GraphSpec(12, 40, seed=4, self_loops=False, duplicates=False, isolated=False),
    ]
