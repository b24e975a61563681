"""Ground floor: EngineConfig (every engine option, validated once; `LLM(**kwargs)` and `replayllm serve --...` map
onto it). ModelConfig (the model facts the engine needs) lives in model_config.py and is re-exported here. Imports
no folder of the package (see docs/architecture.md, "Floors")."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Literal, get_args

import torch

from .embedded_model import DEFAULT_MODEL
from .layer_options import resolve_layer_options
from .model_config import (  # noqa: F401 (re-exported: replayllm.config.ModelConfig and friends)
    DTYPE_CHOICES,
    SUPPORTED_ARCHITECTURES,
    DType,
    ModelConfig,
    auto_dtype_note,
    check_checkpoint_quantization,
    check_max_model_len,
    default_max_model_len,
    mlp_width,
    moe_facts,
    position_limit,
    resolve_architecture,
)
from .model_source import resolve_model_path
from .param_checks import env_flag
from .reasoning import check_reasoning_strings
from .speculative_config import SpeculativeConfig
from .trace_rules import check_engine_options

logger = logging.getLogger(__name__)

# Literal types are the options' choices: the CLI (entrypoints/cli/engine_args.py) offers them as such.
AttentionBackend = Literal["auto", "torch", "triton"]
LoadFormat = Literal["auto", "safetensors", "pt", "dummy"]
QuantizationMethod = Literal["int8", "fp8"]  # model_runner_v2/quantization/
CudaGraphMode = Literal["FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE"]  # vLLM's names
KVCacheDType = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]  # vLLM's names; "fp8" is fp8_e4m3
KV_CACHE_TORCH_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ATTENTION_BACKENDS = get_args(AttentionBackend)
LOAD_FORMATS = get_args(LoadFormat)
QUANTIZATION_METHODS = (None, *get_args(QuantizationMethod))
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
# trace_replay_chunk_size when fast replay is on by default (batch_invariant) and the one benchmarks call "fast".
FAST_REPLAY_CHUNK_SIZE = 64
# A step's default token budget (max_num_batched_tokens): vLLM's rule for its LLM class, 16,384 on a CUDA GPU of
# at least 70 GiB that is not an A100 (H100, H200, ...), else 8,192. Measured on the H200 (docs/benchmarks.md,
# session 25): S1's 500 x (512 in / 128 out) on the engine 2.04-2.05 s against 2.14-2.20 s at 8,192 (fewer steps
# carry its 256k prompt tokens beside the running decodes), W1 unchanged; served, median TPOT 5.5 against 6.1 ms.
TOKEN_BUDGET = 8192
LARGE_GPU_TOKEN_BUDGET = 16384
LARGE_GPU_BYTES = 70 << 30
# Environment variables that turn batch_invariant on for every engine of the process (vLLM's and ours).
BATCH_INVARIANT_ENV_VARS = ("REPLAYLLM_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT")


@dataclass
class EngineConfig:
    """Engine options with vLLM's names. Unknown options are a TypeError (dataclass __init__), bad values a
    ValueError naming the option; options this build cannot honour are rejected, never ignored."""

    # Each field's comment (on its line, or the block right above it) is its `--help` text on the command line.
    model: str | None = None  # model dir, hub id or embedded id (None: the embedded default model)
    tokenizer: str | None = None  # tokenizer dir or hub id (None: the model's)
    skip_tokenizer_init: bool = False  # no tokenizer: prompts must be token ids and outputs carry no text
    dtype: DType = "auto"  # weights and activations; "auto": the checkpoint's dtype (float32 when it names none)
    device: str = "auto"  # a torch device ("cpu", "cuda", "cuda:1"); "auto": cuda when available, else cpu
    seed: int = 0  # seed of sampling (a request's own seed wins) and of dummy weights
    max_model_len: int | None = None  # longest prompt + output in tokens (None: the model's max_position_embeddings)
    # full attention in every layer, max_model_len capped at the model's sliding_window (vLLM's option; the same
    # computation within the window). Off: a windowed model's layers slide past it (docs/features.md)
    disable_sliding_window: bool = False
    max_num_seqs: int = 256  # most sequences in one engine step
    # most tokens in one engine step (None: 16384 on a CUDA GPU of >= 70 GiB other than an A100, else 8192; without
    # chunked prefill at least max_model_len)
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True  # split long prompts over several steps, mixed with decodes
    block_size: int = 16  # tokens per KV-cache block (a power of two)
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompt prefixes seen before
    gpu_memory_utilization: float = 0.9  # this engine's share of the GPU (weights, activations, KV), as in vLLM
    kv_cache_memory_bytes: int | None = None  # explicit KV budget (CPU default: 1 GiB, capped at what fits)
    num_gpu_blocks_override: int | None = None  # explicit block count (any device; wins over the budgets)
    enable_trace_replay: bool = False  # accept trace_decode_token_ids: force a token trace, read its logprobs
    # "auto": the safetensors files, else PyTorch .bin ones; "safetensors" / "pt": only those; "dummy": random weights
    # of the checkpoint's shapes (benchmarks)
    load_format: LoadFormat = "auto"
    max_logprobs: int = 20  # most logprobs / prompt_logprobs a request may ask for; -1: no cap (the vocabulary's size)
    attention_backend: AttentionBackend = "auto"  # "auto": triton on CUDA, torch elsewhere
    quantization: QuantizationMethod | None = None  # weight quantization of the linear layers (None: off)
    # the KV cache's dtype: "auto" = the model's; "fp8" (= "fp8_e4m3") / "fp8_e5m2": K and V rounded to that fp8
    # format as they are written, scale 1 and saturating at its largest value (448 / 57344), as vLLM without
    # calibrated scales; half the bytes of a bf16 cache, so twice the blocks and half decode attention's reads.
    # Changes the numbers: measure it against "auto" (replayllm diff). docs/config_axes.md
    kv_cache_dtype: KVCacheDType = "auto"
    tensor_parallel_size: int = 1  # GPUs the model is split over (Megatron-style; rank r on cuda:index+r)
    # no CUDA graphs (model_runner_v2/cuda_graph.py, piecewise_graph.py): on CUDA with the triton attention
    # backend and tensor_parallel_size=1 steps replay graphs (see cudagraph_mode) unless this is set
    enforce_eager: bool = False
    # most rows of a captured decode CUDA graph; one graph per padded batch size up to it (None: min(max_num_seqs,
    # 512)). Speculative verify graphs (1 + k tokens a row) keep rows * (1 + k) within it, and always have 1 row
    max_cudagraph_capture_size: int | None = None
    # which steps replay CUDA graphs (vLLM's cudagraph_mode): FULL_DECODE_ONLY = uniform decode/verify steps
    # through whole-forward graphs; PIECEWISE = every step of at most max_piecewise_capture_size tokens through
    # graphs of the layers between attention calls, attention eager (model_runner_v2/piecewise_graph.py);
    # FULL_AND_PIECEWISE = both (decode full, the rest piecewise); NONE = eager (as enforce_eager). None:
    # FULL_AND_PIECEWISE (MoE models too: their fused experts have static shapes; a routing-replay step is eager)
    cudagraph_mode: CudaGraphMode | None = None
    # most tokens of a step run through piecewise graphs; one set of graphs per padded token count up to it
    # (None: min(max_num_batched_tokens, 8192); bigger steps run eagerly, their GPU work hides the launches)
    max_piecewise_capture_size: int | None = None
    # Schedule and launch step N+1 before step N's results reach the host, so the host's bookkeeping of step N
    # overlaps the GPU's work on N+1 (vLLM's option of the same name). Same outputs; see docs/architecture.md.
    # None (default): on for CUDA with tensor_parallel_size=1; off on CPU (the forward runs on the host
    # thread, so there is nothing to overlap) and under tensor parallelism (not supported there yet).
    async_scheduling: bool | None = None
    # The final norm, lm_head and log-softmax in fp32 for a bf16/fp16 model (vLLM's and SGLang's
    # --enable-fp32-lm-head; the train/inference mismatch fix MiniMax-M1 reported for RL). See DecoderLM.
    enable_fp32_lm_head: bool = False
    # Fast replay (docs/trace_replay.md, "Fast replay"): a replaying request in its decode phase runs up to this
    # many trace tokens per step (like speculative decoding with drafts that are always accepted); 1 = one token
    # per step, the way the tokens were sampled, so a replay's logprobs are bitwise the sampling-time ones.
    # None: 64 with batch_invariant (where fast replay is bitwise too), else 1. A request may override it
    # (SamplingParams.trace_replay_chunk_size).
    trace_replay_chunk_size: int | None = None
    # n-gram speculative decoding (docs/speculative_decoding.md), vLLM's dict: {"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}; a JSON object on the command
    # line. Implies synchronous steps (async_scheduling=True is rejected with it). None: off.
    speculative_config: SpeculativeConfig | dict | None = None
    # the single token that opens a reasoning span, counted by a request's thinking_token_budget (vLLM's
    # ReasoningConfig.think_start_str; None: "<think>" when the tokenizer has it as one token)
    think_start_str: str | None = None
    # the single token that closes a reasoning span, forced when the budget is spent (vLLM's
    # ReasoningConfig.think_end_str; None: "</think>" when the tokenizer has it as one token)
    think_end_str: str | None = None
    # vLLM's reasoning parser (qwen3 | deepseek_r1; the server's chat splits reasoning_content with it): a request's
    # structured outputs constrain only the tokens after its reasoning span ends (</think>), as vLLM's
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = None
    served_model_name: str | None = None  # the model name requests use (None: the model argument)
    # Every op from embedding to logprobs reduces each row in an order that depends on that row only, so a
    # sequence gets the same bits whatever the batch, chunking or prefix-cache hits (docs/batch_invariance.md).
    # Also turned on by REPLAYLLM_BATCH_INVARIANT=1 or VLLM_BATCH_INVARIANT=1.
    batch_invariant: bool = False
    # Sleep mode (vLLM's option, docs/rl.md): the weights and the KV cache live in memory that LLM.sleep() gives
    # back to the device and wake_up() takes again at the same addresses (CUDA graphs stay valid); for an engine
    # that shares its GPU with a trainer. Off: sleep() is an error.
    enable_sleep_mode: bool = False
    # Mixture-of-experts models (docs/moe.md): each completion's routed_experts, the experts every MoE layer chose
    # at every position whose forward ran (numpy int16 [seq_len - 1, num_layers, top_k]). A dense model: error.
    enable_return_routed_experts: bool = False
    # seconds one structured-outputs grammar may take to compile (docs/structured_outputs.md, "Limits"); a request
    # whose grammar takes longer fails with a 400 and its compile is stopped (the compile process is killed)
    structured_outputs_compile_timeout: float = 30.0
    # MiB of compiled grammars kept for reuse, least recently used evicted beyond it (vLLM's VLLM_XGRAMMAR_CACHE_MB
    # default, 512); 0: none kept
    structured_outputs_cache_mb: int = 512
    # Resolved in __post_init__ (not constructor arguments).
    model_config: ModelConfig = field(init=False, repr=False, default=None)
    torch_device: torch.device = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        # Phases in resolution order: each reads only what the ones before it resolved, and the first bad option
        # raises (the options' own values, then the device, then the model and the limits it bounds).
        self._check_scalars()
        self._check_choices()
        check_reasoning_strings(self.think_start_str, self.think_end_str, self.reasoning_parser)
        if self.speculative_config is not None:
            check_engine_options(self.enable_trace_replay, speculative=True)
            self.speculative_config = SpeculativeConfig.from_value(self.speculative_config)
            if self.async_scheduling:
                raise ValueError("speculative_config needs synchronous steps: async_scheduling=True is not "
                                 "supported with speculative decoding yet (leave it unset or False)")
            self.async_scheduling = False  # the drafts of step N+1 depend on step N's accepted tokens
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative_config is not supported with tensor_parallel_size > 1 yet")
        self._resolve_device()
        if self.batch_invariant:
            self._check_batch_invariant()
        if self.trace_replay_chunk_size is None:
            self.trace_replay_chunk_size = FAST_REPLAY_CHUNK_SIZE if self.batch_invariant else 1
        _check_int("trace_replay_chunk_size", self.trace_replay_chunk_size, 1)
        self._resolve_model()
        self._resolve_token_budgets()
        resolve_layer_options(self)  # hybrid, Gemma 4: what their layers rule out (graphs for decode steps only)
        if self.cudagraph_mode is None:
            self.cudagraph_mode = "FULL_AND_PIECEWISE"
        self._resolve_for_moe()
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        if self.served_model_name is None:
            self.served_model_name = self.model

    def _check_scalars(self) -> None:
        """Ints, bools and numbers checked on their own (the batch-invariant environment variables first: they set
        a bool that is then checked with the others)."""
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_int("max_logprobs", self.max_logprobs, -1)  # -1: vLLM's "no cap", resolved with the model
        _check_int("seed", self.seed, None)
        if any([env_flag(name) for name in BATCH_INVARIANT_ENV_VARS]):  # each checked (a "true" is an error)
            self.batch_invariant = True
        for name in ("skip_tokenizer_init", "enable_chunked_prefill", "enable_prefix_caching",
                     "enable_trace_replay", "enforce_eager", "enable_fp32_lm_head", "batch_invariant",
                     "enable_sleep_mode", "enable_return_routed_experts", "disable_sliding_window"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be a bool or None, got {self.async_scheduling!r}")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        timeout = self.structured_outputs_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"structured_outputs_compile_timeout must be a number of seconds > 0, got {timeout!r}")
        _check_int("structured_outputs_cache_mb", self.structured_outputs_cache_mb, 0)
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.num_gpu_blocks_override is not None:
            _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1)

    def _check_choices(self) -> None:
        """Options with a fixed set of values, tensor parallelism and the CUDA-graph sizes (none needs the device)."""
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.kv_cache_dtype not in get_args(KVCacheDType):
            raise ValueError(f"kv_cache_dtype must be one of {get_args(KVCacheDType)}, got {self.kv_cache_dtype!r}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling is not supported with tensor_parallel_size > 1 yet")
        if self.max_cudagraph_capture_size is None:
            self.max_cudagraph_capture_size = min(self.max_num_seqs, 512)
        _check_int("max_cudagraph_capture_size", self.max_cudagraph_capture_size, 1)
        if self.cudagraph_mode is not None and self.cudagraph_mode not in get_args(CudaGraphMode):
            raise ValueError(f"cudagraph_mode must be one of {get_args(CudaGraphMode)}, got {self.cudagraph_mode!r}")

    def _resolve_device(self) -> None:
        """device "auto", then what depends on it: async_scheduling's default, fp8's compute capability, the
        attention backend "auto" and triton's need for CUDA (or the interpreter)."""
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.torch_device = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device {self.device!r} is not a valid torch device") from e
        if self.torch_device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available")
        if self.async_scheduling is None:
            self.async_scheduling = self.torch_device.type == "cuda" and self.tensor_parallel_size == 1
        for name, fp8 in (("quantization", self.quantization == "fp8"),
                          ("kv_cache_dtype", self.kv_cache_dtype != "auto")):
            if (fp8 and self.torch_device.type == "cuda"
                    and torch.cuda.get_device_capability(self.torch_device) < (8, 9)):
                raise ValueError(f"{name}={getattr(self, name)!r} needs a GPU of compute capability >= 8.9 (fp8), "
                                 f"got {torch.cuda.get_device_capability(self.torch_device)}")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.torch_device.type == "cuda" else "torch"
        if (self.attention_backend == "triton" and self.torch_device.type != "cuda"
                and os.environ.get("TRITON_INTERPRET") != "1"):
            raise ValueError("the triton attention backend needs CUDA, or TRITON_INTERPRET=1 for the interpreter")

    def _resolve_model(self) -> None:
        """model (None: the embedded default) -> model_config, and max_model_len within its position limit."""
        if self.model is None:
            self.model = DEFAULT_MODEL
        path = resolve_model_path(self.model)
        self.model_config = ModelConfig.from_pretrained(path, dtype=self.dtype)
        if note := auto_dtype_note(self.dtype, self.torch_device.type, self.model_config.dtype):
            logger.warning(note)
        if self.max_model_len is None:
            self.max_model_len = default_max_model_len(self.model_config, self.disable_sliding_window)
        _check_int("max_model_len", self.max_model_len, 2)
        check_max_model_len(self.model_config, self.max_model_len, self.disable_sliding_window)
        self.max_logprobs = self.model_config.vocab_size if self.max_logprobs == -1 else self.max_logprobs  # no cap

    def _resolve_token_budgets(self) -> None:
        """A step's token budget and the piecewise graphs' sizes, which default from max_model_len; without
        chunked prefill a whole prompt must fit in one step."""
        if self.max_num_batched_tokens is None:
            budget = default_token_budget(self.torch_device)
            self.max_num_batched_tokens = budget if self.enable_chunked_prefill else max(budget, self.max_model_len)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_piecewise_capture_size is None:
            self.max_piecewise_capture_size = min(self.max_num_batched_tokens, 8192)
        _check_int("max_piecewise_capture_size", self.max_piecewise_capture_size, 1)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than max_model_len="
                f"{self.max_model_len}; enable chunked prefill or raise the token budget"
            )

    def _check_batch_invariant(self) -> None:
        """Combinations whose row-invariance is not built are rejected, never run silently variant."""
        if self.quantization is not None:
            raise ValueError(f"batch_invariant=True does not support quantization={self.quantization!r} yet "
                             "(its matmuls come from torch._scaled_mm / int8 kernels chosen by shape)")
        if self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant=True needs tensor_parallel_size=1: the all-reduce of row-parallel "
                             "layers picks its algorithm (and summation order) from the message size")
        if self.torch_device.type == "cuda" and self.attention_backend != "triton":
            raise ValueError("batch_invariant=True on CUDA needs attention_backend='triton' (torch's CUDA "
                             "reductions choose their launch from the whole batch's shape)")

    def _resolve_for_moe(self) -> None:
        """A MoE model (docs/moe.md): unquantized weights for now (int8/fp8 experts are a ValueError). CUDA graphs
        and tensor parallelism as for a dense model (the fused experts have static shapes and no host sync; TP splits
        every expert's width, _check_tensor_parallel checks moe_intermediate_size)."""
        mc = self.model_config
        if not mc.is_moe:
            if self.enable_return_routed_experts:
                raise ValueError(f"enable_return_routed_experts=True needs a mixture-of-experts model; "
                                 f"{mc.architecture} is dense")
            return
        if self.quantization is not None:
            raise ValueError(f"quantization={self.quantization!r} is not supported with a mixture-of-experts "
                             f"model ({mc.architecture}) yet")

    def _check_tensor_parallel(self) -> None:
        """Megatron sharding splits heads, KV heads and the MLP evenly (model_runner_v2/models/parallel.py);
        on CUDA rank r runs on cuda:<index + r>."""
        tp, mc = self.tensor_parallel_size, self.model_config
        sizes = [("num_attention_heads", mc.num_heads), ("num_key_value_heads", mc.num_kv_heads),
                 ("intermediate_size", mlp_width(mc.hf_config))]
        if mc.is_moe and mc.moe_intermediate_size != mlp_width(mc.hf_config):  # Qwen3-MoE's own width
            sizes.append(("moe_intermediate_size", mc.moe_intermediate_size))  # every expert's is split (moe.py)
        for name in ("shared_expert_intermediate_size", "shared_intermediate_size"):  # Qwen2-MoE's, Granite's
            if mc.is_moe and getattr(mc.hf_config, name, None):
                sizes.append((name, getattr(mc.hf_config, name)))
        for name, value in sizes:
            if value % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide the model's {name}={value}")
        if self.torch_device.type == "cuda":
            need = (self.torch_device.index or 0) + tp
            if need > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size={tp} on {self.device} needs {need} GPUs, "
                                 f"found {torch.cuda.device_count()}")

    @property
    def use_cuda_graphs(self) -> bool:
        """Some steps replay CUDA graphs (see enforce_eager, cudagraph_mode); the torch attention backend's shapes
        follow the longest context, and graphs under tensor parallelism are not built yet."""
        return (not self.enforce_eager and self.cudagraph_mode != "NONE" and self.torch_device.type == "cuda"
                and self.attention_backend == "triton" and self.tensor_parallel_size == 1)

    @property
    def use_full_cuda_graphs(self) -> bool:
        """Uniform decode (and verify) steps replay whole-forward graphs (model_runner_v2/cuda_graph.py)."""
        return self.use_cuda_graphs and self.cudagraph_mode in ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY")

    @property
    def use_piecewise_cuda_graphs(self) -> bool:
        """Other steps replay per-layer graphs around eager attention (model_runner_v2/piecewise_graph.py)."""
        return self.use_cuda_graphs and self.cudagraph_mode in ("FULL_AND_PIECEWISE", "PIECEWISE")

    @property
    def trace_replay_mode(self) -> str:
        """How a trace replays unless its request sets its own chunk size, as reports print it: "one-token" (the
        sampler's own shapes: bitwise the sampling-time logprobs) or "fast:K" (up to K trace tokens a step)."""
        k = self.trace_replay_chunk_size
        return "one-token" if k == 1 else f"fast:{k}"

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The KV cache tensors' dtype: the model's ("auto") or the fp8 format kv_cache_dtype names."""
        return KV_CACHE_TORCH_DTYPES.get(self.kv_cache_dtype, self.model_config.dtype)

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.init]


def default_token_budget(device: torch.device) -> int:
    """max_num_batched_tokens when none is given: LARGE_GPU_TOKEN_BUDGET on a CUDA device of LARGE_GPU_BYTES or
    more not named A100 (vLLM found larger steps slower there), else TOKEN_BUDGET (CPU, smaller GPUs)."""
    if device.type != "cuda":
        return TOKEN_BUDGET
    props = torch.cuda.get_device_properties(device)
    large = props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower()
    return LARGE_GPU_TOKEN_BUDGET if large else TOKEN_BUDGET


def _check_int(name: str, value, minimum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
