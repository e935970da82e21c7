"""A real `tokenloop serve` process and its signals: a second SIGINT/SIGTERM stops it at once, and a compile never
holds up shutdown (issue 28, issue 30).

Timings are printed, not asserted: what is asserted is behaviour (the drain did not run out its 30 s grace, the
compile was stopped, not finished, the exit code says how it stopped).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from tests.e2e.live_server import DEFAULT_MODEL, Proc, first_message_then_rest, gen, outcome
from tokenloop.v1 import tokenloop_pb2 as pb

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(),
                                reason="the default model is not prepared: run `make model`")

GRACE = "30"
# Compiles for 21-34 s with the default model's tokenizer (docs/robustness.md, "Grammar compiles are bounded").
SLOW_SCHEMA = json.dumps({"type": "object", "patternProperties": {f"^k{i}_[a-z]+$": {"type": "integer"}
                                                                  for i in range(500)}})


def children(pid: int) -> list[int]:
    """The process ids whose parent is `pid` and that run `tokenloop.service.compile_worker` (its compile
    processes; the server has one more child, the gRPC core log relay)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"tokenloop.service.compile_worker" in command:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def seconds_to_exit(server: Proc, since: float) -> float:
    server.proc.wait(25)  # well within the 30 s grace: it did not wait it out
    return time.monotonic() - since


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_second_signal_stops_a_streaming_server_at_once(sig, code):
    server = Proc("--shutdown-grace", GRACE)
    try:
        stream = first_message_then_rest(server.stub, gen(max_new=4000))
        server.proc.send_signal(sig)
        deadline = time.monotonic() + 10
        while not any("draining:" in line for line in server.lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        start = time.monotonic()
        server.proc.send_signal(sig)
        took = seconds_to_exit(server, start)
        status, msgs = stream.result()
        assert status == grpc.StatusCode.UNAVAILABLE and "shutting down" in msgs[-1]
        assert server.proc.returncode == code
        print(f"\n{sig.name} x2 with one stream in flight: exited {took:.2f} s after the second signal")
    finally:
        server.kill()
    log = "".join(server.lines)
    assert ("draining: up to 30.0s for 1 in-flight requests; press Ctrl-C again (or send SIGTERM) to stop now"
            in log)
    assert f"{sig.name} again: stopping now; the requests left end UNAVAILABLE" in log


def test_sigterm_during_a_slow_compile_kills_it_and_exits_0():
    server = Proc("--shutdown-grace", GRACE, "--grammar-compile-timeout", "120")
    try:
        workers = children(server.proc.pid)
        assert len(workers) == 2  # --grammar-compile-workers
        result: dict = {}
        request = pb.GenerateRequest(text="Answer in JSON:", json_schema=SLOW_SCHEMA,
                                     stopping=pb.StoppingCriteria(max_new_tokens=8))
        caller = threading.Thread(target=lambda: result.update(zip(("code", "msgs"),
                                                                   outcome(server.stub, request))))
        caller.start()
        time.sleep(2.0)  # the compile is under way (it takes 20 s or more)
        assert caller.is_alive()
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        took = seconds_to_exit(server, start)
        caller.join(10)
        assert result["code"] == grpc.StatusCode.UNAVAILABLE and "shutting down" in result["msgs"][-1]
        assert server.proc.returncode == 0
        assert not any(alive(pid) for pid in workers)  # killed, not left compiling
        print(f"\nSIGTERM during a 500-patternProperties compile: exited {took:.2f} s after the signal")
    finally:
        server.kill()
