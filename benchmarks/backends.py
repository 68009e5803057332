r"""What each backend name means, and whether it can run here.

Suite ``paper`` (a training step of the 2-layer model):

=====================  ========================================================================
``fusegnn``            fusegnn layers, ``aggregation="auto"`` (GAS or GAR by degree and width)
``fusegnn-gas``        fusegnn layers, every sparse op on the fused GAS kernels
``fusegnn-gar``        fusegnn layers, every sparse op on the fused GAR kernels
``fusegnn-reference``  fusegnn layers on the pure-PyTorch reference ops (gather / scatter)
``fusegnn-window``     GCN only: fusegnn layers with ``aggregation="window"`` (row windows on
                       tensor cores; opt-in, name it in ``--backends``)
``pyg``                PyG's ``GCNConv(cached=True)`` / ``GATConv`` with ``edge_index``
``pyg-uncached``       PyG's ``GCNConv(cached=False)`` (opt-in: renormalises every step)
``fusegnn-graphed``    ``fusegnn``'s model and step captured by :func:`fusegnn.graphed_step`
                       into a CUDA graph, timed per replay (small graphs only, CUDA only)
``pyg-graphed``        ``pyg``'s model and step through the same :func:`fusegnn.graphed_step`
                       (a capture that fails is recorded with its reason)
``fusegnn-compiled``   ``fusegnn``'s training step compiled with ``torch.compile(mode=
                       "reduce-overhead")``: forward + loss as one ``fullgraph`` function,
                       its compiled backward, and Adam (``capturable``) with ``step``
                       compiled (Inductor kernels replayed by CUDA-graph trees); compile
                       time recorded apart (small graphs only, CUDA only)
``pyg-compiled``       ``pyg``'s model compiled the same way (a failure is recorded with its
                       reason: PyG's cached ``GCNConv`` keeps a tensor that CUDA-graph trees
                       overwrite)
=====================  ========================================================================

Suite ``agg`` (``out = A @ x`` with the GCN-normalised adjacency, and its backward
``grad_x = A^T @ grad_out``):

=====================  ========================================================================
``fusegnn*``           :func:`fusegnn.sparse.spmm` with that ``aggregation`` (``fusegnn-window``:
                       ``"window"``, opt-in; its ``convert_ms`` builds the row windows)
``cusparse``           ``torch.sparse.mm`` with CSR matrices (int32 indices) of ``A`` and of
                       ``A^T`` built once (cuSPARSE SpMM on a GPU, both directions)
``gather-scatter``     ``zeros.index_add(0, dst, x.index_select(0, src) * w)`` (autograd)
=====================  ========================================================================

``fusegnn-gas`` / ``fusegnn-gar`` exist only where their kernels registered
(:func:`fusegnn.sparse.available_backends`); ``pyg`` where ``torch_geometric`` imports.
Names that cannot run are left out of the run and listed in the results' ``unavailable``.

Conversion cost (``convert_ms`` of a record) is what a backend builds once per graph
before it can run: CSR + CSC (``Graph.csr`` / ``Graph.csc``) for GAR, the two CSR
matrices for ``cusparse``; ``None`` for backends that work on COO (GAS, reference,
gather-scatter, PyG). ``fusegnn`` (auto) reports the conversion of the backend it picked.
"""

from __future__ import annotations

import fnmatch
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from benchmarks.cases import Case

__all__ = [
    "PaperBackend",
    "AggBackend",
    "PAPER_BACKENDS",
    "AGG_BACKENDS",
    "ORACLE_ORDER",
    "registry",
    "select_backends",
    "cuda_graph_unavailable",
    "compiled_unavailable",
    "fusegnn_unavailable",
    "pyg_unavailable",
    "small_graph",
]

ModelBuilder = Callable[[Case, int, int], nn.Module]
SpmmOp = Callable[[Tensor], Tensor]

# Backends whose outputs are trusted first as the correctness oracle of a case.
ORACLE_ORDER = (
    "fusegnn-reference", "pyg", "pyg-uncached", "gather-scatter", "cusparse",
    "fusegnn-gar", "fusegnn-gas", "fusegnn",
)


