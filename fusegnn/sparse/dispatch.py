"""Which implementation of a sparse op runs where.

Every public op takes ``aggregation``:

* ``"reference"`` -- the pure-PyTorch oracle (:mod:`fusegnn.sparse.reference`), any device;
* ``"gas"`` -- fused gather-apply-scatter: edge-parallel over unsorted COO with atomics;
* ``"gar"`` -- fused gather-apply-reduce: row-parallel over CSR (forward) / CSC (backward);
* ``"auto"`` -- the best registered backend for the inputs: CPU tensors take the
  reference; on a GPU fuseGNN's rule picks GAS for graphs of low average degree and GAR
  for high.

Kernel backends register themselves with :func:`register_backend`; asking for a backend
that is not available raises a clear error instead of silently falling back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import Tensor

from fusegnn.sparse.graph import Graph

__all__ = [
    "AGGREGATIONS",
    "Backend",
    "register_backend",
    "available_backends",
    "resolve_aggregation",
]

AGGREGATIONS = ("auto", "gas", "gar", "reference")


@dataclass(frozen=True)
class Backend:
    """A set of op implementations with the signatures of :mod:`fusegnn.sparse.reference`.

    ``supports(graph, *tensors)`` says whether this backend can run on those inputs
    (device, dtype, ...); ``None`` means always.
    """

    name: str
    spmm: Callable[..., Tensor]
    sddmm: Callable[..., Tensor]
    edge_softmax: Callable[..., Tensor]
    supports: Callable[..., bool] | None = None

    def can_run(self, graph: Graph, *tensors: Tensor) -> bool:
        return self.supports is None or bool(self.supports(graph, *tensors))


_BACKENDS: dict[str, Backend] = {}

# Average in-degree at and above which "auto" prefers GAR over GAS on a GPU.
GAR_MIN_AVG_DEGREE = 8.0


def register_backend(backend: Backend) -> None:
    """Make ``backend`` selectable by its name (one of :data:`AGGREGATIONS` but ``auto``)."""
    if backend.name not in AGGREGATIONS or backend.name == "auto":
        raise ValueError(f"backend name must be one of {AGGREGATIONS[1:]}, got {backend.name!r}")
    _BACKENDS[backend.name] = backend


def available_backends() -> tuple[str, ...]:
    """Names of the registered backends."""
    return tuple(_BACKENDS)


def check_aggregation(aggregation: str) -> str:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    return aggregation


def resolve_aggregation(aggregation: str, graph: Graph, *tensors: Tensor) -> Backend:
    """The backend that runs for ``aggregation`` on these inputs."""
    check_aggregation(aggregation)
    if aggregation != "auto":
        backend = _BACKENDS.get(aggregation)
        if backend is None:
            raise NotImplementedError(
                f"aggregation={aggregation!r} is not available in this build of fusegnn "
                f"(available: {available_backends()})"
            )
        if not backend.can_run(graph, *tensors):
            raise ValueError(
                f"aggregation={aggregation!r} cannot run on these inputs "
                f"(device {graph.device}); use 'reference' or 'auto'"
            )
        return backend
    preferred = ("gar", "gas") if graph.avg_degree >= GAR_MIN_AVG_DEGREE else ("gas", "gar")
    for name in preferred:
        backend = _BACKENDS.get(name)
        if backend is not None and backend.can_run(graph, *tensors):
            return backend
    return _BACKENDS["reference"]
