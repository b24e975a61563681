"""StructuredOutputManager: xgrammar grammars compiled per request (cached, off the step loop), bitmasks per step."""

from __future__ import annotations

import collections
import functools
import json
import re
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from ..step_io import GrammarBitmask, SchedulerOutput
from ..structured_outputs import StructuredOutputsParams
from .grammar_compiler import CompileJob, GrammarCompileService, GrammarKey
from .grammar_workers import GrammarWorkers, default_num_threads

_XGRAMMAR_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+\.(?:cc|h|cpp):\d+: ")


def _xgrammar():
    # Imported on first use: an engine that never sees a structured request does not need xgrammar installed.
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - xgrammar is a dependency; a bare device may lack it
        raise ValueError("structured_outputs needs the xgrammar package (pip install xgrammar)") from e
    return xgrammar


def _choice_ebnf(choice: list[str]) -> str:
    # root ::= "a" | "b": a JSON string literal is a valid xgrammar EBNF literal (same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def _schema_text(spec: StructuredOutputsParams) -> str:
    return spec.json if isinstance(spec.json, str) else json.dumps(spec.json, sort_keys=True)


def grammar_key(spec: StructuredOutputsParams) -> GrammarKey:
    """The compile job of a constraint (a choice list becomes its EBNF; json_object without whitespace, a schema)."""
    if spec.json is not None:
        return GrammarKey("json", _schema_text(spec), not spec.disable_any_whitespace)
    if spec.json_object:
        if spec.disable_any_whitespace:
            return GrammarKey("json", '{"type": "object"}', False)
        return GrammarKey("json_object", "", True)
    if spec.regex is not None:
        return GrammarKey("regex", spec.regex, True)
    if spec.choice is not None:
        return GrammarKey("grammar", _choice_ebnf(spec.choice), True)
    return GrammarKey("grammar", spec.grammar, True)


def check_structured_outputs(spec: StructuredOutputsParams) -> None:
    """Parse the constraint without a tokenizer (fast, no compilation): a bad schema, regex or grammar is a
    ValueError naming `structured_outputs` at admission (HTTP 400), never an error inside the engine loop."""
    if spec.json is not None:
        error = _parse_error("json", _schema_text(spec))
    elif spec.regex is not None:
        error = _parse_error("regex", spec.regex)
    elif spec.grammar is not None:
        error = _parse_error("grammar", spec.grammar)
    elif spec.choice is not None:
        error = _parse_error("grammar", _choice_ebnf(spec.choice))
    else:
        error = None  # json_object: xgrammar's built-in JSON grammar
    if error is not None:
        raise ValueError(f"structured_outputs.{spec.kind} is invalid: {error}")


@functools.lru_cache(maxsize=1024)  # many requests share one schema: parse it once
def _parse_error(kind: str, text: str) -> str | None:
    xgr = _xgrammar()
    parse = {"json": xgr.Grammar.from_json_schema, "regex": xgr.Grammar.from_regex,
             "grammar": xgr.Grammar.from_ebnf}[kind]
    try:
        parse(text)
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError subclasses for bad input
        text = str(e).strip()
        # its C++ log prefix ("[17:21:54] /project/cpp/json_schema_converter.cc:5082: ") is no news to a client
        return _XGRAMMAR_PREFIX.sub("", text.splitlines()[0]) if text else type(e).__name__
    return None


class RequestGrammar:
    """One request's grammar state: the compiled grammar (a future until compiled) and its matcher, which
    advances with every token the request emits. Dropped with the request (nothing else holds it); `release`
    (the scheduler, when the request finishes or is aborted) tells the compile service one waiter less."""

    def __init__(self, job: CompileJob, eos_token_ids: tuple[int, ...], workers: GrammarWorkers,
                 parent_id: str | None = None):
        self._job = job
        self._compiled = job.future
        self._released = False
        self.parent_id = parent_id  # the request (all its n completions) that the engine fails if this fails
        self._eos = list(eos_token_ids)
        self._stop = frozenset(eos_token_ids)
        self._matcher = None
        self.handle = None  # the matcher's C++ object (GrammarWorkers' calls take it), set with the matcher
        self.workers = workers  # the engine's: the scheduler advances grammars through them (accept_tokens)
        # A token id the grammar waits for before it constrains anything (the reasoning span's end, with
        # EngineConfig.reasoning_parser): until the request emits it, no bitmask, nothing accepted. None: active.
        self.waits_for: int | None = None

    @property
    def ready(self) -> bool:
        """Compiled, or failed to compile (`error`): the scheduler does not admit the request before."""
        return self._compiled.done()

    @property
    def error(self) -> BaseException | None:
        """Why the compile failed (a ready grammar), None if it did not: the engine then fails the request."""
        return self._compiled.exception() if self._compiled.done() else None

    def wait(self, timeout: float) -> None:
        try:
            self._compiled.exception(timeout)
        except TimeoutError:
            pass

    def release(self) -> None:
        """The request is gone: a compile no other request waits for is skipped or stopped (once per grammar)."""
        if not self._released:
            self._released = True
            self._job.release()

    @property
    def matcher(self):
        if self._matcher is None:
            xgr = _xgrammar()
            # The engine's EOS ids are the grammar's stop tokens: EOS is allowed exactly where the grammar may end.
            self._matcher = xgr.GrammarMatcher(self._compiled.result(), override_stop_tokens=self._eos)
            self.handle = self._matcher._handle
        return self._matcher

    def make_handle(self):
        """`handle`, making the matcher first if no step has needed it yet."""
        return self.matcher._handle

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def ended_by(self, token: int) -> bool:
        """Whether the grammar ended on accepting `token`: only a stop token (an EOS id) can end it, so other
        tokens cost no call into xgrammar (this runs for every structured row of every step)."""
        return token in self._stop and self.matcher.is_terminated()


