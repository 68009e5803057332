"""``fusegnn.losses.linear_cross_entropy`` under ``torch.compile(fullgraph=True)`` on every
backend, the fused (Triton) path included.

Under compilation the fused path is the custom op ``fusegnn::linear_cross_entropy`` (and
``fusegnn::linear_cross_entropy_backward`` for ``reduction="none"``,
:mod:`fusegnn.losses.library`). Checked against the same call eagerly, in value and in
every gradient: float64 and float32, odd class counts, ``index`` with repeats, ignored
rows (narrow target dtypes compared as int64), label smoothing, each reduction, partial
``requires_grad``, no grad, a second backward, autocast, rows all ignored, empty
``index``; one compiled frame whose graph holds the op once; the range checks still
raise; a double backward raises; ``torch.library.opcheck`` on both ops; a compiled GCN /
GAT loss (the models' fused head) trained for a few steps beside its eager twin.

On the CPU the kernels run through Triton's interpreter; on a CUDA machine every tensor
is a CUDA tensor and ``backend="fused"`` runs the Triton kernels themselves.
"""

from __future__ import annotations

import copy
import os

import torch

if not torch.cuda.is_available():  # the fused kernels run through Triton's CPU interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch._dynamo  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._dynamo.backends.registry import lookup_backend  # noqa: E402

pytest.importorskip("triton")

from fusegnn.losses import LinearCrossEntropy, function, linear_cross_entropy  # noqa: E402
from tests.test_compile import fresh_dynamo  # noqa: E402,F401  (autouse: Dynamo reset around every test)

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F64, F32 = torch.float64, torch.float32
OP = torch.ops.fusegnn.linear_cross_entropy.default
OP_TARGETS = (OP, torch.ops.fusegnn.linear_cross_entropy)  # Dynamo's graph holds the packet


def _data(n=10, k=6, c=5, dtype=F64, seed=0, target_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, k, generator=gen, dtype=dtype)
    w = torch.randn(c, k, generator=gen, dtype=dtype) * k ** -0.5
    b = torch.randn(c, generator=gen, dtype=dtype)
    y = torch.randint(0, c, (n,), generator=gen).to(target_dtype)
    return [t.to(DEVICE).requires_grad_() for t in (h, w, b)], y.to(DEVICE)


class _Recorder:
    """A Dynamo backend that keeps each captured graph and hands it to ``inner``."""

    def __init__(self, inner: str) -> None:
        self.inner, self.graphs = lookup_backend(inner), []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.inner(gm, example_inputs)

    def op_nodes(self) -> int:
        return sum(node.target in OP_TARGETS for gm in self.graphs for node in gm.graph.nodes)


def _grads(out, inputs, seed=123):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)
    return torch.autograd.grad((out * weights).sum(), inputs, allow_unused=True)


def _assert_matches(got, want, got_inputs, want_inputs, **tol):
    torch.testing.assert_close(got, want, equal_nan=True, **tol)
    for a, e in zip(_grads(got, got_inputs), _grads(want, want_inputs)):
        if e is None:
            assert a is None
        else:
            torch.testing.assert_close(a, e, **tol)


def _tolerance(dtype):
    return dict(rtol=1e-10, atol=1e-12) if dtype == F64 else dict(rtol=1e-5, atol=1e-6)


def _compile_and_compare(fn, args, inputs, dtype, backend="aot_eager", picked=None):
    """``fn(*args)`` compiled (fullgraph) against eager, twice (the second call reuses the
    frame); one frame; the graph holds ``fusegnn::linear_cross_entropy`` once where eager
    takes the fused path (``picked``), never elsewhere."""
    recorder = _Recorder(backend)
    compiled = torch.compile(fn, backend=recorder, fullgraph=True)
    for _ in range(2):
        _assert_matches(compiled(*args), fn(*args), inputs, inputs, **_tolerance(dtype))
    assert len(recorder.graphs) == 1
    if picked is not None:
        assert recorder.op_nodes() == (1 if picked == "fused" else 0)
    return compiled


