"""Test set-up: Triton under the interpreter (no GPU here), offline hub, tiny HF models, KV-leak check."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit decorator runs
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing can be downloaded here

import weakref  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from replayllm.engine.llm_engine import LLMEngine  # noqa: E402

_ENGINES: "weakref.WeakSet[LLMEngine]" = weakref.WeakSet()
_orig_init = LLMEngine.__init__


def _tracking_init(self, *args, **kwargs):
    _orig_init(self, *args, **kwargs)
    _ENGINES.add(self)


LLMEngine.__init__ = _tracking_init


@pytest.fixture(autouse=True)
def no_kv_block_leak():
    """Every test ends with every engine idle and all of its KV blocks free (cached prefixes may stay)."""
    yield
    for engine in list(_ENGINES):
        sched = engine.scheduler
        assert not sched.has_unfinished(), f"requests left behind: {sched.running + list(sched.waiting)}"
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks, f"KV blocks leaked: {bm.num_blocks - bm.num_free_blocks}"
        assert all(b.ref_count == 0 for b in bm.blocks)
        assert not engine.output_processor.parents, "output state leaked"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run bench/gpu_check.sh on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Tiny random HF checkpoints (fp32) for the three supported architectures: name -> directory."""
    from hf_reference import save_tiny_models

    return save_tiny_models(tmp_path_factory.mktemp("tiny_models"))


# -- engines shared by the trace-replay end-to-end modules (module scope: one set per module) -------------
@pytest.fixture(scope="module")
def embedded():
    """The embedded model with trace replay on (device/dtype from REPLAYLLM_TEST_DEVICE/_DTYPE)."""
    from trace_replay_common import _opts

    from replayllm import LLM

    return LLM(enable_trace_replay=True, **_opts(max_model_len=512))


@pytest.fixture(scope="module")
def tiny_llms(tiny_models):
    from trace_replay_common import _tiny

    return {name: _tiny(path) for name, path in tiny_models.items()}


@pytest.fixture(scope="module")
def hf_models(tiny_models):
    from hf_reference import load_hf
    from trace_replay_common import DEVICE, DTYPE

    return {name: load_hf(path, getattr(torch, DTYPE)).to(DEVICE) for name, path in tiny_models.items()}