def _always(device: torch.device) -> str | None:
    return None


@dataclass(frozen=True)
class PaperBackend:
    """A way to build the model of a ``paper`` case.

    Attributes:
        name: the backend name in results.
        library: ``"fusegnn"`` (takes a :class:`~fusegnn.sparse.Graph`) or ``"pyg"``
            (takes ``edge_index``).
        build: ``(case, in_channels, num_classes) -> nn.Module``.
        aggregation: the fusegnn ``aggregation`` it uses (``None`` for PyG).
        unavailable: ``device -> None`` if it can run there, else the reason.
        applies: whether the backend makes sense for a case (others skip it silently).
        default: run when ``--backends`` is not given.
        graphed: time the step captured into a CUDA graph by :func:`fusegnn.graphed_step`
            (replays), after checking that replays train like eager steps.
        compiled: wrap the model in :func:`benchmarks.runner.compile_model` (``torch.compile``,
            ``mode="reduce-overhead"``, ``fullgraph=True``) and time the eager step around
            it, after checking that it trains like the eager model; the first call's time
            is ``compile_ms``.
    """

    name: str
    library: str
    build: ModelBuilder
    aggregation: str | None = None
    unavailable: Callable[[torch.device], str | None] = _always
    applies: Callable[[Case], bool] = field(default=lambda case: True)
    default: bool = True
    graphed: bool = False
    compiled: bool = False


@dataclass(frozen=True)
class AggBackend:
    """A way to compute ``out = A @ x`` for the ``agg`` suite.

    Attributes:
        name: the backend name in results.
        prepare: ``graph -> op`` with ``op(x) = A @ x`` differentiable in ``x``; the
            graph carries the weights ``A`` (``graph.edge_weight``). Whatever ``prepare``
            builds (formats, matrices) is built outside the timed region.
        aggregation: the fusegnn ``aggregation`` it uses (``None`` otherwise).
        converts: ``graph -> None`` building from scratch the formats this backend
            needs (timed as ``convert_ms``), or ``None`` if it needs none.
        unavailable, default: as for :class:`PaperBackend`.
    """

    name: str
    prepare: Callable[[object], SpmmOp]
    aggregation: str | None = None
    converts: Callable[[object], object] | None = None
    unavailable: Callable[[torch.device], str | None] = _always
    default: bool = True


# ----------------------------------------------------------------------------- availability


def fusegnn_unavailable(aggregation: str) -> Callable[[torch.device], str | None]:
    """Whether ``aggregation`` can run on ``device``: asks the dispatcher on a 2-node
    graph there (which also registers the kernel backends on first use)."""

    def check(device: torch.device) -> str | None:
        from fusegnn.sparse import Graph, resolve_aggregation

        graph = Graph(torch.tensor([[0, 1], [1, 0]], device=device), 2)
        try:
            resolve_aggregation(aggregation, graph, torch.zeros(2, 1, device=device), op="spmm")
        except (NotImplementedError, ValueError, RuntimeError) as err:
            return f"{type(err).__name__}: {err}"
        return None

    return check