CASES = [
    dict(reduction="mean"),
    dict(reduction="sum", label_smoothing=0.1, ignore_index=1),
    dict(reduction="none", index=[0, 2, 2, 5, 9, 9, 9], ignore_index=3, label_smoothing=0.2),
    dict(reduction="mean", index=[4, 4, 1, 8], ignore_index=200, target_dtype=torch.uint8, classes=7),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("dtype", (F64, F32))
@pytest.mark.parametrize("backend", ("reference", "fused", "auto"))
def test_compiled_loss_matches_eager(backend, dtype, case, monkeypatch):
    """Values and every gradient as eagerly, with ``aot_eager``; ``backend="auto"`` with
    the size thresholds at 0 takes the fused path on CUDA (the reference on the CPU)."""
    options = dict(CASES[case])
    classes = options.pop("classes", 5)
    (h, w, b), y = _data(c=classes, dtype=dtype, seed=case, target_dtype=options.pop("target_dtype", torch.int64))
    if "index" in options:
        options["index"] = torch.tensor(options["index"], device=DEVICE)
        y[options["index"][1]] = options["ignore_index"]  # an ignored row, counted twice
    elif "ignore_index" in options:
        y[2] = options["ignore_index"]
    if backend == "auto":
        monkeypatch.setattr(function, "FUSED_MIN_WORK", 0)
        monkeypatch.setattr(function, "FUSED_MIN_WORK_HEAD", 0)

    def loss(h, w, b, y):
        return linear_cross_entropy(h, w, y, b, backend=backend, **options)

    picked = function.pick_backend(backend, h, w, b, options.get("index"))
    assert picked == ("fused" if backend == "fused" or (backend == "auto" and DEVICE.type == "cuda") else "reference")
    _compile_and_compare(loss, (h, w, b, y), [h, w, b], dtype, picked=picked)


@pytest.mark.parametrize("reduction", ("mean", "none"))
@pytest.mark.parametrize("backend", ("reference", "fused"))
def test_compiled_loss_with_inductor(backend, reduction):
    """The default backend (Inductor) too: float32, an odd class count, repeats, an ignored row."""
    (h, w, b), y = _data(n=9, c=7, dtype=F32, seed=4)
    y[5] = -100
    index = torch.tensor([5, 0, 0, 8, 3], device=DEVICE)

    def loss(h, w, b, y):
        return linear_cross_entropy(h, w, y, b, index=index, reduction=reduction, label_smoothing=0.1,
                                    backend=backend)

    _compile_and_compare(loss, (h, w, b, y), [h, w, b], F32, backend="inductor", picked=backend)


@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_compiled_fused_loss_partial_requires_grad_and_no_grad(reduction):
    """Only the gradients asked for are computed (the op's ``want_*`` follow
    ``requires_grad``: Dynamo guards on it, a change recompiles); no bias; under
    ``torch.no_grad`` the value alone."""
    (h, w, _), y = _data(seed=2)
    h.requires_grad_(False)

    def loss(h, w, y):
        return linear_cross_entropy(h, w, y, reduction=reduction, backend="fused")

    compiled = _compile_and_compare(loss, (h, w, y), [w], F64, picked="fused")
    (wg,) = torch.autograd.grad(compiled(h, w, y).sum(), [w])
    torch.testing.assert_close(wg, torch.autograd.grad(loss(h, w, y).sum(), [w])[0], **_tolerance(F64))
    with torch.no_grad():
        out = compiled(h, w, y)
    assert not out.requires_grad
    torch.testing.assert_close(out, loss(h, w, y).detach(), **_tolerance(F64))


@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_compiled_fused_loss_second_backward_with_retain_graph(reduction):
    """``backward(retain_graph=True)`` twice adds the gradients twice, as eagerly."""
    (h, w, b), y = _data(seed=3)
    compiled = torch.compile(lambda *a: linear_cross_entropy(*a, reduction=reduction, backend="fused"),
                             backend="aot_eager", fullgraph=True)
    got = compiled(h, w, y, b).sum()
    for _ in range(2):
        got.backward(retain_graph=True)
    got_grads = [t.grad.clone() for t in (h, w, b)]
    for t in (h, w, b):
        t.grad = None
    want = linear_cross_entropy(h, w, y, b, reduction=reduction, backend="fused").sum()
    for _ in range(2):
        want.backward(retain_graph=True)
    for a, t in zip(got_grads, (h, w, b)):
        torch.testing.assert_close(a, t.grad, **_tolerance(F64))


@pytest.mark.parametrize("rows", ("all ignored", "empty index"))
def test_compiled_fused_mean_over_no_rows_is_nan_with_zero_gradients(rows):
    """As ``F.cross_entropy``: ``mean`` over no counted row is NaN, its gradients zero."""
    (h, w, b), y = _data(seed=5)
    index = torch.tensor([1, 3, 3], device=DEVICE)
    if rows == "all ignored":
        y[index] = -100
    else:
        index = index[:0]

    def loss(h, w, b, y):
        return linear_cross_entropy(h, w, y, b, index=index, backend="fused")

    _compile_and_compare(loss, (h, w, b, y), [h, w, b], F64, picked="fused")
    got = torch.compile(loss, backend="aot_eager", fullgraph=True)(h, w, b, y)
    assert got.isnan()
    for g in torch.autograd.grad(got, (h, w, b)):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on CUDA a failed torch._assert_async is a device-side "
                    "assert, which ends the process's CUDA context (and CPU tensors need the interpreter)")
