"""What the example scripts share: one message instead of a traceback for an error the
user can fix.

Not an example itself; the scripts beside it import it (each puts its own folder on
``sys.path`` first, so that loading a script by its path finds it too).
"""

from __future__ import annotations

import sys
from typing import NoReturn

__all__ = ["USER_ERRORS", "fail"]

# what a user can fix: missing data, a bad --root, malformed files, a path that cannot run here
USER_ERRORS = (OSError, ValueError, ImportError, NotImplementedError, RuntimeError)


def fail(err: BaseException, prog: str, *, debug: bool = False) -> NoReturn:
    """Print ``<prog>: error: <err>`` to stderr and exit with status 2 (argparse's status
    for a usage error); with ``debug`` re-raise ``err``, traceback and all."""
    if debug:
        raise err
    print(f"{prog}: error: {err}\n(--debug shows the traceback)", file=sys.stderr)
    raise SystemExit(2) from None

