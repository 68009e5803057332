"""The one reading of fusegnn's on / off environment switches (``ENVIRONMENT.md``):
``FUSEGNN_FAST_LAUNCH``, ``FUSEGNN_BAND_PATTERNS``.

A switch is on for ``1``, ``true``, ``yes``, ``on``, ``y`` and off for ``0``, ``false``,
``no``, ``off``, ``n`` (any case, surrounding blanks ignored); unset or empty keeps its
default. Anything else raises :class:`ValueError` naming the variable, rather than being
read as the default: ``FUSEGNN_FAST_LAUNCH=false`` meant off, and a silent "on" would
hide the typo.
"""

from __future__ import annotations

import os

__all__ = ["ON_VALUES", "OFF_VALUES", "env_flag"]

#: what reads as on / off (also ``TRITON_INTERPRET``'s on, :func:`fusegnn.kernels._triton.interpreter_enabled`)
ON_VALUES = ("1", "true", "yes", "on", "y")
OFF_VALUES = ("0", "false", "no", "off", "n")


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name`` as a bool (module docstring), ``default`` when unset or empty."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in ON_VALUES:
        return True
    if value in OFF_VALUES:
        return False
    if value == "":
        return default
    raise ValueError(
        f"environment variable {name}={raw!r} is not an on / off switch: "
        f"use one of {ON_VALUES} (on) or {OFF_VALUES} (off), or leave it unset (default: {'on' if default else 'off'})"
    )
