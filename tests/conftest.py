"""Test set-up: Triton under the interpreter (no GPU here), offline hub, tiny HF models, KV-leak check."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit decorator runs
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing can be downloaded here
# One CPU thread for torch in every test process and in the servers, cores and replicas they start (inherited):
# `make test` runs two pytest workers on the 2-core CI machine, and there a 2-thread OpenMP op spin-waits against
# the other worker's (a [6, 64] x [64, 192] linear took ~116 us instead of ~10 us under that load; one suite
# module went from 31 s to 6 s). The tiny test models gain nothing from a second thread. Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import weakref  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from replayllm.engine.llm_engine import LLMEngine  # noqa: E402


def _row_invariant_interpreter_dot() -> None:
    """The Triton interpreter computes `tl.dot` with numpy's matmul (BLAS GEMM), whose result for one row depends
    on the row's position in the matrix on some CPUs (OpenBLAS's kernels on AMD EPYC: the same row shifted by one
    place differs in the last bits), so the batch-invariant kernels' bitwise tests failed there and passed on
    others. A GPU's matrix units compute every row alike; so does einsum's plain loop (each element's sum over k
    in one fixed order), which the interpreter uses here instead. Only under the interpreter (tests)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype.itemsize == 1 or b.data.dtype.itemsize == 1:  # fp8 operands: the interpreter's own path
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


_row_invariant_interpreter_dot()


def _gpu_share_for_concurrent_suites() -> None:
    """bench/gpu_check.sh runs six pytest processes on one GPU at once. gpu_memory_utilization is each engine's
    share of the device (vLLM's meaning), so at the default 0.9 the first engine of a 0.6B shape could take most
    of the card and a later one in another suite start with too little free for its activations (it happened on
    an 80 GiB H100). REPLAYLLM_TEST_GPU_SHARE (set there for the concurrent suites only) is the share of every
    engine a test builds without naming one; a test that names its own keeps it."""
    share = os.environ.get("REPLAYLLM_TEST_GPU_SHARE")
    if not share:
        return
    from replayllm.config import EngineConfig

    original = EngineConfig.__init__

    def init(self, *args, **kwargs):
        kwargs.setdefault("gpu_memory_utilization", float(share))
        original(self, *args, **kwargs)

    EngineConfig.__init__ = init


_gpu_share_for_concurrent_suites()
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


# `make test` runs the suite on two pytest-xdist workers: whole modules go to one worker (a module's fixtures start
# once), and the modules that share the session servers below go to the same one (they start once per worker).
# Modules marked `serial` (they compare timings or deliver signals) run afterwards, alone. The shared-server modules
# are named by file name, whichever folder of tests/ holds them.
_SHARED_SERVER_MODULES = {"test_core_proc", "test_readme", "test_server", "test_server_errors",
                          "test_server_responses", "test_server_streams"}


@pytest.hookimpl(optionalhook=True)  # only when pytest-xdist is installed
def pytest_xdist_make_scheduler(config, log):
    """xdist's `--dist loadfile`, with the shared-server modules as one unit. (Its `loadgroup` marks do not
    reach the scheduler with pytest 9.2, which no longer reads the node id xdist rewrites.)"""
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "shared_servers" if path.rsplit("/", 1)[-1][:-3] in _SHARED_SERVER_MODULES else path

    return ModuleScheduling(config, log)


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
    from helpers.hf_reference import save_tiny_models

    return save_tiny_models(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny16(tmp_path_factory) -> str:
    """A tiny random Qwen3 over 16 tokens: its greedy and sampled outputs fall into repeats quickly, so n-gram
    drafts are often accepted (and often rejected). Token ids 0..15 are single ASCII characters in the Qwen
    tokenizer (used for text and stop strings); EOS is 2. (tests/engine/test_speculative.py,
    tests/model_runner/test_cuda_graph_verify.py)"""
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
                                   initializer_range=0.5, max_position_embeddings=512, bos_token_id=1,
                                   eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny16")
    transformers.Qwen3ForCausalLM(cfg).to(torch.float32).eval().save_pretrained(str(path))
    return str(path)


# -- engines shared by the trace-replay end-to-end modules (module scope: one set per module) -------------
@pytest.fixture(scope="module")
def embedded():
    """The embedded model with trace replay on (device/dtype from REPLAYLLM_TEST_DEVICE/_DTYPE)."""
    from helpers.trace_replay_common import _opts

    from replayllm import LLM

    return LLM(enable_trace_replay=True, **_opts(max_model_len=512))


@pytest.fixture(scope="module")
def tiny_llms(tiny_models):
    from helpers.trace_replay_common import _tiny

    return {name: _tiny(path) for name, path in tiny_models.items()}


@pytest.fixture(scope="module")
def hf_models(tiny_models):
    from helpers.hf_reference import load_hf
    from helpers.trace_replay_common import DEVICE, DTYPE

    return {name: load_hf(path, getattr(torch, DTYPE)).to(DEVICE) for name, path in tiny_models.items()}


# -- `replayllm serve` processes shared across modules (session scope: each start costs ~10 s of the suite) -----
# Tests on them compare metrics as deltas and leave them idle (each module's autouse wait_idle), so the order in
# which modules use them does not matter.
@pytest.fixture(scope="session")
def shared_trace_server(tmp_path_factory):
    """Trace replay on, --api-key required (server_utils.trace_server): test_server.py and the modules that
    import its fixtures, test_server_errors.py."""
    from helpers.server_utils import trace_server

    yield from trace_server(tmp_path_factory)


@pytest.fixture(scope="session")
def shared_open_trace_server(tmp_path_factory):
    """Trace replay on, no API key: test_server_streams.py, test_core_proc.py's shared server."""
    from helpers.server_utils import ENGINE_ARGS, RemoteServer

    srv = RemoteServer([*ENGINE_ARGS, "--enable-trace-replay"], tmp_path_factory.mktemp("open_trace_server"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def server_reference_llm():
    """The offline engine on shared_trace_server's settings: the reference its HTTP results must equal."""
    from replayllm import LLM

    return LLM(enable_trace_replay=True, dtype="float32", device="cpu", max_model_len=512)
