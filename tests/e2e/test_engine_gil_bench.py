"""bench/engine_gil.py end to end, small: a real `tokenloop serve` on the default model and the control server,
both probed idle and under load; the JSON it prints and that the load reached the engine.

Timings are printed by the bench, never asserted here: only the shape of its output.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_engine_gil_bench_probes_both_servers_idle_and_loaded(default_model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "tokenloop.bench", "engine_gil", "--json", "--model", str(default_model_dir),
         "--streams", "2", "--tokens", "8", "--seconds", "2", "--warmup", "1", "--no-py-spy"],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    for phase in ("idle", "loaded"):
        for server in ("tokenloop", "control"):
            probes = res[phase][server]
            assert probes["num"] > 10, (phase, server, probes)  # a probe every ~10 ms for 2 s
            assert 0 < probes["p50_ms"] <= probes["p99_ms"] <= probes["max_ms"], (phase, server, probes)
    assert res["tokens_per_s"] > 0  # the streams ran on the engine while the probes did
    assert res["cpu_pct"]["event loop"] > 0 and "gil_pct" not in res
