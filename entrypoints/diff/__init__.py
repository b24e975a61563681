"""`replayllm.entrypoints.diff`: compare per-token logprobs of two sides (engine configs, transformers, a trace file).

Imports only from this folder (see the import hazard in docs/architecture.md); the engine, torch, transformers and
matplotlib load when a function runs, so `import replayllm.entrypoints.diff` costs little more than numpy. The functions
`compare` and `capture` share their names with their modules; importing them here, eagerly, keeps the
package attributes bound to the functions whatever is imported later.
"""

from .capture import Capture, capture, capture_run, read_prompts
from .compare import compare
from .export import EXPORT_FORMATS, export_rows, write_export
from .html_report import write_html
from .report_files import write_report
from .results import DiffResult, DiffStats, Flip, RequestDiff, TokenDiff
from .spec import SideSpec, SpecError, parse_spec
from .trace_file import TraceFile, TraceFileError, TraceRecord, read_trace_file, read_traces, write_traces

__all__ = ["EXPORT_FORMATS", "Capture", "DiffResult", "DiffStats", "Flip", "RequestDiff", "SideSpec", "SpecError",
           "TokenDiff", "TraceFile", "TraceFileError", "TraceRecord", "capture", "capture_run", "compare",
           "export_rows", "parse_spec", "read_prompts", "read_trace_file", "read_traces", "write_export",
           "write_html", "write_report", "write_traces"]
