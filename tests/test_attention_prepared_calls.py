"""``sparse_attention`` remembers, per mask, the checked and decided form of a call
(:func:`fusegnn.attention.sparse_attention._call_signature`): a repeated call runs the chosen
path directly. These tests check that a prepared call gives the same result as a fresh
one, and that anything the checks or the decision read (shapes, dtypes, devices, grad
mode, scale, options) prepares the call again, so bad input is still refused."""

from __future__ import annotations

import pytest
import torch

from fusegnn.attention import masks, sparse_attention
import fusegnn.attention.sparse_attention  # noqa: F401  (the module, for its private helpers)
import sys

sa_module = sys.modules["fusegnn.attention.sparse_attention"]


def _qkv(B=1, H=2, L=24, D=8, dtype=torch.float64, grad=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(B, H, L, D, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(grad) for _ in range(3)
    )


def _prepared(mask) -> dict:
    return mask.cached("prepared_calls", dict)


@pytest.mark.parametrize("aggregation", ["auto", "reference", "element", "dense"])
def test_a_repeated_call_reuses_its_preparation_and_agrees(aggregation):
    mask = masks.SlidingWindow(24, 3)
    q, k, v = _qkv()
    first = sparse_attention(q, k, v, mask, aggregation=aggregation)
    assert len(_prepared(mask)) == 1
    q2, k2, v2 = _qkv(seed=1)
    again = sparse_attention(q2, k2, v2, mask, aggregation=aggregation)
    assert len(_prepared(mask)) == 1
    fresh = sa_module._prepare_call(q2, k2, v2, mask, None, aggregation, None, "auto")(q2, k2, v2)
    torch.testing.assert_close(again, fresh, rtol=0, atol=0)
    assert not torch.equal(first, again)


def test_what_the_checks_read_prepares_again():
    mask = masks.Causal(24)
    q, k, v = _qkv()
    sparse_attention(q, k, v, mask)
    sparse_attention(*_qkv(dtype=torch.float32), mask)  # dtype
    sparse_attention(*_qkv(grad=True), mask)  # backward needed
    assert len(_prepared(mask)) == 3
    with torch.no_grad():  # no backward, as for the first call: its preparation
        sparse_attention(*_qkv(grad=True), mask)
    assert len(_prepared(mask)) == 3
    sparse_attention(q, k, v, mask, scale=0.5)
    sparse_attention(q, k, v, mask, aggregation="reference")
    sparse_attention(*_qkv(B=2), mask)
    assert len(_prepared(mask)) == 6


def test_bad_input_after_a_good_call_is_still_refused():
    mask = masks.SlidingWindow(24, 3)
    q, k, v = _qkv()
    sparse_attention(q, k, v, mask)
    with pytest.raises(TypeError, match="same dtype"):
        sparse_attention(q, k.float(), v, mask)
    with pytest.raises(ValueError, match="L_q"):
        sparse_attention(*_qkv(L=16), mask)
    with pytest.raises(TypeError, match="scale"):
        sparse_attention(q, k, v, mask, scale="big")
    with pytest.raises(ValueError, match="element_aggregation"):
        sparse_attention(q, k, v, mask, element_aggregation="fast")


def test_unhashable_options_still_work_unprepared():
    mask = masks.SlidingWindow(24, 3)
    q, k, v = _qkv()
    out = sparse_attention(q, k, v, mask, aggregation="element", block_size=[16, 16])
    assert len(_prepared(mask)) == 0
    torch.testing.assert_close(out, sparse_attention(q, k, v, mask, aggregation="element"))


def test_gradients_flow_through_a_prepared_call():
    mask = masks.SlidingWindow(24, 2)
    for _ in range(2):
        q, k, v = _qkv(grad=True)
        out = sparse_attention(q, k, v, mask, aggregation="reference")
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)
    assert len(_prepared(mask)) == 1
