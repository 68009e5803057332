"""``fusegnn.losses.linear_cross_entropy`` against ``F.cross_entropy(F.linear(...))``.

Without CUDA this module sets ``TRITON_INTERPRET=1`` before any kernel is launched, and
the fused path (``backend="fused"``) runs its Triton kernels on the CPU, in float64, on
small shapes. Every case compares the loss and the gradients of ``h``, ``W`` and ``b`` with
PyTorch's own ops in float64, through each of the fused path's two paths:

* ``head``: the row block's logits on chip (``C <= 128``);
* ``wide``: GEMM chunks (classes padded to a multiple of 16) and the row kernel (heads of
  more classes; forced here on small shapes through ``HEAD_MAX_CLASSES = 0``), whose
  classes fit one tile (logits read once);
* ``wide-tiles``: the same with 16-element tiles, so the row kernel sweeps class tiles
  twice (language-model vocabularies).

With CUDA, the ``cuda`` tests add moderate shapes in float32 (``1e-5``) and bfloat16 (no
worse than eager bfloat16 against float32).
"""

from __future__ import annotations

import functools
import os

import torch

if not torch.cuda.is_available():  # run the Triton kernels on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from fusegnn.kernels import linear_cross_entropy as kernels  # noqa: E402
from fusegnn.losses.function import FUSED_MIN_WORK, FUSED_MIN_WORK_HEAD, fused_min_work, pick_backend  # noqa: E402
from fusegnn.losses import LinearCrossEntropy, linear_cross_entropy, linear_cross_entropy_reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
PATHS = ("head", "wide", "wide-tiles")


@pytest.fixture
def path(request, monkeypatch):
    """Force one of the fused path's two paths (see the module docstring)."""
    name = request.param
    if name in ("wide", "wide-tiles"):
        monkeypatch.setattr(kernels, "HEAD_MAX_CLASSES", 0)
    if name == "wide-tiles":  # the row kernel's two sweeps over class tiles (one tile otherwise)
        monkeypatch.setattr(kernels, "_TILE", 16)
    if name == "head":
        monkeypatch.setattr(kernels, "HEAD_MAX_CLASSES", 512)
    return name


def _inputs(n, k, c, seed=0, dtype=torch.float64, bias=True, ignored=()):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(n, k, generator=gen, dtype=torch.float64)
    w = torch.randn(c, k, generator=gen, dtype=torch.float64) * k ** -0.5
    b = torch.randn(c, generator=gen, dtype=torch.float64) if bias else None
    y = torch.randint(0, c, (n,), generator=gen)
    y[list(ignored)] = -100
    to = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return to(h), to(w), y.to(DEVICE), to(b)


def _torch_loss(h, w, y, b, index, reduction, smoothing, ignore_index=-100):
    if index is not None:
        h, y = h[index], y[index]
    return F.cross_entropy(F.linear(h, w, b), y, reduction=reduction, label_smoothing=smoothing,
                           ignore_index=ignore_index)


def _check(h, w, y, b, *, index=None, reduction="mean", smoothing=0.0, chunk_rows=None, rtol=1e-10, atol=1e-12,
           seed=5):
    """The fused loss and its gradients against PyTorch's, on copies of the inputs."""
    leaves = [t.clone().requires_grad_() for t in (h, w) + ((b,) if b is not None else ())]
    refs = [t.clone().requires_grad_() for t in leaves]
    got = linear_cross_entropy(leaves[0], leaves[1], y, leaves[2] if b is not None else None, index=index,
                               reduction=reduction, label_smoothing=smoothing, backend="fused", chunk_rows=chunk_rows)
    want = _torch_loss(refs[0], refs[1], y, refs[2] if b is not None else None, index, reduction, smoothing)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    grad = grad.to(DEVICE, want.dtype)
    g_got = torch.autograd.grad(got, leaves, grad)
    g_want = torch.autograd.grad(want, refs, grad)
    for name, a, e in zip(("h", "weight", "bias"), g_got, g_want):
        assert a.dtype == e.dtype, name
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, msg=lambda m, name=name: f"grad of {name}: {m}")
    return got, g_got


# ----------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("reduction", ("mean", "sum", "none"))
def test_matches_torch(path, reduction):
    h, w, y, b = _inputs(29, 12, 37, ignored=(3, 17))
    _check(h, w, y, b, reduction=reduction, chunk_rows=11)


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("classes", (7, 37))
def test_odd_class_counts_with_label_smoothing(path, classes):
    h, w, y, b = _inputs(23, 9, classes, seed=classes, ignored=(0,))
    _check(h, w, y, b, smoothing=0.15)
    _check(h, w, y, None, reduction="none", smoothing=0.3)


