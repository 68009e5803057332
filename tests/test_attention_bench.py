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
    assert bench.DEFAULT_BACKENDS == ("sdpa", "sdpa-graphed", "flex", "flex-graphed", "fusegnn", "fusegnn-graphed")


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


def test_graphed_backends_are_registered():
    """``sdpa-graphed``, ``flex-graphed``, ``fusegnn-graphed``: default, CUDA only, cases up
    to L = 4096, compared with the captured anchors."""
    cpu = torch.device("cpu")
    cases = bench.attention_cases()
    for name, twin in (("sdpa-graphed", "sdpa"), ("flex-graphed", "flex"), ("fusegnn-graphed", "fusegnn")):
        backend = bench.BACKENDS[name]
        assert backend.graphed and backend.default and not bench.BACKENDS[twin].graphed
        assert backend.checked == bench.BACKENDS[twin].checked
        assert backend.unavailable(cpu).startswith("CUDA graphs need a CUDA device")
        assert {c.L for c in cases if backend.applies(c)} == {1024, 4096}
    assert bench.anchor_name("sdpa", True) == "sdpa-graphed" and bench.anchor_name("flex", False) == "flex"
    runnable, unavailable = bench.select_attention_backends(cpu, ["*-graphed"])
    assert runnable == [] and set(unavailable) == {"sdpa-graphed", "flex-graphed", "fusegnn-graphed"}


def test_capture_step_needs_cuda():
    from benchmarks.graphs import capture_step

    with pytest.raises(ValueError, match="device must be a CUDA device"):
        capture_step(lambda: None, torch.device("cpu"))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="warmup must be an int >= 1"):
            capture_step(lambda: None, torch.device("cuda"), warmup=0)


class _EagerReplay:
    """Stands in for a CUDA-graph capture on the CPU: every "replay" runs the step."""

    def __init__(self, step, device, scale: float = 1.0):
        step()  # the warm-up
        self.step, self.scale = step, scale

    def __call__(self):
        return tuple(t * self.scale for t in self.step())


def _graphed_on_cpu(monkeypatch, scale: float = 1.0) -> None:
    import dataclasses

    for name in ("sdpa-graphed", "fusegnn-graphed"):
        monkeypatch.setitem(bench.BACKENDS, name, dataclasses.replace(bench.BACKENDS[name], unavailable=bench._always))
    monkeypatch.setattr(bench.graphs, "capture_step", lambda step, device: _EagerReplay(step, device, scale))


def test_graphed_rows_on_cpu(tmp_path, monkeypatch):
    """The graphed rows' path with an eager stand-in for the capture: replay checked
    against the eager step and the masked reference, timed, compared with sdpa-graphed."""
    _graphed_on_cpu(monkeypatch)
    assert main(FAST + ["--out", str(tmp_path), "--cases", "window-*",
                        "--backends", "sdpa,sdpa-graphed,fusegnn-graphed"]) == 0
    doc = json.loads((tmp_path / "attention" / "cpu.json").read_text())
    records = {(r["case"], r["backend"]): r for r in doc["records"]}
    assert len(records) == 6
    for case in ("window-L256-fwd", "window-L256-fwdbwd"):
        fus, sdpa_g = records[(case, "fusegnn-graphed")], records[(case, "sdpa-graphed")]
        assert fus["ok"] and sdpa_g["ok"], (fus, sdpa_g)
        assert fus["replay_rel_err"] == 0.0 and sdpa_g["replay_rel_err"] == 0.0
        assert fus["rel_err"] < 1e-4 and fus["checked_against"] and sdpa_g["checked_against"] is None
        assert fus["vs_sdpa"] == pytest.approx(sdpa_g["ms"] / fus["ms"], rel=1e-3)
        assert records[(case, "sdpa")]["replay_rel_err"] is None
    md = (tmp_path / "attention" / "cpu.md").read_text()
    assert "| window-L256-fwdbwd | fusegnn-graphed |" in md


