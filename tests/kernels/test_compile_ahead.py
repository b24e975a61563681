"""kernels/compile_ahead.py: inside the block a Triton launch compiles its variant on a thread pool and runs
nothing; after it, the first real launch of that variant compiles nothing more and computes the right values.
Off CUDA the block does nothing (the CPU suite: the Triton interpreter, the torch backend)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from replayllm.kernels.compile_ahead import compile_ahead, compile_ahead_workers

SCRIPT = r"""
import torch, triton, triton.language as tl
from replayllm.kernels.compile_ahead import compile_ahead

@triton.jit
def scale_kernel(x_ptr, out_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * FACTOR, mask=mask)

compiled = []  # every call of the hook: a launch whose variant is not in the process's cache (yet)
triton.knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(str(kw["key"])) and False
x = torch.arange(1000, device="cuda", dtype=torch.float32)
outs = {f: torch.zeros_like(x) for f in (2, 3, 5, 7)}
with compile_ahead(x.device, "test"):
    for f, out in outs.items():
        scale_kernel[(8,)](x, out, x.numel(), FACTOR=f, BLOCK=128)
    torch.cuda.synchronize()
    assert all(int(out.count_nonzero()) == 0 for out in outs.values()), "a launch ran inside the block"
assert len(set(compiled)) == 4, compiled
compiled.clear()
for f, out in outs.items():
    scale_kernel[(8,)](x, out, x.numel(), FACTOR=f, BLOCK=128)
torch.cuda.synchronize()
assert compiled == [], f"the real launches compiled again: {compiled}"
for f, out in outs.items():
    assert torch.equal(out, x * f)
print("OK")
"""


def test_off_cuda_the_block_is_a_no_op():
    x = torch.zeros(4)
    with compile_ahead(torch.device("cpu"), "test"):
        x += 1  # code inside runs as usual
    assert x.tolist() == [1.0] * 4
    assert compile_ahead_workers() >= 1


def test_workers_follow_the_environment(monkeypatch):
    monkeypatch.setenv("REPLAYLLM_COMPILE_THREADS", "3")
    assert compile_ahead_workers() == 3
    monkeypatch.setenv("REPLAYLLM_COMPILE_THREADS", "1")
    assert compile_ahead_workers() == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compile-ahead needs CUDA")
def test_variants_compile_ahead_and_launch_after(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), TRITON_INTERPRET="0",
               REPLAYLLM_COMPILE_THREADS="4")
    script = tmp_path / "compile_ahead_check.py"  # a file: @triton.jit reads its kernel's source
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]
