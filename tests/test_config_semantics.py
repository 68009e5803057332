"""User-facing configuration and mode switches, checked against their docstrings:
deterministic mode (:func:`fusegnn.sparse.dispatch.deterministic`,
``torch.use_deterministic_algorithms``), the kernels' ``tuning`` context managers and the
environment variables fusegnn reads (``ENVIRONMENT.md``).

Without CUDA the fused kernels run through Triton's interpreter (set before Triton is
imported); inputs are tiny.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from fusegnn.sparse import Graph, dispatch, reference, spmm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _small_graph() -> Graph:
    ei = torch.tensor([[0, 1, 2, 3, 1, 2], [1, 2, 3, 0, 0, 0]], device=DEVICE)
    return Graph(ei, 4)


@pytest.fixture
def restore_torch_determinism():
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


# ----------------------------------------------------------------------------- deterministic mode
def test_gas_refused_in_strict_mode_after_a_warn_only_call(restore_torch_determinism):
    # dispatch docstring: explicit "gas" raises in deterministic mode, and only warns under
    # torch's warn_only (fusegnn's own flag unset). A warn_only call must not leave a
    # remembered path behind that a later strict call would take without the check.
    graph = _small_graph()
    x = torch.randn(4, 3, device=DEVICE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    for _ in range(2):  # every call warns (decisions that warn are not remembered)
        with pytest.warns(UserWarning, match="not deterministic"):
            out = spmm(graph, x, aggregation="gas")
        torch.testing.assert_close(out, reference.spmm(graph, x))
    with dispatch.deterministic(), pytest.raises(RuntimeError, match="not deterministic"):
        spmm(graph, x, aggregation="gas")
    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match="not deterministic"):
        spmm(graph, x, aggregation="gas")
