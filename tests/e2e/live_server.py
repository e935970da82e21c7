"""Real `tokenloop serve` processes with the default model, for the e2e tests.

`live_address()`: one server shared by the client e2e tests, started on first use and stopped when the test
session ends (set TOKENLOOP_E2E_ADDRESS=HOST:PORT to point these tests at a server that is already running
instead). `Proc`: a server of a test's own, with extra flags and environment; `gen`, `outcome` and
`first_message_then_rest` drive it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
READY_TIMEOUT_S = 300.0
_server: LiveServer | None = None
_lora_root: Path | None = None


class LiveServer:
    """A `tokenloop serve` child process; `address` is HOST:PORT once it logged "ready"."""

    def __init__(self, model_dir: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self._ready = threading.Event()
        cmd = [*tokenloop_command(), "serve", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--shutdown-grace", "5", *extra_args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "ready" in line.lower():
                self._ready.set()

    def wait_ready(self) -> None:
        """Block until the server says it is ready; raise with its log if it dies or takes too long."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = "".join(self.lines[-30:])
                raise RuntimeError(f"tokenloop serve did not become ready (exit {self.proc.returncode}):\n{tail}")

    def stop(self) -> None:
        stop_process(self.proc, 30)


def stop_process(proc: subprocess.Popen | None, grace: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited after `grace` s (nothing if it is not running)."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tokenloop_command() -> list[str]:
    script = Path(sys.executable).parent / "tokenloop"
    if script.exists():
        return [str(script)]
    found = shutil.which("tokenloop")
    return [found] if found else [sys.executable, "-m", "tokenloop.service.cli"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shared_lora_root() -> Path:
    """The shared server's --lora-root (a directory of this test session): a test that loads an adapter by
    LoadLoraAdapter writes it here."""
    global _lora_root
    if _lora_root is None:
        _lora_root = Path(tempfile.mkdtemp(prefix="tokenloop-e2e-lora-"))
        atexit.register(shutil.rmtree, _lora_root, True)
    return _lora_root


def live_address() -> str:
    """HOST:PORT of a live server: $TOKENLOOP_E2E_ADDRESS, or a shared `tokenloop serve` child."""
    global _server
    if os.environ.get("TOKENLOOP_E2E_ADDRESS"):
        return os.environ["TOKENLOOP_E2E_ADDRESS"]
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("the default model is not prepared: run `make model`")
    if _server is None:
        _server = LiveServer(DEFAULT_MODEL, ("--lora-root", str(shared_lora_root())))
        atexit.register(_server.stop)
        _server.wait_ready()
    elif _server.proc.poll() is not None:
        raise RuntimeError("the shared tokenloop server has exited:\n" + "".join(_server.lines[-30:]))
    return _server.address


class Proc:
    """`tokenloop serve` with extra flags and environment; `lines` is its log."""

    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        cmd = [*tokenloop_command(), "serve", "--model", str(DEFAULT_MODEL), "--port", str(self.port), *args]
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
