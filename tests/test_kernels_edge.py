"""Triton ``sddmm`` and ``edge_softmax`` kernels against the reference, through Triton's CPU
interpreter (on the GPU when there is one).

Without CUDA this module sets ``TRITON_INTERPRET=1`` before any kernel module is
imported. Outputs and gradients (of ``a`` and ``b`` for ``sddmm``, of the scores for
``edge_softmax``) are compared with :mod:`fusegnn.sparse.reference` in float64 on random
graphs with isolated nodes, self-loops, duplicate edges and a hub row, for ``[N]``,
``[N, F]`` and ``[N, H, F]`` inputs, 1 and 8 heads, int32 and int64 indices.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from fusegnn.kernels import edge_softmax as es_kernels  # noqa: E402
from fusegnn.kernels import sddmm as sddmm_kernels  # noqa: E402
from fusegnn.sparse import Graph, dispatch, reference  # noqa: E402
from fusegnn.sparse import edge_softmax as public_edge_softmax  # noqa: E402
from fusegnn.sparse import sddmm as public_sddmm  # noqa: E402
from tests.graphs import random_graph  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _graph(num_nodes=14, num_edges=160, seed=1, hub=110, dtype=torch.int64, **kw) -> Graph:
    ei = random_graph(num_nodes, num_edges, seed, hub_degree=hub, dtype=dtype, **kw)
    n = num_nodes if kw.get("num_dst_nodes") is None else (num_nodes, kw["num_dst_nodes"])
    return Graph(ei.to(DEVICE), n)


def _rand(shape, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype).requires_grad_()


def _grads(out, inputs, seed):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64).to(DEVICE, out.dtype)
    return torch.autograd.grad(out, inputs, g)


# ------------------------------------------------------------------ sddmm
@pytest.mark.parametrize(
    "trailing,op",
    [
        ((), "add"),
        ((), "mul"),
        ((1,), "dot"),
        ((3,), "dot"),
        ((16,), "dot"),
        ((16,), "sub"),
        ((7,), "mul"),
        ((8, 5), "dot"),
        ((8, 3), "add"),
        ((2, 16), "mul"),
        ((8,), "add"),  # GAT's per-head scores
    ],
)
def test_sddmm_matches_reference(trailing, op):
    graph = _graph()
    a = _rand((graph.num_src_nodes,) + trailing, 1)
    b = _rand((graph.num_dst_nodes,) + trailing, 2)
    out = sddmm_kernels.sddmm(graph, a, b, op)
    ref = reference.sddmm(graph, a, b, op)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    got, want = _grads(out, (a, b), 3), _grads(ref, (a, b), 3)
    for name, x, y in zip("ab", got, want):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-11, msg=lambda m: f"grad {name}: {m}")


@pytest.mark.parametrize("op", ["dot", "mul", "sub"])
def test_sddmm_bipartite_int32(op):
    graph = _graph(num_nodes=11, num_edges=70, hub=30, num_dst_nodes=6, dtype=torch.int32)
    a = _rand((11, 2, 3), 4)
    b = _rand((6, 2, 3), 5)
    out = sddmm_kernels.sddmm(graph, a, b, op)
    ref = reference.sddmm(graph, a, b, op)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for x, y in zip(_grads(out, (a, b), 6), _grads(ref, (a, b), 6)):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-11)


def test_sddmm_gradcheck_and_isolated_nodes():
    graph = Graph(torch.tensor([[0, 1, 1, 3, 3], [1, 1, 0, 0, 0]], device=DEVICE), 5)
    for op in ("dot", "mul"):
        a, b = _rand((5, 2, 3), 1), _rand((5, 2, 3), 2)
        assert torch.autograd.gradcheck(lambda a, b: sddmm_kernels.sddmm(graph, a, b, op), (a, b), fast_mode=True)
        ga, gb = torch.autograd.grad(sddmm_kernels.sddmm(graph, a, b, op).sum(), (a, b))
        # nodes 2 and 4 touch no edge: zero gradient, no NaN
        assert bool((ga[[2, 4]] == 0).all()) and bool((gb[[2, 3, 4]] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sddmm_low_precision(dtype):
    graph = _graph()
    a64, b64 = _rand((14, 8, 5), 1), _rand((14, 8, 5), 2)
    out = sddmm_kernels.sddmm(graph, a64.detach().to(dtype), b64.detach().to(dtype), "dot")
    ref = reference.sddmm(graph, a64.detach().to(dtype).double(), b64.detach().to(dtype).double(), "dot")
    assert out.dtype == dtype
    # fp32 accumulation, one rounding of the result
    tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_sddmm_no_edges():
    graph = Graph(torch.empty(2, 0, dtype=torch.int64, device=DEVICE), 3)
    a, b = _rand((3, 4), 1), _rand((3, 4), 2)
    out = sddmm_kernels.sddmm(graph, a, b, "dot")
    assert out.shape == (0,)
    ga, gb = torch.autograd.grad(sddmm_kernels.sddmm(graph, a, b, "mul").sum(), (a, b))
    assert bool((ga == 0).all()) and bool((gb == 0).all())


class _Widths:
    """Stands in for a lazily jitted kernel (``kernel[grid](*args)``): records the argument at
    ``at`` (its row width) and the widths of the tensors at ``tensors``, then launches it."""

    def __init__(self, kernel, at, tensors):
        self.kernel, self.at, self.tensors, self.seen = kernel, at, tensors, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def record(*args, **kwargs):
            self.seen.append((args[self.at],) + tuple(args[i][0].numel() for i in self.tensors))
            return launch(*args, **kwargs)

        return record


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
@pytest.mark.parametrize("trailing", [(41,), (2, 20), (2, 9), (3, 5)], ids=["F41", "H2xF20", "H2xF9", "H3xF5"])
def test_sddmm_unaligned_widths(trailing, op, monkeypatch):
    """The elementwise SDDMM at unaligned widths (41, 2 x 20, 2 x 9, 3 x 5): values and
    gradients equal the reference's, of their own storage. Both kernels run the width as it
    comes: padding the backward's ``[E, W]`` gradient rows was measured (H100, 20M edges,
    forward + backward of ``mul``) at 24.5 against 25.1 ms for 41 columns and 44.1 against
    30.9 ms for 100 -- the padded copy of every edge row costs what the aligned loads save
    (``benchmarks/NOTES-spmm.md``, session 18)."""
    forward = _Widths(sddmm_kernels.sddmm_kernel, 7, (2, 3))  # F, then the widths of a and b
    sums = _Widths(sddmm_kernels.edge_to_node_kernel, 6, (3, 4))  # W, then the widths of grad and other
    monkeypatch.setattr(sddmm_kernels, "sddmm_kernel", forward)
    monkeypatch.setattr(sddmm_kernels, "edge_to_node_kernel", sums)
    graph = _graph(num_nodes=9, num_edges=40, seed=5, hub=14)  # isolated nodes, duplicates, a hub
    a = _rand((graph.num_src_nodes,) + trailing, 1)
    b = _rand((graph.num_dst_nodes,) + trailing, 2)
    out = sddmm_kernels.sddmm(graph, a, b, op)
    ref = reference.sddmm(graph, a, b, op)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    got, want = _grads(out, (a, b), 3), _grads(ref, (a, b), 3)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-11)
        assert x.is_contiguous() and x.untyped_storage().nbytes() == x.numel() * x.element_size()
    width = math.prod(trailing)
    assert forward.seen == [(width, width, width)]
    # (without ``other``, add / sub, the kernel is handed the gradient in its place)
    assert sums.seen and all(seen == (width, width, width) for seen in sums.seen), sums.seen


@pytest.mark.parametrize("heads", [1, 2, 3])
def test_unpad_heads_copies_once(heads):
    """``unpad_heads`` (the padded GAR outputs and gradients sliced back) gives the kept
    columns as a tensor of their own storage in one copy: for several heads it copied them
    twice (``reshape`` of the strided slice, then ``copy_`` of that)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fusegnn.kernels._edge_utils import unpad_heads

    class Copies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket in (torch.ops.aten.copy_, torch.ops.aten.clone)
            return func(*args, **(kwargs or {}))

    t = torch.randn(5, heads * 48, dtype=torch.float64)
    with Copies() as copies:
        kept = unpad_heads(t, heads, 41)
    assert copies.count == 1
    assert torch.equal(kept, t.view(5, heads, 48)[:, :, :41].reshape(5, heads * 41))
    assert kept.is_contiguous() and kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()


