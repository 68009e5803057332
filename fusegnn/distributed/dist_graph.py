r"""One worker's share of a partitioned graph: owned nodes, their incoming edges, halo
nodes and the send / receive lists of the halo exchange.

For worker ``r`` of a partition (:func:`~fusegnn.distributed.partition.partition_graph`):

* **owned nodes** ``O_r`` (part ``r``), numbered ``0 .. n_own - 1`` in partition order;
* **local edges**: every edge ``j -> i`` with ``i`` in ``O_r``, in the global edge order
  (so an owned target aggregates exactly the edges it has in the whole graph);
* **halo nodes** ``H_r``: the sources of those edges owned by other workers, numbered
  ``n_own .. n_own + n_halo - 1``, grouped by owner (owners in rank order) and, inside a
  group, in the owner's local order;
* **receive counts**: ``recv_counts[q] = |H_r ∩ O_q|``, the rows that arrive from ``q``,
  landing in that order at the halo positions;
* **send lists**: the owned nodes some other worker ``q`` has in its halo, per ``q`` in
  rank order and inside in local order: ``send_index`` (local ids) with ``send_counts[q]``
  rows for ``q``. Worker ``q`` numbers its halo the same way, so ``r``'s ``k``-th row for
  ``q`` is the ``k``-th row ``q`` receives from ``r`` -- no handshake is needed.

Every worker builds its share from the **global** ``edge_index`` and partition, which it
reads on the host (each worker holds the whole edge list in host memory while building:
16 bytes per edge, about 1 GB for ogbn-products' 62M edges; a sharded build from
pre-partitioned files is left for graphs that do not fit). Only the local share is moved
to the device.

The :class:`DistGraph` is what the layers take: it holds a
:class:`~fusegnn.sparse.halo.HaloGraph` (``graph``) whose exchange is
:func:`~fusegnn.distributed.exchange.halo_exchange`, and gives it to the op layer
through ``__fusegnn_graph__``, so ``GCNConv(...)(x_owned, dist_graph)`` runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from fusegnn.distributed.partition import Partition
from fusegnn.sparse.graph import Graph, as_graph, integer_index
from fusegnn.sparse.halo import HaloGraph

__all__ = ["DistGraph", "ExchangeLog", "share_of"]


@dataclass
class ExchangeLog:
    """What the halo exchanges of this worker moved since the last :meth:`reset`:
    ``calls`` exchanges (forward and backward), ``bytes_sent`` / ``bytes_received`` in
    bytes, and ``widths`` the ``(bytes per row, direction)`` of each call in order (what a
    benchmark replays to time the exchange alone). Host-side counters: no device sync."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    widths: list = field(default_factory=list)

    def record(self, sent_rows: int, received_rows: int, row_bytes: int, direction: str) -> None:
        self.calls += 1
        self.bytes_sent += sent_rows * row_bytes
        self.bytes_received += received_rows * row_bytes
        self.widths.append((row_bytes, direction))

    def reset(self) -> None:
        self.calls = self.bytes_sent = self.bytes_received = 0
        self.widths = []


