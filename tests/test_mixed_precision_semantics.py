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


# --------------------------------------------------------------------------- layers
def _mlp(width_in: int, width_out: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width_in, width_out), torch.nn.ReLU(), torch.nn.Linear(width_out, width_out))


#: name -> (constructor arguments given (in, out), whether it takes edge features, the
#: dtype PyG's layer of that name returns under autocast: "half" (its last op is a linear),
#: float32 (a float32 bias, coefficient or edge weight added or multiplied after it) or
#: "softmax" (half scores normalised by ``exp``, which CUDA autocast runs in float32 and
#: CPU autocast does not: float32 coefficients multiply the messages on CUDA only))
LAYERS = {
    "GCNConv": (lambda i, o: ((i, o), {}), False, torch.float32),
    "GATConv": (lambda i, o: ((i, o), {"heads": 2}), False, torch.float32),
    "GATConv-edges": (lambda i, o: ((i, o), {"heads": 2, "edge_dim": 3}), True, torch.float32),
    "GATv2Conv": (lambda i, o: ((i, o), {"heads": 2}), False, torch.float32),
    "GATv2Conv-edges": (lambda i, o: ((i, o), {"heads": 2, "edge_dim": 3}), True, torch.float32),
    "SAGEConv": (lambda i, o: ((i, o), {}), False, "half"),
    "GINConv": (lambda i, o: ((_mlp(i, o),), {}), False, "half"),
    "GINEConv": (lambda i, o: ((_mlp(i, o),), {"edge_dim": 3}), True, "half"),
    "SGConv": (lambda i, o: ((i, o), {"K": 2}), False, "half"),
    "APPNP": (lambda i, o: ((), {"K": 2, "alpha": 0.1}), False, torch.float32),
    "GraphConv": (lambda i, o: ((i, o), {}), False, "half"),
    "TransformerConv": (lambda i, o: ((i, o), {"heads": 2}), False, "softmax"),
    "TransformerConv-edges": (lambda i, o: ((i, o), {"heads": 2, "edge_dim": 3}), True, "softmax"),
}
SPMM_LAYERS = ("GCNConv", "SGConv", "APPNP")  # the layers that run nothing but spmm ("window" too)
WIDTHS = {"widening": (5, 6), "narrowing": (8, 3)}  # both orders of aggregation and projection


def _build(name: str, widths: tuple[int, int], aggregation: str | None):
    """Our layer (``aggregation=None``: PyG's) of ``name``, seeded, float32 on the test device."""
    import fusegnn.layers as ours

    make, _, _ = LAYERS[name]
    args, kwargs = make(*widths)
    torch.manual_seed(0)
    if aggregation is None:
        from tests.pyg_compare import pyg_nn

        return getattr(pyg_nn, name.split("-")[0])(*args, **kwargs).to(DEVICE)
    return getattr(ours, name.split("-")[0])(*args, **kwargs, aggregation=aggregation).to(DEVICE)


def _layer_inputs(name: str, widths: tuple[int, int]):
    g = random_graph(12, 40, 5, hub_degree=8).to(DEVICE)
    x = randn(12, widths[0], seed=6)
    return (x, g) + ((randn(g.size(1), 3, seed=7),) if LAYERS[name][1] else ())


def _expected_dtype(name: str) -> torch.dtype:
    dtype = LAYERS[name][2]
    if dtype == "softmax":
        return torch.float32 if DEVICE.type == "cuda" else HALF
    return HALF if dtype == "half" else dtype


def _layer_cases():
    for name in LAYERS:
        for paths in SPMM_PATHS if name in SPMM_LAYERS else EDGE_PATHS:
            for order in WIDTHS:
                yield pytest.param(name, paths, order, id=f"{name}-{paths}-{order}")


@pytest.mark.parametrize("name, aggregation, order", list(_layer_cases()))
def test_layer_under_autocast(name, aggregation, order):
    """Under autocast every layer runs, returns the dtype PyG's returns under the same
    autocast on every backend and in either order of aggregation and projection, is within
    a half-precision tolerance of the float64 layer, and gives float32 gradients to its
    float32 parameters (and to a float32 input)."""
    widths = WIDTHS[order]
    layer = _build(name, widths, aggregation)
    inputs = _layer_inputs(name, widths)
    x = inputs[0].clone().requires_grad_()
    with autocast():
        out = layer(x, *inputs[1:])
    assert out.dtype == _expected_dtype(name)
    exact = _build(name, widths, "reference").double()
    exact.load_state_dict(layer.state_dict())
    expected = exact(*(t.double() if t.is_floating_point() else t for t in inputs))
    torch.testing.assert_close(out.double(), expected, **HALF_TOL)
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32
    for pname, p in layer.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, pname


@pytest.mark.parametrize("name", list(LAYERS))
def test_expected_dtypes_are_pygs(name):
    """The dtypes :data:`LAYERS` expects are those PyG's layers return under autocast."""
    from tests.pyg_compare import pyg_nn

    if pyg_nn is None:
        pytest.skip("torch_geometric is not importable")
    for widths in WIDTHS.values():
        theirs = _build(name, widths, None)
        with autocast():
            assert theirs(*_layer_inputs(name, widths)).dtype == _expected_dtype(name)


