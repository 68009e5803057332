"""fusegnn.graphed_step: a whole training step captured into a CUDA graph and replayed.

CPU (always): the API's argument errors -- CPU tensors and CPU parameters are refused with
a message naming them, and so is everything else that cannot be captured -- and the
diagnosis of a failed capture.

GPU (skipped without CUDA): GCN and GAT steps on a random graph (:mod:`tests.graphs`),
captured and replayed: parameters after replays match eager steps (dropout off, close
not bitwise: GAS and PyTorch's scatter use atomics), the loss falls over replays with
dropout on, every replay draws new dropout masks (torch's dropout and the fused GAT
attention dropout), Adam takes torch's fused kernel unless told not to, new inputs are
copied in, and what cannot be captured (a host sync inside the step, a changed learning
rate, an optimizer with host state, a kernel plan built during a raw capture) is a clear
error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fusegnn
from fusegnn import CaptureError, GraphedStep, graphed_step
from fusegnn.models import GAT, GCN
from fusegnn.sparse import Graph
from tests.graphs import random_graph

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (none here)")

N, E, FEAT, CLASSES = 400, 2400, 32, 4


# ----------------------------------------------------------------------------- CPU: the API


def test_exported_from_the_package():
    assert fusegnn.graphed_step is graphed_step and fusegnn.GraphedStep is GraphedStep
    assert issubclass(CaptureError, RuntimeError)


def test_cpu_parameters_are_a_clear_error():
    model = GCN(8, 4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 of optimizer 0 .* is on cpu.*CUDA device"):
        graphed_step(lambda: None, optimizer)


def test_cpu_argument_is_a_clear_error():
    step = graphed_step(lambda x, graph: None)
    with pytest.raises(ValueError, match=r"argument 'x' is on cpu; a CUDA graph captures CUDA work only"):
        step(torch.zeros(3), None)
    with pytest.raises(ValueError, match=r"argument 'x' is on cpu"):
        step(x=torch.zeros(3), graph=None)
    assert not step.captured


def test_tensors_inside_containers_are_refused():
    step = graphed_step(lambda xs: None)
    with pytest.raises(TypeError, match=r"argument 'xs' holds tensors inside a list"):
        step([torch.zeros(2)])


@pytest.mark.skipif(CUDA, reason="checks the message without a CUDA device")
def test_no_cuda_device_is_a_clear_error():
    step = graphed_step(lambda: None)
    with pytest.raises(RuntimeError, match=r"CUDA graphs need a CUDA device.*is_available\(\) is False"):
        step()


def test_bad_arguments():
    with pytest.raises(TypeError, match="fn must be callable"):
        graphed_step(3)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        graphed_step(lambda: None, optimizer="adam")
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        graphed_step(lambda: None, optimizer=[object()])
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="warmup must be an int >= 1"):
            graphed_step(lambda: None, warmup=bad)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="fuse_optimizer must be a bool"):
            graphed_step(lambda: None, fuse_optimizer=bad)


def _checked_step(optimizer):
    """A GraphedStep's optimizer checks alone, on the CPU (no capture): the state that
    ``_capture`` snapshots once the recording is made."""
    step = GraphedStep.__new__(GraphedStep)
    step.optimizers, step._name = (optimizer,), "train_step"
    step._snapshot_optimizers()
    return step


def test_replays_refuse_a_replaced_optimizer_state_or_a_changed_cpu_tensor_hyperparameter():
    """What a recording baked in is checked before every replay: ``load_state_dict``
    replaces the groups and the state (the replays would update the captured tensors), a
    CPU-tensor learning rate was read on the host (a change would be ignored), a number
    changed, a group added; a CUDA tensor learning rate is read at every replay, so it may
    change. Each refusal names what changed."""
    params = _params(torch.float32)
    lr = torch.tensor(0.01)
    opt = torch.optim.Adam(params, lr=lr)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    step = _checked_step(opt)
    step._check_optimizers()  # nothing changed
    opt.load_state_dict(opt.state_dict())
    with pytest.raises(RuntimeError, match=r"param groups or state were replaced after the step was captured"):
        step._check_optimizers()
    step = _checked_step(opt)
    lr = opt.param_groups[0]["lr"]  # load_state_dict's copy
    lr.fill_(0.005)
    with pytest.raises(RuntimeError, match=r"'lr', a CPU tensor, changed from 0.0099"):
        step._check_optimizers()
    lr.fill_(0.01)
    step._check_optimizers()
    opt.param_groups[0]["eps"] = 1e-6
    with pytest.raises(RuntimeError, match=r"'eps' changed from 1e-08 to 1e-06"):
        step._check_optimizers()
    opt.param_groups[0]["eps"] = 1e-8
    opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    with pytest.raises(RuntimeError, match=r"a param group was added"):
        step._check_optimizers()


def test_reset_prepares_a_reloaded_optimizer_again():
    """A state loaded after the capture may come from an optimizer that was never made
    capturable: ``reset()`` prepares the optimizers again before the next capture."""
    params = _params(torch.float32)
    opt = torch.optim.Adam(params, lr=0.01)
    plain = torch.optim.Adam(_params(torch.float32), lr=0.01)  # never capturable
    step = _checked_step(opt)
    step.fuse_optimizer = True
    step._prepare_optimizers()
    assert opt.param_groups[0]["capturable"] is True
    opt.load_state_dict(plain.state_dict())
    assert opt.param_groups[0]["capturable"] is False
    step.reset()
    assert opt.param_groups[0]["capturable"] is True and not step.captured


def _params(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(5, 3, dtype=dtype, generator=gen, requires_grad=True),
            torch.randn(7, dtype=dtype, generator=gen, requires_grad=True)]


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fused_implementation_is_torchs_update_through_its_fused_kernel(cls, monkeypatch):
    """graphed_step's optimizer switch, on the CPU (torch's fused Adam runs there too):
    groups that chose no implementation take the fused kernel -- its step counters,
    float64 here, become float32 -- and then step exactly like the multi-tensor update
    they replace (float64); the switch can come after steps were taken."""
    import sys

    from fusegnn.capture import _use_fused_implementation

    # the fused function this torch's class calls (AdamW is Adam's subclass in recent torch)
    name = "_fused_" + cls.__name__.lower()
    module = sys.modules[cls.__module__]
    if not hasattr(module, name):
        name, module = "_fused_adam", sys.modules[torch.optim.Adam.__module__]
    calls = []
    fused = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: (calls.append(1), fused(*a, **k))[1])
    ref_params, params = _params(), _params()
    ref, opt = cls(ref_params, lr=0.01, weight_decay=5e-4), cls(params, lr=0.01, weight_decay=5e-4)
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        if step == 2:
            for p in params:  # counters as a float64 default dtype would have made them
                opt.state[p]["step"] = opt.state[p]["step"].to(torch.float64)
            assert not _use_fused_implementation(opt)  # CPU parameters: only CUDA by default
            assert opt.param_groups[0]["fused"] is None
            assert _use_fused_implementation(opt, device_types=("cpu",))
            assert opt.param_groups[0]["fused"] is True
            assert all(opt.state[p]["step"].dtype == torch.float32 for p in params)
        for p, q in zip(ref_params, params):
            p.grad = torch.randn(p.shape, dtype=p.dtype, generator=gen)
            q.grad = p.grad.clone()
        ref.step()
        opt.step()
    assert len(calls) == 4
    for p, q in zip(ref_params, params):
        torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-14)


def test_fused_implementation_leaves_explicit_choices_alone():
    """A group with tensor ``betas``, or that set ``foreach`` / ``fused`` /
    ``differentiable``, integer parameters, other optimizers and subclasses of Adam keep
    what they were built with."""
    from fusegnn.capture import _use_fused_implementation

    class MyAdam(torch.optim.Adam):
        pass

    tensor_betas = (torch.tensor(0.9, dtype=torch.float64), torch.tensor(0.999, dtype=torch.float64))
    built = [
        torch.optim.Adam(_params(), betas=tensor_betas),  # the fused kernel would read them back
        torch.optim.Adam(_params(), foreach=True),
        torch.optim.Adam(_params(), foreach=False),
        torch.optim.Adam(_params(), fused=False),
        torch.optim.Adam(_params(), differentiable=True),
        torch.optim.SGD(_params(), lr=0.1),
        MyAdam(_params()),
    ]
    for opt in built:
        before = [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
        assert not _use_fused_implementation(opt, device_types=("cpu",))
        assert before == [dict((k, v) for k, v in g.items() if k != "params") for g in opt.param_groups]
    mixed = torch.optim.Adam([{"params": _params()}, {"params": [torch.zeros(3, dtype=torch.int64)]}])
    assert _use_fused_implementation(mixed, device_types=("cpu",))
    assert [g["fused"] for g in mixed.param_groups] == [True, None]


def test_decorator_form_keeps_the_function():
    @graphed_step(warmup=2)
    def train_step(x):
        """Docstring of the step."""

    assert isinstance(train_step, GraphedStep)
    assert train_step.__name__ == "train_step" and train_step.__doc__ == "Docstring of the step."
    assert train_step.warmup == 2 and train_step.optimizers == () and not train_step.captured
    assert train_step.graph is None
    assert repr(train_step) == "GraphedStep(test_decorator_form_keeps_the_function.<locals>.train_step, 0/2 warm-up calls done)"


def _raises_sync(x):
    return x.nonzero()  # a stand-in for the line that synchronises


def test_diagnosis_names_the_line_and_the_cause():
    """The message of a failed capture points at the innermost frame outside torch of
    the first error (the one raised when the capture ended comes second)."""
    from fusegnn.capture import _diagnose

    try:
        _raise_from_helper(RuntimeError("called a synchronizing CUDA operation"))
    except RuntimeError:
        try:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        except RuntimeError as outer:  # its __context__ is the first error
            error = _diagnose(outer, "train_step")
    assert isinstance(error, CaptureError)
    assert error.synchronised and error.function == "_raise_from_helper"
    assert error.filename.endswith("test_capture.py") and error.lineno > 0
    assert error.summary.startswith("host sync in _raise_from_helper() (test_capture.py:")
    assert error.location.endswith(f"test_capture.py:{error.lineno} in _raise_from_helper()")
    text = str(error)
    assert text.startswith("graphed_step(train_step): the step synchronises with the host while being captured at ")
    assert "`raise error`" in text  # the source line
    assert "boolean-mask indexing" in text
    assert "ending the capture: RuntimeError: CUDA error: operation failed" in text


def _raise_from_helper(error: RuntimeError) -> None:
    raise error


# ----------------------------------------------------------------------------- GPU helpers


def _data(seed: int = 0):
    """A learnable node-classification task on a random graph: labels from aggregated
    features, training on every second node."""
    from fusegnn.sparse import gcn_norm, spmm

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, FEAT, generator=gen)
    w = torch.randn(FEAT, CLASSES, generator=gen)
    graph = Graph(random_graph(N, E, seed=seed), N)
    y = spmm(gcn_norm(graph), x @ w, aggregation="reference").argmax(1)
    device = torch.device("cuda")
    return x.to(device), y.to(device), graph.to(device), torch.arange(0, N, 2, device=device)


def _model(kind: str, dropout: float, aggregation: str = "auto", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "gcn":
        model = GCN(FEAT, 16, CLASSES, dropout=dropout, aggregation=aggregation)
    else:
        model = GAT(FEAT, 8, CLASSES, heads=4, dropout=dropout, aggregation=aggregation)
    return model.cuda().train()


def _step(model, optimizer, x, y, graph, index):
    def train_step():
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x, graph).index_select(0, index), y.index_select(0, index))
        loss.backward()
        optimizer.step()
        return loss

    return train_step


# ----------------------------------------------------------------------------- GPU: training


@requires_cuda
@pytest.mark.parametrize("aggregation", ["auto", "gar"])
@pytest.mark.parametrize("kind", ["gcn", "gat"])
def test_replays_train_like_eager_steps(kind, aggregation):
    """Two eager steps with a standard Adam, then 10 more: eagerly on one model, through
    graphed_step (2 warm-up calls, the capture, 7 replays) on its twin. Same losses,
    same parameters, same Adam step counter."""
    x, y, graph, index = _data()
    eager, twin = _model(kind, 0.0, aggregation), _model(kind, 0.0, aggregation)
    opt_e = torch.optim.Adam(eager.parameters(), lr=0.01, weight_decay=5e-4)
    opt_t = torch.optim.Adam(twin.parameters(), lr=0.01, weight_decay=5e-4)
    step_e, step_t = _step(eager, opt_e, x, y, graph, index), _step(twin, opt_t, x, y, graph, index)
    for _ in range(2):  # state exists, with host step counters, before graphed_step
        step_e(), step_t()
    start = [p.detach().clone() for p in twin.parameters()]

    graphed = graphed_step(step_t, opt_t, warmup=2)
    assert all(group["capturable"] and group["fused"] for group in opt_t.param_groups)
    assert all(opt_t.state[p]["step"].is_cuda for p in twin.parameters())
    losses_e, losses_t, outputs = [], [], []
    for _ in range(10):
        losses_e.append(step_e().detach())
        out = graphed()
        outputs.append(out)
        losses_t.append(out.clone())
    assert graphed.captured
    assert all(out is outputs[2] for out in outputs[2:])  # static from the capture on
    torch.testing.assert_close(torch.stack(losses_t), torch.stack(losses_e), rtol=1e-4, atol=1e-6)
    for (name, p_e), p_t, p0 in zip(eager.named_parameters(), twin.parameters(), start):
        torch.testing.assert_close(p_t, p_e, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert (p_t - p0).abs().max() > 1e-3, f"{name} did not move"  # the replays trained
    for p_e, p_t in zip(eager.parameters(), twin.parameters()):
        assert float(opt_t.state[p_t]["step"]) == float(opt_e.state[p_e]["step"]) == 12.0
        assert p_t.grad is not None


@requires_cuda
@pytest.mark.parametrize("built, fuse, expect", [
    ({}, True, True), ({}, False, None), ({"foreach": True}, True, None), ({"fused": False}, True, False),
])
def test_fused_optimizer_switch_and_its_opt_outs(built, fuse, expect):
    """graphed_step switches an Adam that chose no implementation to the fused kernel,
    not one built with an explicit choice nor with ``fuse_optimizer=False``; each trains
    through replays like the same optimizer stepped eagerly."""
    x, y, graph, index = _data()
    eager, twin = _model("gcn", 0.0, "auto"), _model("gcn", 0.0, "auto")
    opt_e = torch.optim.Adam(eager.parameters(), lr=0.01, **({"fused": True} if expect else built))
    opt_t = torch.optim.Adam(twin.parameters(), lr=0.01, **built)
    step_e, step_t = _step(eager, opt_e, x, y, graph, index), _step(twin, opt_t, x, y, graph, index)
    graphed = graphed_step(step_t, opt_t, warmup=2, fuse_optimizer=fuse)
    assert [group["fused"] for group in opt_t.param_groups] == [expect]
    for _ in range(6):
        loss_e, loss_t = step_e().detach(), graphed().clone()
    assert graphed.captured
    torch.testing.assert_close(loss_t, loss_e, rtol=1e-4, atol=1e-6)
    for p_e, p_t in zip(eager.parameters(), twin.parameters()):
        torch.testing.assert_close(p_t, p_e, rtol=1e-4, atol=1e-5)


@requires_cuda
def test_small_fused_loss_head_is_warmed_up_on_the_captured_path(monkeypatch):
    """linear_cross_entropy's ``auto`` takes the reference for a small eager head and the
    fused path in a capture; graphed_step's warm-up steps (under for_capture) take the
    fused path too, so that the capture records kernels they already compiled and ran.
    The replays train like eager steps."""
    from fusegnn.losses import function, linear_cross_entropy

    taken = []

    def spy(*args, **kwargs):
        taken.append(pick(*args, **kwargs))
        return taken[-1]

    pick = function.pick_backend
    monkeypatch.setattr(function, "pick_backend", spy)
    x, y, _, index = _data(4)
    torch.manual_seed(0)
    eager = torch.nn.Linear(FEAT, CLASSES).cuda()
    twin = torch.nn.Linear(FEAT, CLASSES).cuda()
    twin.load_state_dict(eager.state_dict())
    opt_e = torch.optim.Adam(eager.parameters(), lr=0.01, capturable=True)
    opt_t = torch.optim.Adam(twin.parameters(), lr=0.01, capturable=True)

    def step(lin, opt):
        def train_step():
            opt.zero_grad(set_to_none=True)
            loss = linear_cross_entropy(x, lin.weight, y, lin.bias, index=index)
            loss.backward()
            opt.step()
            return loss
        return train_step

    step_e, graphed = step(eager, opt_e), graphed_step(step(twin, opt_t), opt_t, warmup=2)
    losses_e, losses_t = [], []
    for k in range(6):
        losses_e.append(step_e().detach())
        assert taken.pop() == "reference"  # eager: a small head
        losses_t.append(graphed().clone())
        if k < 3:  # two warm-up calls and the capture; the replays call nothing
            assert taken.pop() == "fused", k
        assert not taken
    assert graphed.captured
    torch.testing.assert_close(torch.stack(losses_t), torch.stack(losses_e), rtol=1e-4, atol=1e-6)
    for p_e, p_t in zip(eager.parameters(), twin.parameters()):
        torch.testing.assert_close(p_t, p_e, rtol=1e-4, atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("kind", ["gcn", "gat"])
def test_loss_falls_over_replays_with_dropout(kind):
    x, y, graph, index = _data(1)
    model = _model(kind, 0.5 if kind == "gcn" else 0.6)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    graphed = graphed_step(_step(model, optimizer, x, y, graph, index), optimizer)
    losses = torch.stack([graphed().clone() for _ in range(60)]).tolist()
    assert graphed.captured
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert last < 0.9 * first, losses


@requires_cuda
@pytest.mark.parametrize("which", ["torch-dropout", "fused-gat-dropout"])
def test_replays_draw_new_dropout_masks(which):
    """torch's dropout (GCN's features) and the fused GAT attention dropout (seed drawn on
    the device) give a new mask at every replay; for the attention, an unbiased one: the
    mean over replays approaches the output without dropout."""
    x, _, graph, _ = _data(2)
    if which == "torch-dropout":
        module = _model("gcn", 0.5)
    else:
        module = fusegnn.layers.GATConv(FEAT, 8, heads=4, dropout=0.5).cuda().train()
    graphed = graphed_step(lambda: module(x, graph), warmup=1)
    graphed()
    previous = graphed().clone()
    assert graphed.captured
    total = torch.zeros_like(previous, dtype=torch.float64)
    replays = 1600
    for _ in range(replays):
        out = graphed()
        assert not torch.equal(out, previous)
        total += out
        previous = out.clone()
    if which == "fused-gat-dropout":  # linear in the coefficients: the mean is unbiased
        module.eval()
        with torch.no_grad():
            expected = module(x, graph)
        err = (total / replays - expected).abs().mean() / expected.abs().mean()
        assert err < 0.06, float(err)


@requires_cuda
def test_new_inputs_are_copied_into_the_static_buffers():
    x, _, graph, _ = _data(3)
    model = _model("gcn", 0.0).eval()

    def forward(features, g):
        return model(features, g)

    graphed = graphed_step(forward, warmup=1)
    x1, x2 = x.clone(), torch.randn_like(x)
    keep1 = x1.clone()
    with torch.no_grad():
        expect1, expect2 = model(x1, graph), model(x2, graph)
    graphed(x1, graph)  # eager
    out = graphed(x1, graph)  # capture
    torch.testing.assert_close(out, expect1)
    assert graphed(x2, graph) is out
    torch.testing.assert_close(out, expect2)
    x2.mul_(2)  # in place: copied again
    with torch.no_grad():
        expect2b = model(x2, graph)
    torch.testing.assert_close(graphed(x2, graph), expect2b)
    torch.testing.assert_close(graphed(x1, graph), expect1)
    assert torch.equal(x1, keep1)  # the caller's tensors are never written

    with pytest.raises(ValueError, match=r"argument 'features' is \(10, 32\) float32 on cuda:0 but the step was captured with"):
        graphed(x1[:10], graph)
    other = Graph(graph.edge_index.clone(), N)
    with pytest.raises(ValueError, match="argument 'g' is not the object the step was captured with"):
        graphed(x1, other)
    with pytest.raises(ValueError, match="argument 'features' requires grad"):
        graphed(x1.clone().requires_grad_(), graph)
    with pytest.raises(TypeError, match="called with 1 positional arguments"):
        graphed(x1)
    with pytest.raises(TypeError, match=r"called with 0 positional arguments and keywords \['features', 'g'\]"):
        graphed(features=x1, g=graph)  # call it the way it was captured


# ----------------------------------------------------------------------------- GPU: errors


@requires_cuda
def test_a_host_sync_inside_the_step_is_a_clear_error():
    x, y, graph, index = _data(4)
    model = _model("gcn", 0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    mask = torch.zeros(N, dtype=torch.bool, device="cuda")
    mask[index] = True
    seen = []

    def with_item():
        loss = F.cross_entropy(model(x, graph).index_select(0, index), y.index_select(0, index))
        loss.backward()
        optimizer.step()
        seen.append(loss.item())  # reads the loss back: cannot be captured
        return loss

    def with_mask():
        loss = F.cross_entropy(model(x, graph)[mask], y[mask])  # boolean mask: data-dependent size
        loss.backward()
        optimizer.step()
        return loss

    for fn, code in ((with_item, "seen.append(loss.item())"), (with_mask, "model(x, graph)[mask]")):
        graphed = graphed_step(fn, optimizer, warmup=1)
        graphed()
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(CaptureError) as info:
            graphed()
        error = info.value
        assert error.synchronised and error.function == fn.__name__, str(error)
        assert error.filename.endswith("test_capture.py") and code in str(error)
        assert "synchronises with the host while being captured" in str(error)
        assert not graphed.captured
        for p, p0 in zip(model.parameters(), before):  # a failed capture ran nothing
            assert torch.equal(p, p0)
        assert torch.cuda.get_sync_debug_mode() == 0  # restored
        fn()  # eager training still works
        torch.cuda.synchronize()


@requires_cuda
def test_a_graph_built_inside_the_step_is_named():
    x, y, _, index = _data(5)
    edge_index = random_graph(N, E, seed=5, device="cuda")
    model = _model("gcn", 0.0)
    model.conv1.cached = model.conv2.cached = False

    def step():
        return model(x, Graph(edge_index, N)).sum()  # validates the ids: a host sync

    graphed = graphed_step(step, warmup=1)
    graphed()
    with pytest.raises(CaptureError, match=r"Likely cause: a fusegnn Graph is built or converted inside the step"):
        graphed()


def _set_lr(optimizer):
    optimizer.param_groups[0]["lr"] = 0.005


def _reload(optimizer):
    optimizer.load_state_dict(optimizer.state_dict())


@requires_cuda
@pytest.mark.parametrize("change, message", [
    (_set_lr, r"'lr' changed from 0.01 to 0.005 after the step was captured"),
    (_reload, r"param groups or state were replaced after the step was captured"),
])
def test_a_changed_optimizer_is_an_error_and_reset_captures_again(change, message):
    """A changed number, or ``load_state_dict`` (new groups and state: the replays would go
    on updating the captured tensors), after the capture: the next call refuses; after
    ``reset()`` the optimizer as it is now is captured and steps."""
    x, y, graph, index = _data(6)
    model = _model("gcn", 0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    graphed = graphed_step(_step(model, optimizer, x, y, graph, index), optimizer, warmup=1)
    graphed(), graphed()
    assert graphed.captured
    change(optimizer)
    with pytest.raises(RuntimeError, match=message):
        graphed()
    graphed.reset()
    assert not graphed.captured
    graphed(), graphed()
    assert graphed.captured
    first = next(model.parameters())
    before = float(optimizer.state[first]["step"])
    graphed()
    assert float(optimizer.state[first]["step"]) == before + 1


@requires_cuda
def test_every_graphed_step_shares_one_side_stream():
    """Steps of one device warm up and capture on one side stream: cuBLAS keeps a workspace
    per (handle, stream) for the rest of the process, so a stream per step would keep
    32 MiB a handle (Hopper) alive for every step ever captured."""
    x, y, graph, index = _data(8)
    steps = []
    for seed in (0, 1):
        model = _model("gcn", 0.0, seed=seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        graphed = graphed_step(_step(model, optimizer, x, y, graph, index), optimizer, warmup=1)
        graphed(), graphed()
        assert graphed.captured
        steps.append(graphed)
        if seed == 0:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert steps[0]._stream is steps[1]._stream
    # the second step's graph pool and parameters only: no new cuBLAS workspaces
    assert torch.cuda.memory_allocated() - before < 16 * 2**20


@requires_cuda
def test_a_tensor_learning_rate_is_read_at_every_replay():
    x, y, graph, index = _data(7)
    model = _model("gcn", 0.0)
    lr = torch.tensor(0.01, device="cuda")
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, capturable=True)
    graphed = graphed_step(_step(model, optimizer, x, y, graph, index), optimizer, warmup=1)
    graphed(), graphed()
    moved = [p.detach().clone() for p in model.parameters()]
    graphed()
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), moved))
    lr.fill_(0.0)  # what a scheduler does to a tensor lr
    frozen = [p.detach().clone() for p in model.parameters()]
    graphed(), graphed()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), frozen))


@requires_cuda
def test_an_optimizer_with_host_state_is_refused():
    x, y, graph, index = _data(8)
    model = _model("gcn", 0.0)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)
    graphed = graphed_step(_step(model, optimizer, x, y, graph, index), optimizer, warmup=1)
    graphed()
    with pytest.raises(CaptureError, match=r"Adagrad keeps its state 'step' on the host"):
        graphed()


@requires_cuda
def test_kernel_plans_are_never_built_during_a_raw_capture():
    """Without a warm-up, the first use of a graph would build its GAR segment plan (or
    the fused GAT chunk schedule) inside the capture: a clear error, not a broken graph."""
    from fusegnn.sparse import gat_attention, spmm

    edge_index = random_graph(N, E, seed=9, device="cuda")
    x = torch.randn(N, 8, device="cuda")
    for name, op in (
        ("GAR segment plan", lambda g: spmm(g, x, aggregation="gar")),
        ("chunk schedule", lambda g: gat_attention(
            g, x.view(N, 2, 4), x[:, :2].contiguous(), x[:, 2:4].contiguous(), aggregation="gar")),
    ):
        graph = Graph(edge_index, N)
        graph.csr, graph.csc  # the formats are there, the work lists are not
        capture = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match=name):
            with torch.cuda.graph(capture):
                op(graph)
        op(graph)  # eagerly: builds and caches it
        torch.cuda.synchronize()