class DistGraph:
    """Worker ``rank``'s share of ``graph`` under ``partition`` (see the module docstring).

    Build it with :meth:`build`. Attributes: ``rank``, ``world_size``, ``num_own``,
    ``num_halo``, ``owned`` (``[n_own]`` global ids of the owned nodes, host),
    ``halo`` (``[n_halo]`` global ids of the halo nodes, host), ``send_index``
    (``[S]`` local ids, on the device), ``send_counts`` / ``recv_counts`` (lists of
    ``world_size`` ints), ``graph`` (the :class:`~fusegnn.sparse.halo.HaloGraph`),
    ``group`` (the process group; ``None``: the default one), ``log`` (an
    :class:`ExchangeLog`).
    """

    def __init__(self, *, rank: int, world_size: int, owned: Tensor, halo: Tensor, edge_index: Tensor,
                 send_index: Tensor, send_counts: list[int], recv_counts: list[int], num_global_nodes: int,
                 group=None) -> None:
        from fusegnn.distributed.exchange import halo_exchange

        self.rank, self.world_size = rank, world_size
        self.owned, self.halo = owned, halo
        self.send_index = send_index
        self.send_counts, self.recv_counts = send_counts, recv_counts
        self.num_global_nodes = num_global_nodes
        self.group = group
        self.log = ExchangeLog()
        self.graph = HaloGraph(edge_index, owned.numel(), halo.numel(), lambda x: halo_exchange(x, self),
                               validate=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, graph, partition: Partition, rank: int | None = None, *, device: torch.device | str = "cpu",
              group=None) -> "DistGraph":
        """Worker ``rank``'s share (default: this process's rank in ``group``) of
        ``graph`` (a square :class:`~fusegnn.sparse.Graph` or ``edge_index``) under
        ``partition``, with its edges and send list on ``device``."""
        graph = as_graph(graph, name="graph")
        if graph.is_bipartite:
            raise ValueError(f"graph must be square, got {graph!r}")
        if graph.edge_weight is not None:
            raise ValueError("DistGraph takes an unweighted graph (edge weights are not partitioned yet)")
        if not isinstance(partition, Partition):
            raise TypeError(f"partition must be a fusegnn.distributed.Partition (from partition_graph), "
                            f"got {type(partition).__name__}")
        _check_partition_tensors(partition)
        world_size = partition.num_parts
        if dist.is_available() and dist.is_initialized():
            group_size = dist.get_world_size(group)
            if group_size != world_size:
                raise ValueError(f"the partition has {world_size} parts but the process group has {group_size} ranks")
            if rank is None:
                rank = dist.get_rank(group)
        elif rank is None:
            if world_size != 1:
                raise ValueError("torch.distributed is not initialised: pass rank, or partition into 1 part")
            rank = 0
        rank = _check_rank(rank, world_size)
        if partition.parts.numel() != graph.num_nodes:
            raise ValueError(f"the partition covers {partition.parts.numel()} nodes, the graph has {graph.num_nodes}")
        _check_partition(partition)
        share = share_of(graph.src.cpu().numpy(), graph.dst.cpu().numpy(), partition, rank)
        device = torch.device(device)
        return cls(
            rank=rank, world_size=world_size, owned=share["owned"], halo=share["halo"],
            edge_index=share["edge_index"].to(device), send_index=share["send_index"].to(device),
            send_counts=share["send_counts"], recv_counts=share["recv_counts"], num_global_nodes=graph.num_nodes,
            group=group,
        )

    # ------------------------------------------------------------------ facts
    @property
    def num_own(self) -> int:
        return self.graph.num_own

    @property
    def num_halo(self) -> int:
        return self.graph.num_halo

    @property
    def device(self) -> torch.device:
        return self.graph.device

    def __fusegnn_graph__(self) -> HaloGraph:
        """The graph the ops run on (see :func:`fusegnn.sparse.graph.coerce_graph`)."""
        return self.graph

    def __repr__(self) -> str:
        return (f"DistGraph(rank={self.rank}/{self.world_size}, num_own={self.num_own}, num_halo={self.num_halo}, "
                f"num_edges={self.graph.num_edges}, device={self.device})")

    # ------------------------------------------------------------------ node data
    def owned_rows(self, values: Tensor) -> Tensor:
        """This worker's rows ``values[owned]`` of a global per-node tensor (features,
        labels, masks), on the graph's device."""
        _check_rows(values, "values")
        if values.size(0) != self.num_global_nodes:
            raise ValueError(f"values must have one row per node ({self.num_global_nodes}), got {tuple(values.shape)}")
        return values.index_select(0, self.owned.to(values.device)).to(self.device)

    def gather(self, x_owned: Tensor) -> Tensor:
        """The global ``[N, ...]`` tensor from every worker's owned rows, on every worker
        (an all-gather; for evaluation and tests, not for the training step)."""
        _check_rows(x_owned, "x_owned")
        if x_owned.size(0) != self.num_own:
            raise ValueError(f"x_owned must have {self.num_own} rows (the owned nodes), got {tuple(x_owned.shape)}")
        out = x_owned.new_empty((self.num_global_nodes, *x_owned.shape[1:]))
        if self.world_size == 1:
            return out.index_copy_(0, self.owned.to(out.device), x_owned)
        sizes = [torch.zeros(1, dtype=torch.int64, device=x_owned.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([self.num_own], device=x_owned.device), group=self.group)
        longest = int(max(int(s) for s in sizes))
        padded = x_owned.new_zeros((longest, *x_owned.shape[1:]))
        padded[: self.num_own] = x_owned
        rows = [torch.empty_like(padded) for _ in range(self.world_size)]
        ids = [torch.empty(longest, dtype=torch.int64, device=x_owned.device) for _ in range(self.world_size)]
        own_ids = torch.full((longest,), -1, dtype=torch.int64, device=x_owned.device)
        own_ids[: self.num_own] = self.owned.to(x_owned.device)
        dist.all_gather(rows, padded.contiguous(), group=self.group)
        dist.all_gather(ids, own_ids, group=self.group)
        for part_rows, part_ids, size in zip(rows, ids, sizes):
            n = int(size)
            out.index_copy_(0, part_ids[:n], part_rows[:n])
        return out


def _check_rows(values, name: str) -> None:
    """``values`` is a tensor with at least one dimension (its rows)."""
    if not isinstance(values, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if values.dim() == 0:
        raise ValueError(f"{name} must have one row per node, got a 0-d tensor")


def _check_rank(rank, world_size: int) -> int:
    """``rank`` as an int in ``[0, world_size)`` (a float or a bool is refused: numpy
    indexed with it deep in the build)."""
    index = integer_index(rank)
    if index is None:
        raise TypeError(f"rank must be an int, got {type(rank).__name__} {rank!r}")
    rank = index
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank


def _check_partition_tensors(partition: Partition) -> None:
    """``parts``, ``perm`` and ``offsets`` of a (possibly hand-made) :class:`Partition`
    are 1-D integer tensors (a float, bool or 2-D one failed deep in numpy or torch)."""
    for name in ("parts", "perm", "offsets"):
        value = getattr(partition, name)
        if not isinstance(value, Tensor):
            raise TypeError(f"partition.{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.dim() != 1 or value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
            raise ValueError(f"partition.{name} must be a 1-D integer tensor, got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
    if partition.offsets.numel() < 2:
        raise ValueError(f"partition.offsets must hold at least 2 entries (P + 1, P >= 1), got {partition.offsets.tolist()}")


def _check_partition(partition: Partition) -> None:
    """``parts``, ``perm`` and ``offsets`` describe the same split (a hand-made
    :class:`Partition` may not): parts in ``[0, P)``, ``perm`` a permutation grouped by
    part, ``offsets`` the running part sizes."""
    parts, perm, offsets = partition.parts, partition.perm, partition.offsets
    n, num_parts = parts.numel(), partition.num_parts
    if n and (int(parts.min()) < 0 or int(parts.max()) >= num_parts):
        raise ValueError(f"partition.parts must lie in [0, {num_parts}), got values in "
                         f"[{int(parts.min())}, {int(parts.max())}]")
    sizes = torch.bincount(parts.long(), minlength=num_parts)
    expected = torch.cat([sizes.new_zeros(1), sizes.cumsum(0)])
    if not torch.equal(offsets.long(), expected):
        raise ValueError(f"partition.offsets must be the running part sizes {expected.tolist()}, got {offsets.tolist()}")
    if perm.numel() != n or not torch.equal(torch.sort(perm.long()).values, torch.arange(n)):
        raise ValueError(f"partition.perm must be a permutation of the {n} nodes")
    if n and not torch.equal(parts[perm.long()], torch.repeat_interleave(torch.arange(num_parts), sizes)):
        raise ValueError("partition.perm must list the nodes part by part")


def share_of(src: np.ndarray, dst: np.ndarray, partition: Partition, rank: int) -> dict:
    """The index sets of worker ``rank``'s share, from the global edges on the host
    (numpy in, torch int64 out): ``owned``, ``halo`` (global ids), ``edge_index`` (local
    ids), ``send_index`` (local ids), ``send_counts``, ``recv_counts``. No process group
    is needed (a benchmark sizes other partitions with it)."""
    # int64 throughout: the (part, local id) keys below reach P * N, past int32's range
    # for a hand-made int32 partition of a big graph (or of many parts)
    parts = partition.parts.numpy().astype(np.int64, copy=False)
    perm = partition.perm.numpy().astype(np.int64, copy=False)
    offsets = partition.offsets.numpy().astype(np.int64, copy=False)
    world_size = partition.num_parts
    src = src.astype(np.int64, copy=False)
    dst = dst.astype(np.int64, copy=False)
    # each node's id among its part's nodes
    local_of = np.empty(parts.size, dtype=np.int64)
    local_of[perm] = np.arange(perm.size) - offsets[parts[perm]]
    owned = perm[offsets[rank]:offsets[rank + 1]].copy()  # not a view of the caller's partition.perm
    num_own = owned.size

    mine = parts[dst] == rank  # the incoming edges of the owned nodes, in global order
    e_src, e_dst = src[mine], dst[mine]
    src_part = parts[e_src]
    remote = src_part != rank
    # halo nodes, ordered by (owner, owner's local id): the order their rows arrive in
    halo_key = np.unique(src_part[remote] * parts.size + local_of[e_src[remote]])
    halo_owner, halo_local = np.divmod(halo_key, parts.size)
    halo = perm[offsets[halo_owner] + halo_local]
    local_src = local_of[e_src]
    local_src[remote] = num_own + np.searchsorted(halo_key, src_part[remote] * parts.size + local_of[e_src[remote]])
    recv_counts = np.bincount(halo_owner, minlength=world_size)

    # what the others need from me: owned sources of edges into their nodes, by (rank, local id)
    out_edges = (parts[src] == rank) & (parts[dst] != rank)
    send_key = np.unique(parts[dst[out_edges]] * max(num_own, 1) + local_of[src[out_edges]])
    send_rank, send_index = np.divmod(send_key, max(num_own, 1))
    send_counts = np.bincount(send_rank, minlength=world_size)

    as_t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    return dict(
        owned=as_t(owned), halo=as_t(halo), edge_index=torch.stack([as_t(local_src), as_t(local_of[e_dst])]),
        send_index=as_t(send_index), send_counts=[int(c) for c in send_counts],
        recv_counts=[int(c) for c in recv_counts],
    )
