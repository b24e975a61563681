"""vLLM's `LLM.collective_rpc(method, args=..., kwargs=...)` and `worker_extension_cls` over this engine, whose model
lives in the LLM's own process (tensor_parallel_size=1).

vLLM calls `method` on every worker: a string names a method of the worker (an RL framework adds its own through
`worker_extension_cls`, a class mixed into the worker's), a callable is called as `method(worker, *args, **kwargs)`.
Here the one "worker" is a `WorkerView`: `model_runner` (a RunnerView of this engine's runner: its `model`, the
nn.Module with HF-named parameters, whose own `load_weights(pairs)` is vLLM's in-place update of any subset, and
`load_weights(pairs)`, the engine's checked update: an idle engine), `device`,
`rank` / `local_rank` (0) and `config` (the EngineConfig). The result is vLLM's list, one entry per worker."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

WORKER_ATTRIBUTES = ("model_runner", "device", "rank", "local_rank", "config")  # WorkerView's, set in __init__


class RunnerView:
    """The worker's `model_runner`: the engine's runner, whose `model` is refused while sleep() holds the weights
    (their tensors have no memory: a read would crash the process) and whose `load_weights` is the engine's
    checked update (an idle engine, awake weights; the prefix cache dropped). Other attributes are the runner's."""

    def __init__(self, engine) -> None:
        self._engine = engine

    @property
    def model(self):
        self._engine.check_weights_awake("reading the model")
        return self._engine.runner.model

    def load_weights(self, weights) -> int:
        return self._engine.load_weights(weights)

    def __getattr__(self, name: str):
        return getattr(self._engine.runner, name)


class WorkerView:
    """What an RPC sees as its worker (vLLM's Worker attributes that RL extensions use: WORKER_ATTRIBUTES)."""

    def __init__(self, engine) -> None:
        self.model_runner = RunnerView(engine)
        self.device = engine.config.torch_device
        self.rank = 0
        self.local_rank = 0
        self.config = engine.config


def load_extension(spec: str | type | None) -> type | None:
    """`worker_extension_cls` ("package.module.Class", as vLLM takes it, or the class) -> the class; ValueError when
    it cannot be imported or would replace one of WorkerView's attributes (vLLM refuses that too)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        module, _, name = spec.rpartition(".")
        if not module:
            raise ValueError(f"worker_extension_cls must be 'package.module.Class', got {spec!r}")
        try:
            spec = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"worker_extension_cls {spec!r} could not be imported: {e}") from e
    if not isinstance(spec, type):
        raise ValueError(f"worker_extension_cls must name a class, got {spec!r}")
    ours = set(WORKER_ATTRIBUTES) | set(vars(WorkerView))
    clash = sorted(n for n in vars(spec) if not n.startswith("__") and n in ours)
    if clash:
        raise ValueError(f"worker_extension_cls {spec.__name__} would replace the worker's {clash}")
    return spec


def make_worker(engine, extension: type | None) -> WorkerView:
    """The worker an RPC runs on: WorkerView, with the extension's methods after its own (vLLM appends the extension
    to the worker's bases, so the worker's __init__ is the one that runs)."""
    cls = WorkerView if extension is None else type(f"WorkerView+{extension.__name__}", (WorkerView, extension), {})
    return cls(engine)


def call_worker(worker: WorkerView, method: str | Callable, args: tuple, kwargs: dict[str, Any] | None) -> list:
    """One worker's call, as vLLM's collective_rpc makes it: [result]."""
    if isinstance(method, str):
        fn = getattr(worker, method, None)
        if not callable(fn):
            raise ValueError(f"the worker has no method {method!r} (worker_extension_cls adds methods)")
        return [fn(*args, **(kwargs or {}))]
    if not callable(method):
        raise ValueError(f"method must be a worker method's name or a callable, got {method!r}")
    return [method(worker, *args, **(kwargs or {}))]
