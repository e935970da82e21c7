"""The real Shepherd Model Gateway (PyPI `smg`, pinned) in front of a real `tokenloop serve` on the default model.

SMG speaks OpenAI HTTP to clients and gRPC to tokenloop, on each of smg's worker protocols tokenloop serves:
`vllm.grpc.engine.VllmEngine` (what smg detects when the worker serves both, the default) and
`trtllm.TrtllmService` (`--router-protocol trtllm`). It applies the chat template, sends token ids, detokenizes
what comes back, aborts requests whose HTTP client left, and probes the worker's health. The tests run in file
order, once per protocol; the last one stops tokenloop.
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from tests.e2e.live_server import DEFAULT_MODEL, ROOT, LiveServer, _free_port
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

SMG_VERSION = "1.13.0"
QUESTION = "What is the capital of France?"
READY_TIMEOUT_S = 90.0


def smg_binary() -> str:
    """The `smg` console script next to this Python, on PATH, or installed now from PyPI (pinned)."""
    local = Path(sys.executable).parent / "smg"
    if local.exists():
        return str(local)
    if shutil.which("smg"):
        return shutil.which("smg")
    done = subprocess.run([sys.executable, "-m", "pip", "install", f"smg=={SMG_VERSION}"], check=False,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not local.exists():
        pytest.skip(f"could not install smg=={SMG_VERSION} from PyPI: {done.stderr[-500:]}")
    return str(local)


class Router:
    """An `smg launch` child process in front of one gRPC worker."""

    def __init__(self, worker: str, log_path: Path):
        self.port = _free_port()
        self.base = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", f"grpc://{worker}", "--model-path", str(DEFAULT_MODEL),
             "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
             "--health-success-threshold", "1", "--log-level", "info"],
            cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://{self.base}{path}", timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as err:
            return err.code, {}

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if self.get("/readiness")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"smg did not become ready (exit {self.proc.returncode}):\n{self.log_tail()}")

    def workers(self) -> list[dict]:
        return self.get("/workers")[1].get("workers", [])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module", params=["vllm", "trtllm"])
def stack(request, tmp_path_factory):
    """(tokenloop LiveServer, Router) on loopback, the worker serving both protocols (smg detects vLLM) or only
    TrtllmService; both stopped at the end of the module."""
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("the default model is not prepared: run `make model`")
    smg_binary()
    worker = LiveServer(DEFAULT_MODEL, () if request.param == "vllm" else ("--router-protocol", "trtllm"))
    worker.protocol = request.param
    router = None
    try:
        worker.wait_ready()
        router = Router(worker.address, tmp_path_factory.mktemp("smg") / "smg.log")
        router.wait_ready()
        yield worker, router
    finally:
        if router is not None:
            router.stop()
        worker.stop()


def chat_body(stream: bool, **extra) -> bytes:
    return json.dumps({"model": DEFAULT_MODEL.name, "messages": [{"role": "user", "content": QUESTION}],
                       "temperature": 0, "max_tokens": 24, "stream": stream, **extra}).encode()


def post(router: Router, body: bytes) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(router.base, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    return conn.getresponse()


def load(worker: LiveServer) -> pb.Load:
    with grpc.insecure_channel(worker.address) as channel:
        return pb_grpc.TextGenerationStub(channel).GetLoad(pb.GetLoadRequest(), timeout=10)


def poll(predicate, timeout: float = 20.0, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


def test_router_lists_the_worker_with_the_protocol_it_detected(stack):
    worker, router = stack
    status, models = router.get("/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [DEFAULT_MODEL.name]
    (w,) = router.workers()
    assert w["runtime_type"] == worker.protocol and w["is_healthy"] and w["url"] == f"grpc://{worker.address}"


def test_non_streaming_chat_completion_through_the_router(stack):
    worker, router = stack
    resp = post(router, chat_body(stream=False))
    assert resp.status == 200
    body = json.loads(resp.read())
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] > 0 and 0 < body["usage"]["completion_tokens"] <= 24


def test_streaming_chat_completion_through_the_router(stack):
    worker, router = stack
    resp = post(router, chat_body(stream=True))
    assert resp.status == 200 and resp.getheader("content-type", "").startswith("text/event-stream")
    events = [line[len(b"data: "):].strip() for line in resp.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Paris" in text and len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 2
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def test_stop_strings_and_refused_fields_through_the_router(stack):
    worker, router = stack
    resp = post(router, chat_body(stream=False, stop=[" Paris"]))
    assert resp.status == 200
    choice = json.loads(resp.read())["choices"][0]
    assert choice["finish_reason"] == "stop" and "Paris" not in choice["message"]["content"]
    assert choice["message"]["content"].startswith("The capital of France is")
    resp = post(router, chat_body(stream=False, min_p=2.0))
    body = resp.read().decode()
    assert resp.status >= 400 and "min_p" in body, body  # refused by name, not ignored (test_smg_structured.py:
    # response_format, once refused here, is served)


def test_client_disconnect_at_the_router_ends_the_request_in_tokenloop(stack):
    worker, router = stack
    resp = post(router, chat_body(stream=True, max_tokens=2000, ignore_eos=True,
                                  messages=[{"role": "user", "content": "Tell me a very long story."}]))
    assert resp.status == 200
    for _ in range(5):  # the generation is under way
        assert resp.readline()
    assert load(worker).num_running == 1
    resp.close()  # the HTTP client goes away mid-stream
    assert poll(lambda: load(worker).num_running == 0 and load(worker).num_in_flight == 0), load(worker)


def test_stopping_tokenloop_marks_the_worker_unhealthy(stack):
    worker, router = stack
    worker.stop()
    assert poll(lambda: router.workers() and not router.workers()[0]["is_healthy"]), router.workers()
    assert router.get("/readiness")[0] == 503