def test_graphed_row_whose_replay_differs_is_not_timed(tmp_path, monkeypatch):
    _graphed_on_cpu(monkeypatch, scale=1.5)
    assert main(FAST + ["--out", str(tmp_path), "--cases", "causal-L256-fwdbwd", "--backends", "fusegnn-graphed"]) == 0
    (record,) = json.loads((tmp_path / "attention" / "cpu.json").read_text())["records"]
    assert not record["ok"] and record["ms"] is None
    assert record["error"].startswith("replay mismatch") and record["replay_rel_err"] == pytest.approx(0.5, rel=1e-3)


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


def test_dense_backends_and_path_labels(tmp_path):
    """fusegnn-dense names the SDPA variant it ran; sdpa-causal runs (checked) on the
    causal case only."""
    assert main(FAST + ["--out", str(tmp_path), "--cases", "causal-L256-fwd,window-L256-fwdbwd",
                        "--backends", "fusegnn-dense,sdpa-causal"]) == 0
    doc = json.loads((tmp_path / "attention" / "cpu.json").read_text())
    records = {(r["case"], r["backend"]): r for r in doc["records"]}
    assert records[("causal-L256-fwd", "fusegnn-dense")]["aggregation"] == "dense sdpa (causal)"
    assert records[("window-L256-fwdbwd", "fusegnn-dense")]["aggregation"] == "dense sdpa (bool mask)"
    for key in (("causal-L256-fwd", "fusegnn-dense"), ("window-L256-fwdbwd", "fusegnn-dense"), ("causal-L256-fwd", "sdpa-causal")):
        assert records[key]["ok"] and records[key]["rel_err"] < 1e-4, records[key]
    wrong = records[("window-L256-fwdbwd", "sdpa-causal")]
    assert not wrong["ok"] and "not applicable" in wrong["error"]
    md = (tmp_path / "attention" / "cpu.md").read_text()
    assert "| dense sdpa (causal) |" in md


def test_cost_model_constants_come_from_the_fit():
    """The constants in fusegnn/attention/cost_model.py are what --fit gives on the stored H200 results."""
    from pathlib import Path

    from benchmarks.attention_calibrate import fit_cost_models, load_observations, observations
    from fusegnn.attention.cost_model import COST_MODELS, DENSE_CAUSAL_FACTOR, DENSE_MASK_FACTOR

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "attention"
    obs = observations(load_observations([
        results / "calibration-crossover-nvidia-h200.json", results / "calibration-element-nvidia-h200.json",
        results / "calibration-vector-nvidia-h200.json",
    ]))
    assert len(obs) == 198
    fit = fit_cost_models(obs)
    for mode, model in COST_MODELS.items():
        for name, value in vars(model).items():
            assert fit[mode][name] == pytest.approx(value, rel=6e-3), (mode, name)
    assert fit["DENSE_CAUSAL_FACTOR"] == pytest.approx(DENSE_CAUSAL_FACTOR, rel=6e-3)
    assert fit["DENSE_MASK_FACTOR"] == pytest.approx(DENSE_MASK_FACTOR, rel=6e-3)


def test_fit_recovers_a_known_model():
    """fit_cost_models on synthetic measurements of a known model returns it."""
    from benchmarks.attention_calibrate import fit_cost_models, observations

    a_d, c_d, a_b, c_b, f_c, f_m, a_v, c_v = 0.1, 2e-9, 0.4, 1e-5, 0.55, 2.5, 0.3, 1.5e-7
    records = []
    for L in (1024, 2048, 4096, 8192):
        base = dict(mask="m", L=L, batch=4, heads=12, head_dim=64, density=0.1, mode="fwdbwd")
        x = 48 * L * L
        records.append(dict(base, kind="sdpa", ms=a_d + c_d * x))
        records.append(dict(base, kind="sdpa-causal", ms=a_d + f_c * c_d * x))
        records.append(dict(base, kind="sdpa-mask", ms=a_d + f_m * c_d * x))
        nnzb = L // 64 * 5
        records.append(dict(base, kind="block", BM=64, BN=64, nnzb=nnzb, layout_heads=1, default_launch=True,
                            ms=a_b + c_b * nnzb * 48))
        records.append(dict(base, kind="block", BM=128, BN=64, nnzb=nnzb, layout_heads=1, default_launch=True, ms=99.0))
        entries = L // 16 * 300  # one mask head shared by the 48 pairs; W = 32 counts twice per entry
        records.append(dict(base, kind="vector", W=32, entries=entries, layout_heads=1, ms=a_v + c_v * entries * 48 * 2))
    fit = fit_cost_models(observations(records))
    m = fit["fwdbwd"]
    assert m["vector_overhead_ms"] == pytest.approx(a_v) and m["vector_ms_per_entry"] == pytest.approx(c_v)
    assert m["dense_overhead_ms"] == pytest.approx(a_d) and m["dense_ms_per_element"] == pytest.approx(c_d)
    assert m["block_overhead_ms"] == pytest.approx(a_b) and m["block_ms_per_block"] == pytest.approx(c_b)
    assert fit["DENSE_CAUSAL_FACTOR"] == pytest.approx(f_c) and fit["DENSE_MASK_FACTOR"] == pytest.approx(f_m)
    assert m["element_overhead_ms"] is None and fit["fwd"]["dense_overhead_ms"] is None


