"""The grammar compile worker's child process: compiles xgrammar grammars one at a time, answers serialized JSON.

Run by path (`python grammar_compile_worker.py FD THREADS`), not as part of the package: it imports only the
standard library and xgrammar, so it starts without the engine's modules. It talks to GrammarCompileService
(grammar_compiler.py) over a socket inherited as file descriptor FD, as multiprocessing Connections:
    first message: TokenizerInfo.serialize_json() text (the parent's, built from the engine's tokenizer);
    the worker answers ("ready", None) once its compiler is built (a job's timeout starts after that)
    then, per job: (kind, text, any_whitespace) -> ("ok", CompiledGrammar.serialize_json()) | ("error", message)
It runs at a lower CPU priority (nice +10) than the engine, whose step loop must not wait behind a compile, and
exits when the parent closes the socket. The parent kills it (SIGKILL) to stop a compile that ran too long or
that no request waits for anymore: xgrammar's compile cannot be interrupted inside a thread.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection

NICE = 10  # Linux CFS: a nice-10 thread gets ~1/10 the CPU share of a nice-0 one when both want a core


def compile_one(compiler, kind: str, text: str, any_whitespace: bool):
    """kind: "json" (a JSON schema's text), "json_object" (xgrammar's built-in JSON grammar), "regex" or
    "grammar" (EBNF)."""
    if kind == "json":
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
    if kind == "json_object":
        return compiler.compile_builtin_json_grammar()
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "grammar":
        return compiler.compile_grammar(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def main(fd: int, threads: int) -> None:
    conn = Connection(fd)
    try:
        os.nice(NICE)
    except OSError:  # not allowed here: compile at the engine's priority
        pass
    try:
        import xgrammar  # ~2-4 s (it imports torch), while the parent builds the TokenizerInfo it then sends

        info = xgrammar.TokenizerInfo.deserialize_json(conn.recv())
        # No cache here: the parent keeps the compiled grammars (a byte-bounded LRU) and asks only for misses.
        compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        conn.send(("ready", None))
        while True:
            kind, text, any_whitespace = conn.recv()
            try:
                answer = ("ok", compile_one(compiler, kind, text, any_whitespace).serialize_json())
            except Exception as e:  # xgrammar's errors for input it parsed but cannot compile
                answer = ("error", (str(e).strip().splitlines() or [type(e).__name__])[0])
            conn.send(answer)
    except (EOFError, OSError, KeyboardInterrupt):  # the parent went away (or closed the socket): done
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
