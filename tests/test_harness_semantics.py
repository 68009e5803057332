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
from tests.test_benchmarks import _cora_root

FAST = ["--allow-cpu", "--device", "cpu", "--steps", "1", "--warmup", "0", "--quiet", "--no-png",
        "--no-launches"]


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


@pytest.mark.parametrize("text", [
    "# title\n\nno markers here\n",
    "a\n<!-- results:paper:begin -->\nb\n",
    "a\n<!-- results:paper:end -->\nb\n<!-- results:paper:begin -->\nc\n",  # crashed (ValueError)
])
def test_update_readme_leaves_a_readme_without_usable_markers_alone(text, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(text)
    assert report.update_readme(readme, "paper", "| table |", "src.json") is False
    assert readme.read_text() == text


def _markdown_rows(table: str) -> list[list[str]]:
    lines = [line for line in table.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def _broken_backend() -> bench_backends.PaperBackend:
    def build(case, in_channels, num_classes):
        raise RuntimeError("this backend cannot build its model")

    return bench_backends.PaperBackend("broken", "fusegnn", build, "reference")


def test_update_readme_rewrites_only_its_section_and_md_matches_json(tmp_path, monkeypatch):
    """On a copy of benchmarks/README.md: the paper section becomes the run's table and
    nothing else changes; a backend that raises is an error row, the suite goes on; the
    JSON and the markdown hold the same rows and the same numbers."""
    import benchmarks.run as run

    root = _cora_root()
    readme = tmp_path / "benchmarks" / "README.md"
    readme.parent.mkdir()
    original = report.README.read_text()
    readme.write_text(original)
    monkeypatch.setattr(run, "README", readme)
    monkeypatch.setitem(bench_backends.PAPER_BACKENDS, "broken", _broken_backend())
    out = tmp_path / "results"
    assert main(["--suite", "paper", "--cases", "gcn-cora-h16", "--backends", "fusegnn-reference,broken",
                 "--data-root", root, "--out", str(out), "--update-readme", *FAST]) == 0
    doc = json.loads((out / "paper" / "cpu.json").read_text())
    rows = {r["backend"]: r for r in doc["records"]}
    assert set(rows) == {"fusegnn-reference", "broken"}
    assert rows["fusegnn-reference"]["ok"] and rows["fusegnn-reference"]["ms"] > 0
    assert not rows["broken"]["ok"] and "cannot build its model" in rows["broken"]["error"]
    table = (out / "paper" / "cpu.md").read_text()
    md = {row[1].strip("`"): row for row in _markdown_rows(table)}
    assert set(md) == set(rows)
    assert md["fusegnn-reference"][3] == report._num(rows["fusegnn-reference"]["ms"])
    assert md["broken"][3] == "—" and "cannot build its model" in md["broken"][-1]
    assert not (out / "paper" / "cpu.png").exists()  # --no-png
    new = readme.read_text()
    begin, end = "<!-- results:paper:begin -->", "<!-- results:paper:end -->"
    assert new.split(begin)[0] == original.split(begin)[0]
    assert new.split(end)[1] == original.split(end)[1]
    section = new.split(begin)[1].split(end)[0]
    assert _markdown_rows(section) == _markdown_rows(table)
    assert report.README.read_text() == original  # the real README untouched


@pytest.mark.parametrize("device", ["bogus", "meta"])
def test_a_device_that_is_not_one_is_refused_naming_the_flag(device, tmp_path):
    """'bogus' raised torch's RuntimeError with a traceback; 'meta' went on to run."""
    with pytest.raises(SystemExit) as exc:
        main(["--device", device, "--allow-cpu", "--out", str(tmp_path), "--quiet"])
    assert "--device" in str(exc.value.code) and device in str(exc.value.code)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_says_so(tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cuda", "--out", str(tmp_path), "--quiet"])
    assert "no CUDA device" in str(exc.value.code) and "--allow-cpu" in str(exc.value.code)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("suite, known", [
    ("attention", None), ("vector", None), ("sampled", "sampled-reddit-sage-25x10"), ("loss", "loss-gnn-reddit"),
])
def test_other_suites_name_cases_and_list_the_known_ones(suite, known, tmp_path):
    """attention / vector said 'see --list', sampled named neither the flag nor the cases."""
    with pytest.raises(SystemExit) as exc:
        main(["--suite", suite, "--cases", "nomatch", "--out", str(tmp_path), *FAST])
    message = str(exc.value.code)
    assert "--cases" in message and "known: " in message, message
    assert known is None or known in message
    assert len(message.split("known: ")[1].split(", ")) >= 2


@pytest.mark.parametrize("text", ['{"records": [', "[1, 2]\n", '{"records": 3}\n'])
def test_append_onto_a_file_that_is_not_results_is_refused_and_kept(text, tmp_path):
    """A truncated or foreign file ended in a JSONDecodeError / AttributeError traceback."""
    path = tmp_path / "paper" / "cpu.json"
    path.parent.mkdir()
    path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["--suite", "paper", "--cases", "gcn-cora-h16", "--backends", "fusegnn-reference",
              "--out", str(tmp_path), "--append", *FAST])
    assert "--append" in str(exc.value.code) and str(path) in str(exc.value.code)
    assert path.read_text() == text


def test_sweep_with_suite_all_names_the_suites_that_have_sweeps(capsys):
    """The message named paper (which has no sweep) and left out loss and vector."""
    from benchmarks.sweeps import SWEEPS

    with pytest.raises(SystemExit):
        parse_args(["--suite", "all", "--sweep", "spmm"])
    err = capsys.readouterr().err
    assert "--sweep" in err and "paper" not in err.split("--sweep needs")[1]
    assert all(sweep.suite in err for sweep in SWEEPS)


STORED = report.README.parent / "results"


@pytest.mark.parametrize("name", [
    "paper/nvidia-h200", "agg/nvidia-h200", "attention/nvidia-h100-80gb-hbm3", "vector/nvidia-h100-80gb-hbm3",
    "loss/nvidia-h200", "sampled/nvidia-h100-80gb-hbm3", "dist/nvidia-h200",
])
def test_report_rerenders_each_suite_with_its_own_table(name, tmp_path):
    """``python -m benchmarks.report`` on a copy of a stored results file writes the
    table that suite's run wrote (it wrote the paper/agg table over attention's, vector's,
    loss's, sampled's and dist's .md: other columns, 'speedup = `?`')."""
    source = STORED / f"{name}.json"
    if not source.is_file() or not source.with_suffix(".md").is_file():
        pytest.skip(f"{source} not stored")
    copy = tmp_path / source.name
    copy.write_text(source.read_text())
    assert report.main([str(copy), "--no-png"]) == 0
    assert copy.with_suffix(".md").read_text().rstrip() == source.with_suffix(".md").read_text().rstrip()


def test_report_refuses_a_file_of_no_suite_and_writes_nothing(tmp_path):
    path = tmp_path / "overhead.json"
    path.write_text(json.dumps({"suite": "overhead", "rows": []}))
    with pytest.raises(SystemExit) as exc:
        report.main([str(path), "--no-png"])
    assert str(path) in str(exc.value.code) and "overhead" in str(exc.value.code)
    assert not path.with_suffix(".md").exists()


@pytest.mark.parametrize("text", [None, "{not json"])
def test_report_names_a_missing_or_broken_file(text, tmp_path):
    """A missing file ended in a FileNotFoundError traceback."""
    path = tmp_path / "cpu.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exc:
        report.main([str(path), "--no-png"])
    assert str(path) in str(exc.value.code)


@pytest.mark.parametrize("flag", ["--cases", "--backends"])
@pytest.mark.parametrize("value", ["", " , "])
def test_an_empty_list_is_refused_not_read_as_all(flag, value, capsys):
    """``--cases "$EMPTY"`` selected every case of the grid."""
    with pytest.raises(SystemExit):
        parse_args([flag, value])
    assert flag in capsys.readouterr().err


def test_list_names_an_unknown_backend_pattern(capsys):
    """``--list --backends bogus`` printed 'backends: none' and exited 0."""
    with pytest.raises(SystemExit) as exc:
        main(["--list", "--backends", "bogus"])
    assert "--backends" in str(exc.value.code) and "fusegnn-reference" in str(exc.value.code)


def test_suite_all_leaves_out_a_suite_without_asked_backends(tmp_path):
    """``--suite all --backends pyg`` (a paper-only backend) rewrote agg's results file
    with no records at all, losing what it held."""
    root = _cora_root()
    agg = tmp_path / "agg" / "cpu.json"
    agg.parent.mkdir()
    agg.write_text(json.dumps({"suite": "agg", "records": [{"case": "agg-reddit-f16", "backend": "cusparse"}]}))
    before = agg.read_text()
    code = main(["--suite", "all", "--cases", "gcn-cora-h16,agg-reddit-f16", "--backends", "fusegnn-reference,pyg",
                 "--data-root", root, "--time-limit", "0", "--out", str(tmp_path), *FAST])
    assert code == 0
    assert (tmp_path / "paper" / "cpu.json").is_file()
    # fusegnn-reference is an agg backend too: agg was run (not-run rows) ...
    assert {r["backend"] for r in json.loads(agg.read_text())["records"]} == {"fusegnn-reference"}
    agg.write_text(before)
    assert main(["--suite", "all", "--cases", "gcn-cora-h16,agg-reddit-f16", "--backends", "pyg",
                 "--data-root", root, "--time-limit", "0", "--out", str(tmp_path), *FAST]) == 0
    assert agg.read_text() == before  # ... but not with pyg alone


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a backend that cannot run here")
def test_only_unavailable_backends_are_refused_and_the_file_kept(tmp_path):
    """``--backends pyg-graphed`` on the CPU rewrote the results file with no records."""
    path = tmp_path / "paper" / "cpu.json"
    path.parent.mkdir()
    path.write_text('{"suite": "paper", "records": []}\n')
    with pytest.raises(SystemExit) as exc:
        main(["--suite", "paper", "--cases", "gcn-cora-h16", "--backends", "pyg-graphed",
              "--out", str(tmp_path), *FAST])
    assert "--backends" in str(exc.value.code) and "CUDA" in str(exc.value.code)
    assert path.read_text() == '{"suite": "paper", "records": []}\n'
