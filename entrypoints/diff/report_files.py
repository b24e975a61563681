"""Writing a diff's report folder: diff.json, summary.md, report.html, the PNG plots and the exports."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .export import parse_export_formats, write_export
from .html_report import write_html
from .report import to_json, to_markdown
from .results import DiffResult

JSON_NAME = "diff.json"
SUMMARY_NAME = "summary.md"


@dataclass(frozen=True)
class ReportFiles:
    directory: Path
    json: Path
    summary: Path
    plots: list[Path]
    html: Path | None = None  # report.html (None: html=False)
    exports: list[Path] = field(default_factory=list)  # positions.<format> (export=...)


def default_out_dir(parent: str | os.PathLike = ".") -> Path:
    """A new folder name `diff-YYYYmmdd-HHMMSS` under `parent` (suffixed -2, -3, ... if taken)."""
    base = Path(parent) / time.strftime("diff-%Y%m%d-%H%M%S")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def make_out_dir(out_dir: str | os.PathLike | None = None) -> Path:
    """Create the report folder (default: a new timestamped one) and check a file can be written in it: the CLI
    calls this before any side runs, so a bad --out costs no engine time. Raises ValueError in one line."""
    directory = Path(out_dir) if out_dir is not None else default_out_dir()
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"cannot write the report to {str(directory)!r}: it is an existing file, not a folder")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # A probe file, not os.access: root passes os.access on read-only mounts and /proc.
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ValueError(f"cannot write the report to {str(directory)!r}: "
                         f"{e.strerror or type(e).__name__}") from None
    return directory


def remove_if_empty(directory: Path) -> None:
    """Undo make_out_dir's folder after a failed run (a folder that holds anything, e.g. an earlier report, stays)."""
    try:
        directory.rmdir()
    except OSError:
        pass


def write_report(result: DiffResult, out_dir: str | os.PathLike | None = None, *, plots: bool = True,
                 html: bool = True, export: str | Sequence[str] = ()) -> ReportFiles:
    """Write diff.json, summary.md, report.html (html=True: one self-contained page, plots inline), the PNGs
    (plots=True) and the per-position exports (export: "parquet", "csv", "jsonl", a comma list or a sequence;
    see export.py) into out_dir (default: a new timestamped folder in the current directory). Returns the
    paths written."""
    formats = parse_export_formats(export)  # a bad format (or parquet without pyarrow) fails before writing
    directory = make_out_dir(out_dir)
    pngs: list[Path] = []
    if plots:
        from .plots import write_plots

        pngs = write_plots(result, directory)
    json_path = directory / JSON_NAME
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(to_json(result), f, indent=1, ensure_ascii=False, allow_nan=False)
        f.write("\n")
    summary_path = directory / SUMMARY_NAME
    summary_path.write_text(to_markdown(result, [p.name for p in pngs]), encoding="utf-8")
    html_path = write_html(result, directory, pngs) if html else None
    exports = write_export(result, directory, formats) if formats else []
    return ReportFiles(directory, json_path, summary_path, pngs, html_path, exports)


