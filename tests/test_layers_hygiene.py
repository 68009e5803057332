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
from tests.pyg_compare import pyg_nn, requires_pyg

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
    build = {
        "gcn_cached": lambda c: GCNConv(F_IN, 4, cached=c),
        "appnp_cached": lambda c: APPNP(K=2, alpha=0.1, cached=c),
    }
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


# ============================================================================ every layer
def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("name", list(LAYERS))
def test_state_dict_deepcopy_and_pickle_round_trips(name):
    """A strict ``load_state_dict`` into a fresh layer, ``copy.deepcopy`` and
    ``torch.save`` / ``torch.load`` of the module itself (after a call, so with any cache
    filled) give the same function."""
    layer = _build(name).eval()
    x = _x()
    expected = _run(name, layer, x)
    fresh = _build(name).eval()
    fresh.load_state_dict(layer.state_dict(), strict=True)
    torch.testing.assert_close(_run(name, fresh, x), expected)
    torch.testing.assert_close(_run(name, copy.deepcopy(layer), x), expected)
    torch.testing.assert_close(_run(name, _pickled(layer), x), expected)
    names = [n for n, _ in layer.named_parameters()]
    assert len(names) == len(set(names)) and len(names) == len({id(p) for p in layer.parameters()})


@pytest.mark.parametrize("name", list(LAYERS))
def test_dtype_moves_and_meta_to_empty(name):
    """``.double()`` then a float64 forward equals a float64 reference layer built with the
    same weights (a cached layer built in float32 first included); ``.half()`` gives half
    outputs close to float32's; ``.to('meta')`` then ``to_empty`` and a state dict load
    gives the original back."""
    layer = _build(name).eval()
    x = _x()
    expected = _run(name, layer, x)  # fills any cache in float32
    reference = _build(name).eval().double()
    reference.load_state_dict(layer.state_dict())
    want = _run(name, reference, _x(torch.float64))
    doubled = copy.deepcopy(layer).double()
    got = _run(name, doubled, _x(torch.float64))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.float(), expected, rtol=1e-4, atol=1e-5)
    back = doubled.float()
    torch.testing.assert_close(_run(name, back, x), expected, rtol=1e-5, atol=1e-6)
    halved = copy.deepcopy(layer).half()
    out = _run(name, halved, _x(torch.float16))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, rtol=5e-2, atol=5e-2)
    empty = copy.deepcopy(layer).to("meta").to_empty(device=DEVICE)
    empty.load_state_dict(layer.state_dict())
    torch.testing.assert_close(_run(name, empty, x), expected)


@pytest.mark.parametrize("name", list(LAYERS))
def test_seeded_construction_and_reset_parameters(name):
    """The same seed gives the same parameters, at construction and at
    ``reset_parameters``; a reset draws new values (where the layer has any)."""
    torch.manual_seed(5)
    a = _build(name)
    torch.manual_seed(5)
    b = _build(name)
    _assert_same_state(a, b)
    before = {k: v.clone() for k, v in a.state_dict().items()}
    torch.manual_seed(6)
    a.reset_parameters()
    torch.manual_seed(6)
    b.reset_parameters()
    _assert_same_state(a, b)
    random = [k for k, v in before.items() if v.is_floating_point() and v.numel() > 1 and v.std() > 0]
    assert all(not torch.equal(before[k], a.state_dict()[k]) for k in random)


@pytest.mark.parametrize("name", list(LAYERS))
def test_hooks_frozen_parameters_and_train_eval(name):
    """Forward hooks see the call; a frozen layer (``requires_grad_(False)``) still runs
    and passes the input's gradient; dropout acts in training only (eval is deterministic
    and back to the same values after a training call)."""
    layer = _build(name)
    seen = []
    handle = layer.register_forward_hook(lambda module, args, out: seen.append(out))
    layer.eval()
    x = _x()
    expected = _run(name, layer, x)
    assert len(seen) == 1 and seen[0] is expected
    handle.remove()
    layer.train()
    torch.manual_seed(0)
    _run(name, layer, x)
    layer.eval()
    torch.testing.assert_close(_run(name, layer, x), expected, rtol=0, atol=0)
    if getattr(layer, "dropout", 0.0):
        layer.train()
        torch.manual_seed(1)
        first = _run(name, layer, x)
        torch.manual_seed(2)
        assert not torch.equal(first, _run(name, layer, x))
    if name == "sgc_cached":
        return  # its cached features are detached by design: no gradient reaches x
    frozen = copy.deepcopy(layer).requires_grad_(False).train()
    xg = x.clone().requires_grad_()
    _run(name, frozen, xg).square().sum().backward()
    assert xg.grad is not None and xg.grad.abs().sum() > 0
    assert all(p.grad is None for p in frozen.parameters())


