"""The modes a user sets reach every decision they govern, compiled or eager, in any thread.

A CUDA backward runs in the autograd engine's own device threads, where the thread-local
switches of :mod:`fusegnn.sparse.dispatch` (:func:`~fusegnn.sparse.dispatch.deterministic`,
:func:`~fusegnn.sparse.dispatch.for_capture`) are off. On the CPU a backward is run here in
a thread of its own (as that engine does), and the decisions taken in it are spied on
(on the CPU ``"auto"`` always takes the reference, so the mode a decision was taken in
is what can be observed). Checked:

* :func:`~fusegnn.sparse.propagate` (SGC, APPNP): its backward, K aggregations on the
  reversed graph, decides ``"auto"`` in the forward's deterministic and capture modes.
* a compiled op's backward decides ``"auto"`` in its forward's mode also when that mode is
  *off* in a block (``deterministic(False)``) while it is on globally
  (``set_deterministic(True)``): the engine's thread sees only the global switch.
"""

from __future__ import annotations

import os
import threading

import torch

if not torch.cuda.is_available():  # fused kernels run through Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fusegnn.sparse import Graph, dispatch, library, propagate, sddmm, spmm  # noqa: E402
from tests.graphs import random_graph  # noqa: E402
from tests.test_compile import fresh_dynamo  # noqa: E402,F401  (autouse: Dynamo reset around every test)

pytestmark = pytest.mark.usefixtures("one_thread")
N = 12


def _graph() -> Graph:
    return Graph(random_graph(N, 40, seed=3, hub_degree=5), N)


def _rand(*shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()


def _in_another_thread(fn) -> None:
    """Run ``fn`` in a thread of its own (as CUDA's autograd engine runs a backward)."""
    errors: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller
            errors.append(err)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if errors:
        raise errors[0]


def _spy_dispatch(monkeypatch) -> list[tuple[bool, bool]]:
    """``(deterministic, capture)`` modes of every ``"auto"`` decision the dispatcher takes
    afresh (not from its memo) from now on."""
    seen: list[tuple[bool, bool]] = []
    explain = dispatch.explain

    def spy(*args, **kwargs):
        if kwargs.get("aggregation", "auto") == "auto":
            seen.append((dispatch.is_deterministic(), dispatch.capture_mode()))
        return explain(*args, **kwargs)

    monkeypatch.setattr(dispatch, "explain", spy)
    return seen


@pytest.mark.parametrize("mode", [(True, True), (True, False), (False, True)])
def test_propagate_backward_decides_in_the_forwards_modes(monkeypatch, mode):
    deterministic, capture = mode
    seen = _spy_dispatch(monkeypatch)
    x = _rand(N, 4, seed=1)
    with dispatch.deterministic(deterministic), dispatch.for_capture(capture):
        loss = propagate(_graph(), x, 2, 0.1).sum()
        assert seen and set(seen) == {mode}
        seen.clear()
        _in_another_thread(loss.backward)
    assert x.grad is not None
    assert seen and set(seen) == {mode}


@pytest.fixture
def globally_deterministic():
    """``set_deterministic(True)`` for the test, switched off after it."""
    dispatch.set_deterministic(True)
    try:
        yield
    finally:
        dispatch.set_deterministic(False)


@pytest.mark.parametrize("op", ["spmm", "sddmm"])
def test_compiled_backward_keeps_a_blocks_mode_off(monkeypatch, globally_deterministic, op):
    seen: list[bool] = []
    explain = library.explain
    monkeypatch.setattr(library, "explain",
                        lambda *a, **k: (seen.append(dispatch.is_deterministic()), explain(*a, **k))[1])
    graph, x = _graph(), _rand(N, 4, seed=1)
    fn = (lambda x: spmm(graph, x)) if op == "spmm" else (lambda x: sddmm(graph, x, x))
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with dispatch.deterministic(False):
        loss = compiled(x).sum()
        _in_another_thread(loss.backward)
    assert x.grad is not None
    assert seen and not any(seen)
