"""vLLM `serve` flags that replayllm takes so that vLLM command lines start: aliases (`--model`), accepted no-ops
with a note (`--trust-remote-code`, `--disable-log-requests`, `--max-seq-len-to-capture`), and flags it cannot
honour refused with a reason instead of argparse's "unrecognized" (`--revision R`, `--download-dir` for a hub
model, `--calculate-kv-scales`). `-tp` is engine_args.py's alias of --tensor-parallel-size; `--kv-cache-dtype` is
an engine option."""

from __future__ import annotations

import argparse
import os

from ...embedded_model import is_embedded
from ..vllm_options import DEFAULT_REVISION, check_capture_len, check_revision, download_dir_note


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vLLM compatibility", "vLLM flags accepted so vLLM command lines start "
                                                            "(docs/serving.md, 'vLLM flags')")
    add_model_option(group)
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted, no effect: replayllm runs only its own model code, never a checkpoint's")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="accepted, no effect: requests are not logged unless --enable-log-requests")
    group.add_argument("--calculate-kv-scales", action="store_true",
                       help="refused: an fp8 KV cache (--kv-cache-dtype fp8) stores K/V with scale 1, none computed")
    group.add_argument("--max-seq-len-to-capture", type=int, default=None, metavar="N",
                       help="accepted, no effect: CUDA graphs serve every context length up to --max-model-len")
    group.add_argument("--revision", default=None, metavar="REV",
                       help=f"only '{DEFAULT_REVISION}': a hub model is loaded at its default branch (for another "
                            "revision, download it to a folder and serve the folder)")
    group.add_argument("--download-dir", default=None, metavar="DIR",
                       help="accepted, no effect, for a local MODEL folder; refused for a hub model (set HF_HUB_CACHE)")


def add_model_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                        help="vLLM's spelling of the positional MODEL (give one of the two)")


def resolve_model_option(args: argparse.Namespace) -> None:
    """args.model from --model (vLLM's spelling); ValueError when it contradicts the positional MODEL."""
    if args.model_option is not None:
        if args.model is not None and args.model != args.model_option:
            raise ValueError(f"the positional MODEL ({args.model!r}) and --model ({args.model_option!r}) differ: "
                             "give the model once")
        args.model = args.model_option


def apply_compat_args(args: argparse.Namespace) -> list[str]:
    """Resolve the flags on `args` (args.model from --model); ValueError for what cannot be honoured, else the
    notes to log about flags accepted without effect. Runs before the model loads."""
    notes: list[str] = []
    resolve_model_option(args)
    _check_served_names(args)
    if args.trust_remote_code:
        notes.append("--trust-remote-code has no effect: replayllm runs its own implementation of the model's "
                     "architecture and never a checkpoint's Python code")
    if args.disable_log_requests:
        if args.enable_log_requests:
            raise ValueError("--disable-log-requests and --enable-log-requests contradict each other")
        notes.append("--disable-log-requests has no effect: requests are not logged unless --enable-log-requests")
    if args.calculate_kv_scales:
        raise ValueError("--calculate-kv-scales: not supported; replayllm's fp8 KV cache (--kv-cache-dtype fp8) rounds "
                         "K and V with scale 1, as vLLM does without calibrated scales (docs/config_axes.md)")
    if args.max_seq_len_to_capture is not None:
        check_capture_len(args.max_seq_len_to_capture, "--max-seq-len-to-capture")
        notes.append("--max-seq-len-to-capture has no effect: replayllm's CUDA graphs serve every context length "
                     "up to --max-model-len (their batch sizes: --max-cudagraph-capture-size)")
    check_revision(args.revision, "--revision")
    if note := download_dir_note(args.model, args.download_dir, "--download-dir"):
        notes.append(note)
    return notes


def _check_served_names(args: argparse.Namespace) -> None:
    """`serve --served-model-name a b MODEL`: argparse's nargs='+' takes MODEL as one more name and the server
    would serve the embedded model under all three names. Refused when no MODEL was given and the last name looks
    like one (a folder, a hub id, the embedded model's id)."""
    names = getattr(args, "served_model_name", None)
    if args.model is not None or not names:
        return
    last = names[-1]
    if os.path.isdir(last) or "/" in last or is_embedded(last):
        raise ValueError(f"--served-model-name took {last!r} as a served name, so no model was given (the "
                         f"embedded test model would be served as {', '.join(names)}). Put MODEL first: "
                         f"`replayllm serve {last} --served-model-name {' '.join(names[:-1]) or 'NAME'}`, or "
                         f"give it with --model")
