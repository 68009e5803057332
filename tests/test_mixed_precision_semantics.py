"""Mixed precision: ``torch.autocast`` and mixed-dtype arguments across the sparse ops,
the layers, the models' ``loss`` and :mod:`fusegnn.losses`.

The rules checked here:

* an additive term of another floating dtype (spmm's ``bias``) follows torch's type
  promotion -- the result is ``torch.promote_types(x.dtype, bias.dtype)`` -- on every
  backend (the fused sum used to return ``x``'s dtype, the reference and the mean / max
  paths the promoted one, so ``aggregation="auto"`` returned different dtypes on
  different graphs);
* every layer under autocast returns the dtype that the equivalent PyG layer returns under
  the same autocast (where ``torch_geometric`` imports), the same on every backend, with
  values within a half-precision tolerance of a float64 run, and float32 gradients on its
  float32 parameters.

On a CUDA machine autocast runs float16 on the GPU; on the CPU bfloat16 (the fused paths
through the Triton interpreter, with the aggregation forced).
"""

from __future__ import annotations

import pytest
import torch

from fusegnn.sparse import Graph, available_backends, reference, spmm
from tests.graphs import random_graph

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF = torch.float16 if DEVICE.type == "cuda" else torch.bfloat16
F64 = torch.float64
SPMM_PATHS = tuple(a for a in ("reference", "gas", "gar", "window") if a in available_backends())
EDGE_PATHS = tuple(a for a in SPMM_PATHS if a != "window")
# a half-precision result against float64: bf16 keeps 8 significant bits
HALF_TOL = dict(rtol=3e-2, atol=3e-2)


def autocast():
    """Autocast on the test device in its half dtype."""
    return torch.autocast(DEVICE.type, dtype=HALF)


def graph(n: int = 12, e: int = 40, seed: int = 0) -> Graph:
    return Graph(random_graph(n, e, seed, hub_degree=8).to(DEVICE), n)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=F64).to(DEVICE, dtype).requires_grad_(grad)


# --------------------------------------------------------------------------- spmm's bias
@pytest.mark.parametrize("aggregation", SPMM_PATHS)
@pytest.mark.parametrize("reduce", ["sum", "mean", "max"])
@pytest.mark.parametrize("dtypes", [(torch.float32, F64), (HALF, torch.float32), (torch.float32, HALF)],
                         ids=["f32+f64", "half+f32", "f32+half"])
@pytest.mark.parametrize("heads", [False, True], ids=["flat", "heads"])
def test_spmm_bias_of_another_dtype_follows_type_promotion(aggregation, reduce, dtypes, heads):
    """``spmm(x, bias=b)`` returns ``promote_types(x.dtype, b.dtype)`` on every backend (as
    ``spmm(x) + b`` does), with values near float64 and each gradient in its input's dtype."""
    x_dtype, b_dtype = dtypes
    g = graph()
    shape = (12, 2, 3) if heads else (12, 5)
    x = randn(*shape, seed=1, dtype=x_dtype, grad=True)
    w = randn(g.num_edges, seed=2, dtype=x_dtype).abs_()
    b = randn(*shape[1:], seed=3, dtype=b_dtype, grad=True)
    out = spmm(g, x, w, reduce, bias=b, aggregation=aggregation)
    assert out.dtype == torch.promote_types(x_dtype, b_dtype)
    expected = reference.spmm(g, x.detach().double(), w.double(), reduce, b.detach().double())
    torch.testing.assert_close(out.double(), expected, **HALF_TOL)
    out.sum().backward()
    assert x.grad.dtype == x_dtype and b.grad.dtype == b_dtype
    torch.testing.assert_close(b.grad.double(), torch.full(shape[1:], 12.0, dtype=F64, device=DEVICE))
