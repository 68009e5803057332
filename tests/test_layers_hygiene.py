"""The ``nn.Module`` hygiene of every layer, as PyTorch users rely on it.

For each layer (and the models' recipes): a strict ``state_dict`` round trip into a fresh
layer, ``copy.deepcopy``, ``torch.save`` / ``torch.load`` of the module itself,
``.double()`` / ``.half()`` then a forward, ``.to('meta')`` then ``to_empty``, seeded
``reset_parameters``, ``named_parameters`` without duplicates, forward hooks,
``requires_grad_(False)``, dropout only in training, and the cached layers (``GCNConv``,
``SGConv``, ``APPNP``) across ``inference_mode``, dtype moves and edge weights that need a
gradient. Small graphs, float32 against float64 where values are compared.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from fusegnn import models
from fusegnn.layers import (
    APPNP,
    GATConv,
    GATv2Conv,
    GCNConv,
    GINConv,
    GINEConv,
    GraphConv,
    SAGEConv,
    SGConv,
    TransformerConv,
)
from fusegnn.sparse import Graph

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
N, F_IN = 7, 5
EDGE_INDEX = torch.tensor([[0, 1, 2, 3, 4, 5, 1, 2, 6], [1, 2, 3, 4, 5, 6, 0, 0, 6]], device=DEVICE)
E = EDGE_INDEX.size(1)


def _x(dtype=torch.float32, seed=0, rows=N, cols=F_IN):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen).to(DEVICE, dtype)


def _edge_attr(dtype=torch.float32):
    gen = torch.Generator().manual_seed(11)
    return torch.randn(E, 3, generator=gen).to(DEVICE, dtype)


def _mlp():
    return nn.Sequential(nn.Linear(F_IN, 3), nn.ReLU(), nn.Linear(3, 4))


# name -> (build, forward(layer, x)); every option that adds a parameter or a cache
LAYERS = {
    "gcn": (lambda: GCNConv(F_IN, 4), lambda m, x: m(x, EDGE_INDEX)),
    "gcn_cached": (lambda: GCNConv(F_IN, 4, cached=True), lambda m, x: m(x, EDGE_INDEX)),
    "gat": (lambda: GATConv(F_IN, 3, heads=2, dropout=0.5), lambda m, x: m(x, EDGE_INDEX)),
    "gat_edges": (
        lambda: GATConv(F_IN, 3, heads=2, edge_dim=3, residual=True),
        lambda m, x: m(x, EDGE_INDEX, _edge_attr(x.dtype)),
    ),
    "gatv2": (
        lambda: GATv2Conv(F_IN, 3, heads=2, edge_dim=3, residual=True, dropout=0.5),
        lambda m, x: m(x, EDGE_INDEX, _edge_attr(x.dtype)),
    ),
    "gatv2_shared": (lambda: GATv2Conv(F_IN, 3, heads=2, share_weights=True), lambda m, x: m(x, EDGE_INDEX)),
    "sage": (lambda: SAGEConv(F_IN, 4, project=True), lambda m, x: m(x, EDGE_INDEX)),
    "gin": (lambda: GINConv(_mlp(), train_eps=True), lambda m, x: m(x, EDGE_INDEX)),
    "gine": (lambda: GINEConv(_mlp(), edge_dim=3), lambda m, x: m(x, EDGE_INDEX, _edge_attr(x.dtype))),
    "sgc": (lambda: SGConv(F_IN, 4, K=2), lambda m, x: m(x, EDGE_INDEX)),
    "sgc_cached": (lambda: SGConv(F_IN, 4, K=2, cached=True), lambda m, x: m(x, EDGE_INDEX)),
    "appnp": (lambda: APPNP(K=3, alpha=0.1, dropout=0.5), lambda m, x: m(x, EDGE_INDEX)),
    "appnp_cached": (lambda: APPNP(K=3, alpha=0.1, cached=True), lambda m, x: m(x, EDGE_INDEX)),
    "graph_conv": (lambda: GraphConv(F_IN, 4), lambda m, x: m(x, EDGE_INDEX)),
    "transformer": (
        lambda: TransformerConv(F_IN, 3, heads=2, edge_dim=3, beta=True, dropout=0.5),
        lambda m, x: m(x, EDGE_INDEX, _edge_attr(x.dtype)),
    ),
}


def _build(name):
    return LAYERS[name][0]().to(DEVICE)


def _run(name, layer, x):
    return LAYERS[name][1](layer, x)


# ============================================================================ cached layers
CACHED = ["gcn_cached", "sgc_cached", "appnp_cached"]


@pytest.mark.parametrize("name", CACHED)
def test_cached_layer_first_called_under_inference_mode_then_trains(name):
    """A cached layer's first call under ``torch.inference_mode`` (an evaluation before
    training) must not keep inference tensors: the training step after it saves the
    cached values for its backward."""
    layer = _build(name)
    with torch.inference_mode():
        expected = _run(name, layer, _x())
    x = _x().requires_grad_()
    out = _run(name, layer, x)
    torch.testing.assert_close(out.detach(), expected.clone())
    out.square().sum().backward()
    assert all(p.grad is not None for p in layer.parameters())


@pytest.mark.parametrize("form", ["forward", "graph"])
@pytest.mark.parametrize("name", ["gcn_cached", "appnp_cached"])
def test_cached_layer_with_edge_weights_that_need_a_gradient(name, form):
    """Edge weights that require grad (learnt weights) and ``cached=True``: the first
    call's gradient reaches them (as without the cache), and later calls reuse the first
    call's normalised graph, as PyG's values, without its autograd history -- keeping it
    made the second step's backward fail ('backward through the graph a second time')."""
    build = {"gcn_cached": lambda c: GCNConv(F_IN, 4, cached=c), "appnp_cached": lambda c: APPNP(K=2, alpha=0.1, cached=c)}
    torch.manual_seed(0)
    cached = build[name](True).to(DEVICE)
    plain = copy.deepcopy(cached)
    plain.cached = False
    x = _x().requires_grad_()  # (APPNP has no parameters)

    def weights(seed):
        return (torch.rand(E, generator=torch.Generator().manual_seed(seed)) + 0.5).to(DEVICE).requires_grad_()

    def call(layer, w):
        return layer(x, EDGE_INDEX, w) if form == "forward" else layer(x, Graph(EDGE_INDEX, N, edge_weight=w))

    first, again = weights(0), weights(0)
    call(cached, first).square().sum().backward()
    call(plain, again).square().sum().backward()
    torch.testing.assert_close(first.grad, again.grad)
    second = weights(1)
    out = call(cached, second)
    out.square().sum().backward()  # failed here
    assert second.grad is None  # the stored graph holds the first weights, detached
    torch.testing.assert_close(out, call(plain, weights(0)).detach())