# ------------------------------------------------------------------ edge softmax
@pytest.mark.parametrize("heads", [None, 1, 8, 3])
def test_edge_softmax_matches_reference(heads):
    graph = _graph()
    shape = (graph.num_edges,) if heads is None else (graph.num_edges, heads)
    scores = _rand(shape, 7)
    out = es_kernels.edge_softmax(graph, scores)
    ref = reference.edge_softmax(graph, scores)
    torch.testing.assert_close(out, ref, atol=1e-13, rtol=1e-12)
    for x, y in zip(_grads(out, (scores,), 8), _grads(ref, (scores,), 8)):
        torch.testing.assert_close(x, y, atol=1e-13, rtol=1e-12)


def test_edge_softmax_masked_edges_and_rows():
    graph = Graph(torch.tensor([[0, 1, 2, 3, 0, 1], [1, 1, 1, 2, 2, 0]], device=DEVICE), 4)
    scores = torch.tensor(
        [[0.5, -1.0], [float("-inf"), 2.0], [1.5, float("-inf")], [float("-inf")] * 2, [float("-inf")] * 2, [3.0, 0.1]],
        dtype=torch.float64, device=DEVICE, requires_grad=True,
    )
    out = es_kernels.edge_softmax(graph, scores)
    ref = reference.edge_softmax(graph, scores)
    torch.testing.assert_close(out, ref)
    assert bool((out[3:5] == 0).all())  # target 2: every edge masked -> zeros, not NaN
    (g,) = _grads(out, (scores,), 1)
    assert torch.isfinite(g).all()
    torch.testing.assert_close(g, _grads(ref, (scores,), 1)[0])


