"""bench/engine_bench.py end to end, small: one stream on a real `tokenloop serve` (default model) and on
transformers, each after the same warm-up and as the median of the same repeats, every result with its CPU record
(server by thread, this client, the rest of the machine), and the results file stamped with commit and command.
tests/e2e/test_llama_bench.py adds llama-server where llama.cpp is built.

Timings are printed by the bench, never asserted here: only the shape of what it records.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_engine_bench_gives_transformers_the_same_warm_up_and_repeats(tmp_path, default_model_dir):
    out = tmp_path / "engine.json"
    run = subprocess.run([sys.executable, "-m", "tokenloop.bench", "engine", "--model", str(default_model_dir),
                          "--scenarios", "single", "--single-repeats", "3", "--new-tokens", "4", "--no-bandwidth",
                          "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["command"].startswith("tokenloop-bench engine --model ") and data["commit"]
    systems = {r["system"]: r for r in data["results"]}
    assert set(systems) == {"transformers", "tokenloop"}
    for r in systems.values():
        assert r["num_tokens"] == 4 and len(r["repeats"]) == 3  # the median of 3 on both sides
        assert r["cpu"]["client_cpu_s"] >= 0 and "other_cpu_s" in r["cpu"]
        assert r["median_decode_tokens_per_s"] > 0
    assert systems["tokenloop"]["cpu"]["server_cpu_s"] > 0  # the server's threads, read from /proc
    assert "warm-up" in run.stderr  # the server's warm-up request ran before the timed ones
