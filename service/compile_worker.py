"""A compile process: checks constraints for the server, which kills it when a compile outlives its timeout.

llguidance cannot stop a compile part-way (none of its `LLParserLimits` bounds the time a 500-`patternProperties`
schema takes: docs/robustness.md), and a thread cannot be stopped either; a process can. The server
(service/compile_pool.py) starts a few of these with `python -m tokenloop.service.compile_worker`, sends the
tokenizer once, then one constraint at a time; each answer is either the constraint's llguidance grammar text (it
compiled and passed `GrammarCompiler._probe`: the server then builds its own matcher from that text, in about the
same time) or the reason it does not compile.

Frames on stdin/stdout: a 4-byte big-endian length, then that many bytes of JSON.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import struct
import sys
import threading
import time
from typing import BinaryIO

from tokenloop.core.structured import GrammarCompiler, GrammarError, grammar_text

FRAME = struct.Struct(">I")
STACK_SIZE = 256 << 20  # llguidance recurses ~3 KB of stack per nested rule (see service/app.py)
PR_SET_PDEATHSIG = 1
# Compiles yield the CPU to the server's own threads (engine steps, tokenization) when they compete for it.
NICENESS = 10


def write_frame(stream: BinaryIO, message: dict) -> None:
    data = json.dumps(message).encode()
    stream.write(FRAME.pack(len(data)) + data)
    stream.flush()


def read_frame(stream: BinaryIO) -> dict | None:
    """The next message, or None at end of input (the server closed the pipe or is gone)."""
    head = stream.read(FRAME.size)
    if len(head) < FRAME.size:
        return None
    (size,) = FRAME.unpack(head)
    return json.loads(stream.read(size))


def check(compiler: GrammarCompiler, kind: str, spec: str) -> dict:
    """One constraint's answer: {"ok": True, "text", "elapsed_s"} or {"ok": False, "kind", "message"}."""
    start = time.perf_counter()
    try:
        text = grammar_text(kind, spec)
        compiler.compile(kind, spec, text)
    except GrammarError as exc:
        return {"ok": False, "kind": exc.kind, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - whatever the library raises on a bad input is the input's fault
        return {"ok": False, "kind": kind, "message": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "text": text, "elapsed_s": time.perf_counter() - start}


def serve(stdin: BinaryIO, stdout: BinaryIO) -> None:
    """Read the tokenizer, then answer constraints until the input ends."""
    init = read_frame(stdin)
    if init is None:
        return
    compiler = GrammarCompiler(init["tokenizer_json"], init["vocab_size"], tuple(init["eos_token_ids"]), cache_size=0)
    write_frame(stdout, {"ready": True})
    while (job := read_frame(stdin)) is not None:
        write_frame(stdout, check(compiler, job["kind"], job["spec"]))


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the server exits, however it exits."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    """`python -m tokenloop.service.compile_worker [CPUS]`: CPUS (e.g. "0,1") are the server's CPUs, given back to
    this process before any thread starts (a process started by the server's pinned event-loop thread inherits its
    one CPU: --front-cpu)."""
    if argv and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, [int(cpu) for cpu in argv[0].split(",")])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides
    _die_with_parent()
    os.nice(NICENESS)
    threading.stack_size(STACK_SIZE)
    worker = threading.Thread(target=serve, args=(sys.stdin.buffer, sys.stdout.buffer), name="compile")
    worker.start()
    worker.join()


if __name__ == "__main__":
    main(sys.argv[1:])
