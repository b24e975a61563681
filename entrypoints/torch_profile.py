"""vLLM's `LLM.start_profile()` / `LLM.stop_profile()`: torch.profiler around whatever the engine runs in between (its
steps run in the LLM's process: CPU ops, and CUDA kernels on a GPU), written as a Chrome trace into the folder that
REPLAYLLM_TORCH_PROFILER_DIR (or vLLM's VLLM_TORCH_PROFILER_DIR) names. Without either, start_profile is a
RuntimeError, as vLLM's "profiler is not enabled". With tensor_parallel_size > 1 only rank 0 (this process) is
traced."""

from __future__ import annotations

import itertools
import os
import time

import torch

PROFILER_DIR_ENV = ("REPLAYLLM_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")
_traces = itertools.count()


def profiler_dir() -> str | None:
    """The folder traces go to (the first of PROFILER_DIR_ENV that is set), or None."""
    return next((os.environ[name] for name in PROFILER_DIR_ENV if os.environ.get(name)), None)


class TorchProfile:
    """One engine's profile: start, then stop (which writes the trace and returns its path)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profile: torch.profiler.profile | None = None

    def start(self) -> None:
        if profiler_dir() is None:
            raise RuntimeError(f"profiling is not enabled: set {PROFILER_DIR_ENV[0]} (or {PROFILER_DIR_ENV[1]}) to "
                               "the folder the traces go to")
        if self._profile is not None:
            raise RuntimeError("a profile is already running: call stop_profile() first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()

    def stop(self) -> str:
        """Stop and write the trace: its path (REPLAYLLM_TORCH_PROFILER_DIR/replayllm-PID-TIME-N.pt.trace.json)."""
        if self._profile is None:
            raise RuntimeError("no profile is running: call start_profile() first")
        profile, self._profile = self._profile, None
        profile.stop()
        folder = profiler_dir() or "."
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"replayllm-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}-"
                                    f"{next(_traces)}.pt.trace.json")
        profile.export_chrome_trace(path)
        return path
