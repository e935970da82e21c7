"""bench/service_overhead.py end to end, small: real server processes on loopback, the JSON keys issue 8 names,
and that each scenario sends what it says (one token per message; coalesced batches under a flood).

Timings are printed by the bench, never asserted here: only the shape of its output and token accounting.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

from tests.conftest import ROOT


def test_service_overhead_bench_reports_its_keys_and_each_scenario_sends_what_it_says(tokenizer_dir, tmp_path):
    raw = tmp_path / "raw.json"
    out = subprocess.run(
        [sys.executable, "-m", "tokenloop.bench", "service_overhead", "--json", "--model", str(tokenizer_dir),
         "--scenarios", "bare,messages,coalesced,paced,bare-paced,router,router-paced", "--streams", "1,64",
         "--tokens", "2048",
         "--repeat", "1", "--paced-repeat", "2", "--rate", "50", "--idle-seconds", "1", "--out", str(raw)],
        capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("ratio_1", "ratio_64", "token_ratio_1", "token_ratio_64", "paced_p50_ms_64", "paced_p99_ms_64",
                "router_token_ratio_64", "router_paced_p50_ms_64", "idle_process_pct", "idle_looper_pct"):
        assert key in summary, (key, summary)
        assert math.isfinite(summary[key]) and summary[key] >= 0, (key, summary[key])
    assert summary["ratio_64"] > 0 and summary["token_ratio_64"] > 0
    assert summary["paced_p50_ms_64"] <= summary["paced_p99_ms_64"]
    # the bare server's tokens, timed from when its timer was due, take at least as long as from their send
    assert summary["bare_paced_due_p50_ms_64"] >= summary["bare_paced_p50_ms_64"] > 0

    res = json.loads(raw.read_text())
    for row in res["bare"] + res["messages"]:  # one token per message (coalescing off on the full path)
        assert row["messages"] == row["tokens"] == row["streams"] * (2048 if row["streams"] == 1 else 128), row
    flood = next(r for r in res["coalesced"] if r["streams"] == 64)
    assert flood["tokens"] == 64 * 256  # every token arrived (2048 x 8 / 64 per stream) ...
    assert flood["messages"] < flood["tokens"]  # ... in fewer messages: readers behind a flood get batches
    router = next(r for r in res["router"] if r["streams"] == 64)  # the same through the router API
    assert router["tokens"] == 64 * 256 and router["messages"] < router["tokens"]
    assert all(r["tokens"] == r["streams"] * 150 for r in res["router-paced"])  # 3 s at 50 tokens/s each
    paced = next(r for r in res["paced"] if r["streams"] == 64)
    assert paced["tokens"] == 64 * 150 and 0 < paced["messages"] <= paced["tokens"]  # 3 s at 50 tokens/s
    # two paced runs each; the row kept is the one with the median (here: the lower) p50, and both are listed
    assert len(paced["p50_runs_ms"]) == 2 and paced["p50_runs_ms"][0] <= paced["p50_runs_ms"][1]
    assert round(paced["latency_p50_ms"], 3) == paced["p50_runs_ms"][0]