def test_compiled_fused_loss_still_checks_ranges():
    """The in-graph assertions of the class ids and ``index`` on the fused path."""
    (h, w, b), y = _data(seed=6)
    index = torch.tensor([0, 2, 2], device=DEVICE)
    compiled = torch.compile(lambda h, w, b, y, i: linear_cross_entropy(h, w, y, b, index=i, backend="fused"),
                             backend="aot_eager", fullgraph=True)
    compiled(h, w, b, y, index)
    bad = y.clone()
    bad[2] = 5
    with pytest.raises(RuntimeError, match=r"class id outside \[0, 5\)"):
        compiled(h, w, b, bad, index)
    with pytest.raises(RuntimeError, match=r"rows outside \[0, 10\)"):
        compiled(h, w, b, y, torch.tensor([0, 10], device=DEVICE))


@pytest.mark.parametrize("backend", ("aot_eager", "eager"))
def test_compiled_fused_loss_is_differentiable_once(backend):
    """Differentiating the gradients again raises, never a silently constant gradient:
    AOTAutograd's refusal of a double backward (torch 2.13), or its gradient without a
    graph (torch 2.11, which then refuses the backward of a tensor that does not require
    grad), and without AOTAutograd the fused path's own (``differentiable_once``)."""
    (h, w, b), y = _data(seed=7)
    compiled = torch.compile(lambda *a: linear_cross_entropy(*a, backend="fused"), backend=backend, fullgraph=True)
    (gh,) = torch.autograd.grad(compiled(h, w, y, b), [h], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward|differentiable once|does not require grad"):
        gh.square().sum().backward()


def test_compiled_fused_loss_under_autocast():
    """Autocast's casts as eagerly: a half-precision ``h`` meets float32 parameters, the loss is float32."""
    half = torch.bfloat16 if DEVICE.type == "cpu" else torch.float16
    (h, w, b), y = _data(n=12, k=8, c=6, dtype=F32, seed=8)
    y[3] = -100
    h = h.detach().to(half).requires_grad_()

    def loss(h, w, b, y):
        with torch.autocast(DEVICE.type, dtype=half):
            return linear_cross_entropy(h, w, y, b, label_smoothing=0.1, backend="fused")

    got = torch.compile(loss, backend="aot_eager", fullgraph=True)(h, w, b, y)
    want = loss(h, w, b, y)
    assert got.dtype == want.dtype == torch.float32
    _assert_matches(got, want, [h, w, b], [h, w, b], rtol=1e-3, atol=1e-3)


def _force_fused(monkeypatch):
    """``backend="auto"`` takes the fused path (on the CPU and for small heads it takes the reference)."""
    real_pick = function.pick_backend
    monkeypatch.setattr(function, "pick_backend",
                        lambda backend, *a, **k: real_pick("fused" if backend == "auto" else backend, *a, **k))


def test_compiled_module(monkeypatch):
    """``LinearCrossEntropy`` compiles whole (fullgraph) on the fused path."""
    _force_fused(monkeypatch)
    torch.manual_seed(0)
    head = LinearCrossEntropy(6, 5, reduction="sum", label_smoothing=0.1).double().to(DEVICE)
    (h, _, _), y = _data(seed=9)
    recorder = _Recorder("aot_eager")
    compiled = torch.compile(head, backend=recorder, fullgraph=True)
    params = [h, head.weight, head.bias]
    _assert_matches(compiled(h, y), head(h, y), params, params, **_tolerance(F64))
    assert len(recorder.graphs) == 1 and recorder.op_nodes() == 1


def test_opcheck_both_ops():
    """``torch.library.opcheck``: schemas, fake tensors, autograd registration, AOT dispatch."""
    (h, w, b), y = _data(n=7, c=5, seed=10)
    index = torch.tensor([1, 1, 6], device=DEVICE)
    for reduction in ("mean", "none"):
        args = (h, w, b, y, index, -100, reduction, 0.1, None, True, True, True)
        result = torch.library.opcheck(OP, args)
        assert all(v == "SUCCESS" for v in result.values()), (reduction, result)
    grad = torch.randn(3, dtype=F64, device=DEVICE)
    args = (grad, h.detach(), w.detach(), b.detach(), y, index, -100, 0.1, None, True, False, True)
    result = torch.library.opcheck(torch.ops.fusegnn.linear_cross_entropy_backward.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("model_name", ("gcn", "gat"))
def test_compiled_model_loss_with_the_fused_head_trains_like_eager(model_name, monkeypatch):
    """``model.loss`` of a GCN / GAT whose output layer is the fused head (``auto``
    forced to ``fused``), compiled with fullgraph, its backward and an SGD step, for three
    steps beside the same steps eagerly: losses and parameters agree; one frame."""
    from fusegnn.models import GAT, GCN
    from tests.graphs import random_graph

    _force_fused(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(24, 6, dtype=F64, device=DEVICE)
    graph = random_graph(24, 80, 1, hub_degree=8).to(DEVICE)
    y = torch.randint(0, 12, (24,), device=DEVICE)
    y[3] = -100
    index = torch.tensor([0, 3, 3, 5, 23, 5, 9], device=DEVICE)
    model = (GCN(6, 4, 12, dropout=0.0) if model_name == "gcn"
             else GAT(6, 2, 12, heads=2, out_heads=2, dropout=0.0)).double().to(DEVICE)
    twin = copy.deepcopy(model)
    recorder = _Recorder("aot_eager")
    compiled_loss = torch.compile(model.loss, backend=recorder, fullgraph=True)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.5)
    opt_e = torch.optim.SGD(twin.parameters(), lr=0.5)
    for _ in range(3):
        got = compiled_loss(x, graph, y, index, label_smoothing=0.1)
        want = twin.loss(x, graph, y, index, label_smoothing=0.1)
        torch.testing.assert_close(got, want, **_tolerance(F64))
        for opt, value in ((opt_c, got), (opt_e, want)):
            opt.zero_grad()
            value.backward()
            opt.step()
    assert len(recorder.graphs) == 1 and recorder.op_nodes() == 1
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, **_tolerance(F64))
    # and the same loss as F.cross_entropy of the model's logits
    torch.testing.assert_close(
        twin.loss(x, graph, y, index), F.cross_entropy(twin(x, graph)[index], y[index]), **_tolerance(F64))
