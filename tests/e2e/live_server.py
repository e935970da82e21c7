"""One real `tokenloop serve` process with the default model, shared by the client e2e tests.

Started on first use and stopped when the test session ends. Set TOKENLOOP_E2E_ADDRESS=HOST:PORT
to point these tests at a server that is already running instead.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
READY_TIMEOUT_S = 300.0
_server: LiveServer | None = None


class LiveServer:
    """A `tokenloop serve` child process; `address` is HOST:PORT once it logged "ready"."""

    def __init__(self, model_dir: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.lines: list[str] = []
        self._ready = threading.Event()
        cmd = [*_tokenloop_command(), "serve", "--model", str(model_dir), "--host", "127.0.0.1",
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
        """SIGTERM, then kill if it does not exit."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _tokenloop_command() -> list[str]:
    script = Path(sys.executable).parent / "tokenloop"
    if script.exists():
        return [str(script)]
    found = shutil.which("tokenloop")
    return [found] if found else [sys.executable, "-m", "tokenloop.service.cli"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def live_address() -> str:
    """HOST:PORT of a live server: $TOKENLOOP_E2E_ADDRESS, or a shared `tokenloop serve` child."""
    global _server
    if os.environ.get("TOKENLOOP_E2E_ADDRESS"):
        return os.environ["TOKENLOOP_E2E_ADDRESS"]
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("the default model is not prepared: run `make model`")
    if _server is None:
        _server = LiveServer(DEFAULT_MODEL)
        atexit.register(_server.stop)
        _server.wait_ready()
    elif _server.proc.poll() is not None:
        raise RuntimeError("the shared tokenloop server has exited:\n" + "".join(_server.lines[-30:]))
    return _server.address
