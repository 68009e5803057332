"""Argument checks of :func:`fusegnn.losses.linear_cross_entropy` (one place, clear errors).

Every error names the argument. The value checks (class ids in range, ``index`` in range)
read one small flag tensor back to the host: one synchronisation per new label tensor, like the
device-side asserts of ``F.cross_entropy`` but with a Python error instead of a dead
CUDA context. In code that ``torch.compile`` traces they are in-graph assertions instead
(:func:`_assert_values_in_range`).
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

from fusegnn.losses.target_memo import pair_facts
from fusegnn.sparse.graph import is_integer

__all__ = ["REDUCTIONS", "as_class_ids", "check_arguments", "check_options", "check_target_and_index"]

REDUCTIONS = ("mean", "sum", "none")
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def as_class_ids(target: Tensor) -> Tensor:
    """``target`` as int64 class ids when it holds a narrower integer dtype (int32, int16,
    int8, uint8); any other tensor as it is. ``F.cross_entropy`` takes int64 and uint8, but
    with label smoothing it compares a uint8 target with ``ignore_index`` in uint8 (-100
    reads as 156), where the fused path compares in int64: widened, both agree."""
    return target.to(torch.int64) if target.dtype in _INT_DTYPES and target.dtype != torch.int64 else target


def _check_tensor(name: str, value, dims: int, owner: str = "linear_cross_entropy") -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{owner}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != dims:
        raise ValueError(f"{owner}: {name} must be {dims}-D, got shape {tuple(value.shape)}")
    return value


def check_target_and_index(target, index, num_rows: int, owner: str = "linear_cross_entropy", rows: str = "h") -> None:
    """``target`` one integer class id per row (``num_rows``) and ``index`` a 1-D integer
    tensor of rows (never a boolean mask): shapes and dtypes only, no device sync. Shared
    by :func:`~fusegnn.losses.linear_cross_entropy` and ``NodeClassifier.loss``'s logits path;
    ``rows`` names the tensor whose rows the targets label in the error (``h``, or a model's ``x``)."""
    _check_tensor("target", target, 1, owner)
    if target.dtype not in _INT_DTYPES:
        raise TypeError(f"{owner}: target must hold class ids (an integer tensor), got {target.dtype}")
    if target.shape[0] != num_rows:
        raise ValueError(f"{owner}: target must have one class id per row of {rows} ({num_rows}), "
                         f"got {target.shape[0]}")
    if index is not None:
        _check_tensor("index", index, 1, owner)
        if index.dtype == torch.bool:
            raise TypeError(f"{owner}: index must be an integer tensor of rows, got a boolean mask "
                            "(pass mask.nonzero().squeeze(1))")
        if index.dtype not in _INT_DTYPES:
            raise TypeError(f"{owner}: index must be an integer tensor of rows, got {index.dtype}")


def _check_shapes_and_dtypes(h, weight, target, bias, index) -> None:
    if isinstance(h, Tensor) and h.dim() > 2:  # F.cross_entropy would read dim 1 as the classes
        raise ValueError(
            f"linear_cross_entropy: h must be 2-D (rows of features), got shape {tuple(h.shape)}: "
            "flatten the leading dims (h.flatten(0, -2), target.flatten())"
        )
    _check_tensor("h", h, 2)
    _check_tensor("weight", weight, 2)
    if not h.is_floating_point():
        raise TypeError(f"linear_cross_entropy: h must be a floating tensor, got {h.dtype}")
    if weight.dtype != h.dtype:
        raise TypeError(f"linear_cross_entropy: weight's dtype {weight.dtype} differs from h's {h.dtype}")
    if weight.shape[1] != h.shape[1]:
        raise ValueError(
            f"linear_cross_entropy: weight must be [num_classes, {h.shape[1]}] (h has {h.shape[1]} features), "
            f"got {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("linear_cross_entropy: weight has no classes (shape [0, K])")
    check_target_and_index(target, index, h.shape[0])
    if bias is not None:
        _check_tensor("bias", bias, 1)
        if bias.dtype != h.dtype:
            raise TypeError(f"linear_cross_entropy: bias's dtype {bias.dtype} differs from h's {h.dtype}")
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"linear_cross_entropy: bias must be [{weight.shape[0]}] (weight's classes), got {tuple(bias.shape)}"
            )


def _check_devices(**tensors) -> None:
    device = tensors["h"].device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"linear_cross_entropy: {name} is on {t.device}, h on {device}")