def test_random_calibration_masks():
    """``random<P>``: every pair with probability P % plus the diagonal, built in row slabs."""
    from benchmarks.attention_calibrate import RANDOM_DENSITY, calibration_mask

    for name, density in RANDOM_DENSITY.items():
        mask = calibration_mask(name, 1500, seed=3)
        dense = mask.dense()
        assert dense.shape == (1500, 1500) and bool(dense.diagonal().all())
        off = (dense.sum() - 1500).item() / (1500 * 1499)
        assert abs(off - density) < 4 * (density / (1500 * 1499)) ** 0.5 + 1e-4, (name, off)
    assert torch.equal(calibration_mask("random1", 300, 5).dense(), calibration_mask("random1", 300, 5).dense())


def test_calibration_run_on_tiny_sizes(tmp_path, monkeypatch):
    """The whole calibration (both passes, recommendation) on tiny sizes: on the GPU when
    there is one, else on the CPU with the block kernel through Triton's interpreter."""
    pytest.importorskip("triton")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from benchmarks import attention_calibrate as cal

    monkeypatch.setattr(cal, "GPU_SIZES", bench.CPU_SIZES)
    monkeypatch.setattr(cal, "BLOCK_CONFIGS", [(64, 64), (32, 64)])
    monkeypatch.setattr(cal, "FWD_SWEEP", [(4, 3), (2, 2)])
    monkeypatch.setattr(cal, "BWD_SWEEP", [(4, 2)])
    args = cal.parse_args(["--masks", "causal,window", "--lengths", "48,64", "--steps", "1", "--warmup", "1",
                           "--time-limit", "600", "--vector"])
    lines = []
    records = cal.calibrate(args, device, lines.append)
    kinds = {(r["case"], r["kind"]) for r in records if r.get("ms")}
    assert ("causal-L64-fwdbwd", "sdpa-causal") in kinds and ("window-L64-fwdbwd", "sdpa-causal") not in kinds
    for r in records:
        assert r["error"] is None, r
        assert r["kind"] == "sdpa" or r["rel_err"] < 1e-4
    vector = [r for r in records if r["kind"] == "vector"]
    assert len(vector) == 8 and all(r["entries"] > 0 and r["W"] == 16 and r["fill"] > 0 for r in vector)
    sweep = [r for r in records if r["kind"] == "block" and r["config"].startswith("block 32x64")]
    assert {(r["mode"], r["fwd_warps"], r["fwd_stages"]) for r in sweep if r["mode"] == "fwd"} == {("fwd", 4, 3), ("fwd", 2, 2)}
    rec = cal.build_recommendation(records, args.lengths)
    assert "COST_MODELS" in rec["cost_models_text"] and rec["cost_models"]["fwdbwd"]["dense_overhead_ms"] is not None
    assert {r["case"] for r in rec["crossover"]} == {f"{m}-L{L}-{mode}" for m in ("causal", "window") for L in (48, 64)
                                                     for mode in ("fwd", "fwdbwd")}
    assert set(rec["launch"]) == {"64x64", "32x64"} and set(rec["launch"]["32x64"]) == {"fwd", "bwd"}
    assert set(rec["block"]["DEFAULT_BLOCK_SIZE"]) == {48, 64}
    cal.print_recommendation(rec, lines.append)
    assert any(line.startswith("DEFAULT_BLOCK_SIZE") for line in lines)


