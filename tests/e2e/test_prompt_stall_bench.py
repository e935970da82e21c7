"""bench/prompt_stall.py end to end, small: real server processes on loopback, its JSON keys, and that the long
prompts were sent and answered on both servers (the default one tokenizing them on a thread, the other inline).

Timings are printed by the bench, never asserted here."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from tests.conftest import ROOT


def test_prompt_stall_bench_reports_its_keys(tokenizer_dir):
    out = subprocess.run(
        [sys.executable, "-m", "tokenloop.bench", "prompt_stall", "--json", "--model", str(tokenizer_dir),
         "--streams", "8", "--rate", "50", "--seconds", "1", "--repeat", "1", "--prompt-tokens", "3000",
         "--prompts-per-s", "4"],
        capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert 2048 < res["prompt_chars"] and 0 < res["prompt_tokens"] <= 3000  # long enough to go to the thread
    for run in ("quiet", "offloaded", "inline"):
        for q in ("p50", "p99", "max"):
            value = res[f"{run}_{q}_ms"]
            assert math.isfinite(value) and value >= 0, (run, q, value)
        assert res[f"{run}_p50_ms"] <= res[f"{run}_p99_ms"] <= res[f"{run}_max_ms"]
    for run in ("offloaded", "inline"):
        assert res[f"{run}_prompts"] >= 1 and res[f"{run}_prompt_ms_p50"] > 0
