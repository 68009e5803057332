"""``fusegnn.losses.linear_cross_entropy`` against PyTorch's own semantics, case by case.

The contract: ``linear_cross_entropy(h, W, y, b, index=i, ...)`` equals
``F.cross_entropy(F.linear(h[i], W, b), y[i], ...)`` in value and in every gradient, on
the fused path (``backend="fused"``: Triton kernels, run by the interpreter on the CPU)
and on the reference (``"reference"`` / ``"auto"``), for what a demanding user passes:
narrow target dtypes, ``ignore_index`` inside the class range with label smoothing, rows
all ignored, repeated / empty / int32 indices, strided and tied parameters, partial
``requires_grad``, a second backward, half precision, and the GCN / GAT fused head.
Where fusegnn differs on purpose (more target dtypes than ``F.cross_entropy``; no second
derivative on the fused path), the docstring says so and the test asserts that.

Everything compares in float64 on tiny shapes (the interpreter is slow), through the
fused path's two paths where it matters (``head``: logits on chip; ``wide``: GEMM chunks
and the row kernel, forced through ``HEAD_MAX_CLASSES = 0``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from fusegnn.kernels import linear_cross_entropy as kernels  # noqa: E402
from fusegnn.losses import linear_cross_entropy  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F64 = torch.float64


@pytest.fixture(params=("head", "wide"))
def path(request, monkeypatch):
    """The fused path's two paths: logits on chip (``head``) or GEMM chunks (``wide``)."""
    monkeypatch.setattr(kernels, "HEAD_MAX_CLASSES", 512 if request.param == "head" else 0)
    return request.param


def _data(n=8, k=4, c=5, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, k, generator=gen, dtype=F64).to(DEVICE)
    w = (torch.randn(c, k, generator=gen, dtype=F64) * k ** -0.5).to(DEVICE)
    b = torch.randn(c, generator=gen, dtype=F64).to(DEVICE) if bias else None
    y = torch.randint(0, c, (n,), generator=gen).to(DEVICE)
    return h, w, b, y


def _torch(h, w, b, y, index=None, **kw):
    """PyTorch's definition: ``F.cross_entropy(F.linear(h[index], W, b), y[index], ...)``."""
    if index is not None:
        h, y = h[index], y[index]
    return F.cross_entropy(F.linear(h, w, b), y, **kw)


def _same(got_fn, want_fn, tensors, *, seed=1, rtol=1e-10, atol=1e-12):
    """``got_fn(*leaves)`` against ``want_fn(*leaves)`` on fresh leaf copies of ``tensors``
    (``None`` passes through; a tensor that does not require grad stays so): the values and
    the gradients under a random incoming gradient (non-uniform for ``reduction="none"``)."""
    def leaves():
        return [None if t is None else t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]

    mine, ref = leaves(), leaves()
    got, want = got_fn(*mine), want_fn(*ref)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed), dtype=F64).to(DEVICE, want.dtype)
    pairs = [(a, e) for a, e in zip(mine, ref) if a is not None and a.requires_grad]
    if pairs:
        g_got = torch.autograd.grad(got, [a for a, _ in pairs], grad)
        g_want = torch.autograd.grad(want, [e for _, e in pairs], grad)
        for a, e in zip(g_got, g_want):
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol)
    return got


def _grad(*tensors):
    return [None if t is None else t.requires_grad_() for t in tensors]


# ----------------------------------------------------------------------------- target dtypes


