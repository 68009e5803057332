"""What is known of the ``(target, index)`` pair of the last loss call.

A training loop passes the same label tensor (and the same training-row index) at every
step, so what the loss learns of them -- that their values are in range (a host
read-back: :mod:`fusegnn.losses.checks`), how many rows count (three kernels:
:mod:`fusegnn.losses.function`) -- is learned once and kept while both are the same
objects at the same versions (an in-place change bumps a version and starts afresh).
One pair is kept, the last one.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

__all__ = ["pair_facts"]

# (key, target ref, index ref or None, facts) of the last pair
_LAST: tuple = ()


def pair_facts(target: Tensor, index: Tensor | None) -> dict | None:
    """The dict of facts kept for ``(target, index)`` (an empty one when the pair differs
    from the last call's, or either changed in place since), or ``None`` where nothing may
    be remembered: inference tensors (no version counter to tell an in-place change), a
    CUDA graph capture (its graph must own what it reads) and ``torch.compile`` tracing
    (no module state in a graph)."""
    global _LAST
    if (torch.compiler.is_compiling() or target.is_inference() or (index is not None and index.is_inference())
            or (target.is_cuda and torch.cuda.is_current_stream_capturing())):
        return None
    key = (id(target), target._version, id(index), None if index is None else index._version)
    if _LAST and _LAST[0] == key and _LAST[1]() is target and (index is None or _LAST[2]() is index):
        return _LAST[3]
    facts: dict = {}
    _LAST = (key, weakref.ref(target), weakref.ref(index) if index is not None else None, facts)
    return facts
