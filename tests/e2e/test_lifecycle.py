"""A real `tokenloop serve` process: SIGTERM drains and exits 0, an engine death exits 1, faults stay contained.

Faults are injected with the debug variable TOKENLOOP_DEBUG_FAULT (looper/faults.py).
"""

from __future__ import annotations

import json
import signal
import time

import grpc
import pytest

from tests.e2e.live_server import DEFAULT_MODEL, Proc, first_message_then_rest, gen, outcome

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(),
                                reason="the default model is not prepared: run `make model`")


def test_sigterm_finishes_in_flight_cancels_the_rest_and_exits_0():
    server = Proc("--shutdown-grace", "8", "--log-format", "json", env={"TOKENLOOP_DEBUG_FAULT": "request:BOOM"})
    try:
        # a request-level fault fails only that request; the server keeps serving
        code, msgs = outcome(server.stub, gen("BOOM goes the engine"))
        assert code == grpc.StatusCode.INTERNAL and "injected fault" in msgs[-1]
        server.proc.send_signal(signal.SIGHUP)  # reload certificates (none here): must not stop the server
        code, msgs = outcome(server.stub, gen(), metadata=(("x-request-id", "e2e-ok"),))
        assert code == grpc.StatusCode.OK and msgs[-1].complete.usage.completion_tokens == 8
        short = first_message_then_rest(server.stub, gen(max_new=6))
        long = first_message_then_rest(server.stub, gen(max_new=4000))
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused, _ = outcome(server.stub, gen())
        assert refused == grpc.StatusCode.UNAVAILABLE  # no longer admitting
        assert short.result()[0] == grpc.StatusCode.OK  # finished within the grace period
        code, msgs = long.result()
        assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in msgs[-1]
        assert server.wait() == 0
    finally:
        server.kill()
    ends = [json.loads(line) for line in server.lines if '"request end"' in line]
    ok = next(e for e in ends if e["request_id"] == "e2e-ok")
    assert ok["status"] == "OK" and ok["output_tokens"] == 8 and ok["peer"].startswith("ipv")
    assert {e["status"] for e in ends} >= {"OK", "INTERNAL", "UNAVAILABLE"}


def test_engine_death_fails_open_streams_and_exits_1():
    server = Proc("--shutdown-grace", "30", env={"TOKENLOOP_DEBUG_FAULT": "step:5"})
    try:
        code, msgs = outcome(server.stub, gen(max_new=4000))
        assert code == grpc.StatusCode.UNAVAILABLE and "injected fault" in msgs[-1]
        assert server.wait() == 1  # a supervisor restarts it
    finally:
        server.kill()
    assert any("executor died" in line for line in server.lines)
