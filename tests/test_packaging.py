"""install.sh, the README's Quick start, .ci/run and the distribution checks.

install.sh runs with ``--dry-run`` (it prints the pip commands instead of running them)
against controlled surroundings: a fake ``nvidia-smi`` first on ``PATH``, pip's
configuration replaced by ``PIP_NO_INDEX`` and a find-links folder of empty wheel files
(pip reads versions from file names), the PyTorch CPU index either served by a local
HTTP server or pointed at a closed port, and, for "no torch", a fresh venv.
"""

from __future__ import annotations

import http.server
import importlib.util
import os
import re
import socket
import subprocess
import sys
import threading
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "install.sh"
CI_RUN = REPO / ".ci" / "run"


def _load_check_dist():
    spec = importlib.util.spec_from_file_location("fusegnn_check_dist", REPO / ".ci" / "check_dist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_dist = _load_check_dist()


# --- surroundings ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def python_without_torch(tmp_path_factory) -> Path:
    """A fresh venv's interpreter: pip, no torch."""
    root = tmp_path_factory.mktemp("venv-no-torch")
    venv.create(root, with_pip=True)
    return root / "bin" / "python"


@pytest.fixture(scope="module")
def cpu_index_url(tmp_path_factory):
    """A local HTTP server with a ``torch/`` page, standing in for the PyTorch CPU index."""
    root = tmp_path_factory.mktemp("cpu-index")
    (root / "torch").mkdir()
    (root / "torch" / "index.html").write_text("<html></html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/whl/cpu"


def _find_links(tmp_path: Path, wheels: list[str]) -> Path:
    folder = tmp_path / "find-links"
    folder.mkdir()
    for name in wheels:
        (folder / name).touch()
    return folder


def run_install(tmp_path: Path, *args: str, python: Path | str = sys.executable, gpu: bool = False,
                cpu_index: str | None = None, wheels: tuple[str, ...] = (), pythonpath: Path | None = None):
    """``install.sh ARGS --dry-run`` with a fake nvidia-smi and a local-only pip."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexit {0 if gpu else 9}\n")
    smi.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        PYTHON=str(python),
        FUSEGNN_TORCH_CPU_INDEX=cpu_index or _closed_port_url(),
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(_find_links(tmp_path, list(wheels))),
    )
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(["bash", str(INSTALL), *args, "--dry-run"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


def pip_commands(result) -> list[str]:
    return [line[2:] for line in result.stdout.splitlines() if line.startswith("+ ")]


# --- the torch build -----------------------------------------------------------------------


def test_gpu_machine_gets_torch_from_the_default_index(tmp_path, python_without_torch):
    result = run_install(tmp_path, "test", python=python_without_torch, gpu=True)
    assert result.returncode == 0, result.stderr
    assert pip_commands(result) == [
        f"{python_without_torch} -m pip install torch>=2.5",
        f"{python_without_torch} -m pip install -e .[test]",
    ]
    assert "CUDA build" in result.stderr


def test_cpu_machine_gets_the_cpu_index(tmp_path, python_without_torch, cpu_index_url):
    result = run_install(tmp_path, python=python_without_torch, cpu_index=cpu_index_url)
    assert result.returncode == 0, result.stderr
    assert pip_commands(result) == [
        f"{python_without_torch} -m pip install torch>=2.5 --index-url {cpu_index_url}",
        f"{python_without_torch} -m pip install -e .",
    ]


def test_unreachable_cpu_index_falls_back_to_a_cpu_build_of_the_default_index(tmp_path, python_without_torch):
    wheels = ("torch-2.14.1-py3-none-any.whl", "torch-2.13.0+cpu-py3-none-any.whl", "torch-2.12.0+cpu-py3-none-any.whl")
    result = run_install(tmp_path, python=python_without_torch, wheels=wheels)
    assert result.returncode == 0, result.stderr
    assert pip_commands(result)[0] == f"{python_without_torch} -m pip install torch==2.13.0+cpu"
    assert "cannot be reached" in result.stderr and "torch==2.13.0+cpu" in result.stderr


def test_no_cpu_build_anywhere_warns_and_uses_the_default_index(tmp_path, python_without_torch):
    # 2.4.0+cpu is a CPU build but older than fusegnn's lower bound.
    wheels = ("torch-2.14.1-py3-none-any.whl", "torch-2.4.0+cpu-py3-none-any.whl")
    result = run_install(tmp_path, python=python_without_torch, wheels=wheels)
    assert result.returncode == 0, result.stderr
    assert pip_commands(result)[0] == f"{python_without_torch} -m pip install torch>=2.5"
    assert "warning" in result.stderr and "nvidia-*" in result.stderr


@pytest.mark.parametrize("gpu", [False, True])
def test_an_importable_torch_is_kept(tmp_path, gpu):
    import torch

    result = run_install(tmp_path, "test,ogb", gpu=gpu)
    assert result.returncode == 0, result.stderr
    assert pip_commands(result) == [f"{sys.executable} -m pip install -e .[test,ogb]"]
    assert f"keeping the installed torch {torch.__version__}" in result.stderr


def _fake_torch(tmp_path: Path, body: str, dist_version: str | None = None) -> Path:
    site = tmp_path / "fake-site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(body)
    if dist_version is not None:
        info = site / f"torch-{dist_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {dist_version}\n")
    return site


def test_a_too_old_torch_is_an_error_not_a_silent_replacement(tmp_path, python_without_torch):
    site = _fake_torch(tmp_path, '__version__ = "2.4.1+cu121"\n')
    result = run_install(tmp_path, python=python_without_torch, pythonpath=site)
    assert result.returncode == 2
    assert "torch 2.4.1+cu121 is installed and fusegnn needs torch>=2.5" in result.stderr
    assert pip_commands(result) == []


def test_an_installed_torch_that_fails_to_import_is_an_error(tmp_path, python_without_torch):
    site = _fake_torch(tmp_path, 'raise ImportError("libcudart.so.12: cannot open shared object file")\n', "2.13.0")
    result = run_install(tmp_path, python=python_without_torch, pythonpath=site)
    assert result.returncode == 2
    assert "'import torch' fails" in result.stderr and "libcudart" in result.stderr
    assert pip_commands(result) == []


# --- bad arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("nope",), "EXTRAS: unknown extra 'nope' (known: test,ogb,scatter,bench,metis)"),
        (("test,nope",), "EXTRAS: unknown extra 'nope'"),
        (("test", "ogb"), "EXTRAS given twice ('test', 'ogb')"),
        (("--cpu",), "unknown option '--cpu'"),
    ],
)
def test_bad_arguments_are_named(tmp_path, args, message):
    result = run_install(tmp_path, *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert pip_commands(result) == []


def test_bad_python_is_named(tmp_path):
    result = run_install(tmp_path, python="no-such-python-here")
    assert result.returncode == 2
    assert "PYTHON='no-such-python-here' is not a command" in result.stderr


def test_help_documents_the_choice():
    result = subprocess.run(["bash", str(INSTALL), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "nvidia-smi" in result.stdout and "https://download.pytorch.org/whl/cpu" in result.stdout


# --- consistency between install.sh, pyproject.toml, README and CI -------------------------


def _pyproject() -> str:
    return (REPO / "pyproject.toml").read_text()


def test_install_script_torch_bound_is_pyprojects():
    script_bound = re.search(r"^TORCH_MIN=([\d.]+)$", INSTALL.read_text(), re.M).group(1)
    assert re.search(r'"torch>=([\d.]+)"', _pyproject()).group(1) == script_bound


def test_install_script_knows_every_extra(tmp_path):
    section = _pyproject().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = re.findall(r"^([A-Za-z0-9_-]+)\s*=", section, re.M)
    assert "test" in extras
    result = run_install(tmp_path, ",".join(extras))
    assert result.returncode == 0, result.stderr
    assert pip_commands(result) == [f"{sys.executable} -m pip install -e .[{','.join(extras)}]"]


def quick_start_commands() -> list[str]:
    """The command lines of the README's "Quick start" code block."""
    section = (REPO / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readme_commands_verbatim():
    commands = quick_start_commands()
    assert len(commands) == 2
    assert commands[0].startswith("./install.sh && ") and commands[1].startswith("./install.sh test && ")
    assert commands[1].endswith("-m pytest -q")
    ci = CI_RUN.read_text()
    for command in commands:
        assert f"readme_command '{command}'" in ci


def test_readme_gives_the_timings_and_says_the_package_is_not_on_pypi():
    readme = (REPO / "README.md").read_text()
    assert "on a 2-core CPU machine without a GPU" in readme  # the two commands' CPU timings
    assert "On a machine with one NVIDIA H100" in readme and "to be measured" not in readme
    assert "`pip install fusegnn`" in readme and "not published" in readme


@pytest.mark.parametrize("script", [INSTALL, CI_RUN], ids=["install.sh", ".ci/run"])
def test_shell_scripts_parse_and_are_executable(script):
    assert os.access(script, os.X_OK)
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- .ci/check_dist.py's content checks ----------------------------------------------------


def test_source_modules_are_the_package_files():
    modules = check_dist.source_modules()
    assert "fusegnn/__init__.py" in modules
    assert all(m.startswith("fusegnn/") and m.endswith(".py") and "__pycache__" not in m for m in modules)


def test_wheel_problems():
    modules = {"fusegnn/__init__.py", "fusegnn/sparse/__init__.py"}
    good = ["fusegnn/__init__.py", "fusegnn/sparse/__init__.py", "fusegnn-0.1.0.dist-info/METADATA"]
    assert check_dist.wheel_problems(good, modules) == []
    bad = ["fusegnn/__init__.py", "tests/test_graph.py", "benchmarks/run.py", "fusegnn-0.1.0.dist-info/RECORD"]
    assert check_dist.wheel_problems(bad, modules) == [
        "wheel holds 'tests/test_graph.py', outside the fusegnn package",
        "wheel holds 'benchmarks/run.py', outside the fusegnn package",
        "wheel lacks fusegnn/sparse/__init__.py",
    ]


def test_sdist_problems():
    top = "fusegnn-0.1.0"
    good = [top, f"{top}/PKG-INFO", f"{top}/pyproject.toml", f"{top}/README.md", f"{top}/fusegnn/__init__.py"]
    assert check_dist.sdist_problems(good, licence=None) == []
    assert check_dist.sdist_problems(good, licence="LICENSE") == [f"sdist lacks {top}/LICENSE"]
    assert check_dist.sdist_problems(good[:3], licence=None) == [
        f"sdist lacks {top}/README.md", f"sdist lacks {top}/fusegnn/__init__.py"]
    assert "top-level folders" in check_dist.sdist_problems(good + ["other/x"], licence=None)[0]
