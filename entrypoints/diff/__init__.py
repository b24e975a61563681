"""`replayllm.diff`: compare per-token logprobs of two sides (engine configs, transformers, a trace file).

Imports only from this folder (see the import hazard in docs/architecture.md); the engine, torch, transformers and
matplotlib load when a function runs, so `import replayllm.diff` costs little more than numpy. The functions
`compare` and `capture` share their names with their modules; importing them here, eagerly, keeps the
package attributes bound to the functions whatever is imported later.
"""

from .capture import capture, read_prompts
from .compare import compare
from .report import write_report
from .results import DiffResult, DiffStats, RequestDiff, TokenDiff
from .spec import SideSpec, SpecError, parse_spec
from .trace_file import TraceFileError, TraceRecord, read_traces, write_traces

__all__ = ["DiffResult", "DiffStats", "RequestDiff", "SideSpec", "SpecError", "TokenDiff", "TraceFileError",
           "TraceRecord", "capture", "compare", "parse_spec", "read_prompts", "read_traces", "write_report",
           "write_traces"]
