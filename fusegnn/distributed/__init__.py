"""Full-graph training across workers on ``torch.distributed``: partition the graph
(:func:`partition_graph`), give each worker its share (:class:`DistGraph`), and run the
ordinary layers on it -- the ops fetch the halo rows they aggregate
(:func:`halo_exchange`, an autograd function over ``all_to_all_single``). Parameters are
synchronised with :func:`allreduce_gradients` (or ``DistributedDataParallel``).

    dist.init_process_group("nccl")               # torchrun sets rank and world size
    part = partition_graph(data.graph, dist.get_world_size())
    dg = DistGraph.build(data.graph, part, device="cuda")
    x, y = dg.owned_rows(data.x), dg.owned_rows(data.y)
    out = model(x, dg)                              # GCN / GAT layers, unchanged
"""

from fusegnn.distributed.dist_graph import DistGraph, ExchangeLog
from fusegnn.distributed.exchange import HaloExchange, halo_exchange
from fusegnn.distributed.partition import METHODS, Partition, partition_graph
from fusegnn.distributed.training import allreduce_gradients, global_count, global_sum

__all__ = [
    "DistGraph",
    "ExchangeLog",
    "HaloExchange",
    "METHODS",
    "Partition",
    "allreduce_gradients",
    "global_count",
    "global_sum",
    "halo_exchange",
    "partition_graph",
]
