"""Vector sparsity as a demanding user calls it: the documented semantics of
:class:`~fusegnn.sparse.VectorSparse` (builders, pruning), ``vspmm`` / ``vsddmm``
against dense float64 products (forward and backward), :class:`VectorSparseLinear` as a
masked ``nn.Linear`` (state dict, ``reset_parameters``, dtypes, optimizer steps),
``Graph.reorder`` as a relabelling, and bad input. Tiny shapes: on the CPU the Triton
kernels run in the interpreter."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fusegnn.layers import VectorSparseLinear
from fusegnn.sparse import Graph, VectorSparse, vsddmm, vspmm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.usefixtures("one_thread")


def _dense(M, K, density, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g, dtype=dtype) * (torch.rand(M, K, generator=g) < density)


# ---------------------------------------------------------------------- VectorSparseLinear


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_layer_load_state_dict_of_another_pattern(backend):
    """Loading the state dict of a layer with another pattern (same sizes: same sparsity
    gives the same vector count) after a forward: the loaded layer computes what the
    source does, forward and backward, and its dense weight is the source's."""
    torch.manual_seed(0)
    a = VectorSparseLinear(16, 8, 0.5, V=4, backend=backend).to(DEVICE)
    b = VectorSparseLinear(16, 8, 0.5, V=4, backend=backend).to(DEVICE)
    assert not torch.equal(a.dense_weight() != 0, b.dense_weight() != 0)  # two patterns
    x = torch.randn(3, 16, device=DEVICE)
    a(x).sum().backward()  # fills a's cached structure and index
    a.dense_weight()
    a.load_state_dict(b.state_dict())
    a.zero_grad()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = a(xa), b(xb)
    torch.testing.assert_close(ya, yb)
    go = torch.randn_like(ya)
    ya.backward(go)
    yb.backward(go)
    torch.testing.assert_close(xa.grad, xb.grad)
    torch.testing.assert_close(a.values.grad, b.values.grad)
    assert torch.equal(a.dense_weight(), b.dense_weight())
    assert torch.equal(a.pattern().mask(), b.pattern().mask())
