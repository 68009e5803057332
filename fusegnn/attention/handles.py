"""Process-unique integer handles of Python objects (masks, block layouts) that the
``torch.library`` custom ops take in place of the objects themselves: a compiled graph
carries the integer, the op looks the object up when it runs. The registry holds the
objects weakly; a handle is never reused."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

__all__ = ["register", "lookup"]

_IDS = itertools.count(1)
_OBJECTS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def register(obj: Any) -> int:
    """A new handle for ``obj`` (kept alive by ``obj`` only)."""
    handle = next(_IDS)
    _OBJECTS[handle] = obj
    return handle


def lookup(handle: int) -> Any:
    """The live object of ``handle``."""
    obj = _OBJECTS.get(int(handle))
    if obj is None:
        raise RuntimeError(
            f"object handle {handle} is no longer alive: keep the mask or layout a compiled model "
            "uses referenced (for instance as an attribute of the model)"
        )
    return obj
