"""Ctrl-C on an LLM with tensor_parallel_size=2 on CPU (gloo, two worker processes), opt-in
(REPLAYLLM_TEST_TP_CTRL_C=1): SIGINT mid-generation stops the script and every worker, none left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.server_utils import alive

pytestmark = pytest.mark.serial  # a signal and a 120 s bound: `make test` runs it alone

_CTRL_C_SCRIPT = """
import faulthandler
import signal
import sys
from replayllm import LLM, SamplingParams
if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks if it hangs
    llm = LLM(sys.argv[1], tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=256,
              skip_tokenizer_init=True)
    print("PIDS", *llm.llm_engine.runner.worker_pids, flush=True)
    while True:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=200, ignore_eos=True),
                     use_tqdm=False)
"""


@pytest.mark.skipif(not os.environ.get("REPLAYLLM_TEST_TP_CTRL_C"), reason=(
    "opt-in: it hung in both full-suite runs of session 12 (rank 0 in a gloo all_reduce of the decoder after "
    "SIGINT), cause unknown, and has passed in every run since (3 full suites, 3 serial passes, 6 alone, 88 "
    "stress trials under load); run it with REPLAYLLM_TEST_TP_CTRL_C=1 (on a hang it prints every rank's "
    "stacks and SIGINT dispositions). Issue 31."))
def test_ctrl_c_stops_the_workers(tiny_models, tmp_path):
    script = tmp_path / "serve_forever.py"
    script.write_text(_CTRL_C_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), tiny_models["qwen3"]], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        line = proc.stdout.readline()
        while line and not line.startswith("PIDS"):
            line = proc.stdout.readline()
        assert line.startswith("PIDS"), "the script never started its workers"
        workers = [int(p) for p in line.split()[1:]]
        dispositions = f"rank 0: {_sigint_disposition(proc.pid)}; this pytest process: {_sigint_disposition('self')}"
        time.sleep(1.0)  # mid-generation
        proc.send_signal(signal.SIGINT)
        # Generous bounds: the test is that Ctrl-C stops everything, not how fast (a loaded CI machine once took
        # over 20 s to unwind the gloo workers).
        try:
            returncode = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            for pid in [proc.pid, *workers]:  # every thread's Python stack into the output, then fail with it
                os.kill(pid, signal.SIGUSR1)
            time.sleep(2.0)
            proc.kill()
            pytest.fail(f"Ctrl-C did not stop the engine within 120 s (SIGINT {dispositions}); its threads' "
                        "stacks:\n" + proc.stdout.read())
        assert returncode != 0
        assert "KeyboardInterrupt" in proc.stdout.read()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _sigint_disposition(pid) -> str:
    """How the process's main thread treats SIGINT (from /proc: ignored and blocked are inherited across exec,
    so a parent that ignores it starts children that ignore it too)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    bit = 1 << (signal.SIGINT - 1)
    states = [name for name, key in (("ignored", "SigIgn"), ("blocked", "SigBlk"), ("caught", "SigCgt"))
              if int(fields[key], 16) & bit]
    return "+".join(states) or "default"


def _alive(pid: int) -> bool:
    """Running. Not `os.kill(pid, 0)`: that also succeeds for a zombie, which a worker whose parent exited
    stays for good under a PID 1 that reaps nobody (a container's init-less PID 1), and the wait below then
    ran to its deadline and failed though every worker had exited."""
    return alive(pid)