def accept_tokens(grammars: list[RequestGrammar], tokens: list[int]) -> list[bool]:
    """Each grammar's matcher accepts its token: batched xgrammar calls over the engine's GrammarWorkers (chunks
    of rows in parallel). Per grammar: whether it accepted (always, unless a token escaped its bitmask)."""
    if not grammars:
        return []
    accepted = [True] * len(grammars)
    handles = [g.handle if g.handle is not None else g.make_handle() for g in grammars]
    for i in grammars[0].workers.accept(handles, tokens):
        accepted[i] = False
    return accepted


class StructuredOutputManager:
    """Built once per engine. The compile service (grammar_compiler.py: a killable child process, a timeout of
    compile_timeout_s, a byte-bounded LRU cache of cache_mb MiB) is built on the first structured request, with
    the TokenizerInfo (~1.5 s for a 150k vocabulary, on its thread). Grammars that failed to compile are queued
    in `failed` for the engine to fail their requests. `grammar_bitmask` fills the step's structured rows and
    `accept_tokens` advances them through `workers` (num_threads: default_num_threads(), from the cores)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], pin_memory: bool = False,
                 num_threads: int | None = None, compile_timeout_s: float = 30.0, cache_mb: int = 512):
        self._tokenizer = tokenizer
        self._pin_memory = pin_memory  # CUDA: bitmasks are filled in pinned memory (see _buffers)
        self._pinned_rows: torch.Tensor | None = None
        self._pinned_bits: torch.Tensor | None = None
        self.vocab_size = vocab_size  # the logits' width (may exceed len(tokenizer): padded rows are masked)
        self.eos_token_ids = tuple(eos_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.cache_mb = cache_mb
        self._service: GrammarCompileService | None = None
        self._lock = threading.Lock()
        # RequestGrammars whose compile failed (appended on the compile thread), for LLMEngine to fail their requests.
        self.failed: collections.deque[RequestGrammar] = collections.deque()
        self.workers = GrammarWorkers(default_num_threads() if num_threads is None else num_threads)
        self.live = weakref.WeakSet()  # RequestGrammar objects alive (tests: none outlives its request)

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    @property
    def service(self) -> GrammarCompileService:
        with self._lock:
            if self._service is None:
                self._service = GrammarCompileService(self._tokenizer_info, self.compile_timeout_s,
                                                      self.cache_mb * (1 << 20))
            return self._service

    def _tokenizer_info(self):
        xgr = _xgrammar()
        tokenizer = self._tokenizer
        if isinstance(tokenizer, Future):  # still loading when the engine was built (EngineCore)
            tokenizer = tokenizer.result()
        if tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer (skip_tokenizer_init=True has none)")
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=list(self.eos_token_ids))

    def add_request(self, spec: StructuredOutputsParams, parent_id: str | None = None,
                    eos_token_ids: tuple[int, ...] = ()) -> RequestGrammar:
        """Start compiling off the step loop (a cached grammar is ready at once); the request waits (Scheduler)
        until `ready`. A failed compile puts the grammar in `failed`. eos_token_ids: the request's (the grammar
        ends on one; empty: the model's)."""
        grammar = RequestGrammar(self.service.submit(grammar_key(spec)), eos_token_ids or self.eos_token_ids,
                                 self.workers, parent_id)
        ref, failed = weakref.ref(grammar), self.failed

        def on_done(future) -> None:  # on the compile thread (here if done); a weak ref: an aborted request goes
            g = ref()
            if g is not None and future.exception() is not None and not g._released:
                failed.append(g)

        grammar._compiled.add_done_callback(on_done)
        self.live.add(grammar)
        return grammar

    def compile(self, spec: StructuredOutputsParams, timeout: float | None = None):
        """The compiled grammar, waiting for it (tests and tools; requests go through add_request)."""
        job = self.service.submit(grammar_key(spec))
        try:
            return job.future.result(timeout)
        finally:
            job.release()

    def take_failed(self) -> list[RequestGrammar]:
        """The grammars that failed to compile since the last call (their requests are still waiting)."""
        out = []
        while self.failed:
            out.append(self.failed.popleft())
        return out

    def has_grammar_rows(self, sched: SchedulerOutput, requests: dict) -> bool:
        """Whether any sampling row of the step belongs to a structured request (cheap: no matcher is touched),
        one whose grammar still waits for its reasoning to end included: the step before may have ended it."""
        if not self.live:
            return False
        get = requests.get
        for row in sched.rows:
            if row.num_sampled_tokens and (req := get(row.request_id)) is not None and req.grammar is not None:
                return True
        return False

    def grammar_bitmask(self, sched: SchedulerOutput, requests: dict) -> GrammarBitmask | None:
        """[G, ceil(V/32)] int32 allowed-token bits for the step's G sampling rows that have a grammar, or None
        when no sampling row has one (then the sampler does nothing for grammars). Each matcher must have
        accepted every token of its request up to the previous step: the engine calls this either before launch
        with nothing in flight, or between the runner's execute_model and sample_tokens, after the previous step's
        scheduler update. Rows of requests that finished meanwhile (gone from `requests`) get no mask: their
        tokens are dropped."""
        rows = self._grammar_rows(sched, requests)
        if rows is None:
            return None
        row_ids, bitmask, handles = rows
        # xgrammar writes every word of each row (no clearing needed; the buffer may hold an older step's bits).
        self.workers.fill(handles, bitmask)
        return GrammarBitmask(row_ids, bitmask)

    def start_grammar_bitmask(self, sched: SchedulerOutput, requests: dict) -> Callable[[], GrammarBitmask | None]:
        """`grammar_bitmask` filled on the workers' fill thread: returns at once a function that waits for the
        bits (same rules; the matchers must not be used, nor advanced, before it is called). Accepting stays on
        the engine thread: xgrammar's batch accept holds the GIL (a thread running it beside the engine thread's
        Python made both several times slower on the CPU machine)."""
        rows = self._grammar_rows(sched, requests)
        if rows is None:
            return lambda: None
        row_ids, bitmask, handles = rows
        pending = self.workers.start_fill(handles, bitmask)

        def result() -> GrammarBitmask:
            pending.wait()
            return GrammarBitmask(row_ids, bitmask)

        return result

    def _grammar_rows(self, sched: SchedulerOutput, requests: dict) -> tuple[np.ndarray, np.ndarray, list] | None:
        """([G] sample-row index, [G, W] bitmask buffer to fill, G matcher handles) of the step's structured rows.
        One pass over the step's rows with plain attribute reads (this runs every structured step)."""
        if not self.live:
            return None  # no structured request exists: no per-row pass on the step path
        rows, handles = [], []
        get = requests.get
        sample_index = 0
        for row in sched.rows:
            if not row.num_sampled_tokens:
                continue
            req = get(row.request_id)
            if req is not None and (grammar := req.grammar) is not None and grammar.waits_for is None:
                rows.append(sample_index)
                handles.append(grammar.handle if grammar.handle is not None else grammar.make_handle())
            sample_index += 1
        if not rows:
            return None
        row_ids, bitmask = self._buffers(len(rows))
        row_ids[:] = rows
        return row_ids, bitmask, handles

    def _buffers(self, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """([G] int64, [G, W] int32) arrays to fill. With pin_memory: views of one persistent pinned buffer, so
        the sampler's host-to-device copies are truly asynchronous (a pageable copy can make the host wait for
        the stream, i.e. for the forward pass it should overlap). Reusing one buffer is safe: a step's bits are
        filled only after the engine has waited for every earlier step that copied bits (the previous step's
        results are waited for first, or nothing is in flight)."""
        if not self._pin_memory:
            return np.empty(num_rows, dtype=np.int64), np.empty((num_rows, self.bitmask_width), dtype=np.int32)
        if self._pinned_bits is None or self._pinned_bits.shape[0] < num_rows:
            capacity = 1 << (num_rows - 1).bit_length()  # powers of two: few reallocations as batches grow
            self._pinned_rows = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
            self._pinned_bits = torch.empty((capacity, self.bitmask_width), dtype=torch.int32, pin_memory=True)
        return self._pinned_rows.numpy()[:num_rows], self._pinned_bits.numpy()[:num_rows]

    def wait_for_compile(self, waiting, timeout: float = 0.05) -> None:
        """An empty step while requests wait only for their grammars: block briefly on the first compiling one
        instead of spinning the engine loop (which would also slow the compile thread down)."""
        for req in waiting:
            if req.grammar is not None and not req.grammar.ready:
                req.grammar.wait(timeout)
                return

    def shutdown(self) -> None:
        if self._service is not None:
            self._service.shutdown()
        self.workers.shutdown()
