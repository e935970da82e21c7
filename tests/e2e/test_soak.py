"""The chaos and soak suite, shortened (`bench/soak.py --quick`): no leaks after misbehaving clients."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.live_server import DEFAULT_MODEL, ROOT


@pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(),
                    reason="the default model is not prepared: run `make model`")
def test_quick_soak_finds_no_leaks(tmp_path):
    out = tmp_path / "soak.md"
    proc = subprocess.run([sys.executable, "-m", "tokenloop.bench", "soak", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    table = out.read_text()
    assert "Leaks found: none" in table
    assert "running 0, waiting 0, in flight 0, KV blocks used 0/" in table
    for kind in ("cancel", "deadline", "malformed", "oversized", "abort", "fault"):
        assert f"| {kind} |" in table  # every kind of misbehaviour was exercised
    assert "exit code 1" in table  # the engine-death server exited non-zero
    assert "16/16 good complete" in table  # beside the bad-sampling-values burst (each bad one's status: a leak if not)
    assert "'forward fails on its prompt': {'INTERNAL'" in table and "no token allowed': {'INVALID_ARGUMENT'" in table
