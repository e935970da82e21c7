"""Benchmarks write a file only through `--out FILE`: a run never leaves a new file to commit by accident."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.results import write
from tests.conftest import ROOT

SCRIPTS = ["engine_bench.py", "service_overhead.py", "engine_gil.py", "prompt_stall.py", "idle_cpu.py", "soak.py",
           "grammar_libs.py", "kernels.py", "slow_readers.py", "grammar_bounds.py"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_takes_out_and_writes_nothing_by_default(script):
    run = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "--out FILE" in run.stdout and "none by default" in " ".join(run.stdout.split())


def test_the_client_bench_takes_out():
    from tokenloop_client.cli import build_parser
    args = build_parser().parse_args(["bench", "--out", "x.json"])
    assert args.out == "x.json"
    assert build_parser().parse_args(["bench"]).out is None


def test_write_stamps_the_date_and_machine(tmp_path, capsys):
    write(None, {"a": 1})
    assert capsys.readouterr().out == ""
    out = tmp_path / "r.json"
    write(str(out), {"a": 1})
    data = json.loads(out.read_text())
    assert data["a"] == 1 and data["cpus"] >= 1 and data["date"].endswith("Z") and data["cpu"]


def test_one_current_result_file_per_benchmark():
    files = sorted(p.name for p in (ROOT / "bench").glob("results-*"))
    assert files == ["results-clients.json", "results-clients.png", "results-engine-gil.json", "results-engine.json",
                     "results-grammar-bounds.json", "results-grammar-libs.json", "results-kernels.json", "results-lora.json", "results-overhead.json",
                     "results-prompt-stall.json", "results-shared-prefix.json", "results-structured.json"]
