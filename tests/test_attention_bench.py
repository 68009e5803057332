"""CPU smoke tests of the ``attention`` benchmark suite (``python -m benchmarks.run
--suite attention``): the case grid and names, the JSON / markdown it writes, and that a
backend computing the wrong thing is caught by the correctness check and not timed."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import attention as bench
from benchmarks.run import main

FAST = ["--suite", "attention", "--allow-cpu", "--device", "cpu", "--steps", "1", "--warmup", "1", "--quiet", "--no-png"]


def test_case_grid_matches_the_issue():
    names = [c.name for c in bench.attention_cases()]
    assert len(names) == 5 * 3 * 2
    assert "bigbird-L16384-fwdbwd" in names and "window-L1024-fwd" in names
    quick = {c.name for c in bench.select_attention_cases(None, quick=True)}
    assert quick == {f"{m}-L{L}-{mode}" for m in ("window", "bigbird") for L in (4096, 16384) for mode in ("fwd", "fwdbwd")}
    assert bench.DEFAULT_BACKENDS == ("sdpa", "flex", "fusegnn")


def test_mask_definitions_at_4096():
    """Densities of the issue's masks (exact counts from the definitions)."""
    L = 4096
    window = bench.build_mask("window", L)
    blocks = window.block_map(128, 128)
    assert (blocks == 0).float().mean().item() == pytest.approx(0.85, abs=0.02)  # "85% of 128-blocks empty"
    bigbird = bench.build_mask("bigbird", L)
    assert (bigbird.block_map(128, 128) == 0).float().mean().item() == pytest.approx(0.70, abs=0.05)
    dilated = bench.build_mask("dilated", 64, bench.CPU_SIZES)
    d = dilated.dense()
    assert d[40, 40] and d[40, 38] and not d[40, 39] and not d[40, 40 - 2 * 8 - 2]


def test_smoke_run_writes_results(tmp_path, capsys):
    assert main(FAST + ["--out", str(tmp_path), "--cases", "window-*", "--backends", "sdpa,fusegnn"]) == 0
    doc = json.loads((tmp_path / "attention" / "cpu.json").read_text())
    assert doc["suite"] == "attention" and doc["anchor"] == "sdpa"
    assert set(doc["cases"]) == {"window-L256-fwd", "window-L256-fwdbwd"}
    records = {(r["case"], r["backend"]): r for r in doc["records"]}
    assert len(records) == 4
    for (case, backend), r in records.items():
        assert r["ok"], r["error"]
        assert r["ms"] > 0 and r["ideal_ms"] == pytest.approx(records[(case, "sdpa")]["ms"] * r["density"], rel=1e-3)
        assert 0 < r["density"] < 1
    fus = records[("window-L256-fwdbwd", "fusegnn")]
    assert fus["aggregation"] == "reference" and fus["rel_err"] < 1e-4 and fus["checked_against"]
    assert records[("window-L256-fwd", "sdpa")]["checked_against"] is None  # unmasked anchor: not checked
    md = (tmp_path / "attention" / "cpu.md").read_text()
    assert "| window-L256-fwdbwd | fusegnn |" in md
    assert "| window-L256-fwd | sdpa |" in capsys.readouterr().out


def test_wrong_backend_is_a_mismatch_and_not_timed(tmp_path, monkeypatch):
    def wrong(prep, device):
        return (lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v)), {}

    bad = bench.AttnBackend("fusegnn-wrong", False, bench._always, wrong)
    monkeypatch.setitem(bench.BACKENDS, "fusegnn-wrong", bad)
    assert main(FAST + ["--out", str(tmp_path), "--cases", "causal-L256-fwd", "--backends", "fusegnn-wrong"]) == 0
    (record,) = json.loads((tmp_path / "attention" / "cpu.json").read_text())["records"]
    assert not record["ok"] and record["error"].startswith("mismatch") and record["ms"] is None


def test_list(capsys):
    assert main(["--suite", "attention", "--list", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "suite attention: 8 of 30 cases" in out and "bigbird-L16384-fwdbwd" in out


def test_calibration_recommendation_rule():
    """DEFAULT_BLOCK_SIZE: best geometric mean per L; ELEMENT_MAX_FILL: the fill threshold
    minimising the rule's summed time (the element path wins only on the sparse case)."""
    from benchmarks.attention_calibrate import BLOCK_CONFIGS, recommend

    records = []

    def add(case, L, config, ms, fill=None, bm=None, bn=None):
        records.append(dict(case=case, L=L, config=config, ms=ms, fill=fill, BM=bm, BN=bn))

    for case, fill, element_ms in (("dense-ish", 0.8, 9.0), ("sparse", 0.02, 0.5)):
        for bm, bn in BLOCK_CONFIGS:
            ms = 1.0 if (bm, bn) == (128, 64) else 2.0
            add(case, 4096, f"block {bm}x{bn}", ms, fill, bm, bn)
        add(case, 4096, "element", element_ms)
    rec = recommend(records, [4096])
    assert rec["DEFAULT_BLOCK_SIZE"] == {4096: [128, 64]}
    assert 0.02 < rec["ELEMENT_MAX_FILL"] <= 0.8
    best = {row["case"]: row["best"] for row in rec["per_case"]}
    assert best == {"dense-ish": "block 128x64", "sparse": "element"}
