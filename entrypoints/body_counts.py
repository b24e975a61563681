"""BodyCounter: a large JSON body's list sizes, counted in a helper process (its json.loads holds no GIL here)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import threading
from typing import Any

# The lists check_raw_counts caps, and `n`. The helper answers {"messages": [length, first entry's kind], ...}.
NAMES = ("messages", "stop", "bad_words", "prompt")
_HELPER = r"""
import json, struct, sys
names = sys.argv[1:]
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = inp.read(8)
    if len(head) < 8:
        break
    body = inp.read(struct.unpack("<Q", head)[0])
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    skeleton = {}
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

    def skeleton(self, body: bytes) -> dict[str, Any]:
        """The body's capped lists as stand-ins of the right length ({"messages": [None] * 100000, ...}) and
        its `n`: enough for check_raw_counts. Empty for a body that is no JSON object."""
        proc = getattr(self._local, "proc", None)
        if proc is None or proc.poll() is not None:
            proc = self._local.proc = subprocess.Popen([sys.executable, "-c", _HELPER, *NAMES],
                                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        proc.stdin.write(struct.pack("<Q", len(body)))
        proc.stdin.write(body)
        proc.stdin.flush()
        counts = json.loads(proc.stdout.readline() or b"{}")
        out: dict[str, Any] = {"n": counts.pop("n")} if "n" in counts else {}
        for name, (length, kind) in counts.items():
            out[name] = [_KINDS.get(kind)] * length
        return out
