"""A real `tokenloop serve` process: SIGTERM drains and exits 0, an engine death exits 1, faults stay contained.

Faults are injected with the debug variable TOKENLOOP_DEBUG_FAULT (looper/faults.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.e2e.live_server import DEFAULT_MODEL, ROOT, _free_port, _tokenloop_command
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(),
                                reason="the default model is not prepared: run `make model`")


class Proc:
    """`tokenloop serve` with extra flags and environment; `lines` is its log."""

    def __init__(self, *args: str, env: dict | None = None):
        self.port = _free_port()
        cmd = [*_tokenloop_command(), "serve", "--model", str(DEFAULT_MODEL), "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 300
        while not self.ready.wait(0.2):
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines[-20:])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = tokenloop_pb2_grpc.TextGenerationStub(self.channel)

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if "tokenloop ready" in line:
                self.ready.set()

    def wait(self, timeout=120) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.channel.close()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def gen(text="Count from one to ten:", max_new=8, **kw):
    return pb.GenerateRequest(text=text, stream=True,
                              stopping=pb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True), **kw)


def outcome(stub, request, metadata=None):
    """(status code, messages) of one Generate, read to the end."""
    msgs = []
    try:
        for m in stub.Generate(request, metadata=metadata, timeout=120):
            msgs.append(m)
        return grpc.StatusCode.OK, msgs
    except grpc.RpcError as err:
        return err.code(), msgs + [err.details()]


def first_message_then_rest(stub, request):
    """Start a stream, return once its first message arrived, with a future of (code, all messages)."""
    started = threading.Event()

    def read():
        msgs = []
        try:
            for m in stub.Generate(request, timeout=300):
                msgs.append(m)
                started.set()
            return grpc.StatusCode.OK, msgs
        except grpc.RpcError as err:
            started.set()
            return err.code(), msgs + [err.details()]
    future = ThreadPoolExecutor(1).submit(read)
    assert started.wait(120)
    return future


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