@pytest.mark.parametrize("aggregation", EDGE_PATHS)
@pytest.mark.parametrize("edges", [False, True], ids=["plain", "edge-features"])
def test_bipartite_gat_under_autocast(aggregation, edges):
    """GATConv on separate source and target features (its target scores a GEMM of x_dst,
    half under autocast; its source scores float32) used to refuse the mixed scores."""
    from fusegnn.layers import GATConv

    torch.manual_seed(0)
    layer = GATConv((8, 4), 3, heads=2, add_self_loops=False, edge_dim=3 if edges else None,
                    aggregation=aggregation).to(DEVICE)
    edge_index = torch.stack([torch.arange(30) % 10, torch.arange(30) % 6]).to(DEVICE)
    x_src, x_dst = randn(10, 8, seed=1), randn(6, 4, seed=2)
    edge_attr = (randn(30, 3, seed=3),) if edges else ()
    with autocast():
        out = layer((x_src, x_dst), edge_index, *edge_attr)
    assert out.dtype == torch.float32
    exact = GATConv((8, 4), 3, heads=2, add_self_loops=False, edge_dim=3 if edges else None,
                    aggregation="reference").to(DEVICE).double()
    exact.load_state_dict(layer.state_dict())
    expected = exact((x_src.double(), x_dst.double()), edge_index, *(e.double() for e in edge_attr))
    torch.testing.assert_close(out.double(), expected, **HALF_TOL)


@pytest.mark.parametrize("aggregation", EDGE_PATHS)
@pytest.mark.parametrize("order", list(WIDTHS))
def test_gat_attention_weights_dtype_under_autocast(aggregation, order):
    """GATConv's returned coefficients are float32 under autocast (PyG's: the float32
    attention vectors promote the scores) in either order of aggregation and projection
    (aggregating first formed the scores by a GEMM: half)."""
    widths = WIDTHS[order]
    layer = _build("GATConv", widths, aggregation)
    x, edge_index = _layer_inputs("GATConv", widths)
    with autocast():
        out, (_, alpha) = layer(x, edge_index, return_attention_weights=True)
    assert out.dtype == torch.float32 and alpha.dtype == torch.float32


# --------------------------------------------------------------------------- models' loss
MODELS = ("GCN", "GAT", "GATv2", "GraphSAGE", "GIN", "SGC", "APPNPNet")


def _model(name: str, aggregation: str, widths: tuple[int, int, int]):
    import fusegnn.models as models

    torch.manual_seed(0)
    i, h, o = widths
    if name == "SGC":
        return getattr(models, name)(i, o, aggregation=aggregation)
    if name == "APPNPNet":
        return models.APPNPNet(i, h, o, K=2, aggregation=aggregation)
    return getattr(models, name)(i, h, o, aggregation=aggregation)


@pytest.mark.parametrize("aggregation", EDGE_PATHS)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("widths", [(8, 4, 6), (6, 8, 3)], ids=["fused-head", "logits"])
def test_model_loss_under_autocast(name, aggregation, widths):
    """``model.loss`` under autocast is a float32 loss within a half-precision tolerance of
    the float64 model's (whichever form it takes: the fused head of :meth:`head_inputs`
    where the output layer aggregates narrower than the classes, else the logits), and
    gives float32 gradients to every float32 parameter."""
    model = _model(name, aggregation, widths).to(DEVICE).eval()
    x = randn(12, widths[0], seed=8)
    edge_index = random_graph(12, 40, 5, hub_degree=8).to(DEVICE)
    target = torch.arange(12, device=DEVICE) % widths[2]
    index = torch.tensor([0, 3, 4, 7, 11], device=DEVICE)
    with autocast():
        loss = model.loss(x, edge_index, target, index)
    assert loss.dtype == torch.float32
    exact = _model(name, "reference", widths).to(DEVICE).double().eval()
    exact.load_state_dict(model.state_dict())
    torch.testing.assert_close(loss.double(), exact.loss(x.double(), edge_index, target, index), **HALF_TOL)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, pname


@pytest.mark.parametrize("aggregation", EDGE_PATHS)
@pytest.mark.parametrize("name", ["GCNConv", "GATConv", "GATv2Conv"])
def test_layers_without_bias_return_half_under_autocast(name, aggregation):
    """Without a bias GCNConv / GATConv / GATv2Conv return the features' half dtype under
    autocast (the documented difference from PyG, whose float32 edge weights or
    coefficients promote the messages), the same on every backend and in either order."""
    import fusegnn.layers as ours

    edge_index = random_graph(12, 40, 5, hub_degree=8).to(DEVICE)
    for widths in WIDTHS.values():
        kwargs = {} if name == "GCNConv" else {"heads": 2}
        layer = getattr(ours, name)(*widths, bias=False, aggregation=aggregation, **kwargs).to(DEVICE)
        with autocast():
            assert layer(randn(12, widths[0], seed=9), edge_index).dtype == HALF


# --------------------------------------------------------------------------- edge_softmax
@pytest.mark.parametrize("aggregation", EDGE_PATHS)
@pytest.mark.parametrize("heads", [(), (2,)], ids=["flat", "heads"])
def test_edge_softmax_under_autocast_has_torch_softmaxs_dtype(aggregation, heads):
    """Under autocast ``edge_softmax`` returns what ``torch.softmax`` returns there (float32
    on CUDA, the half dtype on the CPU), on every path, with float32-accurate values and a
    gradient in the scores' dtype."""
    from fusegnn.sparse import edge_softmax

    g = graph()
    scores = randn(g.num_edges, *heads, seed=3, dtype=HALF, grad=True)
    with autocast():
        alpha = edge_softmax(g, scores, aggregation=aggregation)
        expected_dtype = torch.softmax(scores, dim=0).dtype
    assert alpha.dtype == expected_dtype
    exact = reference.edge_softmax(g, scores.detach().double())
    torch.testing.assert_close(alpha.double(), exact, **HALF_TOL)
    alpha.sum().backward()
    assert scores.grad is not None and scores.grad.dtype == HALF
