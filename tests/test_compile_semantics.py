"""What ``torch.compile`` promises for fusegnn, checked on the CPU with ``backend="aot_eager"``:

* every public op (``spmm`` with each reduce, ``edge_aggregate``, ``sddmm``,
  ``edge_softmax``, ``gat_attention``, ``gatv2_attention``, ``propagate``) and every GNN
  layer compiles with ``fullgraph=True`` and gives eager's values and gradients (float64,
  random graphs with isolated nodes, duplicates and self-loops, bipartite graphs);
* ``fusegnn.losses.linear_cross_entropy`` compiles with ``fullgraph=True`` (its range
  checks become in-graph assertions) and still refuses out-of-range class ids;
* a fixed graph compiles once; new graphs recompile at most twice (handle, then sizes
  symbolic) and are reused from then on;
* documented refusals under compilation carry their message;
* a whole compiled training step (model, loss, backward, optimizer step) tracks eager.

Dynamo's caches are reset around every test. Kept small: compilation is slow on the CPU.
"""

from __future__ import annotations

import copy
import os

import torch

if not torch.cuda.is_available():  # fused kernels run through Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch._dynamo  # noqa: E402
import torch._dynamo.testing  # noqa: E402

from fusegnn import layers as L  # noqa: E402
from fusegnn.losses import linear_cross_entropy  # noqa: E402
from fusegnn.sparse import Graph, edge_aggregate, edge_softmax, gat_attention, sddmm, spmm  # noqa: E402
from fusegnn.sparse.gatv2 import gatv2_attention  # noqa: E402
from fusegnn.sparse.propagate import propagate  # noqa: E402
from tests.graphs import random_graph  # noqa: E402
from tests.test_compile import fresh_dynamo  # noqa: E402,F401  (autouse: Dynamo reset around every test)

F64 = torch.float64
pytestmark = pytest.mark.usefixtures("one_thread")


def _square(n: int = 12, e: int = 40, seed: int = 1) -> Graph:
    return Graph(random_graph(n, e, seed=seed, hub_degree=5), n)


def _bipartite(n_src: int = 9, n_dst: int = 6, e: int = 30, seed: int = 2) -> Graph:
    return Graph(random_graph(n_src, e, seed=seed, num_dst_nodes=n_dst), (n_src, n_dst))


def _rand(*shape, seed: int, dtype=F64, requires_grad: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_(requires_grad)


def _flat(value) -> list:
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return [value]


def _grads(outputs: list, inputs: list):
    gen = torch.Generator().manual_seed(123)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device)).sum()
               for o in outputs if o.is_floating_point() and o.requires_grad)
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def _assert_same(compiled_out, eager_out, inputs, **tol) -> None:
    got, want = _flat(compiled_out), _flat(eager_out)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, **tol)
        else:
            assert torch.equal(a, b)
    for a, b in zip(_grads(got, inputs), _grads(want, inputs)):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, **tol)


def _compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