def _check_values(target: Tensor, index: Tensor | None, num_rows: int, num_classes: int, ignore_index: int) -> None:
    """Class ids in ``[0, C)`` (or ``ignore_index``) and ``index`` in ``[0, N)``: the minima
    and maxima of both, read back in one transfer. Done once for a pair of tensors that
    stays unchanged (:func:`~fusegnn.losses.target_memo.pair_facts`: not for inference
    tensors) and skipped while a CUDA graph is being captured (the eager steps before a
    capture check them; a capture cannot read back)."""
    if torch.compiler.is_compiling():  # first: traced code never asks about a capture
        _assert_values_in_range(target, index, num_rows, num_classes, ignore_index)
        return
    if target.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    facts = pair_facts(target, index)
    checked = ("values in range", num_rows, num_classes, ignore_index)
    if facts is not None and checked in facts:
        return
    parts = []
    if target.numel():
        parts.append(torch.stack(torch.aminmax(_counted_ids(target, ignore_index))))
    if index is not None and index.numel():
        parts.append(torch.stack(torch.aminmax(index)).to(torch.int64))
    if not parts:
        return
    bounds = torch.cat(parts).tolist()
    if target.numel() and not (0 <= bounds[0] and bounds[1] < num_classes):
        first = bounds[0] if bounds[0] < 0 else bounds[1]
        raise ValueError(
            f"linear_cross_entropy: target holds class id {first}, outside [0, {num_classes}) "
            f"and not ignore_index ({ignore_index})"
        )
    if index is not None and index.numel() and not (0 <= bounds[-2] and bounds[-1] < num_rows):
        raise IndexError(f"linear_cross_entropy: index holds rows outside [0, {num_rows}) (h has {num_rows} rows; "
                         "a negative row is not counted from the end)")
    if facts is not None:
        facts[checked] = True


def _counted_ids(target: Tensor, ignore_index: int) -> Tensor:
    """The class ids as int64 with ``ignore_index`` rows as 0 (a valid id), for range checks;
    compared as int64, as the kernels and F.cross_entropy compare (torch casts the Python
    int to a narrow target's dtype, wrapping it: uint8 == -100 is == 156)."""
    wide = target.to(torch.int64)
    return torch.where(wide == ignore_index, torch.zeros((), dtype=torch.int64, device=target.device), wide)


def _assert_values_in_range(target: Tensor, index: Tensor | None, num_rows: int, num_classes: int,
                            ignore_index: int) -> None:
    """:func:`_check_values` in traced code: a host read-back (``.tolist()``) is a
    data-dependent guard that ``torch.compile(fullgraph=True)`` refuses, so the ranges are
    asserted in the graph instead (``torch._assert_async``: on the CPU a ``RuntimeError``
    with the message when the compiled code runs, the value itself unnamed; on CUDA a
    device-side assert, which ends the process's CUDA context, as ``F.cross_entropy``'s
    own out-of-range class ids do)."""
    if target.numel():
        low, high = torch.aminmax(_counted_ids(target, ignore_index))
        torch._assert_async(
            (low >= 0) & (high < num_classes),
            f"linear_cross_entropy: target holds a class id outside [0, {num_classes}) "
            f"and not ignore_index ({ignore_index})",
        )
    if index is not None and index.numel():
        low, high = torch.aminmax(index)
        torch._assert_async(
            (low >= 0) & (high < num_rows),
            f"linear_cross_entropy: index holds rows outside [0, {num_rows}) (h has {num_rows} rows; "
            "a negative row is not counted from the end)",
        )


def check_arguments(h, weight, target, bias, index, ignore_index, reduction, label_smoothing) -> None:
    """Raise a clear ``TypeError`` / ``ValueError`` / ``IndexError`` for bad arguments."""
    _check_shapes_and_dtypes(h, weight, target, bias, index)
    _check_devices(h=h, weight=weight, target=target, bias=bias, index=index)
    check_options("linear_cross_entropy", ignore_index, reduction, label_smoothing)
    _check_values(target, index, h.shape[0], weight.shape[0], int(ignore_index))


def check_options(owner: str, ignore_index, reduction, label_smoothing) -> None:
    """The loss's options (``owner`` names the caller in the errors): ``ignore_index`` an
    integer that fits int64, ``reduction`` one of :data:`REDUCTIONS`, ``label_smoothing`` a
    real number in ``[0, 1)``. Python's and NumPy's scalars alike, as ``F.cross_entropy``
    takes them (``numbers.Integral`` / ``numbers.Real``)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{owner}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, numbers.Real):
        raise TypeError(f"{owner}: label_smoothing must be a float, got {type(label_smoothing).__name__}")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"{owner}: label_smoothing must be in [0, 1), got {label_smoothing}")
    if not is_integer(ignore_index):
        raise TypeError(f"{owner}: ignore_index must be an int, got {type(ignore_index).__name__}")
    if not -2**63 <= int(ignore_index) < 2**63:
        raise ValueError(f"{owner}: ignore_index must fit int64, got {ignore_index}")