@pytest.mark.parametrize("pad", (True, False))
def test_wide_path_with_and_without_padded_classes(pad, monkeypatch):
    """The GEMM path pads 37 classes to 48 (zero rows of ``W`` and ``b``) unless the copy
    would pass ``PAD_MAX_WEIGHT_BYTES``; either way the values and gradients are the
    unpadded ones, and ``dW`` is a contiguous ``[C, K]`` tensor."""
    monkeypatch.setattr(kernels, "HEAD_MAX_CLASSES", 0)
    if not pad:
        monkeypatch.setattr(kernels, "PAD_MAX_WEIGHT_BYTES", 0)
    h, w, y, b = _inputs(21, 6, 37, seed=11, ignored=(2,))
    w_gemm, b_gemm = kernels._padded_classes(w, b)
    assert w_gemm.shape == ((48, 6) if pad else (37, 6)) and (b_gemm.shape[0] == w_gemm.shape[0])
    if pad:
        assert bool((w_gemm[37:] == 0).all()) and bool((b_gemm[37:] == 0).all())
        assert torch.equal(w_gemm[:37], w) and torch.equal(b_gemm[:37], b)
    _, grads = _check(h, w, y, b, chunk_rows=8, smoothing=0.1)
    assert grads[1].shape == w.shape and grads[1].is_contiguous()
    index = torch.tensor([3, 3, 20, 0, 9], device=DEVICE)
    _check(h, w, y, None, index=index, reduction="none", chunk_rows=2)


@pytest.mark.parametrize("dtype", (torch.float64, torch.float32))
def test_one_tile_rows_over_several_warp_loads(dtype, monkeypatch):
    """150 classes (padded to 160) take one 256-column tile of the row kernel, laid out as
    ``[SPLIT, rows, one warp's loads]`` with SPLIT 4 (float64) or 2 (float32) and 4 rows a
    program: loss and gradients as PyTorch's, with smoothing, ignored rows and a ragged
    last row block."""
    monkeypatch.setattr(kernels, "HEAD_MAX_CLASSES", 0)
    h, w, y, b = _inputs(23, 10, 150, seed=4, ignored=(1, 22))
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    _check(h, w, y, b, smoothing=0.2, chunk_rows=9, **tol)
    _check(h, w, y, None, reduction="none", **tol)


@pytest.mark.parametrize("reduction", ("mean", "none"))
def test_chunks_lent_the_unwritten_rows_of_grad_h(reduction, monkeypatch):
    """Without ``index`` the GEMM path keeps a chunk's logits in the rows of ``dh`` that no
    chunk has written yet: chunks of several sizes (lent, then the budget's own buffer), the
    same loss and gradients as PyTorch's, and the logits never land on rows already
    written."""
    monkeypatch.setattr(kernels, "HEAD_MAX_CLASSES", 0)
    monkeypatch.setattr(kernels, "HEAD_CHUNK_BYTES", 6 * 48 * 8)  # 6 rows of 48 float64 logits
    n, k, c = 150, 40, 37
    schedule = kernels._chunk_schedule(n, 6, lend_to=(48, k))
    lent = [(r0, r1) for r0, r1, is_lent in schedule if is_lent]
    assert len(lent) >= 3 and len({r1 - r0 for r0, r1 in lent}) >= 3 and not schedule[-1][2]
    assert schedule[0][0] == 0 and schedule[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(schedule, schedule[1:]))
    for r0, r1 in lent:  # the logits fit the rows after the chunk
        assert r1 * k + (r1 - r0) * 48 <= n * k
    spy = []
    real = kernels._chunk_schedule
    monkeypatch.setattr(kernels, "_chunk_schedule",
                        lambda *a, lend_to=None: (lend_to and spy.append((a, lend_to))) or real(*a, lend_to=lend_to))
    h, w, y, b = _inputs(n, k, c, seed=8, ignored=(0, 77))
    _check(h, w, y, b, reduction=reduction, smoothing=0.05)
    assert spy and spy[0] == ((n, 6), (48, k))


@pytest.mark.parametrize("num_rows, rows", [(0, 5), (3, 5), (5, 5), (17, 5), (17, 1), (128, 64)])
def test_chunk_schedule_without_lending_is_plain_chunks(num_rows, rows):
    """Without ``lend_to`` the schedule is ``rows``-row chunks in order (the last one the
    remainder), none lent; no chunk for no rows, one short chunk for fewer rows than
    ``rows``."""
    want = [(r0, min(r0 + rows, num_rows), False) for r0 in range(0, num_rows, rows)]
    assert kernels._chunk_schedule(num_rows, rows) == want
    assert kernels._chunk_schedule(num_rows, rows, lend_to=None) == want
    assert sum(r1 - r0 for r0, r1, _ in want) == num_rows
    with pytest.raises(ValueError, match="rows"):
        kernels._chunk_schedule(num_rows, 0)


