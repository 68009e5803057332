"""A line logger for the GPU scripts: prints each line and keeps the log file current, so
that a run cut short by its time limit still leaves what it printed."""

from __future__ import annotations

from pathlib import Path


class Tee:
    """``emit(line)`` prints ``line`` and rewrites ``path`` (if any) with every line so far."""

    def __init__(self, path: Path | None) -> None:
        self.lines: list[str] = []
        self.path = path

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)
        if self.path is not None:
            self.path.write_text("\n".join(self.lines) + "\n")