def test_edge_softmax_gradcheck():
    graph = _graph(num_nodes=6, num_edges=14, hub=6)
    scores = _rand((graph.num_edges, 2), 3)
    assert torch.autograd.gradcheck(lambda s: es_kernels.edge_softmax(graph, s), (scores,), fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_edge_softmax_low_precision(dtype):
    graph = _graph(dtype=torch.int32)
    s64 = _rand((graph.num_edges, 8), 5).detach()
    out = es_kernels.edge_softmax(graph, s64.to(dtype))
    ref = reference.edge_softmax(graph, s64.to(dtype).double())
    assert out.dtype == dtype
    tol = {torch.bfloat16: 8e-3, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


# ------------------------------------------------------------------ through the public ops
@pytest.mark.parametrize("path", ["gas", "gar"])
def test_public_ops_use_the_kernels(path, monkeypatch):
    """``aggregation="gas"/"gar"`` reaches these kernels once the backends point to them."""
    calls = []
    real_sddmm, real_softmax = sddmm_kernels.SddmmFunction.forward, es_kernels.EdgeSoftmaxFunction.forward
    monkeypatch.setattr(sddmm_kernels.SddmmFunction, "forward",
                        staticmethod(lambda *a: calls.append("sddmm") or real_sddmm(*a)))
    monkeypatch.setattr(es_kernels.EdgeSoftmaxFunction, "forward",
                        staticmethod(lambda *a: calls.append("softmax") or real_softmax(*a)))
    graph = _graph()
    q, k = _rand((14, 2, 4), 1), _rand((14, 2, 4), 2)
    scores = public_sddmm(graph, k, q, "dot", aggregation=path)
    assert dispatch.last_backend() == path
    alpha = public_edge_softmax(graph, scores, aggregation=path)
    ref = reference.edge_softmax(graph, reference.sddmm(graph, k, q, "dot"))
    torch.testing.assert_close(alpha, ref, atol=1e-12, rtol=1e-12)
    for x, y in zip(_grads(alpha, (q, k), 2), _grads(ref, (q, k), 2)):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-11)
    assert calls == ["sddmm", "softmax"]