@pytest.mark.parametrize("name", list(LAYERS))
def test_no_grad_and_inference_mode_calls_then_a_training_step(name):
    """Calls under ``no_grad`` and ``inference_mode`` (evaluation) between training steps
    leave nothing behind that breaks the next step's backward."""
    layer = _build(name)
    x = _x()
    with torch.no_grad():
        _run(name, layer.eval(), x)
    with torch.inference_mode():
        _run(name, layer, x)
    layer.train()
    out = _run(name, layer, x.clone().requires_grad_())
    out.square().sum().backward()
    trainable = [p for p in layer.parameters() if p.requires_grad]
    assert all(p.grad is not None for p in trainable)


# (the layers with edge features are left out: their edge_attr follows one graph's edges)
WITH_EDGE_FEATURES = ("gat_edges", "gatv2", "gine", "transformer")


@pytest.mark.parametrize("name", [n for n in LAYERS if "cached" not in n and n not in WITH_EDGE_FEATURES])
def test_one_layer_on_two_graphs_alternately_and_an_edge_index_changed_in_place(name):
    """An uncached layer called on two graphs in turn gives each graph's own output every
    time (nothing keyed wrongly); an ``edge_index`` tensor changed in place between calls
    is read afresh (the layer builds the graph on each call; a :class:`Graph` is
    documented immutable instead)."""
    layer = _build(name).eval()
    x = _x()
    other = torch.tensor([[6, 5, 4, 3, 0], [0, 0, 1, 2, 6]], device=DEVICE)
    g1, g2 = Graph(EDGE_INDEX, N), Graph(other, N)
    want1, want2 = layer(x, g1), layer(x, g2)
    for _ in range(2):
        torch.testing.assert_close(layer(x, g1), want1, rtol=0, atol=0)
        torch.testing.assert_close(layer(x, g2), want2, rtol=0, atol=0)
    ei = EDGE_INDEX.clone()
    before = layer(x, ei)
    torch.testing.assert_close(before, want1, rtol=0, atol=0)
    ei[1, 0] = 5  # the edge 0 -> 1 becomes 0 -> 5
    torch.testing.assert_close(layer(x, ei), layer(x, ei.clone()), rtol=0, atol=0)
    assert not torch.equal(layer(x, ei), before)


@pytest.mark.parametrize("name", CACHED)
def test_cached_layer_after_a_dtype_move_and_train_eval(name):
    """A cached layer moved by ``.double()`` after its first call does not return the
    float32 cache; train / eval switches keep using the cache of that dtype."""
    layer = _build(name)
    x = _x()
    first = _run(name, layer, x)
    layer.double()
    got = _run(name, layer, _x(torch.float64))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.float(), first, rtol=1e-4, atol=1e-5)
    layer.eval()
    torch.testing.assert_close(_run(name, layer, _x(torch.float64)), got)
    layer.train()
    torch.testing.assert_close(_run(name, layer, _x(torch.float64)), got)


# ============================================================================ lazy layers
def _lazy_inputs(pair: bool):
    if pair:
        x = (_x(rows=6, cols=40, seed=1), _x(rows=4, cols=30, seed=2))
        return x, torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 0, 1]], device=DEVICE)
    return _x(cols=40), EDGE_INDEX  # wide: a weight's largest entry is near its bound


LAZY = {
    "gcn": (lambda m, c: m.GCNConv(c, 4), False),
    "gat_residual": (lambda m, c: m.GATConv(c, 3, heads=2, residual=True), False),
    "gat_pair_residual": (lambda m, c: m.GATConv(c, 3, heads=2, residual=True), True),
    "gat_pair_wide": (lambda m, c: m.GATConv(c, 8, heads=2), True),
    "gatv2_residual": (lambda m, c: m.GATv2Conv(c, 3, heads=2, residual=True), False),
    "gatv2_pair": (lambda m, c: m.GATv2Conv(c, 3, heads=2, residual=True), True),
    "sage": (lambda m, c: m.SAGEConv(c, 4), True),
    "graph_conv": (lambda m, c: m.GraphConv(c, 4), True),
    "sgc": (lambda m, c: m.SGConv(c, 4, K=2), False),
    "transformer": (lambda m, c: m.TransformerConv(c, 3, heads=2, beta=True), False),
    "transformer_pair": (lambda m, c: m.TransformerConv(c, 3, heads=2), True),
}


def _materialised(build, module, pair: bool, seed: int = 0):
    torch.manual_seed(seed)
    layer = build(module, (-1, -1) if pair else -1).to(DEVICE, torch.float64)
    x, ei = _lazy_inputs(pair)
    x = tuple(t.double() for t in x) if pair else x.double()
    torch.manual_seed(seed + 1)
    return layer, layer(x, ei), (x, ei)


