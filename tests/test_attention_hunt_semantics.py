"""Semantics found wanting in a bug hunt over ``fusegnn.attention``, each against
PyTorch's SDPA (or the documented behaviour):

* the reference and element paths (``"auto"`` off CUDA) stay finite in float16 where
  the unscaled products ``q . k`` overflow float16 but the scaled scores do not (SDPA,
  the block and vector kernels are finite there).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fusegnn.attention import masks as M
from fusegnn.attention import sparse_attention


def _sdpa64(q, k, v, mask, scale=None):
    """SDPA in float64 with ``mask``'s dense boolean matrix (rows with no key: zeros)."""
    allowed = mask.dense(q.device)
    allowed = allowed.view(1, 1, *allowed.shape) if allowed.dim() == 2 else allowed.unsqueeze(0)
    has_key = allowed.any(-1, keepdim=True)
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=allowed | ~has_key,
                                         scale=scale)
    return torch.where(has_key, out, torch.zeros((), dtype=out.dtype))


@pytest.mark.parametrize("aggregation", ["auto", "reference", "element"])
def test_half_products_beyond_the_float16_range_stay_finite(aggregation):
    gen = torch.Generator().manual_seed(0)
    q, k = ((torch.randn(1, 2, 16, 64, generator=gen) * 120).half() for _ in range(2))
    v = torch.randn(1, 2, 16, 64, generator=gen).half()
    assert (q.float() @ k.float().transpose(-2, -1)).abs().max() > 65504  # the products overflow float16
    mask = M.causal(16)
    out = sparse_attention(q, k, v, mask, aggregation=aggregation)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _sdpa64(q, k, v, mask, 1 / math.sqrt(64)), rtol=2e-3, atol=2e-3)
