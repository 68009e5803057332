"""What the example scripts share: one message instead of a traceback for an error the
user can fix, and when a progress bar is drawn.

Not an example itself; the scripts beside it import it (each puts its own folder on
``sys.path`` first, so that loading a script by its path finds it too).
"""

from __future__ import annotations

import sys
import argparse
from typing import NoReturn

import torch

__all__ = ["USER_ERRORS", "check_device", "check_device_present", "check_range", "fail", "show_progress"]

# what a user can fix: missing data, a bad --root, malformed files, a path that cannot run here
USER_ERRORS = (OSError, ValueError, ImportError, NotImplementedError, RuntimeError)


def fail(err: BaseException, prog: str, *, debug: bool = False) -> NoReturn:
    """Print ``<prog>: error: <err>`` to stderr and exit with status 2 (argparse's status
    for a usage error); with ``debug`` re-raise ``err``, traceback and all."""
    if debug:
        raise err
    print(f"{prog}: error: {err}\n(--debug shows the traceback)", file=sys.stderr)
    raise SystemExit(2) from None


def check_range(parser: argparse.ArgumentParser, flag: str, value: float | None, *, low: float,
                high: float | None = None, low_open: bool = False, high_open: bool = False) -> None:
    """Refuse ``value`` of ``flag`` outside ``[low, high]`` (an end excluded when ``*_open``;
    ``high=None``: no upper end) with a usage error naming the flag, before any data is
    loaded; ``None`` (a flag not given, no recipe value) passes."""
    if value is None:
        return
    too_low = value <= low if low_open else value < low
    too_high = high is not None and (value >= high if high_open else value > high)
    if not (too_low or too_high):
        return
    if high is None:
        parser.error(f"{flag} must be {'>' if low_open else '>='} {low:g}, got {value}")
    parser.error(f"{flag} must be in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}, "
                 f"got {value}")


def check_device(parser: argparse.ArgumentParser, device: str) -> torch.device:
    """``--device`` as a ``torch.device``; a string torch cannot parse is a usage error
    naming the flag (torch's own error is a traceback listing every device type)."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        parser.error(f"--device {device!r} is not a device (e.g. 'cpu', 'cuda', 'cuda:1')")


def check_device_present(device: torch.device) -> None:
    """Raise ``ValueError`` naming ``--device`` when ``device`` is a CUDA device this
    machine does not have (torch's own error comes from deep inside the first tensor
    moved there, after the data set was loaded). A run calls it before loading, inside
    its ``USER_ERRORS`` handler: one message, exit status 2."""
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ValueError(f"--device {str(device)!r}: no CUDA device here (torch.cuda.is_available() is False); "
                         "use --device cpu")
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {str(device)!r}: this machine has {count} CUDA device(s) "
                         f"(cuda:0 to cuda:{count - 1})")


def show_progress(quiet: bool = False) -> bool:
    """Whether to draw a progress bar: not with ``--quiet``, and only when both stdout
    and stderr are terminals. The bar is drawn on stderr (tqdm's default checks only
    that stream); a redirected stdout (``> run.log``, ``--json | jq``, CI) marks a run
    whose output is kept rather than watched, where a bar's carriage returns would
    only clutter the log."""
    return not quiet and _isatty(sys.stdout) and _isatty(sys.stderr)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no stream, or a closed one
        return False
