"""kernels/compile_workers.py: a Triton variant described as a CompileJob compiles in a worker process into the
on-disk cache, and the process's own compile of the same variant then finds it there (Triton compiles for a
CUDA target without a GPU, so this runs on CPU); jobs that cannot be described are refused; the workers stay off
where they cannot help."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest
import torch

KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, FACTOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * FACTOR, mask=mask)
'''

# In a fresh process (compiled Triton, its own Triton cache and forkserver): a worker compiles two variants; the
# process's compile of each then never builds IR (a cache hit); a variant no worker compiled does. Closures that
# cannot be described are refused.
SCRIPT = r"""
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, ".")
import ca_kernels
from replayllm.kernels import compile_workers

SIG = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "FACTOR": "constexpr", "BLOCK": "constexpr"}

def closure(factor, kernel=ca_kernels.scale_kernel, target=GPUTarget("cuda", 90, 32)):
    # the shape of Triton's async-compile closure: src, target, options (an object)
    src = ASTSource(kernel, SIG, {(3,): factor, (4,): 128}, {})
    options = type("Options", (), {})()
    def async_compile():
        return triton.compile(src, target=target, options=options.__dict__)
    return async_compile

assert compile_workers.job_of(closure(2, kernel=triton.jit(ca_kernels.scale_kernel.fn))) is None  # not the module's
assert compile_workers.job_of(closure(2, target=None)) is None
assert compile_workers.job_of(lambda: None) is None  # no closure
workers = compile_workers.CompileWorkers(2)
fn = closure(2)
assert not workers.compile(compile_workers.job_of(fn)), "sent before the server was up"  # the thread compiles
assert workers.wait_ready(120), "the compile server did not start"
built = []
make_ir = ASTSource.make_ir
ASTSource.make_ir = lambda self, *a, **k: (built.append(self.constants), make_ir(self, *a, **k))[1]
for factor in (3, 4):
    fn = closure(factor)
    job = compile_workers.job_of(fn)
    assert job is not None and job.module == "ca_kernels" and job.name == "scale_kernel", job
    assert job.constexprs == {(3,): factor, (4,): 128} and job.options == {}, job
    assert workers.compile(job), "the worker did not compile it"
    assert fn().metadata.name == "scale_kernel"
assert built == [] and workers.jobs == 2, built
closure(5)()
assert len(built) == 1, built  # no worker compiled this one: the process built it
workers.stop()
import time
start = time.perf_counter()
early = compile_workers.CompileWorkers(2)
early.stop()  # while its server still starts: returns at once, the server is closed once up
assert time.perf_counter() - start < 1.0
assert not early.wait_ready(120) and not early.compile(compile_workers.job_of(closure(6)))
print("OK")
"""


def test_a_worker_compiles_into_the_cache_the_process_then_reads(tmp_path):
    (tmp_path / "ca_kernels.py").write_text(KERNEL)
    (tmp_path / "check.py").write_text(SCRIPT)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "check.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]


def test_workers_stay_off_where_they_cannot_help(monkeypatch):
    """`_wanted` with a driver present (patched in: this CPU machine has none): on only with every condition
    met; each of the others turns it off; without a driver it is off."""
    from replayllm.kernels import compile_workers

    monkeypatch.setattr(compile_workers, "nvidia_driver_present", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("REPLAYLLM_COMPILE_WORKERS", "3")
    assert compile_workers.worker_count() == 3 and compile_workers._wanted()
    for name, value in (("REPLAYLLM_COMPILE_WORKERS", "1"), ("REPLAYLLM_COMPILE_WORKERS", "0"),
                        ("TRITON_INTERPRET", "1"), ("CUDA_VISIBLE_DEVICES", ""), ("CUDA_VISIBLE_DEVICES", "-1")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert not compile_workers._wanted(), (name, value)
    monkeypatch.setenv("REPLAYLLM_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="REPLAYLLM_COMPILE_WORKERS must be an integer"):
        compile_workers.worker_count()
    monkeypatch.setenv("REPLAYLLM_COMPILE_WORKERS", "3")
    monkeypatch.setattr(compile_workers, "nvidia_driver_present", lambda: False)
    assert not compile_workers._wanted() and compile_workers.start() is None
    assert compile_workers.running() is None


def _wanted_in_child(queue) -> None:
    from replayllm.kernels import compile_workers

    os.environ.update(TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="0", REPLAYLLM_COMPILE_WORKERS="2")
    compile_workers.nvidia_driver_present = lambda: True  # as on a GPU host
    queue.put(compile_workers._wanted())


@pytest.mark.parametrize("daemon", [True, False])
def test_a_daemonic_process_starts_no_workers(daemon):
    """A daemonic process may not have children (tensor-parallel workers are daemonic): off there, on in an
    ordinary child with the same settings."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_wanted_in_child, args=(queue,), daemon=daemon)
    proc.start()
    assert queue.get(timeout=120) is (not daemon)
    proc.join(30)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real async-compile closure needs CUDA")
def test_compile_ahead_sends_every_variant_to_the_workers(tmp_path):
    """On CUDA: inside compile_ahead each variant of a kernel in an importable module goes through a worker, and
    the real launches after the block compile nothing and compute the right values."""
    (tmp_path / "ca_kernels.py").write_text(KERNEL)
    script = r'''
import sys, torch, triton
sys.path.insert(0, ".")
import ca_kernels
from replayllm.kernels import compile_workers
from replayllm.kernels.compile_ahead import compile_ahead
compiled = []
triton.knobs.runtime.jit_cache_hook = lambda **kw: compiled.append(str(kw["key"])) and False
x = torch.arange(1000, device="cuda", dtype=torch.float32)
outs = {f: torch.zeros_like(x) for f in (2, 3, 5, 7)}
assert compile_workers.start().wait_ready(120)  # as the engine core process starts it, before it needs it
with compile_ahead(x.device, "test"):
    for f, out in outs.items():
        ca_kernels.scale_kernel[(8,)](x, out, x.numel(), FACTOR=f, BLOCK=128)
assert compile_workers.running() is not None and compile_workers.running().jobs == 4, compile_workers.running()
compiled.clear()
for f, out in outs.items():
    ca_kernels.scale_kernel[(8,)](x, out, x.numel(), FACTOR=f, BLOCK=128)
torch.cuda.synchronize()
assert compiled == [], compiled
assert all(torch.equal(out, x * f) for f, out in outs.items())
compile_workers.stop()
print("OK")
'''
    (tmp_path / "check.py").write_text(script)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), TRITON_INTERPRET="0",
               REPLAYLLM_COMPILE_THREADS="4", REPLAYLLM_COMPILE_WORKERS="2")
    proc = subprocess.run([sys.executable, "check.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-4000:]
