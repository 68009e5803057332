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


# ---------------------------------------------------------------------- prune


def _prune_reference(weight: torch.Tensor, sparsity: float, V: int) -> torch.Tensor:
    """The documented pruning, by brute force: the ``[G, K]`` mask of the kept vectors
    (largest float64 L2 norm first, ties by position ``g K + k``)."""
    M, K = weight.shape
    G = -(-M // V)
    w = weight.detach().double()
    norms = [(-float(w[g * V:(g + 1) * V, k].norm()), g * K + k) for g in range(G) for k in range(K)]
    keep = int(round((1.0 - sparsity) * G * K))
    mask = torch.zeros(G * K, dtype=torch.bool)
    for _, position in sorted(norms)[:keep]:
        mask[position] = True
    return mask.view(G, K)


@settings(max_examples=30)
@given(
    M=st.integers(1, 11), K=st.integers(1, 7), V=st.sampled_from([2, 4, 8, 16]),
    sparsity=st.sampled_from([0.0, 0.1, 0.25, 0.5, 0.75, 0.9]), seed=st.integers(0, 2**16),
    ties=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_prune_keeps_the_documented_vectors(M, K, V, sparsity, seed, ties, dtype):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(M, K, generator=g, dtype=dtype)
    if ties:  # exact ties: repeated columns, some vectors zero
        weight = weight[:, torch.randint(0, max(K // 2, 1), (K,), generator=g)]
        weight[:, 0] = 0
    before = weight.clone()
    A = VectorSparse.prune(weight, sparsity, V)
    G = -(-M // V)
    kept = torch.zeros(G, K, dtype=torch.bool)
    kept[A.vector_groups(), A.col_idx.long()] = True
    assert torch.equal(kept, _prune_reference(weight, sparsity, V))
    assert A.shape == (M, K) and A.V == V and A.dtype == dtype
    assert A.num_vectors == int(round((1 - sparsity) * G * K))
    mask = kept.repeat_interleave(V, 0)[:M]
    assert torch.equal(A.to_dense(), weight * mask)  # the values: a copy of the weight's
    assert torch.equal(weight, before)  # the input is left alone
    A.values.add_(1)
    assert torch.equal(weight, before)  # and not aliased


def test_prune_float64_norms_are_not_rounded_to_float32():
    """Two float64 vectors whose norms differ by less than float32 resolves: the larger
    one is kept (computing the norms in float32 tied them and kept the first)."""
    w = torch.tensor([[1.0, 1.0 + 1e-12]], dtype=torch.float64).repeat(2, 1)
    A = VectorSparse.prune(w, 0.5, 2)
    assert A.col_idx.tolist() == [1]


def test_prune_ties_keep_the_first_positions():
    """Equal norms: the first vectors in row-group-major order are kept (the docstring's
    'ties by position'; topk kept the last group here)."""
    A = VectorSparse.prune(torch.ones(4, 6), 0.5, 2)
    assert A.vector_groups().tolist() == [0] * 6 and A.col_idx.tolist() == list(range(6))
    A = VectorSparse.prune(torch.zeros(4, 6), 0.75, 2)
    assert A.vector_groups().tolist() == [0, 0, 0] and A.col_idx.tolist() == [0, 1, 2]
