"""Build the sdist and the wheel, check what they hold, install the wheel into a fresh venv.

    python3 .ci/check_dist.py [--outdir DIR]

Steps (any failure exits non-zero with the reason):

1. ``python -m build``: the sdist, then the wheel built *from the sdist* (so a file the
   sdist forgets breaks the wheel build);
2. the wheel holds the ``fusegnn`` package and its ``.dist-info`` only (no tests,
   benchmarks, examples), and every module of the source tree's ``fusegnn/``;
3. the sdist holds ``PKG-INFO``, ``pyproject.toml``, ``README.md``, the licence file if the
   repository has one, and the package;
4. a virtual environment with ``--system-site-packages`` (torch and the other
   dependencies come from the interpreter running this; nothing is downloaded) gets the
   wheel with ``--no-deps --no-index --ignore-installed`` (an editable install of the
   checkout in the base interpreter must not satisfy it), and ``import fusegnn`` in it,
   run isolated (``-I``) from outside the checkout, must load the venv's copy.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "fusegnn"
LICENCE_NAMES = ("LICENSE", "LICENSE.txt", "LICENSE.md", "COPYING")


def source_modules(repo: Path = REPO) -> set[str]:
    """The package's ``.py`` files in the source tree, as paths relative to ``repo``."""
    return {
        path.relative_to(repo).as_posix()
        for path in (repo / PACKAGE).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def wheel_problems(names: list[str], modules: set[str]) -> list[str]:
    """What is wrong with a wheel holding ``names``, given the source ``modules``."""
    problems = [
        f"wheel holds {name!r}, outside the {PACKAGE} package"
        for name in names
        if not (name.startswith(f"{PACKAGE}/") or name.split("/", 1)[0].endswith(".dist-info"))
    ]
    problems += [f"wheel lacks {module}" for module in sorted(modules - set(names))]
    return problems


def sdist_problems(names: list[str], licence: str | None) -> list[str]:
    """What is wrong with an sdist holding ``names`` (paths under one top folder)."""
    tops = {name.split("/", 1)[0] for name in names}
    if len(tops) != 1:
        return [f"sdist has {len(tops)} top-level folders, expected one: {sorted(tops)}"]
    top = tops.pop()
    required = ["PKG-INFO", "pyproject.toml", "README.md", f"{PACKAGE}/__init__.py"]
    if licence is not None:
        required.append(licence)
    present = {name.split("/", 1)[1] for name in names if "/" in name}
    return [f"sdist lacks {top}/{path}" for path in required if path not in present]


def _run(*command: str | Path, cwd: Path | None = None) -> str:
    print("+", " ".join(map(str, command)), flush=True)
    result = subprocess.run(list(map(str, command)), cwd=cwd, text=True, capture_output=True)
    if result.returncode != 0:
        sys.exit(f"check_dist: {command[0]} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
    return result.stdout


def _only(outdir: Path, pattern: str) -> Path:
    found = sorted(outdir.glob(pattern))
    if len(found) != 1:
        sys.exit(f"check_dist: expected one {pattern} in {outdir}, found {[p.name for p in found]}")
    return found[0]


def check_installed_wheel(wheel: Path, workdir: Path) -> Path:
    """Install ``wheel`` into a fresh venv under ``workdir``; return where fusegnn loads from."""
    venv = workdir / "venv"
    _run(sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", venv)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
         "--no-deps", "--no-index", "--ignore-installed", wheel)
    location = Path(_run(python, "-I", "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)", cwd=workdir).strip())
    site_packages = Path(_run(python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    if not location.resolve().is_relative_to(site_packages.resolve()):
        sys.exit(f"check_dist: the venv imports {PACKAGE} from {location}, not from its {site_packages}")
    return location


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outdir", type=Path, help="where to keep the sdist and wheel (default: a temporary folder)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fusegnn-dist-") as tmp:
        outdir = args.outdir.resolve() if args.outdir else Path(tmp) / "dist"
        _run(sys.executable, "-m", "build", "--outdir", outdir, REPO)
        wheel, sdist = _only(outdir, "*.whl"), _only(outdir, "*.tar.gz")

        with zipfile.ZipFile(wheel) as archive:
            problems = wheel_problems(archive.namelist(), source_modules())
        licence = next((name for name in LICENCE_NAMES if (REPO / name).is_file()), None)
        with tarfile.open(sdist) as archive:
            problems += sdist_problems(archive.getnames(), licence)
        if problems:
            sys.exit("check_dist:\n  " + "\n  ".join(problems))

        location = check_installed_wheel(wheel, Path(tmp))
        print(f"check_dist: {sdist.name} and {wheel.name} are sound; the venv imports {location}")


if __name__ == "__main__":
    main()
