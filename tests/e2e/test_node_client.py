"""The Node.js example (clients/node/stream.js) streams a completion from a real server."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.e2e.live_server import ROOT, live_address

pytestmark = pytest.mark.e2e

NODE_DIR = ROOT / "clients" / "node"


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with the example's npm dependencies installed."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node not installed")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm not installed: cannot install @grpc/grpc-js for the Node example")
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=False, capture_output=True,
                              text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"npm ci failed in clients/node (no registry?): {done.stderr[-500:]}")
    return node


def test_node_example_streams_a_completion(node):
    address = live_address()
    run = subprocess.run([node, "stream.js", "--chat", "What is the capital of France?", "--address", address,
                          "--max-new-tokens", "16", "--temperature=0"], cwd=NODE_DIR, check=False,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout
    assert "completion tokens" in run.stderr  # the summary line built from the `complete` message


def test_node_example_reports_the_status_code(node):
    address = live_address()
    run = subprocess.run([node, "stream.js", "Hi", "--address", address, "--temperature=-1"], cwd=NODE_DIR,
                         check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "error: INVALID_ARGUMENT:" in run.stderr
