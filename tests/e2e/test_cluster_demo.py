"""`make cluster-demo` (scripts/cluster_demo.sh) as a user runs it: it narrates what it shows, its SIGKILL reads as
intended (no bash "Killed" line), and the router's requests after the kill all succeed."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.live_server import DEFAULT_MODEL, ROOT, free_port

pytestmark = pytest.mark.e2e


def test_cluster_demo_narrates_and_its_kill_reads_as_intended():
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("the default model is not prepared: run `make model`")
    if not (ROOT / ".venv" / "bin" / "smg").exists():
        pytest.skip("smg is not installed in .venv (make setup installs it)")
    base = free_port()
    while any(_busy(base + k) for k in (1, 2, 10, 11, 12)):  # workers on base..+2, metrics on base+10..+12
        base = free_port()
    router = free_port()
    while base <= router <= base + 12:  # free now, but a worker's metrics port once the workers start
        router = free_port()
    env = dict(os.environ, BASE_PORT=str(base), ROUTER_PORT=str(router))
    run = subprocess.run(["bash", str(Path(ROOT) / "scripts" / "cluster_demo.sh")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1200, check=False)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    assert not re.search(r"line \d+: .*Killed", out), out
    assert "with SIGKILL on purpose, as a crash would" in out
    assert "the workers' protocol, as SMG detected it: ['vllm']" in out  # no runtime type given (docs/router.md)
    assert "6 of 6 requests after the kill succeeded" in out
    assert out.count("(the same worker every time)") == 3, out  # affinity: each system prompt stays on its worker
    assert "== done: the kill above was part of the demo" in out


def _busy(port: int) -> bool:
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
