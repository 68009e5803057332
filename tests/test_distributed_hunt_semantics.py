"""fusegnn.distributed against one process, on 2 gloo workers (one small spawn) and
single-process shares:

* TransformerConv on a worker's share (its ``edge_softmax`` asks for the local graph
  alone, which crashed in ``with_halo_rows``): outputs and gradients as in one process;
  ``edge_softmax`` on a share;
* a share owns copies of its ids: writing into the partition after the build (or into
  ``dg.owned``) leaves the other unchanged;
* a hand-made partition of float / bool / 2-D / non-tensor parts, and a float or bool
  ``rank``, are refused with errors that name them;
* an int32 partition whose ``parts x nodes`` passes 2**31 builds the same share as int64;
* GINEConv and TransformerConv with edge features on 2 workers (``edge_aggregate``
  fetches the halo rows), and ``edge_aggregate`` on a share;
* ``Partition.nodes`` returns a copy (an in-place shuffle of it reordered the partition)
  and refuses a part out of range (-1 gave an empty tensor);
* examples/train_distributed.py: the processes start from the same parameters but draw
  their own dropout masks.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fusegnn.distributed import DistGraph, allreduce_gradients, partition_graph
from fusegnn.sparse import Graph
from tests.graphs import random_graph
from tests.gloo_workers import spawn_reports, write_report

pytestmark = pytest.mark.usefixtures("one_thread")

WORLD = 2
NUM_NODES = 24


def _graph() -> Graph:
    """Isolated nodes, a hub, self-loops and duplicate edges."""
    return Graph(random_graph(NUM_NODES, 90, seed=5, hub_degree=10), NUM_NODES)


def _features() -> torch.Tensor:
    return torch.randn(NUM_NODES, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _layer_against_one_process(layer: torch.nn.Module, graph: Graph, dg: DistGraph, x: torch.Tensor) -> list:
    """Max abs differences (outputs, input gradients, summed parameter gradients) of
    ``layer`` on the worker's share against a copy of it on the whole graph."""
    layer = layer.double()
    single = copy.deepcopy(layer)
    x_all = x.clone().requires_grad_()
    out_all = single(x_all, graph)
    (out_all ** 2).sum().backward()
    x_own = dg.owned_rows(x).requires_grad_()
    out = layer(x_own, dg)
    (out ** 2).sum().backward()
    allreduce_gradients(layer)
    grads = [float((p.grad - q.grad).abs().max()) for p, q in zip(layer.parameters(), single.parameters())]
    return [float((dg.gather(out.detach()) - out_all.detach()).abs().max()),
            float((dg.gather(x_own.grad) - x_all.grad).abs().max()), max(grads)]


def _transformer(graph: Graph, dg: DistGraph, x: torch.Tensor) -> dict:
    from fusegnn.layers import TransformerConv

    torch.manual_seed(0)
    return {"concat": _layer_against_one_process(TransformerConv(5, 3, heads=2), graph, dg, x),
            "beta_mean": _layer_against_one_process(TransformerConv(5, 3, heads=2, concat=False, beta=True),
                                                    graph, dg, x)}


