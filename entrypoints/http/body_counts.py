"""BodyCounter: a large JSON body's list sizes, counted in a helper process (its json.loads holds no GIL here)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
from typing import Any

from ... import json_depth
from ...json_depth import NestedTooDeep

# The lists check_raw_counts caps, and `n`. The helper answers {"messages": [length, first entry's kind], ...},
# or {"too_deep": [top-level key or null]} for a body nested deeper than the depth limit sent with it (0: none).
NAMES = ("messages", "stop", "bad_words", "prompt")
_HELPER = r"""
import importlib.util, json, struct, sys
spec = importlib.util.spec_from_file_location("json_depth", sys.argv[1])  # by path: no package import needed
json_depth = importlib.util.module_from_spec(spec)
spec.loader.exec_module(json_depth)
NestedTooDeep, check = json_depth.NestedTooDeep, json_depth.check
names = sys.argv[2:]
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = inp.read(12)
    if len(head) < 12:
        break
    size, max_depth = struct.unpack("<QI", head)
    body = inp.read(size)
    skeleton, data = {}, None
    try:
        if max_depth:
            check(body, max_depth)
        data = json.loads(body)
    except NestedTooDeep as e:
        skeleton["too_deep"] = [e.key]
    except (ValueError, RecursionError):
        pass
    if isinstance(data, dict):
        for k in names:
            v = data.get(k)
            if isinstance(v, list):
                skeleton[k] = [len(v), type(v[0]).__name__ if v else None]
        if type(data.get("n")) is int:
            skeleton["n"] = data["n"]
    out.write(json.dumps(skeleton).encode() + b"\n")
    out.flush()
"""
_KINDS = {"str": "", "list": [], "dict": {}}


class BodyCounter:
    """One helper process per pool thread (started on its first large body; it exits when this process
    does: end of its stdin). Why a process: json.loads of a 4 MB body of 100k chat messages is one C call
    that holds the GIL ~0.1-0.5 s, and every stream in this process would stall for it; counted there, a body
    far over a cap is refused without ever being parsed here."""

    def __init__(self):
        self._local = threading.local()

    def skeleton(self, body: bytes, max_depth: int = 0) -> dict[str, Any]:
        """The body's capped lists as stand-ins of the right length ({"messages": [None] * 100000, ...}) and
        its `n`: enough for check_raw_counts. Empty for a body that is no JSON object. NestedTooDeep when its
        arrays/objects nest deeper than max_depth levels (0: not checked); such a body is not parsed there."""
        proc = getattr(self._local, "proc", None)
        if proc is None or proc.poll() is not None:
            proc = self._local.proc = subprocess.Popen([sys.executable, "-c", _HELPER, json_depth.__file__, *NAMES],
                                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        proc.stdin.write(struct.pack("<QI", len(body), min(max_depth, 0xFFFFFFFF)))
        proc.stdin.write(body)
        proc.stdin.flush()
        counts = json.loads(proc.stdout.readline() or b"{}")
        if "too_deep" in counts:
            raise NestedTooDeep(counts["too_deep"][0], max_depth)
        out: dict[str, Any] = {"n": counts.pop("n")} if "n" in counts else {}
        for name, (length, kind) in counts.items():
            out[name] = [_KINDS.get(kind)] * length
        return out
