"""Shared pytest configuration and fixtures.

* Puts the repository root on ``sys.path`` so that test modules (in ``tests/`` or any
  sub-folder) can ``from tests.graphs import random_graph`` however pytest is invoked.
* Fixtures: ``random_graph`` (the :func:`tests.graphs.random_graph` generator itself),
  ``nasty_graph`` (a small :class:`fusegnn.sparse.Graph` with isolated nodes, a hub,
  self-loops and duplicate edges).
* Without a CUDA device, sets ``TRITON_INTERPRET=1`` before anything can import Triton
  (``triton.jit`` reads it when a kernel is decorated; importing e.g. torch_geometric
  imports Triton), so every Triton kernel runs through the interpreter on the CPU.
* Hypothesis profile ``fusegnn``: few examples, no deadline, derandomised (CI is a
  2-core CPU machine and must be deterministic).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tests import graphs as _graphs  # noqa: E402

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "fusegnn",
        max_examples=25,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    settings.load_profile("fusegnn")
except ImportError:  # pragma: no cover - hypothesis is a test dependency
    pass


def pytest_configure(config):
    # torch warns that sparse CSR support is "beta" on every CSR construction.
    config.addinivalue_line("filterwarnings", "ignore:Sparse CSR tensor support is in beta state")


@pytest.fixture
def random_graph():
    """The :func:`tests.graphs.random_graph` generator (``random_graph(N, E, seed, ...)``)."""
    return _graphs.random_graph


@pytest.fixture
def nasty_graph():
    """A 17-node graph, 60 edges: isolated nodes, a hub of in-degree 12, self-loops,
    duplicate edges (incl. a duplicated self-loop), unsorted COO order."""
    from fusegnn.sparse import Graph

    return Graph(_graphs.random_graph(17, 60, seed=2, hub_degree=12), 17)



@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-tensor tests: faster, and immune to an
    oversubscribed CPU. Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
