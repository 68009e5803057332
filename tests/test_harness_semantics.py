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


@pytest.mark.parametrize("cases", ["nomatch*", "gcn-cora-h16,gcn-cora-h61"])
def test_cases_matching_nothing_name_the_flag_and_the_known_cases(cases, tmp_path):
    """Also when only one of several patterns is a typo (it was dropped silently)."""
    with pytest.raises(SystemExit) as exc:
        main(["--suite", "paper", "--cases", cases, "--out", str(tmp_path), *FAST])
    message = str(exc.value.code)
    assert "--cases" in message and "gcn-cora-h16" in message and "gat-cora-8x8" in message
    assert not (tmp_path / "paper").exists()


def test_suite_all_leaves_out_a_suite_without_asked_cases(tmp_path):
    """``--suite all --cases gcn-cora-h16``: the paper case, and no exit at agg (which
    has none of the asked cases) after paper was run."""
    root = _cora_root()
    code = main(["--suite", "all", "--cases", "gcn-cora-h16", "--backends", "fusegnn-reference",
                 "--data-root", root, "--time-limit", "0", "--out", str(tmp_path), *FAST])
    assert code == 0
    doc = json.loads((tmp_path / "paper" / "cpu.json").read_text())
    assert [(r["case"], r["backend"]) for r in doc["records"]] == [("gcn-cora-h16", "fusegnn-reference")]
    assert not (tmp_path / "agg").exists()


def _rows(path) -> list[tuple[str, str, bool]]:
    return [(r["case"], r["backend"], r["ok"]) for r in json.loads(path.read_text())["records"]]


def test_append_past_the_time_limit_keeps_the_earlier_records(tmp_path):
    """A case asked for again but not started (past --time-limit) kept no row: its
    measured records were replaced by 'not run' ones. New cases still get 'not run'."""
    root = _cora_root()
    out = tmp_path / "new" / "nested"  # --out into a folder that does not exist yet
    args = ["--suite", "paper", "--backends", "fusegnn-reference", "--data-root", root, "--out", str(out), *FAST]
    assert main([*args, "--cases", "gcn-cora-h16"]) == 0
    path = out / "paper" / "cpu.json"
    before = json.loads(path.read_text())["records"]
    assert _rows(path) == [("gcn-cora-h16", "fusegnn-reference", True)]
    assert main([*args, "--cases", "gcn-cora-h16,gat-cora-8x8", "--append", "--time-limit", "0"]) == 0
    records = json.loads(path.read_text())["records"]
    assert [r for r in records if r["case"] == "gcn-cora-h16"] == before
    [new] = [r for r in records if r["case"] == "gat-cora-8x8"]
    assert not new["ok"] and new["error"].startswith("not run: --time-limit")
    # appending the same case again replaces its rows, never duplicates them
    assert main([*args, "--cases", "gcn-cora-h16", "--append"]) == 0
    assert sorted(_rows(path)) == [("gat-cora-8x8", "fusegnn-reference", False),
                                   ("gcn-cora-h16", "fusegnn-reference", True)]
