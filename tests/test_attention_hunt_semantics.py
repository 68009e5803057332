"""Semantics found wanting in a bug hunt over ``fusegnn.attention``, each against
PyTorch's SDPA (or the documented behaviour):

* the reference and element paths (``"auto"`` off CUDA) stay finite in float16 where
  the unscaled products ``q . k`` overflow float16 but the scaled scores do not (SDPA,
  the block and vector kernels are finite there);
* the block and vector kernels' public entry points check ``scale`` as
  ``sparse_attention`` does (a default scale at D = 0, a string, ``True``);
* a scale that is not finite (NaN rows on every path) is refused;
* an ``aggregation`` of another type (a list) is named in the error;
* ``explain_attention`` checks ``q``, the mask's lengths and heads, ``backward`` and
  ``value_dim`` as ``sparse_attention`` would.
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


@pytest.mark.parametrize("kernel", ["block", "vector"])
@pytest.mark.parametrize("scale, error, match", [
    (None, ValueError, "head dim D is 0"), ("0.5", TypeError, "scale must be a float"),
    (True, TypeError, "scale must be a float"),
])
def test_kernel_entry_points_check_scale_like_sparse_attention(kernel, scale, error, match):
    """``block_sparse_attention`` raised ZeroDivisionError for the default scale at D = 0,
    'could not convert string to float' for a string and took ``True`` as 1.0;
    ``vector_sparse_attention`` took ``True`` too. Both now check ``scale`` as
    ``sparse_attention`` does."""
    from fusegnn.attention.block_layout import BlockLayout
    from fusegnn.attention.vector_windows import vector_structure
    from fusegnn.kernels.block_attention import block_sparse_attention
    from fusegnn.kernels.vector_attention import vector_sparse_attention

    mask = M.causal(16)
    D = 0 if scale is None else 8
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where the kernels run (else the device is refused first)
    q = torch.randn(1, 1, 16, D, device=device)
    if kernel == "block":
        layout = BlockLayout.from_mask(mask, 16, 16).to(device)
        call = lambda: block_sparse_attention(q, q, q, layout, scale)  # noqa: E731
    else:
        call = lambda: vector_sparse_attention(q, q, q, vector_structure(mask, 16, q.device), scale)  # noqa: E731
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("aggregation", ["reference", "dense", "block"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_a_scale_that_is_not_finite_is_refused(aggregation, scale):
    """A NaN or infinite ``scale`` gave NaN rows on every path, silently."""
    q = torch.randn(1, 1, 16, 8)
    with pytest.raises(ValueError, match="scale must be finite"):
        sparse_attention(q, q, q, M.sliding_window(16, 2), aggregation=aggregation, scale=scale)


@pytest.mark.parametrize("aggregation", [["block"], {"block": 1}, None])
def test_an_aggregation_of_another_type_is_named(aggregation):
    """A list (unhashable) reached the decision cache's key first: 'unhashable type'."""
    q = torch.randn(1, 1, 16, 8)
    with pytest.raises(ValueError, match="aggregation must be one of"):
        sparse_attention(q, q, q, M.causal(16), aggregation=aggregation)


@pytest.mark.parametrize("aggregation", ["auto", "block", "dense", "reference"])
@pytest.mark.parametrize("case, error, match", [
    ("mask of another length", ValueError, "L_q = 16"),
    ("mask of other heads", ValueError, "3 heads"),
    ("mask a string", TypeError, "mask must be"),
    ("q a list", TypeError, "q must be a torch.Tensor"),
    ("backward a string", TypeError, "backward must be"),
    ("value_dim a string", ValueError, "value_dim must be"),
])
def test_explain_attention_checks_what_it_reads(aggregation, case, error, match):
    """``explain_attention`` explained a mask of other lengths (a decision for a call that
    raises), and raised AttributeError for a ``q`` or a ``mask`` of the wrong type."""
    from fusegnn.attention import explain_attention

    q, mask, kwargs = torch.randn(1, 2, 16, 8), M.causal(16), {}
    if case == "mask of another length":
        mask = M.causal(8)
    elif case == "mask of other heads":
        mask = M.stack_heads([M.causal(16)] * 3)
    elif case == "mask a string":
        mask = "causal"
    elif case == "q a list":
        q = [[1.0]]
    elif case == "backward a string":
        kwargs = {"backward": "yes"}
    else:
        kwargs = {"value_dim": "8"}
    with pytest.raises(error, match=match):
        explain_attention(q, mask, aggregation=aggregation, **kwargs)
