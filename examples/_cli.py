"""What the example scripts share: one message instead of a traceback for an error the
user can fix, and when a progress bar is drawn.

Not an example itself; the scripts beside it import it (each puts its own folder on
``sys.path`` first, so that loading a script by its path finds it too).
"""

from __future__ import annotations

import sys
from typing import NoReturn

__all__ = ["USER_ERRORS", "fail", "show_progress"]

# what a user can fix: missing data, a bad --root, malformed files, a path that cannot run here
USER_ERRORS = (OSError, ValueError, ImportError, NotImplementedError, RuntimeError)


def fail(err: BaseException, prog: str, *, debug: bool = False) -> NoReturn:
    """Print ``<prog>: error: <err>`` to stderr and exit with status 2 (argparse's status
    for a usage error); with ``debug`` re-raise ``err``, traceback and all."""
    if debug:
        raise err
    print(f"{prog}: error: {err}\n(--debug shows the traceback)", file=sys.stderr)
    raise SystemExit(2) from None


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
