r"""The autograd op over the fused kernel, and the public :func:`linear_cross_entropy`.

:class:`FusedLinearCrossEntropy` (the fused path). With ``reduction="mean"`` or ``"sum"``
the gradient of the loss is the same for every caller up to the scalar incoming gradient
:math:`g`, so the forward computes it along with the loss (loss elimination: no second
pass over the logits; the row kernel forms :math:`\partial z` right after the
log-sum-exp) and the backward only scales it by :math:`g` (a kernel that reads :math:`g` on
the device and returns at once when it is 1: no pass over the gradients, no read-back).
With ``reduction="none"`` the incoming gradient is per row: the backward recomputes the
logits chunk by chunk with :math:`s_i = g_i`.

Dispatch (``backend="auto"``): CUDA tensors take the fused path when the head is large
enough for it to pay (:func:`fused_min_work`) or while a CUDA graph is captured (a
replay has no host time) or warmed up for a capture
(:func:`fusegnn.sparse.dispatch.for_capture`, as in :func:`fusegnn.graphed_step`),
otherwise (and on the CPU) the PyTorch reference.
``backend="fused"`` forces the fused path (on the CPU it needs ``TRITON_INTERPRET=1``:
how the tests run the Triton kernel), ``backend="reference"`` the reference.

Under ``torch.compile`` (``fullgraph=True`` included, every backend): the checks, the
dispatch and the reference are traced as they are (the range checks of class ids and
``index`` become in-graph assertions, :mod:`fusegnn.losses.checks`; triton's presence,
``TRITON_INTERPRET`` and the capture state are constants of the compiled code). The fused
path is not this module's autograd Function there but the custom op
``fusegnn::linear_cross_entropy`` (one node of the graph), with the same loss elimination
(its backward scales the forward's gradients by :math:`g` in the graph) and, for
``reduction="none"``, the recomputing ``fusegnn::linear_cross_entropy_backward``
(:mod:`fusegnn.losses.library`). Both routes run the passes of
:mod:`fusegnn.losses.passes`, so they agree in value and gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusegnn.kernels._autograd import differentiable_once
from fusegnn.kernels import linear_cross_entropy as linear_cross_entropy_kernels
from fusegnn.kernels._triton import FLOAT_DTYPES, fused_can_run
from fusegnn.losses.checks import as_class_ids, check_arguments
from fusegnn.losses.library import compiled_fused_loss
from fusegnn.losses.passes import FusedInputs, forward_pass, recompute_gradients
from fusegnn.sparse.dispatch import capture_mode

__all__ = ["BACKENDS", "FUSED_MIN_WORK", "FUSED_MIN_WORK_HEAD", "FusedLinearCrossEntropy", "fused_min_work",
           "linear_cross_entropy", "pick_backend"]

BACKENDS = ("auto", "fused", "reference")


def _kernels():
    return linear_cross_entropy_kernels


class FusedLinearCrossEntropy(torch.autograd.Function):
    """``loss = fused(h, weight, bias, target, index)`` in eager mode; see the module docstring."""

    @staticmethod
    def forward(ctx, h, weight, bias, target, index, ignore_index, reduction, smoothing, chunk_rows, out_dtype=None):
        want = tuple(ctx.needs_input_grad[:3])
        out = forward_pass(h, weight, bias, target, index, ignore_index, reduction, smoothing, chunk_rows, want)
        ctx.reduction = reduction
        ctx.grads = out.grads
        if any(want):  # for reduction="none", and for a second backward (retain_graph)
            ctx.save_for_backward(*out.inputs, out.n_valid)
            ctx.config = (ignore_index, smoothing, chunk_rows)
        return out.loss.to(out_dtype or h.dtype)  # float32 under autocast: the loss is computed in it

    @staticmethod
    @differentiable_once  # under create_graph=True the gradients raise when differentiated again
    def backward(ctx, grad):
        grads = FusedLinearCrossEntropy._gradients(ctx, grad)
        return (*grads, None, None, None, None, None, None, None)

    @staticmethod
    def _gradients(ctx, grad):
        """``(dh, dW, db)`` (``None`` where not asked for) for the incoming gradient ``grad``."""
        if ctx.grads is not None:  # computed by the forward: hand them over, scaled by grad
            grads, ctx.grads = ctx.grads, None
            # one launch for the three, on the device, skipped there when grad is 1: no read-back
            _kernels().scale_all_unless_one(grads, grad.reshape(1))
            return grads
        *inputs, n_valid = ctx.saved_tensors
        ignore_index, smoothing, chunk_rows = ctx.config
        return recompute_gradients(FusedInputs(*inputs), grad, ctx.reduction, n_valid, ignore_index, smoothing,
                                   chunk_rows, tuple(ctx.needs_input_grad[:3]))


#: ``backend="auto"`` takes the fused path on CUDA from this many ``rows x (classes +
#: features)`` on (heads of more than ``HEAD_MAX_CLASSES`` classes: the GEMM path). Below
#: it the reference (``F.linear`` + ``F.cross_entropy``) is faster: its GPU time is under
#: the fused path's host time (0.4-0.8 ms a step: the autograd Function, the checks, the
#: launches). Three H100 crossover runs (sessions 12 and 14) crossed at ~40-130M; the
#: figures are in ``benchmarks/NOTES-loss.md`` and ``benchmarks/results/loss/crossover-*``.
FUSED_MIN_WORK = 64_000_000
#: the same for heads of up to ``HEAD_MAX_CLASSES`` classes: one Triton kernel a chunk and
#: no GEMMs around it, so a lower floor; they crossed at ~25-40M (session 14, H100: the
#: Reddit-sized head, 39M, runs 1.3x eager fused; ``benchmarks/NOTES-loss.md``).
FUSED_MIN_WORK_HEAD = 32_000_000


def fused_min_work(num_classes: int) -> int:
    """``backend="auto"``'s threshold (rows x (classes + features)) for a head of
    ``num_classes`` classes: :data:`FUSED_MIN_WORK_HEAD` on the one-kernel head path,
    :data:`FUSED_MIN_WORK` on the GEMM path."""
    return FUSED_MIN_WORK_HEAD if num_classes <= _kernels().HEAD_MAX_CLASSES else FUSED_MIN_WORK


def pick_backend(backend: str, h: Tensor, weight: Tensor, bias: Tensor | None, index: Tensor | None = None) -> str:
    """``"fused"`` or ``"reference"`` for these inputs (see the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"linear_cross_entropy: backend must be one of {BACKENDS}, got {backend!r}")
    tensors = (h, weight) + ((bias,) if bias is not None else ())
    if backend == "reference":
        return "reference"
    runnable = h.dtype in FLOAT_DTYPES and fused_can_run(*tensors)
    if backend == "fused":
        if not runnable:
            raise RuntimeError(
                "linear_cross_entropy: backend='fused' needs triton and CUDA tensors (or TRITON_INTERPRET=1 "
                f"on the CPU) in one of {FLOAT_DTYPES}; got {h.dtype} on {h.device}"
            )
        return "fused"
    if not (runnable and h.is_cuda):
        return "reference"
    # a replayed graph has no host time to amortise; capture_mode is also on in the warm-up
    # steps of fusegnn.graphed_step, which must run (compile, cache) what the capture records
    if _replayed():
        return "fused"
    rows = index.numel() if index is not None else h.shape[0]
    return "fused" if rows * (weight.shape[0] + weight.shape[1]) >= fused_min_work(weight.shape[0]) else "reference"


