"""One walk over the tensors of a nested value (dicts, lists, tuples, NamedTuples), for
the helpers that move, detach or renumber every tensor in such a value."""

from __future__ import annotations

from typing import Any, Callable

from torch import Tensor

__all__ = ["map_tensors"]


def map_tensors(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it, through dicts, lists, tuples and
    NamedTuples (each rebuilt as its own type, a dict as a dict); anything else as it is."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple: fields by position
        return type(value)(*(map_tensors(item, fn) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(item, fn) for item in value)
    if isinstance(value, dict):
        return {key: map_tensors(item, fn) for key, item in value.items()}
    return value