def _edge_feature_layer(layer: torch.nn.Module, graph: Graph, dg: DistGraph, x: torch.Tensor) -> list:
    """As :func:`_layer_against_one_process` for a layer with edge features: the worker
    passes the rows of its local edges (the global edges into its nodes, in order); last,
    the difference of the edge features' gradients."""
    e = torch.randn(graph.num_edges, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    mine = torch.isin(graph.dst, dg.owned)
    layer = layer.double()
    single = copy.deepcopy(layer)
    x_all, e_all = x.clone().requires_grad_(), e.clone().requires_grad_()
    out_all = single(x_all, graph, e_all)
    (out_all ** 2).sum().backward()
    x_own, e_own = dg.owned_rows(x).requires_grad_(), e[mine].clone().requires_grad_()
    out = layer(x_own, dg, e_own)
    (out ** 2).sum().backward()
    allreduce_gradients(layer)
    grads = [float((p.grad - q.grad).abs().max()) for p, q in zip(layer.parameters(), single.parameters())]
    return [float((dg.gather(out.detach()) - out_all.detach()).abs().max()),
            float((dg.gather(x_own.grad) - x_all.grad).abs().max()), max(grads),
            float((e_own.grad - e_all.grad[mine]).abs().max())]


def _edge_features(graph: Graph, dg: DistGraph, x: torch.Tensor) -> dict:
    from fusegnn.layers import GINEConv, TransformerConv

    torch.manual_seed(0)
    return {"gine": _edge_feature_layer(GINEConv(torch.nn.Linear(5, 4), edge_dim=3), graph, dg, x),
            "transformer": _edge_feature_layer(TransformerConv(5, 4, heads=2, edge_dim=3), graph, dg, x),
            "transformer_narrow": _edge_feature_layer(TransformerConv(5, 2, heads=2, edge_dim=3), graph, dg, x)}


CASES = {"transformer": _transformer, "edge_features": _edge_features}


def _cases_report(world_size: int) -> dict:
    """Every case's result on this worker (an error message where it fails: the case's
    test reports it)."""
    graph, x = _graph(), _features()
    dg = DistGraph.build(graph, partition_graph(graph, world_size, "contiguous"))
    report = {}
    for name, case in CASES.items():
        try:
            report[name] = case(graph, dg, x)
        except Exception as err:  # reported by the case's test
            report[name] = f"{type(err).__name__}: {err}"
    return report


def _worker(rank: int, world_size: int, init: str, out_dir: str) -> None:
    # a case that fails on one worker only leaves the other in a collective: not for long
    write_report(rank, world_size, init, out_dir, lambda: _cases_report(world_size), timeout_s=60)


def _assert_every_worker_matches_one_process(reports: list[dict], key: str) -> None:
    """Case ``key`` ran on every worker (no error message) and each of its sub-cases'
    errors against one process is within 1e-10."""
    for r in reports:
        assert isinstance(r[key], dict), r[key]
        for case, errors in r[key].items():
            assert max(errors) <= 1e-10, (case, errors)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return spawn_reports(_worker, WORLD, tmp_path_factory.mktemp("dist_hunt"))


def test_transformer_conv_on_two_workers(reports):
    """Before: ``ValueError: torch.cat(): expected a non-empty list of Tensors`` from
    ``edge_softmax``'s ``with_halo_rows(graph)`` (no source tensor to exchange)."""
    _assert_every_worker_matches_one_process(reports, "transformer")


def test_edge_softmax_on_a_share():
    """``edge_softmax`` on a (one-worker) share: the local graph, no exchange."""
    from fusegnn.sparse import edge_softmax

    graph = _graph()
    dg = DistGraph.build(graph, partition_graph(graph, 1))
    scores = torch.randn(graph.num_edges, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(edge_softmax(dg, scores), edge_softmax(graph, scores))


def test_share_does_not_alias_the_partition():
    """A share's ``owned`` ids were a view of ``partition.perm``: writing into the
    partition after the build (reusing a hand-made partition's buffer, or an in-place op
    on ``part.perm``) silently changed which rows ``owned_rows`` / ``gather`` took every
    step, and writing into ``dg.owned`` corrupted the partition other shares are built from."""
    graph = _graph()
    part = partition_graph(graph, 2, "contiguous")
    dg = DistGraph.build(graph, part, 0)
    owned, perm = dg.owned.clone(), part.perm.clone()
    x = _features()
    rows = dg.owned_rows(x)
    part.perm.copy_(part.perm.flip(0))
    assert torch.equal(dg.owned, owned) and torch.equal(dg.owned_rows(x), rows)
    part.perm.copy_(perm)
    dg.owned.zero_()
    assert torch.equal(part.perm, perm)


def _hand_partition(parts, perm, offsets):
    from fusegnn.distributed import Partition

    return Partition(parts, perm, offsets, 0, 1.0, "manual")


def test_hand_made_partition_and_rank_of_the_wrong_type_are_refused():
    """Before: ``IndexError: arrays used as indices must be of integer (or boolean) type``
    (float tensors), a boolean-mask ``IndexError`` (bool parts), ``AttributeError: 'list'
    object has no attribute 'numel'``, a ``bincount`` RuntimeError (2-D parts), and an
    ``IndexError`` / ``TypeError`` from numpy for ``rank=1.0`` / ``rank=True``."""
    graph = _graph()
    good = partition_graph(graph, 2, "contiguous")
    parts, perm, offsets = good.parts, good.perm, good.offsets
    bad = {
        "partition.parts": [(parts.double(), perm, offsets), (parts.bool(), perm, offsets),
                            (parts.view(1, -1), perm, offsets)],
        "partition.perm": [(parts, perm.double(), offsets)],
        "partition.offsets": [(parts, perm, offsets.double()), (parts, perm, offsets[:1])],
    }
    for name, cases in bad.items():
        for case in cases:
            with pytest.raises(ValueError, match=name):
                DistGraph.build(graph, _hand_partition(*case), 0)
    with pytest.raises(TypeError, match="partition.parts"):
        DistGraph.build(graph, _hand_partition(parts.tolist(), perm, offsets), 0)
    for rank in (1.0, True):
        with pytest.raises(TypeError, match="rank"):
            DistGraph.build(graph, good, rank)
    ints = _hand_partition(parts.int(), perm.int(), offsets.int())  # any integer dtype is fine
    assert torch.equal(DistGraph.build(graph, ints, torch.tensor(1)).owned, DistGraph.build(graph, good, 1).owned)


def test_int32_partition_keys_do_not_overflow():
    """A share numbers its halo by the key ``owner * N + owner's local id``, computed in
    the partition's dtype: with a hand-made int32 partition whose ``P * N`` passes 2**31
    (here 50,000 one-node parts) the keys wrapped negative and the build raised
    ``'list' argument must have no negative elements`` (or, elsewhere, numbered the halo
    wrongly)."""
    from fusegnn.distributed import Partition

    n = 50_000
    graph = Graph(torch.tensor([[n - 1, 1, n - 2], [0, 0, n - 1]]), n)
    ids = torch.arange(n)
    by_dtype = {}
    for dtype in (torch.int64, torch.int32):
        part = Partition(ids.to(dtype), ids.to(dtype), torch.arange(n + 1).to(dtype), 3, 1.0, "manual")
        dg = DistGraph.build(graph, part, 0)
        by_dtype[dtype] = (dg.halo.tolist(), dg.recv_counts, dg.graph.edge_index.tolist())
    assert by_dtype[torch.int32] == by_dtype[torch.int64]
    assert by_dtype[torch.int64][0] == [1, n - 1]


class _MaskRecorder(torch.nn.Module):
    """A model that ignores the graph and records its dropout masks (no exchange: the
    example's step runs without a process group)."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(features, classes)
        self.masks: list[torch.Tensor] = []

    def forward(self, x, graph):
        dropped = torch.nn.functional.dropout(torch.ones_like(x), 0.5, self.training)
        if self.training:
            self.masks.append(dropped != 0)
        return self.lin(x * dropped)


def test_example_draws_other_dropout_masks_on_each_process(monkeypatch):
    """examples/train_distributed.py seeded every process with ``seed + run`` (for equal
    initial parameters) and left it there, so processes owning as many nodes drew the
    same dropout mask on their rows: node k of part 0 and node k of part 1 were always
    dropped together. The parameters must still start equal everywhere."""
    import importlib.util
    from pathlib import Path

    from fusegnn.datasets.synthetic import generate_reddit_like

    path = Path(__file__).resolve().parents[1] / "examples" / "train_distributed.py"
    spec = importlib.util.spec_from_file_location("fusegnn_example_train_distributed_hunt", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    data = generate_reddit_like(0.002, seed=0, avg_degree=4)
    models, initial = [], []

    def build(args, data):
        models.append(_MaskRecorder(data.x.size(1), int(data.y.max()) + 1))
        initial.append([p.detach().clone() for p in models[-1].parameters()])
        return models[-1]

    monkeypatch.setattr(example.single, "build_model", build)
    args = example.parse_args(["--device", "cpu", "--epochs", "2", "--runs", "1", "--quiet", "--model", "gcn"])
    num_nodes = data.x.size(0) - data.x.size(0) % 2  # two parts of equal size
    part = _hand_partition(torch.arange(data.x.size(0)) * 2 // num_nodes, torch.arange(data.x.size(0)),
                           torch.tensor([0, num_nodes // 2, data.x.size(0)]))
    for rank in (0, 1):
        dg = DistGraph.build(data.graph, part, rank)
        tensors = {"x": dg.owned_rows(data.x), "y": dg.owned_rows(data.y),
                   "masks": {s: dg.owned_rows(getattr(data, f"{s}_mask")) for s in ("train", "val", "test")}}
        example.train_run(args, data, dg, tensors, 0, _NoBar())
    assert all(torch.equal(a, b) for a, b in zip(*initial))  # the same initial parameters
    first, second = models
    assert len(first.masks) == len(second.masks) == 2
    for a, b in zip(first.masks, second.masks):
        assert not torch.equal(a, b)


class _NoBar:
    def update(self, *args) -> None:
        pass

    def set_postfix(self, **kwargs) -> None:
        pass


def test_edge_feature_layers_on_two_workers(reports):
    """GINEConv and TransformerConv(edge_dim=...) aggregate with ``edge_aggregate``, which
    did not fetch the halo rows: ``ValueError: x has 14 rows but the graph needs 24``."""
    _assert_every_worker_matches_one_process(reports, "edge_features")


def test_edge_aggregate_on_a_share():
    """``edge_aggregate`` on a (one-worker) share takes the owned rows, as ``spmm`` does."""
    from fusegnn.sparse import edge_aggregate

    graph = _graph()
    dg = DistGraph.build(graph, partition_graph(graph, 1))
    x = _features()
    e = torch.randn(graph.num_edges, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    expected = edge_aggregate(graph, x, e, activation="relu")
    assert torch.equal(edge_aggregate(dg, dg.owned_rows(x), e, activation="relu"), dg.owned_rows(expected))
    assert torch.equal(edge_aggregate(dg, None, e), dg.owned_rows(edge_aggregate(graph, None, e)))


def test_partition_nodes_is_a_copy():
    """``Partition.nodes(p)`` was a view of ``perm``: shuffling a part's ids in place (a
    worker's own node order) reordered the (frozen) partition, so a share built from it
    later numbered that part's rows differently from the other workers' shares (a silently
    wrong halo exchange)."""
    graph = _graph()
    part = partition_graph(graph, 2, "contiguous")
    perm = part.perm.clone()
    ids = part.nodes(0)
    ids[:] = ids.flip(0)
    assert torch.equal(part.perm, perm)
    assert torch.equal(part.nodes(0), perm[: part.sizes()[0]])


@pytest.mark.parametrize("part", [-1, 2, True, 1.0])
def test_partition_nodes_refuses_a_part_out_of_range(part):
    """``nodes(-1)`` returned an empty tensor (the slice ``perm[offsets[-1]:offsets[0]]``),
    ``nodes(P)`` an IndexError about ``offsets``, ``nodes(1.0)`` torch's index TypeError."""
    part_of = partition_graph(_graph(), 2, "contiguous")
    with pytest.raises(ValueError, match="part must be an int in \\[0, 2\\)"):
        part_of.nodes(part)
    assert torch.equal(part_of.nodes(np.int64(1)), part_of.nodes(1))


def test_part_and_rank_are_one_integer_by_the_same_rule():
    """``Partition.nodes`` and ``DistGraph.build``'s ``rank`` take what every integer
    argument of fusegnn takes (``is_integer``: Python and NumPy ints), plus a 0-d integer
    tensor, through one helper. ``nodes`` tested with ``operator.index`` and refused only a
    Python bool, so ``nodes(torch.tensor(True))`` gave part 1 and ``nodes(torch.tensor([1]))``
    part 1 too; ``rank=torch.tensor([1])`` was taken as rank 1."""
    graph = _graph()
    part = partition_graph(graph, 2, "contiguous")
    assert torch.equal(part.nodes(torch.tensor(1)), part.nodes(1))
    for bad in (torch.tensor(True), torch.tensor([1]), np.bool_(True)):
        with pytest.raises(ValueError, match="part must be an int"):
            part.nodes(bad)
    for bad in (torch.tensor(True), torch.tensor([1]), torch.tensor(1.0)):
        with pytest.raises(TypeError, match="rank must be an int"):
            DistGraph.build(graph, part, bad)
    assert torch.equal(DistGraph.build(graph, part, np.int64(1)).owned, DistGraph.build(graph, part, 1).owned)


def test_partition_graph_takes_a_numpy_int_num_parts_and_refuses_bools():
    """``num_parts`` follows fusegnn's one integer rule (:func:`~fusegnn.sparse.graph.is_integer`):
    a NumPy int (a count computed with NumPy) was refused as "not a positive int"."""
    import numpy as np

    from fusegnn.distributed import partition_graph
    from fusegnn.sparse import Graph

    graph = Graph(torch.tensor([[0, 1, 2, 3], [1, 2, 3, 0]]), 4)
    part = partition_graph(graph, np.int64(2), "contiguous")
    assert part.num_parts == 2 and isinstance(part.num_parts, int)
    for bad in (True, 2.0, 0, torch.tensor(2)):
        with pytest.raises(ValueError, match="num_parts must be a positive int"):
            partition_graph(graph, bad, "contiguous")
