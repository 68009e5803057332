"""How ``python -m benchmarks.run`` treats what a user types: bad option values are
refused naming the flag, ``--cases`` / ``--append`` / ``--time-limit`` / ``--update-readme``
keep the results and the README whole, and the JSON and markdown agree. CPU only, tiny."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import backends as bench_backends
from benchmarks import report
from benchmarks.run import main, parse_args

FAST = ["--allow-cpu", "--device", "cpu", "--steps", "1", "--warmup", "0", "--quiet", "--no-png",
        "--no-launches"]


def _cora_root() -> str:
    from benchmarks.run import default_data_root
    from fusegnn.datasets.paths import find_dataset_dir
    from fusegnn.datasets.planetoid import planetoid_raw_file_names

    root = default_data_root()
    try:
        find_dataset_dir("Cora", planetoid_raw_file_names("Cora"), root, subdir="raw")
    except FileNotFoundError:
        pytest.skip("Cora raw files not found ($FUSEGNN_DATA or .carry/planetoid)")
    return root


@pytest.mark.parametrize("flag, value", [
    ("--rtol", "-1e-4"), ("--rtol", "nan"), ("--warmup-s", "-1"), ("--time-limit", "-5"),
    ("--scale", "0"), ("--scale", "-0.5"), ("--avg-degree", "0"),
])
def test_bad_numbers_are_refused_naming_the_flag(flag, value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([flag, value])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_steps_below_one_are_refused(steps, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--steps", steps])
    assert "--steps" in capsys.readouterr().err


def test_zero_rtol_and_time_limit_are_allowed():
    args = parse_args(["--rtol", "0", "--time-limit", "0", "--warmup-s", "0"])
    assert args.rtol == 0 and args.time_limit == 0 and args.warmup_s == 0
