"""`tokenloop-cli` as a real process against a real `tokenloop serve` with the default model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.live_server import ROOT, live_address

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def address() -> str:
    return live_address()


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run tokenloop-cli (the console script when installed, else the module from the source tree)."""
    script = Path(sys.executable).parent / "tokenloop-cli"
    if script.exists():
        cmd = [str(script)]
    else:
        code = "import sys; sys.path.insert(0, 'clients/python'); from tokenloop_client.cli import main; main()"
        cmd = [sys.executable, "-c", code]
    return subprocess.run([*cmd, *args], cwd=ROOT, check=False, capture_output=True, text=True, timeout=timeout)


def test_generate_prints_the_answer_and_streams_the_same_text(address):
    once = cli("--address", address, "generate", QUESTION, "--chat", "--max-new-tokens", "16",
               "--temperature", "0")
    streamed = cli("--address", address, "generate", QUESTION, "--chat", "--stream", "--max-new-tokens", "16",
                   "--temperature", "0")
    assert once.returncode == 0, once.stderr
    assert streamed.returncode == 0, streamed.stderr
    assert "Paris" in once.stdout
    assert streamed.stdout == once.stdout  # greedy: the deltas add up to the same text
    assert "prompt +" in streamed.stderr and "completion tokens" in streamed.stderr


def test_generate_reports_a_typed_error(address):
    bad = cli("--address", address, "generate", "Hi", "--temperature", "-1")
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: INVALID_ARGUMENT:") and "temperature" in bad.stderr


def test_info_and_tokenize(address):
    info = cli("--address", address, "info", "--json")
    tok = cli("--address", address, "tokenize", "Hello world", "--json")
    assert info.returncode == 0, info.stderr
    data = json.loads(info.stdout)
    assert data["model"]["model_id"] == "SmolLM2-135M-Instruct"
    assert data["health"] == "SERVING"
    ids = json.loads(tok.stdout)["token_ids"]
    assert len(ids) >= 2


def test_bench_json_sweeps_concurrency(address):
    run = cli("--address", address, "bench", "--concurrency", "1,2", "--num-requests", "3",
              "--prompt-tokens", "16", "--max-new-tokens", "8", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["server"]["model_id"] == "SmolLM2-135M-Instruct"
    assert [level["concurrency"] for level in report["results"]] == [1, 2]
    for level in report["results"]:
        assert level["num_ok"] == 3 and level["num_errors"] == 0, level["errors_by_code"]
        assert level["output_tokens"] == 3 * 8  # ignore_eos: every request runs to max_new_tokens
        assert level["output_tokens_per_s"] > 0
        assert level["ttft_s"]["p50"] is not None and level["itl_s"]["p99"] is not None