def cuda_graph_unavailable(also: Callable[[torch.device], str | None]) -> Callable[[torch.device], str | None]:
    """``also``'s verdict, after requiring a CUDA device (CUDA graphs capture CUDA work only)."""

    def check(device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"CUDA graphs need a CUDA device (running on {device})"
        return also(device)

    return check


def compiled_unavailable(also: Callable[[torch.device], str | None]) -> Callable[[torch.device], str | None]:
    """``also``'s verdict, after requiring a CUDA device and ``torch.compile`` (its
    ``reduce-overhead`` mode replays CUDA graphs)."""

    def check(device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"torch.compile(mode='reduce-overhead') replays CUDA graphs: needs a CUDA device (running on {device})"
        if not hasattr(torch, "compile"):
            return f"torch {torch.__version__} has no torch.compile"
        return also(device)

    return check


def small_graph(case: Case) -> bool:
    """The cases a CUDA-graph backend runs: the small graphs (Cora, CiteSeer, PubMed), whose
    step is bound by kernel launches; the arxiv-sized and Reddit-like steps are bound by
    their sparse kernels and GEMMs."""
    return case.dataset in ("cora", "citeseer", "pubmed")


def pyg_unavailable(device: torch.device) -> str | None:
    try:
        importlib.import_module("torch_geometric")
    except Exception as err:  # noqa: BLE001 - any import failure means "not here"
        return f"torch_geometric does not import: {type(err).__name__}: {err}"
    return None


# ----------------------------------------------------------------------------- paper


def _fusegnn_builder(aggregation: str) -> ModelBuilder:
    def build(case: Case, in_channels: int, num_classes: int) -> nn.Module:
        from benchmarks.models import build_fusegnn_model

        return build_fusegnn_model(case, in_channels, num_classes, aggregation)

    return build


def _pyg_builder(cached: bool) -> ModelBuilder:
    def build(case: Case, in_channels: int, num_classes: int) -> nn.Module:
        from benchmarks.models import build_pyg_model

        return build_pyg_model(case, in_channels, num_classes, cached=cached)

    return build


# (backend name, aggregation=) of the fusegnn rows of the paper and agg suites
_FUSEGNN_BACKENDS = (
    ("fusegnn", "auto"),
    ("fusegnn-gas", "gas"),
    ("fusegnn-gar", "gar"),
    ("fusegnn-reference", "reference"),
)


def _paper_backends() -> dict[str, PaperBackend]:
    backends = {}
    for name, aggregation in _FUSEGNN_BACKENDS:
        backends[name] = PaperBackend(
            name, "fusegnn", _fusegnn_builder(aggregation), aggregation, fusegnn_unavailable(aggregation)
        )
    backends["pyg"] = PaperBackend("pyg", "pyg", _pyg_builder(True), unavailable=pyg_unavailable)
    backends["pyg-uncached"] = PaperBackend(
        "pyg-uncached", "pyg", _pyg_builder(False), unavailable=pyg_unavailable,
        applies=lambda case: case.model == "gcn", default=False,
    )
    # CUDA-graph rows (fusegnn.graphed_step) and compiled rows (torch.compile), each
    # library's model and step; small graphs only, where launches bound the step
    for kind, needs in (("graphed", cuda_graph_unavailable), ("compiled", compiled_unavailable)):
        backends[f"fusegnn-{kind}"] = PaperBackend(
            f"fusegnn-{kind}", "fusegnn", _fusegnn_builder("auto"), "auto", needs(fusegnn_unavailable("auto")),
            applies=small_graph, **{kind: True},
        )
        backends[f"pyg-{kind}"] = PaperBackend(
            f"pyg-{kind}", "pyg", _pyg_builder(True), unavailable=needs(pyg_unavailable),
            applies=small_graph, **{kind: True},
        )
    backends["fusegnn-window"] = PaperBackend(
        "fusegnn-window", "fusegnn", _fusegnn_builder("window"), "window", fusegnn_unavailable("window"),
        applies=lambda case: case.model == "gcn", default=False,
    )
    return backends


# ----------------------------------------------------------------------------- agg


def _fusegnn_spmm(aggregation: str) -> Callable[[object], SpmmOp]:
    def prepare(graph) -> SpmmOp:
        from fusegnn.sparse import spmm

        return lambda x: spmm(graph, x, aggregation=aggregation)

    return prepare


def build_csr_formats(graph) -> None:
    """CSR (by target) and CSC (by source) of ``graph``: what GAR runs on."""
    graph.csr
    graph.csc


def build_row_windows(graph) -> None:
    """The row windows of ``graph`` (structure, transposed index, tiles of its weights):
    what ``aggregation="window"`` runs on."""
    from fusegnn.sparse.window_aggregation import window_values

    weight = graph.edge_weight
    window_values(graph, weight, weight.dtype if weight is not None else torch.float32)


class _CsrSpmm(torch.autograd.Function):
    """``A @ x`` with cuSPARSE in both directions: backward is ``A^T @ grad``."""

    @staticmethod
    def forward(ctx, x: Tensor, a: Tensor, a_t: Tensor) -> Tensor:  # type: ignore[override]
        ctx.a_t = a_t
        return torch.sparse.mm(a, x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return torch.sparse.mm(ctx.a_t, grad.contiguous()), None, None


def csr_matrices(graph) -> tuple[Tensor, Tensor]:
    """``(A, A^T)`` as ``torch.sparse_csr_tensor`` with int32 indices where they fit."""
    weight = graph.edge_weight
    if weight is None:
        weight = torch.ones(graph.num_edges, device=graph.device)
    index_dtype = torch.int32 if graph.num_edges < 2**31 else torch.int64

    def matrix(compressed, rows: int, cols: int) -> Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
            return torch.sparse_csr_tensor(
                compressed.ptr.to(index_dtype), compressed.index.to(index_dtype),
                weight[compressed.perm], size=(rows, cols), check_invariants=False,
            )

    a = matrix(graph.csr, graph.num_dst_nodes, graph.num_src_nodes)
    a_t = matrix(graph.csc, graph.num_src_nodes, graph.num_dst_nodes)
    return a, a_t


def _cusparse(graph) -> SpmmOp:
    a, a_t = csr_matrices(graph)
    return lambda x: _CsrSpmm.apply(x, a, a_t)


def _gather_scatter(graph) -> SpmmOp:
    src, dst = graph.src.long(), graph.dst.long()
    weight = graph.edge_weight
    rows = graph.num_dst_nodes

    def op(x: Tensor) -> Tensor:
        messages = x.index_select(0, src)
        if weight is not None:
            messages = messages * weight.unsqueeze(1)
        return x.new_zeros((rows, x.size(1))).index_add(0, dst, messages)

    return op


def _agg_backends() -> dict[str, AggBackend]:
    backends = {}
    for name, aggregation in _FUSEGNN_BACKENDS:
        backends[name] = AggBackend(
            name, _fusegnn_spmm(aggregation), aggregation,
            build_csr_formats if aggregation == "gar" else None, fusegnn_unavailable(aggregation),
        )
    backends["fusegnn-window"] = AggBackend(
        "fusegnn-window", _fusegnn_spmm("window"), "window", build_row_windows, fusegnn_unavailable("window"),
        default=False,
    )
    backends["cusparse"] = AggBackend("cusparse", _cusparse, converts=csr_matrices)
    backends["gather-scatter"] = AggBackend("gather-scatter", _gather_scatter)
    return backends


PAPER_BACKENDS: dict[str, PaperBackend] = _paper_backends()
AGG_BACKENDS: dict[str, AggBackend] = _agg_backends()


def registry(suite: str) -> dict:
    """The (mutable) backend table of ``suite``; tests add fake backends to it."""
    if suite == "paper":
        return PAPER_BACKENDS
    if suite == "agg":
        return AGG_BACKENDS
    raise ValueError(f"unknown suite {suite!r}")


def select_backends(
    suite: str, device: torch.device, patterns: list[str] | None = None, *, strict: bool = True
) -> tuple[list, dict[str, str]]:
    """``(backends that can run on device, {name: reason} for those that cannot)``.

    ``patterns`` are names or globs (``fusegnn*``); ``None`` takes the default set. With
    ``strict``, a pattern that matches no backend of ``suite`` raises :class:`ValueError`
    naming the known ones (``--suite all`` checks against both suites instead).
    """
    table = registry(suite)
    if patterns:
        chosen = []
        for pattern in patterns:
            hits = [name for name in table if fnmatch.fnmatchcase(name, pattern)]
            if not hits and strict:
                raise ValueError(
                    f"--backends {pattern!r} matches no {suite} backend; known: {', '.join(table)}"
                )
            chosen += [name for name in hits if name not in chosen]
    else:
        chosen = [name for name, backend in table.items() if backend.default]
    runnable, unavailable = [], {}
    for name in chosen:
        reason = table[name].unavailable(device)
        if reason is None:
            runnable.append(table[name])
        else:
            unavailable[name] = reason
    return runnable, unavailable


def oracle_rank(name: str) -> int:
    """Position of ``name`` in :data:`ORACLE_ORDER` (unknown names last)."""
    return ORACLE_ORDER.index(name) if name in ORACLE_ORDER else len(ORACLE_ORDER)
