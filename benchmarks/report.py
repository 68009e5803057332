"""Results on disk: the JSON (written after every record), the markdown table, the PNG.

Layout: ``<out>/<suite>/<gpu-slug>.{json,md,png}`` with ``<out>`` = ``benchmarks/results``
by default and ``<gpu-slug>`` the device name in lower case with runs of other
characters turned into ``-`` (``nvidia-h100-80gb-hbm3``; ``cpu`` on a CPU run).

Re-render the table and chart of an existing JSON (e.g. one fetched from a GPU machine;
each suite's own table: paper, agg, attention, vector, loss, sampled, dist) and put its
table into ``benchmarks/README.md``::

    python -m benchmarks.report benchmarks/results/paper/nvidia-h100-80gb-hbm3.json --update-readme
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

__all__ = [
    "markdown_table",
    "write_sweep_result",
    "ANCHORS",
    "DISPLAY_ORDER",
    "ResultFile",
    "environment",
    "gpu_slug",
    "render_markdown",
    "write_png",
    "update_readme",
    "main",
]

#: The row every other row of a case is compared with, per suite.
ANCHORS = {"paper": "pyg", "agg": "cusparse"}
#: Row order within a case in the table and the chart.
DISPLAY_ORDER = (
    "pyg", "pyg-uncached", "pyg-graphed", "pyg-compiled", "cusparse", "gather-scatter",
    "fusegnn", "fusegnn-graphed", "fusegnn-compiled", "fusegnn-gas", "fusegnn-gar", "fusegnn-reference",
)
README = Path(__file__).resolve().parent / "README.md"


# ----------------------------------------------------------------------------- environment


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine() or 'unknown'}, {os.cpu_count()} cores)"


def gpu_slug(device: torch.device) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``; ``cpu`` for a CPU run."""
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-") or "cuda"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001 - absent or broken: recorded as null
        return None


def environment(device: torch.device) -> dict:
    """The header fields of a results file."""
    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch_geometric": _version("torch_geometric"),
        "python": platform.python_version(),
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


# ----------------------------------------------------------------------------- the JSON


class ResultFile:
    """A results document kept on disk: every :meth:`add` rewrites the JSON atomically,
    so a run killed half-way leaves the records measured so far."""

    def __init__(self, path: Path, header: dict, *, append: bool = False, rerun_cases: Iterable[str] = ()):
        self.path = Path(path)
        self.doc = dict(header)
        self.doc.setdefault("cases", {})
        self.doc.setdefault("datasets", {})
        self.doc.setdefault("unavailable", {})
        self.doc["records"] = []
        self._previous: list[dict] = []  # the old records of the cases run now
        if append and self.path.is_file():
            old = _read_results(self.path)
            rerun = set(rerun_cases)
            self.doc["records"] = [r for r in old.get("records", []) if r.get("case") not in rerun]
            self._previous = [r for r in old.get("records", []) if r.get("case") in rerun]
            cases = {k: v for k, v in old.get("cases", {}).items()}
            cases.update(self.doc["cases"])
            self.doc["cases"] = cases
            self.doc["datasets"] = {**old.get("datasets", {}), **self.doc["datasets"]}
            self.doc["unavailable"] = {**old.get("unavailable", {}), **self.doc["unavailable"]}
        self.write()

    def restore(self, case: str) -> bool:
        """Put back the appended file's records of ``case`` (a case that was to be run
        but was not, e.g. past ``--time-limit``); whether it had any."""
        kept = [r for r in self._previous if r.get("case") == case]
        self.doc["records"].extend(kept)
        self._previous = [r for r in self._previous if r.get("case") != case]
        if kept:
            self.write()
        return bool(kept)

    def add(self, record: dict) -> None:
        self.doc["records"].append(record)
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(self.doc, handle, indent=1, allow_nan=False, default=_json_default)
                handle.write("\n")
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _read_results(path: Path) -> dict:
    """The results document at ``path``; :class:`ValueError` naming it when it is not one
    (to append to, so that it is not overwritten)."""
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"cannot append to {path}: not valid JSON ({err})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("records", []), list):
        raise ValueError(f"cannot append to {path}: not a results file (no 'records' list)")
    return doc