def test_sweeps_run_through_the_harness(capsys, tmp_path):
    """``--sweep NAME``: the options after it are the sweep's; --fit needs no device; a
    GPU sweep on a CPU-only machine exits with a message; an unknown sweep names the known ones."""
    from pathlib import Path

    from benchmarks.run import _split_at_sweep

    assert _split_at_sweep(["--suite", "agg", "--sweep", "spmm", "--steps", "3"]) == (
        ["--suite", "agg", "--sweep", "spmm"], ["--steps", "3"])
    assert _split_at_sweep(["--sweep=kernels", "--out", "x"]) == (["--sweep=kernels"], ["--out", "x"])
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "attention"
    assert main(["--suite", "attention", "--sweep", "calibrate", "--fit",
                 str(results / "calibration-crossover-nvidia-h200.json")]) == 0
    assert "COST_MODELS" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no such sweep; known: --suite attention --sweep calibrate"):
        main(["--suite", "agg", "--sweep", "calibrate"])
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(["--suite", "attention", "--allow-cpu", "--device", "cpu", "--out", str(tmp_path), "--sweep", "kernels"])
    # the message depends on whether the machine has a CUDA device to offer instead
    with pytest.raises(SystemExit, match="needs a CUDA device|runs on cuda here"):
        main(["--suite", "agg", "--allow-cpu", "--device", "cpu", "--out", str(tmp_path), "--sweep", "spmm"])
    with pytest.raises(SystemExit):
        main(["--suite", "all", "--sweep", "spmm"])
    assert main(["--suite", "attention", "--list"]) == 0
    assert "sweep calibrate:" in capsys.readouterr().out


def test_calibration_time_limit_records_what_did_not_run():
    from benchmarks import attention_calibrate as cal

    args = cal.parse_args(["--masks", "causal", "--lengths", "64", "--time-limit", "0"])
    records = cal.calibrate(args, torch.device("cpu"), lambda line: None)
    assert records and all(r["ms"] is None and r["error"].startswith("not run: --time-limit") for r in records)


def test_interleaved_timing_takes_the_workloads_in_turn(monkeypatch):
    """interleaved_ms runs rounds of each workload in turn and reports per-workload medians."""
    from benchmarks import measure as M

    order = []
    monkeypatch.setattr(M, "_timed_step", lambda phases, device: [phases[0]()])

    def workload(name, ms):
        return [lambda: order.append(name) or ms]

    out = M.interleaved_ms([workload("a", 1.0), workload("b", 3.0)], torch.device("cpu"), steps=4, rounds=2)
    assert out == [1.0, 3.0]
    assert order == ["a", "a", "b", "b", "a", "a", "b", "b"]
    with pytest.raises(ValueError):
        M.interleaved_ms([workload("a", 1.0)], torch.device("cpu"), steps=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs fused kernels on CPU tensors through Triton's interpreter, which conftest enables only without a "
                    "CUDA device")
def test_vector_backends_on_irregular_masks(tmp_path):
    """The opt-in ``irregular*`` masks and ``fusegnn-vector*`` backends (issue 17) run and
    match the reference (through Triton's interpreter on the CPU)."""
    assert main(FAST + ["--out", str(tmp_path), "--cases", "irregular5-L256-fwdbwd,irregular1-L256-fwd",
                        "--backends", "fusegnn-element,fusegnn-vector,fusegnn-vector64"]) == 0
    doc = json.loads((tmp_path / "attention" / "cpu.json").read_text())
    records = {(r["case"], r["backend"]): r for r in doc["records"]}
    for case in ("irregular5-L256-fwdbwd", "irregular1-L256-fwd"):
        for backend in ("fusegnn-element", "fusegnn-vector", "fusegnn-vector64"):
            assert records[(case, backend)]["ok"] and records[(case, backend)]["rel_err"] < 1e-4, records[(case, backend)]
    assert records[("irregular1-L256-fwd", "fusegnn-vector")]["aggregation"] == "vector W16 x 64"
    assert records[("irregular1-L256-fwd", "fusegnn-vector64")]["block_size"] == "vector W64 x 64"
    assert 0 < records[("irregular5-L256-fwdbwd", "fusegnn-vector")]["block_density"] <= 1
