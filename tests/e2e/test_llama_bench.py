"""bench/engine_bench.py against a real llama.cpp `llama-server`, small: only where llama.cpp is built
(`../shared/tools/build_llamacpp.sh DIR`; DIR from $TOKENLOOP_LLAMA_CPP, default .cache/llama.cpp), skipped with
the reason otherwise: llama.cpp is a benchmark tool, not part of CI.

Both ways docs/engine.md "Comparing with llama.cpp" gives: the bench starting llama-server itself (--llama-cpp)
and one already running (--llama-server URL). The one-stream scenario on each system, the engine in its default
fp32; the JSON's keys, the tokens each system returned and the CPU record. Timings are never asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tokenloop.bench.llama_server import GGUF, LlamaClient, LlamaServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LLAMA_DIR = Path(os.environ.get("TOKENLOOP_LLAMA_CPP") or ROOT / ".cache" / "llama.cpp")


@pytest.fixture(scope="module")
def llama_dir() -> Path:
    for path in (LLAMA_DIR / "build" / "bin" / "llama-server", LLAMA_DIR / GGUF):
        if not path.is_file():
            pytest.skip(f"llama.cpp is not built: no {path} (../shared/tools/build_llamacpp.sh {LLAMA_DIR}, "
                        "or set TOKENLOOP_LLAMA_CPP to its directory)")
    return LLAMA_DIR


def _bench(tmp_path, model: Path, *flags: str) -> dict:
    out = tmp_path / "engine.json"
    run = subprocess.run([sys.executable, "-m", "tokenloop.bench", "engine", "--model", str(model),
                          "--scenarios", "single", "--reference", "none", "--no-bandwidth", "--out", str(out), *flags],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "vs llama.cpp" in run.stdout and "fastest mode against llama-server" in run.stdout
    return json.loads(out.read_text())


def _check(data: dict) -> None:
    systems = {r["system"]: r for r in data["results"]}
    assert set(systems) == {"tokenloop", "llama-server Q4_1"}
    for r in systems.values():
        assert r["num_tokens"] == 128 and len(r["ttft_s"]) == 1 and r["ttft_s"][0] > 0
        # each side's client CPU is kept (both clients are asyncio loops in the bench process)
        assert r["cpu"]["client_cpu_s"] > 0 and "other_cpu_s" in r["cpu"]
    assert systems["tokenloop"]["cpu"]["server_cpu_s"] > 0  # (llama-server's only when the bench started it)
    summary = data["issue_32"]["vs_llama_single"]
    assert summary["system"] == "tokenloop" and summary["ratio"] > 0
    assert data["cpu"] and "isa" in data and data["cpu_family"] is not None


def test_the_bench_starts_llama_server_itself(tmp_path, llama_dir, default_model_dir):
    data = _bench(tmp_path, default_model_dir, "--llama-cpp", str(llama_dir))
    _check(data)
    assert data["llama_server"][0].endswith("llama-server") and "-np" in data["llama_server"]


def test_the_bench_drives_a_running_llama_server(tmp_path, llama_dir, default_model_dir):
    from tokenloop.bench.harness import free_port

    with LlamaServer(llama_dir, free_port()) as server:
        data = _bench(tmp_path, default_model_dir, "--llama-server", server.url)
        assert LlamaClient(server.url).healthy()  # the bench leaves a server it did not start running
    _check(data)
    assert data["llama_server"] == server.url
