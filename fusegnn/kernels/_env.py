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

__all__ = ["env_flag"]

_ON = ("1", "true", "yes", "on", "y")
_OFF = ("0", "false", "no", "off", "n")


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name`` as a bool (module docstring), ``default`` when unset or empty."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    if value == "":
        return default
    raise ValueError(
        f"environment variable {name}={raw!r} is not an on / off switch: "
        f"use one of {_ON} (on) or {_OFF} (off), or leave it unset (default: {'on' if default else 'off'})"
    )
