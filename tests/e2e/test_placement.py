"""A real `tokenloop serve`: where its threads run (--front-cpu), read from /proc after it has served.

With `auto` (the default) the event-loop thread and the looper thread share one CPU and every other thread
(gRPC's, the engine's and torch's, the tokenizer threads started later) keeps all of the process's CPUs; with
`off` nothing is pinned; a CPU the process may not use is a start-up error naming the flag.
"""

from __future__ import annotations

import os
import subprocess

import grpc
import pytest

from tests.e2e.live_server import DEFAULT_MODEL, ROOT, Proc, free_port, gen, outcome, tokenloop_command
from tokenloop.v1 import tokenloop_pb2 as pb

CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
pytestmark = [
    pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(),
                       reason="the default model is not prepared: run `make model`"),
    pytest.mark.skipif(len(CPUS) < 2, reason="needs a process that may use two CPUs or more (Linux)"),
]
LONG_TEXT = "The looper thread never spins. " * 120  # 3,720 characters: past --tokenize-inline-chars (2,048)


def threads(pid: int) -> dict[int, tuple[str, set[int]]]:
    """tid -> (OS name, CPUs it may run on) for every thread of `pid`."""
    out = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            out[tid] = (name, os.sched_getaffinity(tid))
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            pass
    return out


def serve_some(proc: Proc) -> None:
    """Short and long prompts (the long one starts the tokenizer threads) and a long Tokenize: all answered."""
    for text in ("Count from one to ten:", LONG_TEXT):
        code, msgs = outcome(proc.stub, gen(text=text, max_new=4))
        assert code == grpc.StatusCode.OK and sum(len(m.chunk.token_ids) for m in msgs) == 4
    assert len(proc.stub.Tokenize(pb.TokenizeRequest(text=LONG_TEXT), timeout=60).token_ids) > 500


def test_auto_pins_the_event_loop_and_the_looper_to_one_cpu_and_nothing_else():
    proc = Proc()
    try:
        serve_some(proc)
        seen = threads(proc.proc.pid)
        loop_cpus = seen[proc.proc.pid][1]
        loopers = [cpus for name, cpus in seen.values() if name == "tokenloop-loopr"]
        assert len(loop_cpus) == 1 and loopers == [loop_cpus]
        others = {tid: (name, cpus) for tid, (name, cpus) in seen.items()
                  if tid != proc.proc.pid and name != "tokenloop-loopr"}
        assert len(others) >= 4  # gRPC's threads, the engine's, the tokenizer threads
        assert {tid: cpus for tid, (_, cpus) in others.items()} == {tid: CPUS for tid in others}, others
        (cpu,) = loop_cpus
        assert any(f"share CPU {cpu} (--front-cpu auto" in line for line in proc.lines), "".join(proc.lines)
    finally:
        proc.proc.terminate()
        assert proc.wait() == 0


def test_off_pins_nothing():
    proc = Proc("--front-cpu", "off")
    try:
        serve_some(proc)
        seen = threads(proc.proc.pid)
        assert any(name == "tokenloop-loopr" for name, _ in seen.values())
        assert {tid: cpus for tid, (_, cpus) in seen.items()} == {tid: CPUS for tid in seen}
    finally:
        proc.proc.terminate()
        assert proc.wait() == 0


def test_a_cpu_the_process_may_not_use_is_a_start_up_error():
    bad = max(CPUS) + 1000
    done = subprocess.run([*tokenloop_command(), "serve", "--model", str(DEFAULT_MODEL), "--port",
                           str(free_port()), "--front-cpu", str(bad)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"--front-cpu {bad} is not one of the CPUs this process may use" in done.stdout + done.stderr