# ------------------------------------------------------------------------------ ops
def test_every_op_compiles_to_eager_values_and_gradients():
    """One compiled function calls every public op (each reduce, heads, bipartite)."""
    g, bg = _square(), _bipartite()
    n, e = g.num_nodes, g.num_edges
    x, w, x3, wh = _rand(n, 5, seed=0), _rand(e, seed=1), _rand(n, 2, 3, seed=2), _rand(e, 2, seed=3)
    xb, wb, eab = _rand(9, 5, seed=4), _rand(bg.num_edges, seed=5), _rand(bg.num_edges, 5, seed=6)
    ea = _rand(e, 5, seed=7)
    s, t, u = _rand(n, 2, seed=8), _rand(n, 2, seed=9), _rand(e, 2, seed=10)
    att, sb, tb = _rand(1, 2, 3, seed=11), _rand(9, 2, seed=12), _rand(6, 2, seed=13)
    xb3, xd3 = _rand(9, 2, 3, seed=14), _rand(6, 2, 3, seed=15)
    inputs = [x, w, x3, wh, xb, wb, eab, ea, s, t, u, att, sb, tb, xb3, xd3]

    def fn(x, w, x3, wh, xb, wb, eab, ea, s, t, u, att, sb, tb, xb3, xd3, g, bg, gw):
        outs = []
        for reduce in ("sum", "mean", "max"):
            outs += [
                spmm(g, x, w, reduce=reduce),
                spmm(g, x3, wh, reduce=reduce),
                spmm(bg, xb, wb, reduce=reduce),
                spmm(gw, x, reduce=reduce),  # the graph's own weights
                edge_aggregate(g, x, ea, edge_weight=w, activation="relu", reduce=reduce),
                edge_aggregate(bg, xb, eab, reduce=reduce),
            ]
        scores = sddmm(g, x3, x3, "dot")
        outs += [edge_softmax(g, scores), sddmm(g, x, x, "sub"), edge_softmax(bg, wb)]
        outs += list(gat_attention(g, x3, s, t, score_edge=u, return_alpha=True))
        outs += list(gat_attention(bg, xb3, sb, tb, return_alpha=True))
        outs += list(gatv2_attention(g, x3, x3, att, return_alpha=True))
        outs += list(gatv2_attention(bg, xb3, xd3, att, return_alpha=True))
        outs += [propagate(g, x, K=3, alpha=0.1), propagate(g.edge_index, x, K=2)]
        return tuple(outs)

    gw = g.with_edge_weight(w)  # built outside: a Graph is not built in traced code
    _assert_same(_compiled(fn)(*inputs, g, bg, gw), fn(*inputs, g, bg, gw), inputs)


# ------------------------------------------------------------------------------ layers
def _layer_cases():
    g, bg = _square(), _bipartite()
    x, xs, xd = _rand(12, 6, seed=0), _rand(9, 6, seed=1), _rand(6, 6, seed=2)
    w = (torch.rand(g.num_edges, dtype=F64, generator=torch.Generator().manual_seed(3)) + 0.1).requires_grad_()
    ea, eab = _rand(g.num_edges, 4, seed=4), _rand(bg.num_edges, 4, seed=5)
    torch.manual_seed(0)
    return [
        ("APPNP", L.APPNP(3, 0.1), (x, g, w)),
        ("GCNConv", L.GCNConv(6, 4), (x, g, w)),
        ("GATConv", L.GATConv(6, 3, heads=2), (x, g, None, None, True)),
        ("GATConv edge", L.GATConv(6, 3, heads=2, edge_dim=4, add_self_loops=False), (x, g, ea)),
        ("GATConv bipartite", L.GATConv((6, 6), 3, heads=2, add_self_loops=False), ((xs, xd), bg)),
        ("GATv2Conv", L.GATv2Conv(6, 3, heads=2, residual=True), (x, g, None, True)),
        ("GATv2Conv edge bipartite", L.GATv2Conv((6, 6), 3, heads=2, edge_dim=4, add_self_loops=False),
         ((xs, xd), bg, eab)),
        ("GINConv", L.GINConv(torch.nn.Linear(6, 5), train_eps=True), ((xs, xd), bg)),
        ("GINEConv", L.GINEConv(torch.nn.Linear(6, 5), edge_dim=4), (x, g, ea)),
        ("GraphConv max", L.GraphConv((6, 6), 4, aggr="max"), ((xs, xd), bg)),
        ("SAGEConv", L.SAGEConv(6, 4, aggr="max", normalize=True, project=True), (x, g)),
        ("SGConv", L.SGConv(6, 4, K=2), (x, g, w)),
        ("TransformerConv", L.TransformerConv(6, 3, heads=2, edge_dim=4, beta=True), (x, g, ea, True)),
    ]