@torch.compiler.assume_constant_result
def _replayed() -> bool:
    """:func:`~fusegnn.sparse.dispatch.capture_mode` (in code that ``torch.compile`` traces:
    read once while tracing, a constant of the compiled code)."""
    return capture_mode()


def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    index: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    backend: str = "auto",
    chunk_rows: int | None = None,
) -> Tensor:
    r"""``F.cross_entropy(F.linear(h[index], weight, bias), target[index], ...)`` without
    the ``[M, C]`` logits in memory.

    .. math::
        \ell_i = \operatorname{lse}(z_i) - (1-\varepsilon) z_{i y_i} - \tfrac{\varepsilon}{C}\textstyle\sum_c z_{ic},
        \quad z_i = W h_i + b,

    reduced over the rows whose target is not ``ignore_index`` (``mean`` divides by their
    number, exactly as ``F.cross_entropy``: with every row ignored, ``mean`` is NaN and the
    gradients are zero; ``sum`` is 0).

    Args:
        h: ``[N, K]`` floating rows (fp16 / bf16 / fp32; fp64 for checks).
        weight: ``[C, K]`` classifier (``F.linear``'s layout), same dtype as ``h``.
        target: ``[N]`` integer class ids, one per row of ``h``; ``ignore_index`` marks a
            row that counts for nothing. Any of int64, int32, int16, int8 and uint8, on
            every backend (``F.cross_entropy`` itself takes int64 and uint8 only), compared
            with ``ignore_index`` as int64.
        bias: ``[C]`` or ``None``.
        index: ``[M]`` integer rows of ``h`` (and ``target``) that count, e.g. a GNN's
            training nodes; repeats count each time. ``None``: all rows. Unlike
            ``h[index]``, rows must be in ``[0, N)`` (a negative row is an error, not
            counted from the end) and a boolean mask is refused (pass
            ``mask.nonzero().squeeze(1)``).
        ignore_index, label_smoothing: as ``F.cross_entropy`` (smoothing in ``[0, 1)``).
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (``[M]`` per-row losses, 0 on
            ignored rows).
        backend: ``"auto"`` (fused on CUDA from :func:`fused_min_work` rows x (classes +
            features) on, where it is faster, and in CUDA graph captures and their
            warm-up steps; the reference otherwise), ``"fused"``, ``"reference"``.
        chunk_rows: rows per chunk of the fused path (default: a 128 MiB logits budget;
            32 MiB of per-chunk buffers for heads of up to 512 classes).
            Memory for time on wide heads: a language-model head (8192 x 4096 -> 128,256,
            bf16, H100) takes 45.3 ms / 1191 MiB at the default 512 rows, 41.7 ms /
            1317 MiB at 1024 (eager: 41.6 ms / 6012 MiB; ``benchmarks/NOTES-loss.md``).

    Returns the loss in ``h``'s dtype (computed in float32, float64 for float64 inputs).
    Inputs are never modified.

    Under ``torch.autocast`` it follows ``F.linear`` + ``F.cross_entropy``'s autocast
    rules: ``h``, ``weight`` and ``bias`` (but float64 ones) are cast to the autocast
    dtype -- so a half-precision ``h`` may meet a float32 ``weight`` -- and a
    half-precision loss is returned as float32.

    The fused path is differentiable once: differentiating its gradients again (a
    gradient penalty through ``create_graph=True``) raises a ``RuntimeError`` instead of
    treating them as constants; the reference path
    (``F.cross_entropy``) has second derivatives.
    """
    autocast = _autocast_dtype(h)
    if autocast is not None:
        h, weight, bias = (_autocast_cast(t, autocast) for t in (h, weight, bias))
    check_arguments(h, weight, target, bias, index, ignore_index, reduction, label_smoothing)
    ignore_index, label_smoothing = int(ignore_index), float(label_smoothing)  # NumPy scalars too
    if chunk_rows is not None and (not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"linear_cross_entropy: chunk_rows must be a positive int, got {chunk_rows!r}")
    if pick_backend(backend, h, weight, bias, index) == "reference":  # autocast applies to it as to any caller
        return _kernels().linear_cross_entropy_reference(
            h, weight, as_class_ids(target), bias, index=index, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing,
        )
    if autocast is None:
        return _fused(h, weight, bias, target, index, ignore_index, reduction, label_smoothing, chunk_rows)
    # the kernels' GEMMs keep their dtypes; a half-precision loss comes back in float32, as
    # cross_entropy's under autocast (the kernels compute it in float32: no rounding to half)
    with torch.autocast(h.device.type, enabled=False):
        return _fused(h, weight, bias, target, index, ignore_index, reduction, label_smoothing, chunk_rows,
                      torch.float32 if h.dtype in (torch.float16, torch.bfloat16) else None)


