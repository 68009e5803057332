"""Deterministic mode reaches the backward of compiled ops.

:func:`fusegnn.sparse.dispatch.deterministic` is thread-local, and a CUDA backward runs in
the autograd engine's own device threads. A compiled op's backward (``fusegnn::<op>_backward``)
re-decides ``aggregation="auto"`` when it runs, so it used to decide there with the mode
off: after a deterministic forward, the backward of ``spmm`` took GAS (atomics), and
``x.grad`` differed bitwise between two runs (seen on an H100). A compiled call now hands
its op :data:`fusegnn.sparse.library.DETERMINISTIC_AUTO`, which the op and its backward
op both decide in deterministic mode, whatever thread runs them.

On the CPU the backward is run in a thread of its own (as the CUDA engine does) and the
backward ops' decisions are spied on; on CUDA, a graph with a hub (where GAS's atomics
reorder sums) checks that two compiled backward passes agree bitwise.
"""

from __future__ import annotations

import os
import threading

import torch

if not torch.cuda.is_available():  # fused kernels run through Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from fusegnn.sparse import Graph, dispatch, edge_aggregate, edge_softmax, gat_attention, library, sddmm, spmm  # noqa: E402
from fusegnn.sparse.gatv2 import gatv2_attention  # noqa: E402
from tests.graphs import random_graph  # noqa: E402
from tests.test_compile import fresh_dynamo  # noqa: E402,F401  (autouse: Dynamo reset around every test)

pytestmark = pytest.mark.usefixtures("one_thread")
N = 12


def _rand(*shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()


def _ops():
    """``name -> (fn(graph, x), x)`` for every op whose backward re-decides ``"auto"``."""
    x, h = _rand(N, 4, seed=1), _rand(N, 2, 3, seed=2)
    s_src, s_dst = _rand(N, 2, seed=3), _rand(N, 2, seed=4)
    att = _rand(1, 2, 3, seed=5)
    return {
        "spmm": (lambda g, x: spmm(g, x), x),
        "spmm_max": (lambda g, x: spmm(g, x, reduce="max"), x),
        "edge_aggregate": (lambda g, x: edge_aggregate(g, x, reduce="mean"), x),
        "sddmm": (lambda g, x: sddmm(g, x, x), x),
        "edge_softmax": (lambda g, x: edge_softmax(g, sddmm(g, x, x)), x),
        "gat_attention": (lambda g, h: gat_attention(g, h, s_src, s_dst), h),
        "gatv2_attention": (lambda g, h: gatv2_attention(g, h, h, att), h),
    }


def _spied_backward(monkeypatch, fn, graph, x, mode: bool) -> list[bool]:
    """The deterministic mode each backward op decided ``"auto"`` in, the backward run in
    another thread (as CUDA's autograd engine runs it)."""
    seen: list[bool] = []
    explain = library.explain

    def spy(*args, **kwargs):
        seen.append(dispatch.is_deterministic())
        return explain(*args, **kwargs)

    monkeypatch.setattr(library, "explain", spy)
    compiled = torch.compile(lambda x: fn(graph, x), fullgraph=True, backend="aot_eager")
    with dispatch.deterministic(mode):
        out = compiled(x)
        loss = sum(t.sum() for t in (out if isinstance(out, tuple) else (out,)))
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join()
    assert x.grad is not None
    return seen


@pytest.mark.parametrize("name", list(_ops()))
def test_backward_in_another_thread_decides_in_the_forwards_mode(monkeypatch, name):
    fn, x = _ops()[name]
    graph = Graph(random_graph(N, 40, seed=3, hub_degree=5), N)
    seen = _spied_backward(monkeypatch, fn, graph, x, True)
    assert seen and all(seen)
    x.grad = None
    torch._dynamo.reset()
    seen = _spied_backward(monkeypatch, fn, graph, x, False)
    assert seen and not any(seen)


def test_switching_the_mode_recompiles(monkeypatch):
    """The mode is read while tracing (a guard): a compiled function first called outside
    deterministic mode decides its next backward in it when called inside."""
    fn, x = _ops()["spmm"]
    graph = Graph(random_graph(N, 40, seed=3, hub_degree=5), N)
    compiled = torch.compile(lambda x: fn(graph, x), fullgraph=True, backend="aot_eager")
    seen: list[bool] = []
    explain = library.explain
    monkeypatch.setattr(library, "explain", lambda *a, **k: (seen.append(dispatch.is_deterministic()), explain(*a, **k))[1])
    for mode in (False, True, False):
        with dispatch.deterministic(mode):
            loss = compiled(x).sum()
        worker = threading.Thread(target=loss.backward)  # the backward after the block, elsewhere
        worker.start()
        worker.join()
    assert seen == [False, True, False]


def test_explicit_aggregations_pass_unchanged():
    assert library.traced_aggregation("gar") == "gar"
    with dispatch.deterministic():
        assert library.traced_aggregation("auto") == library.DETERMINISTIC_AUTO
        assert library.traced_aggregation("reference") == "reference"
    assert library.traced_aggregation("auto") == "auto"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the atomics' reordering shows on CUDA")
def test_compiled_cuda_backward_is_bitwise_reproducible():
    """A hub of 100k in-edges (GAS's atomics reorder its sums), degree low enough that
    ``"auto"`` takes GAS outside deterministic mode: two compiled backward passes agree
    bitwise in deterministic mode."""
    n, e = 20000, 200000
    gen = torch.Generator().manual_seed(0)
    dst = torch.cat([torch.randint(0, n, (e // 2,), generator=gen), torch.zeros(e // 2, dtype=torch.long)])
    edge_index = torch.stack([torch.randint(0, n, (e,), generator=gen), dst]).cuda()
    graph = Graph(edge_index, n)
    x = torch.randn(n, 32, device="cuda", generator=torch.Generator("cuda").manual_seed(1), requires_grad=True)
    compiled = torch.compile(lambda x: (spmm(graph, x) ** 2).sum(), fullgraph=True)
    grads = []
    with dispatch.deterministic():
        for _ in range(3):
            x.grad = None
            compiled(x).backward()
            grads.append(x.grad.clone())
    assert all(torch.equal(grads[0], g) for g in grads[1:])