def test_narrow_targets_compare_with_ignore_index_as_int64(path):
    """``ignore_index`` is compared with the class ids as int64 (F.cross_entropy's and the
    kernels' comparison). A uint8 target of 156 with the default ``ignore_index=-100`` is
    class 156 (torch would cast -100 to uint8, i.e. 156, if compared in the target's
    dtype: the fused ``mean`` then divided by one row fewer than it summed)."""
    h, w, b, _ = _data(n=4, k=3, c=160)
    y = torch.tensor([156, 1, 2, 3], dtype=torch.uint8, device=DEVICE)  # F.cross_entropy takes uint8
    for reduction in ("mean", "sum"):
        _same(lambda h_, w_, b_: linear_cross_entropy(h_, w_, y, b_, reduction=reduction, backend="fused"),
              lambda h_, w_, b_: _torch(h_, w_, b_, y, reduction=reduction), _grad(h, w, b))
    # with label smoothing F.cross_entropy itself compares a uint8 target in uint8 (-100 reads
    # as 156): every backend widens the ids first, so reference, auto and fused agree
    want = _torch(h.double(), w.double(), b.double(), y.long(), label_smoothing=0.1)
    for backend in ("reference", "auto", "fused"):
        got = linear_cross_entropy(h, w, y, b, label_smoothing=0.1, backend=backend)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6, msg=backend)
    # an int8 -100 is no longer taken for ignore_index=156 (which it equals modulo 256):
    # class id -100 is out of range, as F.cross_entropy says (not a read outside W)
    h, w, b, _ = _data(n=4, k=3, c=5)
    y8 = torch.tensor([-100, 1, 2, 3], dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match="class id -100"):
        linear_cross_entropy(h, w, y8, b, ignore_index=156, backend="fused")
    with pytest.raises(ValueError, match="class id 7"):  # 2**32 + 7 is not 7
        linear_cross_entropy(h, w, torch.tensor([7, 1, 2, 3], dtype=torch.int32, device=DEVICE), b,
                             ignore_index=2**32 + 7, backend="fused")


@pytest.mark.parametrize("dtype", (torch.int32, torch.int16, torch.int8, torch.uint8))
def test_every_integer_target_dtype_on_every_backend(dtype):
    """The fused path takes int32 / int16 / int8 / uint8 class ids; so do the reference and
    ``auto`` (documented: ``F.cross_entropy`` itself refuses all but int64 and uint8, and
    the reference passed them to it, so a loss that ran fused failed on the CPU)."""
    h, w, b, y = _data()
    y = y.to(dtype)
    y[2] = 0 if dtype == torch.uint8 else -100  # an ignored row where the dtype holds -100
    for backend in ("fused", "reference", "auto"):
        _same(lambda h_, w_, b_: linear_cross_entropy(h_, w_, y, b_, label_smoothing=0.1, backend=backend),
              lambda h_, w_, b_: _torch(h_, w_, b_, y.long(), label_smoothing=0.1), _grad(h, w, b))
    assert "int32, int16, int8 and uint8" in linear_cross_entropy.__doc__


def test_model_loss_takes_int32_targets_on_the_logits_path_too():
    """``model.loss`` without a fused head (hidden width >= classes) takes the class ids the
    fused head takes (it passed an int32 target to ``F.cross_entropy``, which refused it)."""
    from fusegnn.models import GCN
    from tests.graphs import random_graph

    torch.manual_seed(0)
    x = torch.randn(20, 6, dtype=F64, device=DEVICE)
    graph = random_graph(20, 60, 0).to(DEVICE)
    y = torch.randint(0, 4, (20,), device=DEVICE)
    index = torch.tensor([0, 3, 3, 19], device=DEVICE)
    model = GCN(6, 8, 4).double().to(DEVICE).eval()
    assert model.head_inputs(x, graph) is None
    want = F.cross_entropy(model(x, graph)[index], y[index])
    torch.testing.assert_close(model.loss(x, graph, y.to(torch.int32), index), want)


# ----------------------------------------------------------------------------- autograd


def test_second_derivative_raises_on_the_fused_path_and_matches_on_the_reference():
    """A gradient penalty ``loss + |dL/dh|^2`` through ``create_graph=True``: the reference
    gives PyTorch's gradients; the fused path (documented: differentiable once) raises
    rather than dropping the penalty's gradient (its gradients had no graph, so the
    penalty was silently a constant: W's gradient was the loss's alone)."""
    h, w, b, y = _data()

    def penalised(backend):
        def fn(h_, w_, b_):
            loss = linear_cross_entropy(h_, w_, y, b_, backend=backend) if backend else _torch(h_, w_, b_, y)
            (g,) = torch.autograd.grad(loss, h_, create_graph=True)
            return loss + g.pow(2).sum()
        return fn

    _same(penalised("reference"), penalised(None), _grad(h, w, b))
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    with pytest.raises(RuntimeError, match="differentiable once"):
        penalised("fused")(*leaves).backward()
    assert "differentiable once" in linear_cross_entropy.__doc__