@pytest.mark.parametrize("tile", (4096, 16))
def test_row_kernel_reads_no_logit_outside_the_row(tile, monkeypatch):
    """The row kernel reads the target logit with one load at ``z[row, y]``. The op layer
    rejects class ids outside ``[0, C)``, but a replayed CUDA graph runs without that check,
    so the kernel itself must not read outside the row's classes: an id past them (in the
    padding, in the next or the previous row's logits) adds no target logit and no one-hot,
    as if ``z[row, y]`` were 0 -- never another row's logit."""
    monkeypatch.setattr(kernels, "HEAD_MAX_CLASSES", 0)
    monkeypatch.setattr(kernels, "_TILE", tile)
    h, w, y, b = _inputs(6, 5, 37, seed=11)  # 37 classes padded to 48 columns
    z = F.linear(h, w, b)
    row, others = 2, [0, 1, 3, 4, 5]
    for bad in (37, 47, 48, 48 + 5, -1, -48 + 3):
        target = y.clone()
        target[row] = bad
        out = kernels.fused_linear_cross_entropy(h, w, target, b, None, -100, 0.0, None, grads=(False, False, True))
        torch.testing.assert_close(out.loss[row], torch.logsumexp(z[row], 0), rtol=1e-10, atol=1e-12,
                                   msg=f"class id {bad}")
        torch.testing.assert_close(out.loss[others], F.cross_entropy(z[others], y[others], reduction="none"),
                                   rtol=1e-10, atol=1e-12)
        dz = torch.softmax(z, 1)
        dz[others] -= F.one_hot(y[others], 37)
        torch.testing.assert_close(out.grad_bias, dz.sum(0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_index_with_repeats(path):
    h, w, y, b = _inputs(19, 10, 13, seed=3, ignored=(4,))
    index = torch.tensor([0, 4, 4, 7, 18, 7, 7, 2, 11], device=DEVICE)  # row 4 is ignored, 7 thrice
    _check(h, w, y, b, index=index, chunk_rows=4)
    _check(h, w, y, b, index=index, reduction="none", smoothing=0.1, chunk_rows=4)
    _check(h, w, y, b, index=index.to(torch.int32), reduction="sum")


@pytest.mark.parametrize("path", PATHS, indirect=True)
def test_all_rows_ignored_match_torch(path):
    """``mean`` over no row is NaN (0 / 0, as ``F.cross_entropy``) with zero gradients; ``sum`` is 0."""
    h, w, y, b = _inputs(6, 5, 7, ignored=range(6))
    loss, grads = _check(h, w, y, b)
    assert torch.isnan(loss)
    assert all(bool((g == 0).all()) for g in grads)
    loss, _ = _check(h, w, y, b, reduction="sum")
    assert loss.item() == 0.0
    loss, _ = _check(h, w, y, b, reduction="none", smoothing=0.2)
    assert bool((loss == 0).all())


def test_empty_index_and_custom_ignore_index():
    h, w, y, b = _inputs(8, 4, 5)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    _check(h, w, y, b, index=empty, reduction="sum")
    y2 = y.clone()
    y2[2] = 3
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    got = linear_cross_entropy(*leaves[:2], y2, ignore_index=3, backend="fused")
    want = F.cross_entropy(F.linear(h, w), y2, ignore_index=3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_gradcheck_tiny():
    h, w, y, b = _inputs(5, 3, 4, seed=9, ignored=(1,))
    index = torch.tensor([0, 1, 3, 3], device=DEVICE)
    for reduction in ("mean", "none"):
        def fn(h_, w_, b_, reduction=reduction):
            return linear_cross_entropy(h_, w_, y, b_, index=index, reduction=reduction, label_smoothing=0.1,
                                        backend="fused")

        assert torch.autograd.gradcheck(fn, tuple(t.clone().requires_grad_() for t in (h, w, b)))


def test_bfloat16_close_to_float64():
    """bfloat16 inputs: float32 accumulation, outputs in bfloat16, close to the float64 loss."""
    h, w, y, b = _inputs(40, 16, 11, seed=2, ignored=(5,))
    lo = [t.to(torch.bfloat16).requires_grad_() for t in (h, w, b)]
    ref = [t.to(torch.bfloat16).double().requires_grad_() for t in (h, w, b)]
    got = linear_cross_entropy(*lo[:2], y, lo[2], backend="fused")
    want = _torch_loss(*ref[:2], y, ref[2], None, "mean", 0.0)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
    for a, e in zip(torch.autograd.grad(got, lo), torch.autograd.grad(want, ref)):
        assert a.dtype == torch.bfloat16
        assert ((a.double() - e).norm() / e.norm()).item() < 2e-2


@pytest.mark.parametrize("path", ("head",), indirect=True)
@pytest.mark.parametrize("use_index", (False, True))
def test_bfloat16_grad_h_as_close_as_its_own_rounding(path, use_index):
    """The head path's bfloat16 ``dh`` within the error its own rounding costs: the rounding
    of ``dz`` (its target entries above all) is carried (``hi + lo``), so ``dh`` is nearer
    float32 than a product of the rounded ``dz`` (which eager bfloat16 computes) -- on a
    GNN-like head, with label smoothing, ignored rows and (``use_index``) repeated rows."""
    n, k, c = 384, 32, 41
    h, w, y, _ = _inputs(n, k, c, seed=11, bias=False, ignored=(3, 77))
    index = torch.randint(0, n, (300,), generator=torch.Generator().manual_seed(2)).to(DEVICE) if use_index else None
    lo = [t.to(torch.bfloat16).requires_grad_() for t in (h, w)]
    exact = [t.to(torch.bfloat16).double().requires_grad_() for t in (h, w)]
    got = linear_cross_entropy(*lo, y, index=index, label_smoothing=0.1, backend="fused")
    want = _torch_loss(*exact, y, None, index, "mean", 0.1)
    g_got = torch.autograd.grad(got, lo)
    g_want = torch.autograd.grad(want, exact)
    # the floor: each output rounded once; and the product of dz rounded to bfloat16
    hh, ww = (t.detach() for t in exact)
    rows, targets = (hh, y) if index is None else (hh[index], y[index])
    logits = rows @ ww.t()
    counts = targets != -100
    dz = torch.softmax(logits, 1) - 0.1 / c
    dz[counts.nonzero().flatten(), targets[counts]] -= 0.9
    dz = dz * counts[:, None] / counts.sum()
    every_row = torch.arange(n, device=DEVICE)
    dh_rounded_dz = torch.zeros_like(hh).index_add_(0, index if index is not None else every_row,
                                                    _round_as_triton(dz) @ ww)
    floor_h = _rel(_round_as_triton(g_want[0]), g_want[0])
    rounded_dz = _rel(_round_as_triton(dh_rounded_dz), g_want[0])
    err_h = _rel(g_got[0], g_want[0])
    assert err_h <= 1.1 * floor_h, (err_h, floor_h, rounded_dz)
    assert err_h < 0.8 * rounded_dz, (err_h, floor_h, rounded_dz)
    assert _rel(g_got[1], g_want[1]) < 2.5 * _rel(_round_as_triton(g_want[1]), g_want[1])


def _round_as_triton(t):
    """``t`` (float64) rounded to bfloat16 as the kernels' ``.to(tl.bfloat16)`` rounds it, as
    float64: to nearest on a GPU; Triton's interpreter truncates (its floor is twice as high)."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n).to(tl.bfloat16), mask=offs < n)

    x = t.detach().float().contiguous()
    y = torch.empty_like(x, dtype=torch.bfloat16)
    cast[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    return y.double()


def test_inputs_not_modified_and_grad_scaled():
    h, w, y, b = _inputs(10, 6, 5, ignored=(2,))
    copies = [t.clone() for t in (h, w, y, b)]
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    loss = linear_cross_entropy(leaves[0], leaves[1], y, leaves[2], backend="fused")
    (3.0 * loss).backward()
    ref = [t.clone().requires_grad_() for t in (h, w, b)]
    (3.0 * _torch_loss(ref[0], ref[1], y, ref[2], None, "mean", 0.0)).backward()
    for a, e in zip(leaves, ref):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-10, atol=1e-12)
    for t, c in zip((h, w, y, b), copies):
        assert torch.equal(t, c)


def _scaled_once(x, g, dtype):
    """``x * g`` in the accumulation dtype, rounded once to ``dtype``."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (x.to(acc) * torch.tensor(g, dtype=dtype).to(acc).to(x.device)).to(dtype)


def _assert_scaled(got, want, dtype):
    if dtype == torch.bfloat16:  # one ulp: Triton's interpreter rounds bfloat16 stores its own way
        torch.testing.assert_close(got, want, rtol=2**-7, atol=0)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_scale_all_unless_one(dtype):
    """The backward's scaling of the precomputed gradients reads the incoming gradient on
    the device: by 1 the values stay bitwise, otherwise one rounding of the product in the
    accumulation dtype; NaN propagates; an empty tensor is skipped; a strided tensor is
    refused."""
    x = torch.randn(4099, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype).to(DEVICE)
    kept = x.clone()
    kernels.scale_all_unless_one([x], torch.ones(1, dtype=dtype, device=DEVICE))
    assert torch.equal(x, kept)
    kernels.scale_all_unless_one([x], torch.full((1,), 0.3, dtype=dtype, device=DEVICE))
    _assert_scaled(x, _scaled_once(kept, 0.3, dtype), dtype)
    kernels.scale_all_unless_one([x], torch.full((1,), float("nan"), dtype=dtype, device=DEVICE))
    assert x.isnan().all()
    kernels.scale_all_unless_one([x[:0]], torch.full((1,), 2.0, dtype=dtype, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.scale_all_unless_one([kept[::2]], torch.full((1,), 2.0, dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_all_unless_one_scales_several_tensors_in_one_launch(dtype, monkeypatch):
    """Tensors of very different sizes (1 and 5000 elements, a 2-D one; ``None`` and empty
    ones skipped) are scaled by one launch each time: each one by itself, each element once
    (no block of one tensor reaches into another's); by 1 all stay bitwise. Too many
    tensors, mixed dtypes and a ``g`` of several elements are refused."""
    gen = torch.Generator().manual_seed(2)
    cases = [
        [torch.randn(1, generator=gen), torch.randn(5000, generator=gen), torch.randn(3, 7, generator=gen)],
        [None, torch.randn(5000, generator=gen), torch.randn(1, generator=gen)],
        [torch.randn(4096, generator=gen), torch.empty(0), torch.randn(4097, generator=gen)],
        [torch.randn(9, generator=gen), None, None],
        [None, torch.empty(0), None],
    ]
    launches = []

    class CountedLaunches:
        def __getitem__(self, grid, real=kernels.scale_kernel):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(kernels, "scale_kernel", CountedLaunches())
    for tensors in cases:
        tensors = [t.to(dtype).to(DEVICE) if t is not None else None for t in tensors]
        kept = [t.clone() if t is not None else None for t in tensors]
        launches.clear()
        kernels.scale_all_unless_one(tensors, torch.ones(1, dtype=dtype, device=DEVICE))
        assert all(t is None or torch.equal(t, k) for t, k in zip(tensors, kept))
        kernels.scale_all_unless_one(tensors, torch.full((1,), 0.37, dtype=dtype, device=DEVICE))
        for t, k in zip(tensors, kept):
            if t is not None:
                _assert_scaled(t, _scaled_once(k, 0.37, dtype), dtype)
        nonempty = sum(t is not None and t.numel() > 0 for t in tensors)
        assert len(launches) == (2 if nonempty else 0)
    x = torch.ones(4, dtype=dtype, device=DEVICE)
    g = torch.full((1,), 2.0, dtype=dtype, device=DEVICE)
    with pytest.raises(ValueError, match="at most 3"):
        kernels.scale_all_unless_one([x, x.clone(), x.clone(), x.clone()], g)
    with pytest.raises(ValueError, match="dtype"):
        kernels.scale_all_unless_one([x, x.double()], g)
    with pytest.raises(ValueError, match="one element"):
        kernels.scale_all_unless_one([x], g.expand(2))
    assert bool((x == 1).all())


def test_counted_rows_follow_the_targets():
    """The count of counted rows is reused for the same ``target`` / ``index`` tensors, and
    recomputed when either changes in place, is another tensor, or ``ignore_index`` differs."""
    h, w, y, b = _inputs(12, 5, 4)
    index = torch.tensor([0, 3, 3, 7, 9], device=DEVICE)

    def check(y_, index_, ignore_index=-100):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        got = linear_cross_entropy(leaves[0], leaves[1], y_, leaves[2], index=index_, ignore_index=ignore_index,
                                   backend="fused")
        y64, index64 = y_.long(), (index_.long() if index_ is not None else None)  # F.cross_entropy's dtypes
        want = _torch_loss(h, w, y64, b, index64, "mean", 0.0, ignore_index=ignore_index)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        ref = [t.clone().requires_grad_() for t in (h, w, b)]
        _torch_loss(ref[0], ref[1], y64, ref[2], index64, "mean", 0.0, ignore_index=ignore_index).backward()
        got.backward()
        for a, e in zip(leaves, ref):
            torch.testing.assert_close(a.grad, e.grad, rtol=1e-10, atol=1e-12)

    check(y, index)
    check(y, index)
    y[3] = -100  # in place: one counted row fewer (it is picked twice)
    check(y, index)
    index[0] = 3  # in place
    check(y, index)
    check(y, None)
    check(y.to(torch.int32), index.to(torch.int32))
    check(y.clamp_min(0), index, ignore_index=int(y[9]))
    with torch.inference_mode():  # not kept: an inference tensor cannot be saved for backward
        linear_cross_entropy(h, w, y, b, index=index, backend="fused")
    check(y, index)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_targets_made_under_inference_mode(backend):
    """Targets and index made under ``torch.inference_mode`` (an evaluation loop's labels)
    have no version counter: the value check and the counted-row memo must not read
    one, inside inference_mode or after it (under no_grad: torch refuses to save an
    inference tensor for a backward)."""
    h, w, y, b = _inputs(12, 5, 4, ignored=(2,))
    with torch.inference_mode():
        y_inf, index_inf = y.clone(), torch.tensor([0, 2, 3, 3, 7], device=DEVICE)
    want = _torch_loss(h, w, y, b, index_inf.clone(), "mean", 0.0)
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            for _ in range(2):
                got = linear_cross_entropy(h, w, y_inf, b, index=index_inf, backend=backend)
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with torch.inference_mode():  # no version counter: an in-place change is seen only if nothing is kept
        labels = y.clone()
        linear_cross_entropy(h, w, labels, b, backend=backend)
        labels[0] = 9
        with pytest.raises(ValueError, match="class id 9"):
            linear_cross_entropy(h, w, labels, b, backend=backend)
        labels[0] = -100
        torch.testing.assert_close(linear_cross_entropy(h, w, labels, b, backend=backend),
                                   _torch_loss(h, w, labels.clone(), b, None, "mean", 0.0), rtol=1e-10, atol=1e-12)


def test_only_some_gradients():
    h, w, y, b = _inputs(9, 4, 6)
    wl = w.clone().requires_grad_()
    got = torch.autograd.grad(linear_cross_entropy(h, wl, y, b, backend="fused"), wl)[0]
    wr = w.clone().requires_grad_()
    want = torch.autograd.grad(_torch_loss(h, wr, y, b, None, "mean", 0.0), wr)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y, b, backend="fused"),
                                   _torch_loss(h, w, y, b, None, "mean", 0.0), rtol=1e-10, atol=1e-12)


def test_reference_and_dispatch():
    h, w, y, b = _inputs(7, 3, 4)
    want = _torch_loss(h, w, y, b, None, "sum", 0.1)
    got = linear_cross_entropy_reference(h, w, y, b, reduction="sum", label_smoothing=0.1)
    torch.testing.assert_close(got, want)
    # auto: the reference on the CPU and for small heads (no autograd Function then); fused
    # on CUDA from fused_min_work(C) rows x (classes + features) on: FUSED_MIN_WORK_HEAD on
    # the head path (C <= HEAD_MAX_CLASSES), FUSED_MIN_WORK on the GEMM path
    auto = linear_cross_entropy(h, w, y, b.clone().requires_grad_())
    assert type(auto.grad_fn).__name__ != "FusedLinearCrossEntropyBackward"
    assert FUSED_MIN_WORK_HEAD < FUSED_MIN_WORK
    for classes, bound in ((4, FUSED_MIN_WORK_HEAD), (kernels.HEAD_MAX_CLASSES + 4, FUSED_MIN_WORK)):
        assert fused_min_work(classes) == bound
        width = classes + 4  # rows x (classes + 4 features)
        small_index = torch.zeros(1, dtype=torch.int64, device=DEVICE).expand((bound - 1) // width)
        for index, fused in ((None, CUDA), (small_index, False)):
            for dtype in (torch.float32, torch.bfloat16):
                big = torch.zeros(1, 4, device=DEVICE, dtype=dtype).expand(-(-bound // width), 4)
                weight = torch.empty(classes, 4, device=DEVICE, dtype=dtype)
                got = pick_backend("auto", big, weight, None, index)
                assert got == ("fused" if fused else "reference"), (classes, index is None, dtype)
    with pytest.raises(ValueError, match="backend"):
        linear_cross_entropy(h, w, y, b, backend="cuda")


def test_auto_warm_up_for_capture_takes_the_captured_path():
    """graphed_step's warm-up steps run under for_capture: ``auto`` takes there the path
    the capture records (fused on CUDA at any size), so that they compile and cache it."""
    from fusegnn.sparse.dispatch import for_capture

    h, w, y, b = _inputs(7, 3, 4)
    assert pick_backend("auto", h, w, b) == "reference"
    with for_capture():
        assert pick_backend("auto", h, w, b) == ("fused" if CUDA else "reference")  # the CPU: always the reference
        if CUDA:
            got = linear_cross_entropy(h, w, y, b.clone().requires_grad_())
            assert type(got.grad_fn).__name__ == "FusedLinearCrossEntropyBackward"
            torch.testing.assert_close(got, _torch_loss(h, w, y, b, None, "mean", 0.0), rtol=1e-10, atol=1e-12)
    assert pick_backend("auto", h, w, b) == "reference"


def test_module():
    torch.manual_seed(0)
    head = LinearCrossEntropy(6, 9, label_smoothing=0.05).to(DEVICE, torch.float64)
    h, _, y, _ = _inputs(12, 6, 9, ignored=(1,))
    index = torch.tensor([0, 1, 5, 5, 11], device=DEVICE)
    got = head(h, y, index)
    want = F.cross_entropy(head.logits(h)[index], y[index], label_smoothing=0.05)
    torch.testing.assert_close(got, want)
    got.backward()
    assert head.weight.grad is not None and head.bias.grad is not None
    assert "num_classes=9" in repr(head)
    assert LinearCrossEntropy(4, 3, bias=False).bias is None
    with pytest.raises(ValueError, match="reduction"):
        LinearCrossEntropy(4, 3, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        LinearCrossEntropy(4, 3, label_smoothing=1.0)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(y="out_of_range"), ValueError, "class id 7"),
        (dict(y="negative"), ValueError, r"class id -3"),
        (dict(y="float"), TypeError, "target must hold class ids"),
        (dict(y="short"), ValueError, "one class id per row"),
        (dict(h="int"), TypeError, "h must be a floating tensor"),
        (dict(h="3d"), ValueError, "h must be 2-D"),
        (dict(w="features"), ValueError, r"weight must be \[num_classes, 4\]"),
        (dict(w="dtype"), TypeError, "weight's dtype"),
        (dict(b="size"), ValueError, r"bias must be \[7\]"),
        (dict(b="dtype"), TypeError, "bias's dtype"),
        (dict(index="float"), TypeError, "index must be an integer tensor"),
        (dict(index="range"), IndexError, "index holds rows outside"),
        (dict(reduction="avg"), ValueError, "reduction must be one of"),
        (dict(label_smoothing=1.0), ValueError, r"label_smoothing must be in \[0, 1\)"),
        (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
        (dict(label_smoothing="0.1"), TypeError, "label_smoothing must be a float"),
        (dict(ignore_index=1.5), TypeError, "ignore_index must be an int"),
        (dict(chunk_rows=0), ValueError, "chunk_rows"),
    ],
)
def test_bad_input(change, error, match):
    h, w, y, b = _inputs(6, 4, 7)
    index = None
    kwargs = {}
    bad = {
        ("y", "out_of_range"): lambda: y.clone().index_fill_(0, torch.tensor([2], device=DEVICE), 7),
        ("y", "negative"): lambda: y.clone().index_fill_(0, torch.tensor([2], device=DEVICE), -3),
        ("y", "float"): lambda: y.double(),
        ("y", "short"): lambda: y[:5],
        ("h", "int"): lambda: h.long(),
        ("h", "3d"): lambda: h[None],
        ("w", "features"): lambda: w[:, :3],
        ("w", "dtype"): lambda: w.float(),
        ("b", "size"): lambda: b[:6],
        ("b", "dtype"): lambda: b.float(),
        ("index", "float"): lambda: torch.tensor([0.0, 1.0], device=DEVICE),
        ("index", "range"): lambda: torch.tensor([0, 6], device=DEVICE),
    }
    for key, value in change.items():
        if (key, value) in bad:
            new = bad[(key, value)]()
            if key == "y":
                y = new
            elif key == "h":
                h = new
            elif key == "w":
                w = new
            elif key == "b":
                b = new
            else:
                index = new
        else:
            kwargs[key] = value
    with pytest.raises(error, match=match):
        linear_cross_entropy(h, w, y, b, index=index, backend="fused", **kwargs)


def test_bad_input_devices_and_types():
    h, w, y, b = _inputs(6, 4, 7)
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        linear_cross_entropy(h, w.tolist(), y)
    if CUDA:
        with pytest.raises(ValueError, match="target is on cpu"):
            linear_cross_entropy(h, w, y.cpu())
    else:
        with pytest.raises(ValueError, match="is on meta"):
            linear_cross_entropy(h, w, y, b.to("meta"))


# ----------------------------------------------------------------------------- CUDA, moderate shapes


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("classes, features", [(47, 256), (349, 128), (349, 512), (2000, 64)])
@pytest.mark.parametrize("use_index", (False, True))
def test_cuda_float32_and_bfloat16(classes, features, use_index):
    gen = torch.Generator(device="cuda").manual_seed(classes)
    n = 3000
    h = torch.randn(n, features, device="cuda", generator=gen)
    w = torch.randn(classes, features, device="cuda", generator=gen) * features ** -0.5
    b = torch.randn(classes, device="cuda", generator=gen)
    y = torch.randint(0, classes, (n,), device="cuda", generator=gen)
    y[::9] = -100
    index = torch.randint(0, n, (n // 2,), device="cuda", generator=gen) if use_index else None

    def run(dtype, fn, reduction):
        leaves = [t.to(dtype).requires_grad_() for t in (h, w, b)]
        loss = fn(*leaves[:2], y, leaves[2], index=index, reduction=reduction, label_smoothing=0.1)
        grad = torch.ones_like(loss) if reduction != "none" else torch.linspace(0, 1, loss.numel(), device="cuda")
        return (loss, *torch.autograd.grad(loss, leaves, grad.to(loss.dtype)))

    for reduction in ("mean", "none"):
        want = run(torch.float32, linear_cross_entropy_reference, reduction)
        fused = functools.partial(linear_cross_entropy, backend="fused")  # "auto" takes the reference here
        got32 = run(torch.float32, fused, reduction)
        for a, e in zip(got32, want):
            assert _rel(a, e) < 1e-5
        eager16 = run(torch.bfloat16, linear_cross_entropy_reference, reduction)
        got16 = run(torch.bfloat16, fused, reduction)
        for a, e, ref in zip(got16, eager16, want):
            assert _rel(a, ref) < max(2e-3, 1.5 * _rel(e, ref)), (reduction, _rel(a, ref), _rel(e, ref))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("use_index", (False, True))
def test_cuda_wide_path_holds_one_chunk_of_logits(use_index):
    """The wide path's chunks share one logits buffer (and one buffer of gathered rows): a
    larger chunk raises the peak by its own size once, not by two chunks' worth (the
    previous chunk's logits alive while the next GEMM allocates)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    n, k, c = 4096, 64, 20_000  # C > HEAD_MAX_CLASSES: the wide path
    h = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(c, k, device="cuda", generator=gen) * k ** -0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, c, (n,), device="cuda", generator=gen)
    index = torch.randperm(n, device="cuda", generator=gen)[: n // 2] if use_index else None

    def peak(chunk_rows):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        linear_cross_entropy(h, w, y, index=index, backend="fused", chunk_rows=chunk_rows).backward()
        torch.cuda.synchronize()
        h.grad = w.grad = None
        return torch.cuda.max_memory_allocated() - base

    peak(256)  # warm-up (kernels compiled, allocator primed)
    step = 256 * (c * 2 + (k * 2 if use_index else 0))  # one more chunk of logits (and gathered rows)
    grown = peak(512) - peak(256)
    assert grown < 1.5 * step, (grown, step)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("classes", (10, 200))  # the head path, the GEMM path
def test_cuda_graph_replays_scale_the_gradients_by_the_incoming_one(classes):
    """The backward scales the forward's gradients (``dh``, ``dW``, ``db``) by the incoming
    gradient read on the device, in one launch and without a read-back: a captured forward
    and backward replays with a new incoming gradient each time (1 included, where the
    kernel only loads it) and gives PyTorch's gradients."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    n, k = 300, 32
    h = torch.randn(n, k, device="cuda", generator=gen).requires_grad_()
    w = (torch.randn(classes, k, device="cuda", generator=gen) * k ** -0.5).requires_grad_()
    b = torch.randn(classes, device="cuda", generator=gen).requires_grad_()
    y = torch.randint(0, classes, (n,), device="cuda", generator=gen)
    s = torch.ones((), device="cuda")

    def step():
        loss = linear_cross_entropy(h, w, y, b, backend="fused")
        return torch.autograd.grad(loss * s, (h, w, b))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and run the kernels once before the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grads = step()
    for value in (1.0, 0.37, 1.0, -2.0):
        s.fill_(value)
        graph.replay()
        want = torch.autograd.grad(linear_cross_entropy_reference(h, w, y, b) * value, (h, w, b))
        for got, expected in zip(grads, want):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=f"incoming gradient {value}")
