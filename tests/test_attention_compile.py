"""``sparse_attention`` and ``SparseMultiheadAttention`` under ``torch.compile(fullgraph=True)``:
the decision is made outside the trace (``compiled_decision``), the block kernels run as
the ``fusegnn::block_attention`` custom ops (through Triton's interpreter on the CPU), the
other paths are traced. Outputs and gradients against the eager calls."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # the block kernels through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")

from fusegnn.layers import SparseMultiheadAttention  # noqa: E402
from fusegnn.attention import handles, masks, sparse_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _qkv(L: int, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, L, 16, generator=gen).to(DEVICE, dtype).requires_grad_() for _ in range(3))


@pytest.mark.parametrize("aggregation", ["block", "reference", "element", "dense", "auto"])
@pytest.mark.parametrize("make_mask", [lambda: masks.SlidingWindow(64, 9), lambda: masks.Causal(64),
                                       lambda: masks.Dilated(64, 6, 2)])
def test_compiled_sparse_attention_matches_eager(aggregation, make_mask):
    torch._dynamo.reset()
    mask = make_mask()
    q, k, v = _qkv(64)

    def attend(q, k, v):
        return sparse_attention(q, k, v, mask, aggregation=aggregation)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out, ref = compiled(q, k, v), attend(q, k, v)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _Attend(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = SparseMultiheadAttention(32, 2)
        self.mask = masks.SlidingWindow(48, 7)

    def forward(self, x):
        return self.mha(x, x, x, self.mask)[0]


def test_compiled_multihead_attention_trains_like_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Attend().to(DEVICE)
    torch.manual_seed(0)
    model = _Attend().to(DEVICE)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 48, 32, device=DEVICE)
    for _ in range(2):
        a, b = compiled(x), eager(x)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        a.square().mean().backward()
        b.square().mean().backward()
    for p, r in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-5)


def test_a_dead_handle_is_a_clear_error():
    handle = masks.Causal(8).handle  # the mask is gone at once
    with pytest.raises(RuntimeError, match="no longer alive"):
        handles.lookup(handle)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_compiled_attention_modes_on_the_gpu(mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = _Attend().cuda()
    torch.manual_seed(0)
    model = _Attend().cuda()
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    x = torch.randn(2, 48, 32, device="cuda")
    for _ in range(4):
        for net in (model, eager):  # as a training loop does: a graph's gradients are not accumulated into
            net.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        a, b = compiled(x), eager(x)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        a.square().mean().backward()
        b.square().mean().backward()


@pytest.mark.parametrize("aggregation", ["block", "vector"])
def test_compiled_kernel_paths_take_transposed_views(aggregation):
    """``q``, ``k``, ``v`` as ``SparseMultiheadAttention`` makes them,
    ``x.view(B, L, H, D).transpose(1, 2)``: the backward ops' fake outputs have the real
    outputs' (contiguous) strides, so the compiled backward (which views the gradients
    as the fakes say) runs and matches eager (it raised 'view size is not compatible')."""
    torch._dynamo.reset()
    mask = masks.SlidingWindow(32, 3)
    gen = torch.Generator().manual_seed(3)
    x = [torch.randn(1, 32, 2 * 8, generator=gen).to(DEVICE).requires_grad_() for _ in range(3)]

    def attend(xq, xk, xv):
        q, k, v = (t.view(1, 32, 2, 8).transpose(1, 2) for t in (xq, xk, xv))
        out = sparse_attention(q, k, v, mask, aggregation=aggregation)
        return out.transpose(1, 2).reshape(1, 32, 16)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    out, ref = compiled(*x), attend(*x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(torch.autograd.grad(out.square().sum(), x), torch.autograd.grad(ref.square().sum(), x)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("aggregation", ["reference", "block"])
def test_compiled_call_survives_a_new_batch_size(aggregation):
    """A second batch size makes Dynamo's sizes symbolic; the decision outside the trace
    takes them specialised (a recompile), so a compiled call with a smaller last batch
    runs and matches eager (it raised 'assume_constant_result argument conversion
    failed' under ``fullgraph=True``)."""
    torch._dynamo.reset()
    mask = masks.SlidingWindow(32, 3)

    def attend(q, k, v):
        return sparse_attention(q, k, v, mask, aggregation=aggregation)

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    for batch in (2, 1, 3):
        gen = torch.Generator().manual_seed(batch)
        q, k, v = (torch.randn(batch, 2, 32, 8, generator=gen).to(DEVICE).requires_grad_() for _ in range(3))
        out, ref = compiled(q, k, v), attend(q, k, v)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        for got, want in zip(torch.autograd.grad(out.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_multihead_n_m_attention_without_a_mask():
    """``SparseMultiheadAttention(nm=...)`` called without a mask runs N:M attention over
    a full mask it builds per length; under ``torch.compile(fullgraph=True)`` that mask is
    built outside the trace (building it inside raised Dynamo's 'Unsupported method
    call' on the mask's handle registration), for every length seen."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mha = SparseMultiheadAttention(16, 2, nm=(2, 4)).to(DEVICE)

    def attend(x):
        return mha(x, x, x)[0]

    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    for L in (16, 20):
        x = torch.randn(2, L, 16, generator=torch.Generator().manual_seed(L)).to(DEVICE).requires_grad_()
        out, ref = compiled(x), attend(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        (got,), (want,) = torch.autograd.grad(out.sum(), (x,)), torch.autograd.grad(ref.sum(), (x,))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