@pytest.mark.parametrize("reduction", ("mean", "none"))
def test_retain_graph_second_backward(path, reduction):
    """``backward(retain_graph=True)`` twice accumulates the same gradients twice (the
    second backward of ``mean`` recomputes what the first one handed over)."""
    h, w, b, y = _data()
    y[1] = -100
    grads = []
    for backend in ("fused", None):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        loss = (linear_cross_entropy(*leaves[:2], y, leaves[2], reduction=reduction, backend=backend) if backend
                else _torch(*leaves[:2], leaves[2], y, reduction=reduction))
        g = torch.linspace(0.5, 2.0, loss.numel(), dtype=F64, device=DEVICE).reshape(loss.shape)
        loss.backward(g, retain_graph=True)
        once = [t.grad.clone() for t in leaves]
        loss.backward(g)
        for t, o in zip(leaves, once):
            torch.testing.assert_close(t.grad, 2 * o, rtol=1e-12, atol=1e-14)
        grads.append(once)
    for a, e in zip(*grads):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- ignore_index, smoothing, rows


@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
@pytest.mark.parametrize("ignore_index", (-100, 0, 3))
def test_ignore_index_with_label_smoothing(path, reduction, ignore_index):
    """Ignored rows leave the smoothing term too (F.cross_entropy); ``ignore_index`` may be
    a class id inside the range (0, 3), whose rows then count for nothing."""
    h, w, b, y = _data(seed=ignore_index % 7)
    y[[1, 5]] = ignore_index
    y[6] = 3 if ignore_index != 3 else 2
    index = torch.tensor([1, 6, 6, 0, 5, 7], dtype=torch.int32, device=DEVICE)
    for idx in (None, index):
        _same(lambda h_, w_, b_: linear_cross_entropy(h_, w_, y, b_, index=idx, ignore_index=ignore_index,
                                                      reduction=reduction, label_smoothing=0.2, backend="fused"),
              lambda h_, w_, b_: _torch(h_, w_, b_, y, None if idx is None else idx.long(), ignore_index=ignore_index,
                                        reduction=reduction, label_smoothing=0.2), _grad(h, w, b))


@pytest.mark.parametrize("backend", ("fused", "reference"))
def test_no_counted_row_is_nan_for_mean_as_documented(backend):
    """Every row ignored, an empty ``index`` and a 0-row ``h``: ``mean`` is NaN (0 / 0) as in
    F.cross_entropy, with zero gradients; ``sum`` is 0 and ``none`` is zeros / empty."""
    h, w, b, y = _data(n=5)
    cases = [(h, y.new_full((5,), -100), None),
             (h, y, torch.empty(0, dtype=torch.int64, device=DEVICE)),
             (h[:0], y[:0], None)]
    for rows, labels, index in cases:
        for reduction in ("mean", "sum", "none"):
            got = _same(lambda h_, w_, b_: linear_cross_entropy(h_, w_, labels, b_, index=index, reduction=reduction,
                                                                label_smoothing=0.1, backend=backend),
                        lambda h_, w_, b_: _torch(h_, w_, b_, labels, index, reduction=reduction, label_smoothing=0.1),
                        _grad(rows, w, b))
            if reduction == "mean":
                assert torch.isnan(got)
            else:
                assert bool((got == 0).all())
    assert "every row ignored, ``mean`` is NaN" in linear_cross_entropy.__doc__


def test_index_with_repeats_and_int32_and_reduction_none(path):
    """``index`` rows count once per occurrence, int32 as int64, and ``none`` returns them
    in ``index``'s order, under a non-uniform incoming gradient."""
    h, w, b, y = _data(n=7)
    index = torch.tensor([6, 2, 2, 0, 6, 6], dtype=torch.int32, device=DEVICE)
    for reduction in ("mean", "none"):
        _same(lambda h_, w_, b_: linear_cross_entropy(h_, w_, y, b_, index=index, reduction=reduction,
                                                      backend="fused"),
              lambda h_, w_, b_: _torch(h_, w_, b_, y, index.long(), reduction=reduction), _grad(h, w, b))


# ----------------------------------------------------------------------------- layouts and requires_grad