def test_every_layer_compiles_to_eager_values_and_gradients():
    for name, layer, args in _layer_cases():
        torch._dynamo.reset()
        layer = layer.double().eval()
        inputs = [a for a in _flat(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        inputs += list(layer.parameters())
        try:
            _assert_same(_compiled(layer)(*args), layer(*args), inputs)
        except Exception as error:
            raise AssertionError(f"{name}: {error}") from error


# ------------------------------------------------------------------------------ recompilation
@pytest.mark.parametrize("kind", ["ops", "gatv2_layer"])
def test_a_fixed_graph_compiles_once_and_new_graphs_at_most_twice(kind):
    torch.manual_seed(0)
    layer = L.GATv2Conv(4, 3, heads=2).double().eval()

    def ops(x, g):
        return spmm(g, x, reduce="max"), edge_softmax(g, sddmm(g, x, x, "dot")), propagate(g, x, K=2)

    def gatv2_layer(x, g):
        out, (ei, alpha) = layer(x, g, return_attention_weights=True)
        return out, ei, alpha

    fn = ops if kind == "ops" else gatv2_layer
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    fixed = _square(14, 48, seed=0)
    for step in range(3):
        x = _rand(14, 4, seed=step)
        _assert_same(compiled(x, fixed), fn(x, fixed), [x])
    assert counter.frame_count == 1
    frames = []
    for seed, (n, e) in enumerate([(14, 48), (20, 60), (25, 90), (31, 70)], start=1):
        g = _square(n, e, seed=seed)
        x = _rand(n, 4, seed=seed)
        _assert_same(compiled(x, g), fn(x, g), [x])
        frames.append(counter.frame_count)
    assert frames == [2, 3, 3, 3]


# ------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("make_layer,args,message", [
    (lambda: L.GATConv(6, 3, heads=2, edge_dim=4), "square", "edge features with self-loops"),
    (lambda: L.GATv2Conv(6, 3, heads=2, edge_dim=4), "square", "edge features with self-loops"),
    (lambda: L.GATv2Conv((6, 6), 3, heads=2), "bipartite", "self-loops on a bipartite graph"),
])
def test_documented_refusals_carry_their_message(make_layer, args, message):
    """Without fullgraph the documented error itself; with fullgraph Dynamo's report names it."""
    layer = make_layer().double()
    if args == "square":
        g = _square()
        args = (_rand(12, 6, seed=0), g, _rand(g.num_edges, 4, seed=1))
    else:
        args = ((_rand(9, 6, seed=0), _rand(6, 6, seed=1)), _bipartite())
    with pytest.raises(NotImplementedError, match=message):
        torch.compile(layer, backend="aot_eager")(*args)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=message):
        _compiled(layer)(*args)


