"""Where data sets are looked for, and the download step.

Every loader resolves its files the same way, first match wins:

1. the ``root`` argument (``--root`` in the examples), if given. It must exist: a root
   that does not is an error naming it, never silently skipped. A root one level too
   deep -- the data set's own folder ``<root>/<Name>`` or its ``<root>/<Name>/raw`` --
   is recognised and read;
2. the ``FUSEGNN_DATA`` environment variable (CI points it at ``shared/data/planetoid``),
   with the same tolerance for a path one level too deep;
3. the cache directory: ``$XDG_CACHE_HOME/fusegnn`` (default ``~/.cache/fusegnn``);
4. a download, when the loader knows a URL and the network allows, into ``root`` if it
   was given, else into the cache -- never into ``$FUSEGNN_DATA``, which is only read
   (it may be a shared, read-only folder).

Nothing is written where data is only read. A download goes into a temporary folder
beside its target (in the target's nearest existing parent); only when every file has
arrived is the target folder created and the files moved in, so a failed download leaves
no folder and no partial file behind. A target inside ``$FUSEGNN_DATA`` or in a folder
that is not writable (no write permission, or no write bit set: a folder made read-only
with ``chmod`` counts as read-only even for the superuser) is not attempted.

When no searched folder holds a data set, one :class:`FileNotFoundError` says which files
are missing where, why nothing was downloaded, and how to get them.

A data set lives in ``<base>/<Name>/raw/`` (Planetoid, Reddit) or ``<base>/<name>/``
(OGB), the layouts the usual loaders use.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
import urllib.request
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ENV_VAR",
    "SearchedFolder",
    "cache_dir",
    "candidate_roots",
    "check_root",
    "download_files",
    "download_target",
    "fetch_url",
    "find_dataset_dir",
    "is_writable",
    "locate_dataset_dir",
    "move_into",
    "search_dataset",
    "staging_dir",
]

ENV_VAR = "FUSEGNN_DATA"


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/fusegnn``, or ``~/.cache/fusegnn``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fusegnn"


def check_root(root: str | os.PathLike | None) -> Path | None:
    """``root`` as a :class:`~pathlib.Path` (``~`` expanded); ``None`` stays ``None``.

    Raises:
        FileNotFoundError: ``root`` does not exist (named in the message).
        NotADirectoryError: ``root`` is a file.
    """
    if root is None:
        return None
    path = Path(root).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"data root {str(root)!r} (root= / --root) does not exist. Create it to download "
            f"into it, or leave root unset to use ${ENV_VAR} and the cache ({cache_dir()})."
        )
    if not path.is_dir():
        raise NotADirectoryError(f"data root {str(root)!r} (root= / --root) is not a directory")
    return path


def _origins(root: str | os.PathLike | None) -> list[tuple[Path, str]]:
    """The base directories searched, in order, with where each comes from."""
    bases: list[tuple[Path, str]] = []
    checked = check_root(root)
    if checked is not None:
        bases.append((checked, "root"))
    env = os.environ.get(ENV_VAR)
    if env:
        bases.append((Path(env).expanduser(), f"${ENV_VAR}"))
    bases.append((cache_dir(), "cache"))
    seen, unique = set(), []
    for path, origin in bases:
        key = str(path.resolve()) if path.exists() else str(path)
        if key not in seen:
            seen.add(key)
            unique.append((path, origin))
    return unique


def candidate_roots(root: str | os.PathLike | None = None) -> list[Path]:
    """The base directories searched, in order: ``root``, ``$FUSEGNN_DATA``, the cache
    (raises like :func:`check_root` for a ``root`` that does not exist)."""
    return [path for path, _ in _origins(root)]


def _layouts(base: Path, name: str, subdir: str, deep: bool) -> list[Path]:
    """Where a data set may sit under ``base``: the standard layout first, then (for the
    folders a user names, ``deep``) ``base`` being the data set's folder or its ``subdir``."""
    canonical = base / name / subdir if subdir else base / name
    if not deep:
        return [canonical]
    return [canonical, *([base / subdir] if subdir else []), base]


@dataclass(frozen=True)
class SearchedFolder:
    """One folder a data set was looked for in: ``missing`` are the files it lacks."""

    directory: Path
    origin: str  # "root", "$FUSEGNN_DATA" or "cache"
    missing: tuple[str, ...]