@pytest.mark.parametrize("reduction", ("mean", "none"))
def test_strided_views_and_no_bias(path, reduction):
    """Transposed and sliced views of ``h`` and ``W`` (and no bias) give the same values and
    gradients as their contiguous copies in PyTorch."""
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(10, 9, generator=gen, dtype=F64).to(DEVICE)
    y = torch.randint(0, 5, (8,), generator=gen).to(DEVICE)

    def views(x):
        return x[1:9, ::2], x[:5, 4:].t(), x[9, :5]

    # h: rows 1..8, even columns (5); W: a transposed 5 x 5 block; b: a row slice -- one leaf behind all three
    _same(lambda x: linear_cross_entropy(*views(x)[:2], y, views(x)[2], reduction=reduction, backend="fused"),
          lambda x: _torch(*views(x), y, reduction=reduction), _grad(base))
    _same(lambda ht, wt: linear_cross_entropy(ht.t(), wt.t(), y, reduction=reduction, backend="fused"),
          lambda ht, wt: _torch(ht.t(), wt.t(), None, y, reduction=reduction),
          _grad(base[:5, :8].clone(), base[:5, 1:6].clone()))


def test_weight_tied_to_an_embedding(path):
    """``h = E[ids]`` and ``W = E`` (a tied output embedding): one leaf, both gradients summed."""
    gen = torch.Generator().manual_seed(2)
    emb = torch.randn(5, 4, generator=gen, dtype=F64).to(DEVICE)
    ids = torch.tensor([0, 3, 2, 2, 1, 4, 0, 1], device=DEVICE)
    y = torch.tensor([1, 1, 0, 4, 2, 3, 0, 2], device=DEVICE)
    index = torch.tensor([1, 1, 7, 0], device=DEVICE)
    _same(lambda e: linear_cross_entropy(e[ids], e, y, index=index, backend="fused"),
          lambda e: _torch(e[ids], e, None, y, index), _grad(emb))


def test_only_some_inputs_require_grad(path):
    """``h`` without grad (a frozen encoder), ``W`` / ``b`` without grad (a frozen head), and
    the bias alone: the gradients asked for, as PyTorch's."""
    h, w, b, y = _data()
    for needs in ((False, True, True), (True, False, False), (False, False, True), (False, False, False)):
        tensors = [t.clone().requires_grad_(n) for t, n in zip((h, w, b), needs)]
        _same(lambda h_, w_, b_: linear_cross_entropy(h_, w_, y, b_, label_smoothing=0.1, backend="fused"),
              lambda h_, w_, b_: _torch(h_, w_, b_, y, label_smoothing=0.1), tensors)


