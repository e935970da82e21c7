"""The real Shepherd Model Gateway (PyPI `smg`, pinned) as a child process, for the e2e tests that route through it."""

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

import pytest

from tests.e2e.live_server import DEFAULT_MODEL, ROOT, LiveServer, free_port, stop_process

SMG_VERSION = "1.13.0"
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
    """An `smg launch` child process in front of one gRPC worker; smg loads the tokenizer from `model_path` (a path
    that does not exist: smg takes the worker's, by GetTokenizer)."""

    def __init__(self, worker: str, log_path: Path, model_path: Path = DEFAULT_MODEL):
        self.port = free_port()
        self.base = f"127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [smg_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
             "--worker-urls", f"grpc://{worker}", "--model-path", str(model_path),
             "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
             "--health-success-threshold", "1", "--log-level", "info",
             # its own metrics port: two routers at once (a test's two stacks) would both take smg's default 29000
             "--prometheus-port", str(free_port()), "--prometheus-host", "127.0.0.1"],
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
        stop_process(self.proc, 20)
        self._log.close()


def post(router: Router, body: bytes) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(router.base, timeout=120)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    return conn.getresponse()


def worker_and_router(tmp_path_factory, protocol: str, flags: tuple[str, ...]):
    """A fixture's body: `tokenloop serve` with `flags` (its `protocol` noted: what smg must detect) and an smg router
    in front of it, yielded as (worker, router); both stopped afterwards."""
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("the default model is not prepared: run `make model`")
    smg_binary()
    worker = LiveServer(DEFAULT_MODEL, flags)
    worker.protocol = protocol
    router = None
    try:
        worker.wait_ready()
        router = Router(worker.address, tmp_path_factory.mktemp(f"smg-{protocol}") / "smg.log")
        router.wait_ready()
        yield worker, router
    finally:
        if router is not None:
            router.stop()
        worker.stop()


def generate_records(worker: LiveServer) -> list[dict]:
    """The worker's request-log records of Generate calls (`--log-format json`), in order."""
    return [rec for rec in (json.loads(line) for line in list(worker.lines) if line.startswith("{"))
            if rec.get("message") == "request end" and rec.get("rpc", "").endswith("/Generate")]


def poll(predicate, timeout: float = 20.0, step: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)
