"""Where data sets are looked for, and the download step.

Every loader resolves its files the same way, first match wins:

1. the ``root`` argument (``--root`` in the examples), if given;
2. the ``FUSEGNN_DATA`` environment variable (CI points it at ``shared/data/planetoid``);
3. the cache directory: ``$XDG_CACHE_HOME/fusegnn`` (default ``~/.cache/fusegnn``);
4. a download into the first of those (``root``, else ``FUSEGNN_DATA``, else the cache)
   when the loader knows a URL and the network allows; otherwise a :class:`FileNotFoundError`
   that lists the files to put where.

A data set lives in ``<base>/<Name>/raw/`` (Planetoid, Reddit) or ``<base>/<name>/``
(OGB), the layouts the usual loaders use.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ENV_VAR", "cache_dir", "candidate_roots", "find_dataset_dir", "download_files"]

ENV_VAR = "FUSEGNN_DATA"


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fusegnn``, or ``~/.cache/fusegnn``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusegnn"


def candidate_roots(root: str | os.PathLike | None = None) -> list[Path]:
    """The base directories searched, in order: ``root``, ``$FUSEGNN_DATA``, the cache."""
    roots: list[Path] = []
    if root is not None:
        roots.append(Path(root).expanduser())
    env = os.environ.get(ENV_VAR)
    if env:
        roots.append(Path(env).expanduser())
    roots.append(cache_dir())
    seen, unique = set(), []
    for path in roots:
        key = str(path.resolve()) if path.exists() else str(path)
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def find_dataset_dir(
    name: str,
    files: Sequence[str],
    root: str | os.PathLike | None = None,
    *,
    subdir: str = "raw",
    urls: dict[str, str] | None = None,
) -> Path:
    """The directory ``<base>/<name>/<subdir>`` that holds every file in ``files``.

    Searches :func:`candidate_roots`; if none has all files and ``urls`` (file name ->
    URL) is given, downloads the missing files into the first root and returns that
    directory. Raises :class:`FileNotFoundError` naming the files and places otherwise.
    """
    roots = candidate_roots(root)
    for base in roots:
        directory = base / name / subdir if subdir else base / name
        if all((directory / f).is_file() for f in files):
            return directory
    target = roots[0] / name / subdir if subdir else roots[0] / name
    problems = ""
    if urls:
        try:
            download_files({f: urls[f] for f in files if not (target / f).is_file()}, target)
            return target
        except OSError as err:  # no network, HTTP error, read-only target, ...
            problems = f"\nDownload failed ({type(err).__name__}: {err})."
    searched = "\n".join(f"  - {b / name / subdir if subdir else b / name}" for b in roots)
    raise FileNotFoundError(
        f"Data set {name!r} not found. It needs these files:\n  "
        + ", ".join(files)
        + f"\nin one of (searched in this order):\n{searched}\n"
        + f"Put the files in <root>/{name}/{subdir + '/' if subdir else ''} and pass root=... "
        + f"(--root in the examples), or set {ENV_VAR}=<root>."
        + problems
    )


def download_files(urls: dict[str, str], directory: Path, timeout: float = 30.0) -> None:
    """Download each ``name -> url`` into ``directory`` (atomically: temp file, then rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, url in urls.items():
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
                shutil.copyfileobj(response, out)
            os.replace(tmp, directory / name)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