# ------------------------------------------------------------------------------ fused loss
@pytest.mark.parametrize("backend", ["auto", "fused"])
@pytest.mark.parametrize("options", [
    dict(),
    dict(reduction="sum", label_smoothing=0.1, ignore_index=1),
    dict(reduction="none", index=[0, 2, 2, 5, 9]),
])
def test_linear_cross_entropy_compiles_with_fullgraph(options, backend):
    """The range check of the targets read them back to the host (a data-dependent guard
    that fullgraph refused: "Could not guard on data-dependent expression"); under
    compilation it is an in-graph assertion. ``backend="auto"`` (the reference for these
    sizes) once refused ``importlib.util.find_spec`` (triton's presence) in traced code
    on torch 2.11; ``backend="fused"`` is the custom op ``fusegnn::linear_cross_entropy``.
    On a CUDA machine the tensors are CUDA tensors (the Triton kernels themselves)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    options = dict(options, backend=backend)
    if "index" in options:
        options["index"] = torch.tensor(options["index"], device=device)
    h, weight, bias = (t.detach().to(device).requires_grad_()
                       for t in (_rand(10, 6, seed=0), _rand(4, 6, seed=1), _rand(4, seed=2)))
    target = torch.tensor([0, 1, 2, 3, 1, 1, 0, 2, 3, 1], device=device)

    def loss(h, weight, bias, target):
        return linear_cross_entropy(h, weight, target, bias, **options)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    for _ in range(2):
        _assert_same(compiled(h, weight, bias, target), loss(h, weight, bias, target), [h, weight, bias])
    assert counter.frame_count == 1
    if device.type == "cuda":
        # the range checks on CPU tensors (through the reference: no interpreter here): on
        # CUDA a failed torch._assert_async is a device-side assert, which ends the
        # process's CUDA context
        options["backend"] = "auto"
        if "index" in options:
            options["index"] = options["index"].cpu()
        h, weight, bias, target = (t.cpu() for t in (h, weight, bias, target))
        compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    bad = target.clone()
    bad[3] = 4
    with pytest.raises(RuntimeError, match=r"class id outside \[0, 4\)"):
        compiled(h, weight, bias, bad)
    if "index" in options:
        with pytest.raises(RuntimeError, match=r"rows outside \[0, 10\)"):
            options["index"] = torch.tensor([0, 10])
            compiled(h, weight, bias, target)


# ------------------------------------------------------------------------------ training step
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = L.GATConv(6, 4, heads=2)
        self.conv2 = L.SAGEConv(8, 5)
        self.head = torch.nn.Linear(5, 3)

    def forward(self, x, graph):
        return self.conv2(torch.relu(self.conv1(x, graph)), graph)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_compiled_training_step_tracks_eager(optimizer):
    """Model, fused loss, backward and optimizer step in one compiled function (the
    optimizer calls break the graph, so no fullgraph), against the same step eagerly."""
    graph = _square(14, 48, seed=1)
    x = _rand(14, 6, seed=0, requires_grad=False)
    target = torch.randint(0, 3, (14,), generator=torch.Generator().manual_seed(1))
    index = torch.tensor([0, 1, 2, 5, 7, 9])
    torch.manual_seed(0)
    model = _Net().double()
    twin = copy.deepcopy(model)

    def make(m):
        if optimizer == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.Adam(m.parameters(), lr=0.05)

    def step(m, opt):
        opt.zero_grad()
        loss = linear_cross_entropy(m(x, graph), m.head.weight, target, m.head.bias, index=index)
        loss.backward()
        opt.step()
        return loss.detach()

    # compiled Adam keeps its step count in a float32 tensor: about 1e-6 apart from eager
    # after a few steps even for a plain torch.nn.Linear
    tol = {} if optimizer == "sgd" else dict(rtol=1e-4, atol=1e-5)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter)
    opt_c, opt_e = make(model), make(twin)
    frames = []
    for _ in range(4):
        torch.testing.assert_close(compiled(model, opt_c), step(twin, opt_e), **tol)
        frames.append(counter.frame_count)
    assert frames[1] == frames[-1], frames  # no recompilation once the optimizer state exists
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, **tol)


def test_building_a_graph_inside_compiled_code_says_what_to_do():
    """``Graph(edge_index, n)`` inside a compiled function checks the ids on the host, which
    fullgraph cannot trace; the error says to build it outside or pass the edge_index (which
    the layers take under compile), not Dynamo's words about data-dependent symbols."""
    layer = L.GCNConv(6, 4).double()
    x, edge_index = _rand(12, 6, seed=0), torch.tensor([[0, 1, 2, 3, 11], [1, 2, 3, 0, 5]])

    def step(x, edge_index):
        return layer(x, Graph(edge_index, 12))

    torch._dynamo.reset()
    with pytest.raises(Exception, match="cannot be built inside a torch.compile'd function"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(x, edge_index)
    torch._dynamo.reset()
    # the suggested form compiles, and without fullgraph the graph breaks and runs eagerly
    eager = layer(x, Graph(edge_index, 12))
    _assert_same(torch.compile(layer, backend="aot_eager", fullgraph=True)(x, edge_index), eager, [x])
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(step, backend="aot_eager")(x, edge_index), eager)