def search_dataset(
    name: str, files: Sequence[str], root: str | os.PathLike | None = None, *, subdir: str = "raw"
) -> list[SearchedFolder]:
    """Every folder searched for ``files``, in order: the standard layout of each base of
    :func:`candidate_roots`, plus the folders one level up from it that hold some of
    ``files`` (a ``root`` or ``$FUSEGNN_DATA`` that points into the data set)."""
    found: list[SearchedFolder] = []
    for base, origin in _origins(root):
        for k, directory in enumerate(_layouts(base, name, subdir, deep=origin != "cache")):
            missing = tuple(f for f in files if not (directory / f).is_file())
            if k == 0 or len(missing) < len(files):
                found.append(SearchedFolder(directory, origin, missing))
    return found


def locate_dataset_dir(
    name: str, files: Sequence[str], root: str | os.PathLike | None = None, *, subdir: str = "raw"
) -> Path | None:
    """The first searched folder that holds every file in ``files``, or ``None``."""
    for folder in search_dataset(name, files, root, subdir=subdir):
        if not folder.missing:
            return folder.directory
    return None


def download_target(name: str, root: str | os.PathLike | None = None, *, subdir: str = "raw") -> Path:
    """Where a download of ``name`` goes: under ``root`` if given (its own folder when
    ``root`` already names ``<Name>`` or ``<Name>/<subdir>``), else under the cache."""
    base = check_root(root)
    if base is None:
        return cache_dir() / name / subdir if subdir else cache_dir() / name
    if subdir and base.name == subdir and base.parent.name.lower() == name.lower():
        return base
    if base.name.lower() == name.lower():
        return base / subdir if subdir else base
    return base / name / subdir if subdir else base / name