def _fused(h, weight, bias, target, index, ignore_index, reduction, smoothing, chunk_rows, out_dtype=None) -> Tensor:
    """The fused path: :class:`FusedLinearCrossEntropy` eagerly, the custom op
    ``fusegnn::linear_cross_entropy`` in code that ``torch.compile`` traces
    (:mod:`fusegnn.losses.library`). The loss in ``out_dtype`` (default: ``h``'s)."""
    if torch.compiler.is_compiling():
        loss = compiled_fused_loss(h, weight, bias, target, index, ignore_index, reduction, smoothing, chunk_rows)
        return loss.to(out_dtype or h.dtype)
    return FusedLinearCrossEntropy.apply(h, weight, bias, target, index, ignore_index, reduction, smoothing,
                                         chunk_rows, out_dtype)


def _autocast_dtype(h) -> torch.dtype | None:
    """The dtype ``torch.autocast`` gives ``F.linear``'s inputs on ``h``'s device, or
    ``None`` outside autocast."""
    if not isinstance(h, Tensor) or h.device.type not in ("cuda", "cpu") or not torch.is_autocast_enabled(h.device.type):
        return None
    return torch.get_autocast_dtype(h.device.type)


def _autocast_cast(t, dtype: torch.dtype):
    """``t`` as autocast casts ``F.linear``'s inputs: floating tensors but float64 to ``dtype``."""
    if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64:
        return t.to(dtype)
    return t
