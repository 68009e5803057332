"""Process-unique integer handles of Python objects (masks, block layouts) that the
``torch.library`` custom ops take in place of the objects themselves: a compiled graph
carries the integer, the op looks the object up when it runs. The registry holds the
objects weakly; a handle is never reused."""

from __future__ import annotations

import itertools
import weakref
from typing import Any

__all__ = ["Handled", "register", "lookup"]

_IDS = itertools.count(1)
_OBJECTS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def register(obj: Any) -> int:
    """A new handle for ``obj`` (kept alive by ``obj`` only)."""
    handle = next(_IDS)
    _OBJECTS[handle] = obj
    return handle


class Handled:
    """Copy / pickle rules of an object with a handle (``self.handle``) and derived state:
    a copy (``copy.copy``, ``deepcopy``, ``pickle``, a saved model) registers a handle of
    its own -- a handle belongs to one live object of one process, and a compiled op would
    otherwise look up the original -- and starts its derived attributes afresh (caches,
    rebuilt on use; they may hold closures, which cannot be pickled). Subclasses name them
    in ``_DERIVED`` (attribute -> a function making its empty value)."""

    _DERIVED: dict[str, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["handle"]
        for name in self._DERIVED:
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name, empty in self._DERIVED.items():
            setattr(self, name, empty())
        self.handle = register(self)


def lookup(handle: int) -> Any:
    """The live object of ``handle``."""
    obj = _OBJECTS.get(int(handle))
    if obj is None:
        raise RuntimeError(
            f"object handle {handle} is no longer alive: keep the mask or layout a compiled model "
            "uses referenced (for instance as an attribute of the model)"
        )
    return obj