def _json_default(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def clean_number(value: float | None, digits: int = 6) -> float | None:
    """``value`` to ``digits`` significant digits for the JSON; NaN / inf become
    ``None`` (JSON has no NaN)."""
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return None
    return float(f"{float(value):.{digits}g}")


# ----------------------------------------------------------------------------- markdown


def _num(value: float | None) -> str:
    if value is None:
        return "—"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    if value >= 0.01:
        return f"{value:.2f}"
    return f"{value:.2g}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else (f"{value:.2f}x" if value < 100 else f"{value:.0f}x")


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _status(record: dict) -> str:
    if record.get("ok"):
        return "ok (oracle)" if record.get("checked_against") is None else "ok"
    error = str(record.get("error") or "failed").split(" | at ")[0].replace("|", "/").replace("\n", " ")
    return error if len(error) <= 70 else error[:67] + "..."


def sorted_records(doc: dict) -> list[dict]:
    """Records in case order (the ``cases`` table), then :data:`DISPLAY_ORDER`."""
    case_rank = {name: k for k, name in enumerate(doc.get("cases", {}))}

    def key(record: dict):
        name = record.get("backend", "")
        rank = DISPLAY_ORDER.index(name) if name in DISPLAY_ORDER else len(DISPLAY_ORDER)
        return (case_rank.get(record.get("case"), len(case_rank)), rank, name)

    return sorted(doc.get("records", []), key=key)


def _anchors(doc: dict) -> dict[str, dict]:
    anchor = ANCHORS.get(doc.get("suite", ""), "")
    return {r["case"]: r for r in doc.get("records", []) if r.get("backend") == anchor and r.get("ok")}


def render_markdown(doc: dict, heading: str = "##") -> str:
    """The results table of ``doc`` with each row's ratios to the anchor row of its case."""
    suite = doc.get("suite", "?")
    anchor = ANCHORS.get(suite, "?")
    anchors = _anchors(doc)
    config = doc.get("config", {})
    lines = [
        f"{heading} `{suite}` on {doc.get('device', '?')}",
        "",
        f"torch {doc.get('torch')}, triton {doc.get('triton')}, torch_geometric {doc.get('torch_geometric')}, "
        f"CUDA {doc.get('cuda')}; {doc.get('date')}. Median of {config.get('steps', '?')} timed steps; "
        f"speedup = `{anchor}` ms / ms and mem = peak / `{anchor}` peak, within each case.",
        "",
    ]
    if suite == "agg":
        lines += [
            "| case | backend | agg | fwd ms | bwd ms | fwd speedup | bwd speedup | peak MiB | mem | launches fwd/bwd | convert ms | status |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
    else:
        lines += [
            "| case | backend | agg | ms | speedup | peak MiB | mem | launches | norm ms | convert ms | status |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
    for r in sorted_records(doc):
        base = anchors.get(r["case"], {})
        ok = bool(r.get("ok"))
        ms = r.get("ms") if ok else None
        peak = r.get("peak_mem_mib") if ok else None
        cells = [f"`{r['case']}`", f"`{r['backend']}`", r.get("aggregation") or "—", _num(ms)]
        if suite == "agg":
            bwd = r.get("bwd_ms") if ok else None
            launches = "—" if r.get("launches") is None else f"{r['launches']}/{r.get('bwd_launches')}"
            cells += [
                _num(bwd), _ratio(_div(base.get("ms"), ms)), _ratio(_div(base.get("bwd_ms"), bwd)),
                _num(peak), _ratio(_div(peak, base.get("peak_mem_mib"))), launches,
                _num(r.get("convert_ms")), _status(r),
            ]
        else:
            cells += [
                _ratio(_div(base.get("ms"), ms)), _num(peak), _ratio(_div(peak, base.get("peak_mem_mib"))),
                "—" if r.get("launches") is None else str(r["launches"]),
                _num(r.get("norm_ms")), _num(r.get("convert_ms")), _status(r),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    for name, info in doc.get("datasets", {}).items():
        notes.append(
            f"- data `{name}`: {info.get('nodes')} nodes, {info.get('edges')} edges, "
            f"{info.get('features')} features; {info.get('source')}"
        )
    for r in sorted_records(doc):
        if r.get("ok") and r.get("compile_ms") is not None:
            notes.append(f"- `{r['backend']}` on `{r['case']}`: first step (compilation) "
                         f"{_num(r['compile_ms'])} ms, not in its ms")
    for name, reason in doc.get("unavailable", {}).items():
        notes.append(f"- backend `{name}` not run: {reason}")
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- PNG


def write_png(doc: dict, path: Path) -> str | None:
    """Grouped bar chart (log scale) of time and peak memory per case and backend.
    Returns ``None`` when written, else why not (matplotlib missing, nothing to plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as err:  # noqa: BLE001
        return f"matplotlib unavailable ({type(err).__name__}); pip install -e '.[bench]'"
    records = [r for r in sorted_records(doc) if r.get("ok")]
    if not records:
        return "no successful records to plot"
    suite = doc.get("suite", "?")
    panels = [("ms", "forward ms" if suite == "agg" else "training step, ms")]
    if suite == "agg":
        panels.append(("bwd_ms", "backward ms"))
    panels.append(("peak_mem_mib", "peak extra memory, MiB"))
    cases = [c for c in doc.get("cases", {}) if any(r["case"] == c for r in records)]
    names = [n for n in DISPLAY_ORDER if any(r["backend"] == n for r in records)]
    names += sorted({r["backend"] for r in records} - set(names))
    width = 0.8 / max(len(names), 1)
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8.0, 0.55 * len(cases) * max(1.0, len(names) / 3)),
                                                    3.2 * len(panels)), squeeze=False)
    for ax, (field, label) in zip(axes[:, 0], panels):
        plotted = False
        for k, name in enumerate(names):
            xs, ys = [], []
            for i, case in enumerate(cases):
                value = next((r.get(field) for r in records if r["case"] == case and r["backend"] == name), None)
                if value is not None and value > 0:
                    xs.append(i + (k - (len(names) - 1) / 2) * width)
                    ys.append(value)
            if xs:
                ax.bar(xs, ys, width, label=name)
                plotted = True
        ax.set_ylabel(label)
        ax.set_xticks(range(len(cases)))
        ax.set_xlim(-0.5, len(cases) - 0.5)
        ax.set_xticklabels(cases, rotation=45, ha="right", fontsize=8)
        if plotted:
            ax.set_yscale("log")
        else:
            ax.text(0.5, 0.5, "not measured on this device", transform=ax.transAxes, ha="center")
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0, 0].legend(fontsize=8, ncol=min(len(names), 4))
    axes[0, 0].set_title(f"{suite} on {doc.get('device')} (missing bars: OOM / failed / not run)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------- README


def update_readme(readme: Path, suite: str, table: str, source: str) -> bool:
    """Replace the text between ``<!-- results:<suite>:begin -->`` and
    ``<!-- results:<suite>:end -->`` in ``readme``; ``False`` (the file untouched) if the
    markers are missing or the end marker does not follow the begin marker."""
    text = readme.read_text()
    begin, end = f"<!-- results:{suite}:begin -->", f"<!-- results:{suite}:end -->"
    if begin not in text or end not in text.split(begin, 1)[1]:
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    body = f"{begin}\n_From `{source}`._\n\n{table.strip()}\n{end}"
    readme.write_text(head + body + tail)
    return True


def suite_renderers(suite: str) -> tuple[Callable[[dict, str], str], Callable[[dict, Path], str | None]]:
    """``(render(doc, heading), write_png(doc, path))`` of a suite's results file: the
    suites with their own grid have their own table and chart (rendering them with the
    paper / agg table wrote wrong columns over their ``.md``)."""
    if suite in ANCHORS:
        return render_markdown, write_png
    if suite == "attention":
        from benchmarks import attention

        return (lambda doc, heading: attention.render_markdown(doc, heading=heading)), attention.write_png
    if suite == "vector":
        from benchmarks import vector

        return (lambda doc, heading: vector.render_markdown(doc)), vector.write_png
    if suite == "loss":
        from benchmarks import loss

        return (lambda doc, heading: loss.render_markdown(doc)), loss._write_png
    if suite == "sampled":
        from benchmarks import sampled

        return (lambda doc, heading: sampled.render(doc) + "\n"), sampled.write_png
    if suite == "dist":
        from benchmarks import dist

        return (lambda doc, heading: dist.render_markdown(doc) + "\n"), dist.write_png
    raise ValueError(f"no table for results of suite {suite!r} (a sweep's or the overhead suite's file?); "
                     f"known: {', '.join((*ANCHORS, 'attention', 'vector', 'loss', 'sampled', 'dist'))}")


def render_outputs(json_path: Path, *, png: bool = True, readme: Path | None = None) -> tuple[str, str | None]:
    """Write ``<stem>.md`` (and ``<stem>.png``) beside ``json_path`` with its suite's table
    and chart; update ``readme`` if given. Returns ``(markdown, why the PNG was not written
    or None)``; :class:`ValueError` (nothing written) for a file of no known suite."""
    doc = json.loads(Path(json_path).read_text())
    suite = doc.get("suite") if isinstance(doc, dict) else None
    render, png_writer = suite_renderers(str(suite))
    table = render(doc, "##")
    json_path = Path(json_path)
    json_path.with_suffix(".md").write_text(table)
    why = png_writer(doc, json_path.with_suffix(".png")) if png else "--no-png"
    if readme is not None:
        try:
            source = str(json_path.resolve().relative_to(readme.resolve().parent.parent))
        except ValueError:
            source = json_path.name
        if not update_readme(readme, str(suite), render(doc, "###"), source):
            print(f"warning: no results markers for suite {doc.get('suite')!r} in {readme}", file=sys.stderr)
    return table, why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Re-render results JSON files as markdown / PNG.")
    parser.add_argument("json", nargs="+", type=Path, help="results files written by benchmarks.run")
    parser.add_argument("--no-png", action="store_true")
    parser.add_argument("--update-readme", action="store_true", help=f"put the tables into {README}")
    args = parser.parse_args(argv)
    for path in args.json:
        try:
            table, why = render_outputs(path, png=not args.no_png, readme=README if args.update_readme else None)
        except (OSError, ValueError) as err:  # missing, unreadable, not JSON, no known suite
            raise SystemExit(f"benchmarks.report: {path}: {err}") from None
        if why and not args.no_png:
            print(f"PNG not written: {why}", file=sys.stderr)
        print(table)
    return 0

def write_sweep_result(out_dir: Path, name: str, device, doc: dict, lines: list[str]) -> Path:
    """A sweep's result: ``doc`` as ``<out_dir>/<name>-<gpu-slug>.json`` and the markdown
    ``lines`` beside it (``.md``, also printed); returns the JSON's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{gpu_slug(device)}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return path


def markdown_table(columns: list[tuple[str, str]], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table: ``columns`` as ``(title, alignment)`` pairs
    (``"l"`` or ``"r"``), then one line per row of cells."""
    lines = ["| " + " | ".join(title for title, _ in columns) + " |",
             "|" + "|".join("---:" if align == "r" else "---" for _, align in columns) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


if __name__ == "__main__":
    sys.exit(main())