def _existing_ancestor(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _inside(path: Path, folder: Path) -> bool:
    try:
        return os.path.commonpath([path.resolve(), folder.resolve()]) == str(folder.resolve())
    except ValueError:  # different drives
        return False


def _read_only_reason(path: str | os.PathLike) -> str | None:
    """Why nothing may be written at ``path`` (``None``: it may)."""
    env = os.environ.get(ENV_VAR)
    if env and _inside(Path(path), Path(env).expanduser()):
        return f"it is inside ${ENV_VAR} ({env}), which fusegnn only reads"
    folder = _existing_ancestor(Path(path))
    if not folder.is_dir():
        return f"{folder} is not a directory"
    if not os.access(folder, os.W_OK | os.X_OK) or not os.stat(folder).st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return f"{folder} is read-only"
    return None


def is_writable(path: str | os.PathLike) -> bool:
    """Whether fusegnn may create ``path`` or write into it: not inside
    ``$FUSEGNN_DATA``, and its nearest existing folder is writable (see the module
    docstring)."""
    return _read_only_reason(path) is None


@contextlib.contextmanager
def staging_dir(target: Path) -> Iterator[Path]:
    """A temporary folder beside ``target`` (in its nearest existing parent, so moving
    out of it is a rename), removed with whatever is left in it on exit.

    Raises:
        PermissionError: ``target`` may not be written (:func:`is_writable`).
    """
    reason = _read_only_reason(target)
    if reason is not None:
        raise PermissionError(f"cannot write {target}: {reason}")
    with tempfile.TemporaryDirectory(dir=_existing_ancestor(target), prefix=".fusegnn-download-") as tmp:
        yield Path(tmp)


def fetch_url(url: str, path: Path, timeout: float = 30.0) -> None:
    """Download ``url`` into the file ``path`` (meant for a file in :func:`staging_dir`)."""
    with urllib.request.urlopen(url, timeout=timeout) as response, open(path, "wb") as out:
        shutil.copyfileobj(response, out)


def move_into(files: Iterable[Path], directory: Path) -> None:
    """Create ``directory`` (and its parents) and move ``files`` into it."""
    directory.mkdir(parents=True, exist_ok=True)
    for file in files:
        shutil.move(str(file), str(directory / file.name))


def download_files(urls: dict[str, str], directory: Path, timeout: float = 30.0) -> None:
    """Download each ``name -> url``; only when all have arrived create ``directory`` and
    move them in (a failure leaves ``directory`` as it was)."""
    with staging_dir(directory) as tmp:
        for name, url in urls.items():
            fetch_url(url, tmp / name, timeout)
        move_into([tmp / name for name in urls], directory)


def find_dataset_dir(
    name: str,
    files: Sequence[str],
    root: str | os.PathLike | None = None,
    *,
    subdir: str = "raw",
    fetch: Callable[[Path], None] | None = None,
    source: str = "",
    how_to_get: Callable[[Sequence[str]], str] | None = None,
) -> Path:
    """The directory that holds every file in ``files`` (see :func:`search_dataset`).

    If none does and ``fetch`` is given, ``fetch(target)`` downloads the data set into
    :func:`download_target` (after checking that the target may be written) and that
    directory is returned.

    Args:
        name: the data set's folder name (``"Cora"``, ``"ogbn_arxiv"``).
        files: the files it needs, relative to its directory.
        root, subdir: where to look (see the module docstring).
        fetch: downloads into the directory it is given; ``None``: no download.
        source: the URL ``fetch`` downloads from (for the error message).
        how_to_get: a sentence on how to get the files, given the files missing from
            the most complete folder found (for the error message).

    Raises:
        FileNotFoundError: one message with the files missing in each searched folder,
            why nothing was (or could be) downloaded, and how to get the files; or a
            ``root`` that does not exist.
    """
    searched = search_dataset(name, files, root, subdir=subdir)
    for folder in searched:
        if not folder.missing:
            return folder.directory
    if fetch is None:
        note = "Nothing was downloaded (download=False)."
    else:
        target = download_target(name, root, subdir=subdir)
        reason = _read_only_reason(target)
        if reason is not None:
            note = f"Not downloaded: {target} may not be written ({reason})."
        else:
            try:
                fetch(target)
                missing = [f for f in files if not (target / f).is_file()]
                if not missing:
                    return target
                note = f"Download of {source} into {target} did not provide {', '.join(missing)}."
            except (OSError, zipfile.BadZipFile) as err:  # no network, HTTP error, bad archive, ...
                note = f"Download of {source} failed ({type(err).__name__}: {err}); it was to go into {target}."
    raise FileNotFoundError(_missing_message(name, files, subdir, searched, note, how_to_get))


def _missing_message(
    name: str,
    files: Sequence[str],
    subdir: str,
    searched: Sequence[SearchedFolder],
    note: str,
    how_to_get: Callable[[Sequence[str]], str] | None,
) -> str:
    lines = [f"Data set {name!r} not found: no searched folder holds all of {', '.join(files)}.",
             "Searched, in this order:"]
    for folder in searched:
        where = f"[{folder.origin}]"
        if len(folder.missing) < len(files):
            verb = "is" if len(folder.missing) == 1 else "are"
            lines.append(f"  - found {name} in {folder.directory} but {', '.join(folder.missing)} {verb} missing {where}")
        elif folder.directory.is_dir():
            lines.append(f"  - {folder.directory}: holds none of the files {where}")
        else:
            lines.append(f"  - {folder.directory}: does not exist {where}")
            env = os.environ.get(ENV_VAR)
            if folder.origin == f"${ENV_VAR}" and env and not Path(env).expanduser().exists():
                # unlike root=, a mistyped variable is not an error of its own: say it here
                lines.append(f"    {ENV_VAR}={env} itself does not exist: is it mistyped?")
        base = folder.directory.parent.parent if subdir else folder.directory.parent
        if folder.directory == (base / name / subdir if subdir else base / name) and base.is_dir():
            for child in base.iterdir():  # a differently-cased folder, e.g. <root>/cora
                if child.name.lower() == name.lower() and child.name != name and child.is_dir():
                    lines.append(f"    found {child}, but the folder must be named {name!r}: {base / name}")
    lines.append(note)
    fewest = min((folder.missing for folder in searched), key=len, default=tuple(files))
    if how_to_get is not None:
        lines.append(f"To get it: {how_to_get(fewest)}.")
    layout = f"<root>/{name}/{subdir + '/' if subdir else ''}"
    lines.append(f"Put the files in {layout} and pass root=<root> (--root in the examples), or set {ENV_VAR}=<root>.")
    return "\n".join(lines)