# ============================================================================ attention modules
def _attention_layers():
    from fusegnn.attention.masks import sliding_window
    from fusegnn.layers import SparseMultiheadAttention, SparseTransformerEncoderLayer

    mask = sliding_window(12, 3)
    return {
        "mha_mask": (lambda: SparseMultiheadAttention(16, 4), lambda m, x: m(x, x, x, mask=mask)[0]),
        "mha_nm": (lambda: SparseMultiheadAttention(16, 4, nm=(2, 4)), lambda m, x: m(x, x, x)[0]),
        "encoder": (lambda: SparseTransformerEncoderLayer(16, 4, 32, mask=mask), lambda m, x: m(x)),
    }


@pytest.mark.parametrize("name", ["mha_mask", "mha_nm", "encoder"])
def test_attention_module_saved_after_a_forward(name):
    """``torch.save`` of a module that holds a mask (the encoder layer's ``mask``, the N:M
    layer's full masks), after it ran: the mask's caches held the prepared calls
    (closures), which cannot be pickled."""
    build, run = _attention_layers()[name]
    layer = build().to(DEVICE).eval()
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    expected = run(layer, x)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(run(loaded, x), expected)
    torch.testing.assert_close(run(copy.deepcopy(layer), x), expected)


def test_copied_masks_and_layouts_get_handles_of_their_own():
    """A mask or block layout copied (``copy.deepcopy``, pickle: a deep-copied or loaded
    model) is another object, with its own handle: the compiled ops look masks up by
    handle, so a copy that kept the original's found the original (or, once that was
    garbage collected, nothing; in another process, whatever object held that number)."""
    from fusegnn.attention import handles
    from fusegnn.attention.block_layout import BlockLayout
    from fusegnn.attention.masks import causal

    mask = causal(32)
    layout = BlockLayout.from_mask(mask, 16, 16)
    for original in (mask, layout):
        for copied in (copy.deepcopy(original), copy.copy(original), _pickled(original)):
            assert copied.handle != original.handle
            assert handles.lookup(copied.handle) is copied
            assert handles.lookup(original.handle) is original
    assert torch.equal(copy.deepcopy(mask).dense(), mask.dense())


def _pickled(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)