@pytest.mark.parametrize("name", list(LAZY))
def test_lazy_layer_initialises_as_its_eager_form_and_loads_before_the_first_forward(name):
    """A lazy layer (``in_channels=-1``) materialised at its first forward draws each
    weight from the distribution its eager form (and PyG's) uses: Glorot's bound for the
    attention layers' transforms, the residual ``res`` included (it drew ``nn.Linear``'s
    narrower Kaiming bound), ``nn.Linear``'s otherwise. A fresh lazy layer takes a state
    dict before any forward and then computes the same function."""
    build, pair = LAZY[name]
    import fusegnn.layers as ours

    lazy, out, (x, ei) = _materialised(build, ours, pair)
    widths = (x[0].size(1), x[1].size(1)) if pair else x.size(1)
    eager = build(ours, widths).to(DEVICE, torch.float64)
    for key, value in eager.state_dict().items():
        got = lazy.state_dict()[key]
        assert got.shape == value.shape, key
        if value.numel() >= 100:  # the same bound, up to sampling (the weights)
            ratio = got.abs().max().item() / value.abs().max().item()
            assert 0.85 < ratio < 1.15, f"{key}: the lazy draw's bound is {ratio:.2f} x the eager one's"
    fresh = build(ours, (-1, -1) if pair else -1).to(DEVICE, torch.float64)
    fresh.load_state_dict(lazy.state_dict(), strict=True)
    torch.testing.assert_close(fresh(x, ei), out)


@requires_pyg
@pytest.mark.parametrize("name", list(LAZY))
def test_lazy_layer_draws_pygs_values_under_the_same_seed(name):
    """Materialised under the same seed, a lazy layer holds exactly PyG's lazy layer's
    parameters (same distributions, drawn in PyG's order: GAT's ``res`` before ``lin``,
    GATv2's ``res`` before ``lin_l`` / ``lin_r``, TransformerConv's query, key, value,
    skip; a Glorot transform draws no Kaiming weight first)."""
    import fusegnn.layers as ours_module

    build, pair = LAZY[name]
    ours, _, _ = _materialised(build, ours_module, pair)
    theirs, _, _ = _materialised(build, pyg_nn, pair)
    want = theirs.state_dict()
    assert sorted(ours.state_dict()) == sorted(want)
    for key, value in ours.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=1e-12, atol=1e-14, msg=lambda m: f"{key}: {m}")


# ============================================================================ models, VectorSparseLinear
MODELS = {
    "gcn": lambda: models.GCN(F_IN, 6, 3),
    "gat": lambda: models.GAT(F_IN, 2, 3, heads=2),
    "gatv2": lambda: models.GATv2(F_IN, 2, 3, heads=2),
    "sage": lambda: models.GraphSAGE(F_IN, 6, 3),
    "gin": lambda: models.GIN(F_IN, 6, 3),
    "sgc": lambda: models.SGC(F_IN, 3),
    "appnp": lambda: models.APPNPNet(F_IN, 6, 3),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_model_recipes_round_trip_and_train_after_an_inference_mode_evaluation(name):
    """The recipes (cached by default where they can be) load, copy, save and move dtype
    like their layers, and a training loss after an ``inference_mode`` evaluation
    backpropagates (SGC's cached features were inference tensors)."""
    model = MODELS[name]().to(DEVICE).eval()
    x = _x()
    expected = model(x, EDGE_INDEX)
    fresh = MODELS[name]().to(DEVICE).eval()
    fresh.load_state_dict(model.state_dict(), strict=True)
    for other in (fresh, copy.deepcopy(model), _pickled(model)):
        torch.testing.assert_close(other(x, EDGE_INDEX), expected)
    doubled = copy.deepcopy(model).double()
    torch.testing.assert_close(doubled(_x(torch.float64), EDGE_INDEX).float(), expected, rtol=1e-4, atol=1e-5)
    trained = MODELS[name]().to(DEVICE)
    with torch.inference_mode():
        trained.eval()(x, EDGE_INDEX)
    trained.train()
    target = torch.arange(N, device=DEVICE) % 3
    trained.loss(x, EDGE_INDEX, target).backward()
    assert all(p.grad is not None for p in trained.parameters())


def test_vector_sparse_linear_round_trips():
    """``VectorSparseLinear``: a state dict (pattern buffers included) loads into a layer of
    another pattern, even after that one built its cached structure; copies, pickles,
    dtype moves and ``to_empty`` give the same function."""
    from fusegnn.layers import VectorSparseLinear

    torch.manual_seed(2)
    layer = VectorSparseLinear(16, 20, 0.5, V=4).to(DEVICE)
    x = torch.randn(3, 10, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    expected = layer(x)
    torch.manual_seed(9)
    other = VectorSparseLinear(16, 20, 0.5, V=4).to(DEVICE)
    other(x)
    other.load_state_dict(layer.state_dict(), strict=True)
    for copied in (other, copy.deepcopy(layer), _pickled(layer)):
        torch.testing.assert_close(copied(x), expected)
    empty = copy.deepcopy(layer).to("meta").to_empty(device=DEVICE)
    empty.load_state_dict(layer.state_dict())
    torch.testing.assert_close(empty(x), expected)
    doubled = copy.deepcopy(layer).double()
    torch.testing.assert_close(doubled(x.double()).float(), expected, rtol=1e-5, atol=1e-5)
    with torch.inference_mode():
        layer(x)
    xg = x.clone().requires_grad_()
    layer.requires_grad_(False)(xg).sum().backward()
    assert xg.grad is not None