def test_inputs_are_never_modified(path):
    """After forward and two backwards (retain_graph), every input is bitwise unchanged,
    narrow targets and int32 indices included."""
    h, w, b, y = _data()
    y = y.to(torch.int32)
    y[0] = -100
    index = torch.tensor([0, 4, 4, 2], dtype=torch.int32, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    before = [t.detach().clone() for t in leaves] + [y.clone(), index.clone()]
    for reduction in ("mean", "none"):
        loss = linear_cross_entropy(*leaves[:2], y, leaves[2], index=index, reduction=reduction,
                                    label_smoothing=0.1, backend="fused")
        loss.sum().backward(retain_graph=True)
        loss.sum().backward()
    for a, e in zip([t.detach() for t in leaves] + [y, index], before):
        assert torch.equal(a, e)


# ----------------------------------------------------------------------------- grad modes, shapes, precision


@pytest.mark.parametrize("backend", ("fused", "reference"))
def test_no_grad_and_inference_mode(backend):
    h, w, b, y = _data()
    want = _torch(h, w, b, y, label_smoothing=0.1)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            got = linear_cross_entropy(*leaves[:2], y, leaves[2], label_smoothing=0.1, backend=backend)
        assert not got.requires_grad
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_three_dimensional_h_is_refused_clearly():
    """``F.cross_entropy(F.linear(h[B, T, K]), y[B, T])`` reads dim 1 as the classes (an
    error or a wrong loss); fusegnn takes ``[N, K]`` rows only and says how to flatten."""
    h, w, b, y = _data(n=6)
    with pytest.raises(ValueError, match=r"h must be 2-D.*flatten"):
        linear_cross_entropy(h.reshape(2, 3, 4), w, y.reshape(2, 3), b)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_half_precision_as_close_as_pytorchs_own(path, dtype):
    """Half-precision inputs (float32 accumulation): the loss and gradients are no further
    from the float64 ones than PyTorch's own half-precision loss is (plus one rounding)."""
    h, w, b, y = _data(n=16, k=8, c=11, seed=3)
    y[4] = -100
    exact = [t.to(dtype).double().requires_grad_() for t in (h, w, b)]
    mine = [t.to(dtype).requires_grad_() for t in (h, w, b)]
    theirs = [t.to(dtype).requires_grad_() for t in (h, w, b)]
    want = _torch(*exact[:2], exact[2], y, label_smoothing=0.1)
    got = linear_cross_entropy(*mine[:2], y, mine[2], label_smoothing=0.1, backend="fused")
    eager = _torch(*theirs[:2], theirs[2], y, label_smoothing=0.1)
    assert got.dtype == eager.dtype == dtype
    ulp = torch.finfo(dtype).eps
    for a, e, ref in zip([got] + list(torch.autograd.grad(got, mine)), [eager] + list(torch.autograd.grad(eager, theirs)),
                         [want] + list(torch.autograd.grad(want, exact))):
        scale = ref.abs().max().item()
        assert (a.double() - ref).abs().max().item() <= (e.double() - ref).abs().max().item() + 2 * ulp * scale


def test_index_forms_that_h_index_takes_but_the_loss_refuses_clearly():
    """``h[index]`` also takes a boolean mask and negative rows; the loss refuses both with
    an error that says what to pass (documented)."""
    h, w, b, y = _data(n=6)
    mask = torch.tensor([True, False, True, False, True, True], device=DEVICE)
    with pytest.raises(TypeError, match=r"boolean mask.*nonzero"):
        linear_cross_entropy(h, w, y, b, index=mask)
    with pytest.raises(IndexError, match="negative row is not counted from the end"):
        linear_cross_entropy(h, w, y, b, index=torch.tensor([0, -1], device=DEVICE))
    torch.testing.assert_close(linear_cross_entropy(h, w, y, b, index=mask.nonzero().squeeze(1)),
                               _torch(h, w, b, y, mask))
    assert "a boolean mask is refused" in linear_cross_entropy.__doc__


# ----------------------------------------------------------------------------- options


def test_numpy_scalar_options_as_f_cross_entropy_takes_them():
    """``F.cross_entropy`` takes NumPy integers for ``ignore_index`` and NumPy floats for
    ``label_smoothing`` (a config read with NumPy); so do the function and the module (they
    raised TypeError). An ``ignore_index`` beyond int64 is a clear ValueError."""
    np = pytest.importorskip("numpy")
    h, w, b, y = _data()
    y[3] = 2
    want = _torch(h, w, b, y, ignore_index=2, label_smoothing=0.25)
    for backend in ("fused", "reference"):
        got = linear_cross_entropy(h, w, y, b, ignore_index=np.int64(2), label_smoothing=np.float32(0.25),
                                   backend=backend)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    from fusegnn.losses import LinearCrossEntropy

    head = LinearCrossEntropy(4, 5, ignore_index=np.int32(2), label_smoothing=np.float64(0.25)).double().to(DEVICE)
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.copy_(b)
    torch.testing.assert_close(head(h, y), want, rtol=1e-10, atol=1e-12)
    assert type(head.ignore_index) is int
    with pytest.raises(ValueError, match="ignore_index must fit int64"):
        linear_cross_entropy(h, w, y, b, ignore_index=2**70)
    with pytest.raises(TypeError, match="LinearCrossEntropy: ignore_index must be an int"):
        LinearCrossEntropy(4, 5, ignore_index=1.5)


def test_module_state_dict_is_nn_linears_and_repr_names_every_option():
    """``LinearCrossEntropy`` loads an ``nn.Linear``'s state dict (same keys, same layout) and
    then equals ``F.cross_entropy`` of that layer's logits; its repr names every option,
    ``ignore_index`` included (it was missing)."""
    from fusegnn.losses import LinearCrossEntropy

    h, _, _, y = _data()
    y[2] = 3
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 5).double().to(DEVICE)
    head = LinearCrossEntropy(4, 5, ignore_index=3, reduction="sum", label_smoothing=0.1).double().to(DEVICE)
    assert list(head.state_dict()) == list(linear.state_dict())
    head.load_state_dict(linear.state_dict())
    torch.testing.assert_close(head(h, y), F.cross_entropy(linear(h), y, ignore_index=3, reduction="sum",
                                                           label_smoothing=0.1), rtol=1e-10, atol=1e-12)
    assert "ignore_index=3, reduction='sum', label_smoothing=0.1" in repr(head)


# ----------------------------------------------------------------------------- the GNN models' fused head


@pytest.mark.parametrize("model_name", ("gcn", "gat"))
def test_model_loss_fused_head_matches_logits_and_cross_entropy(path, model_name, monkeypatch):
    """``model.loss(x, graph, y, train_index)`` through the fused kernels (``auto`` forced to
    ``fused``: on the CPU it takes the reference) equals ``F.cross_entropy`` of the model's
    logits at ``train_index`` -- int32, with repeats, ignored rows, ``ignore_index`` inside
    the class range and label smoothing -- in value and in every parameter's gradient."""
    from fusegnn.losses import function
    from fusegnn.models import GAT, GCN
    from tests.graphs import random_graph

    picked = []
    real_pick = function.pick_backend

    def fused_pick(backend, *args, **kwargs):
        picked.append(real_pick("fused" if backend == "auto" else backend, *args, **kwargs))
        return picked[-1]

    monkeypatch.setattr(function, "pick_backend", fused_pick)
    torch.manual_seed(0)
    x = torch.randn(24, 6, dtype=F64, device=DEVICE)
    graph = random_graph(24, 80, 1, hub_degree=8).to(DEVICE)
    y = torch.randint(0, 12, (24,), device=DEVICE)
    y[[3, 9]] = 4
    index = torch.tensor([0, 3, 3, 5, 23, 5, 5, 9], dtype=torch.int32, device=DEVICE)
    model = (GCN(6, 4, 12) if model_name == "gcn" else GAT(6, 2, 12, heads=2, out_heads=2)).double().to(DEVICE).eval()
    params = list(model.parameters())
    for ignore_index, smoothing in ((-100, 0.0), (4, 0.2)):
        loss = model.loss(x, graph, y, index, ignore_index=ignore_index, label_smoothing=smoothing)
        assert picked[-1] == "fused"
        want = F.cross_entropy(model(x, graph)[index.long()], y[index.long()], ignore_index=ignore_index,
                               label_smoothing=smoothing)
        torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
        for a, e in zip(torch.autograd.grad(loss, params), torch.autograd.grad(want, params)):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ("fused", "reference"))
def test_autocast_mixed_precision_as_f_linear_and_cross_entropy(path, backend):
    """Under ``torch.autocast`` a half-precision ``h`` (an autocast layer's output) meets a
    float32 ``weight`` and ``bias``: PyTorch casts them for ``F.linear`` and returns the
    loss in float32; so does the loss (it raised "weight's dtype differs" on every
    backend). Outside autocast mixed dtypes stay an error."""
    device_type = DEVICE.type
    half = torch.bfloat16 if device_type == "cpu" else torch.float16
    h, w, b, y = _data(n=12, k=8, c=6, seed=5)
    y[3] = -100
    h = h.to(half)
    for reduction in ("mean", "none"):
        mine = [t.float().requires_grad_() for t in (w, b)]
        theirs = [t.float().requires_grad_() for t in (w, b)]
        with torch.autocast(device_type, dtype=half):
            got = linear_cross_entropy(h, mine[0], y, mine[1], reduction=reduction, label_smoothing=0.1,
                                       backend=backend)
            want = _torch(h, theirs[0], theirs[1], y, reduction=reduction, label_smoothing=0.1)
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        g = torch.linspace(0.5, 1.5, got.numel(), device=DEVICE).reshape(got.shape)
        for a, e in zip(torch.autograd.grad(got, mine, g), torch.autograd.grad(want, theirs, g)):
            assert a.dtype == e.dtype == torch.float32
            torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2)
    with pytest.raises(TypeError, match="weight's dtype"):
        linear_cross_entropy(h, w.float(), y, b.float(), backend=backend)
