"""`tokenloop-cli` as a real process against a real `tokenloop serve` with the default model."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.e2e.live_server import ROOT, live_address
from tests.e2e.tools import cli, cli_command

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def address() -> str:
    return live_address()


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


def _sigint(disposition):
    """preexec_fn: the child starts with SIGINT at `disposition`, whatever pytest's own is (`make test &` from a
    script starts pytest, and so every child, with SIGINT ignored: Python then raises no KeyboardInterrupt)."""
    return lambda: signal.signal(signal.SIGINT, disposition)


@pytest.mark.parametrize("sig, sigint, status", [(signal.SIGINT, signal.SIG_DFL, 130),
                                                 (signal.SIGTERM, signal.SIG_IGN, 143)],
                         ids=["ctrl-c", "sigterm-in-a-background-job"])
def test_bench_keeps_the_finished_levels_on_ctrl_c(address, tmp_path, sig, sigint, status):
    out = tmp_path / "bench.json"
    cmd = [*cli_command(), "--address", address, "bench", "-c", "1,2", "-d", "5", "--prompt-tokens", "8",
           "--max-new-tokens", "32", "--out", str(out)]
    # each level starts requests for 5 s; the signal comes right after level 1, while level 2 runs
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_sigint(sigint))
    lines = []
    for line in proc.stderr:  # not a terminal: progress comes as lines
        lines.append(line)
        if line.startswith("concurrency   1 done"):
            break
    time.sleep(0.5)
    proc.send_signal(sig)
    stdout, rest = proc.communicate(timeout=60)
    stderr = "".join(lines) + rest
    assert proc.returncode == status, stderr
    assert "Traceback" not in stderr
    stop = ("Ctrl-C stops and keeps the levels that finished" if sigint == signal.SIG_DFL else
            "SIGINT is ignored in this process (started in the background by a script?): `kill PID` (SIGTERM) "
            "stops and keeps the levels that finished")
    assert lines[0] == ("bench: 2 levels (concurrency 1, 2), 5 s each, then the requests in flight finish: about 10 s "
                        f"or a little more; {stop}\n")
    how = "interrupted" if sig == signal.SIGINT else "terminated (SIGTERM)"
    assert f"bench: {how}; levels that finished: 1 (the level cut short is left out)" in stderr
    table = [row for row in stdout.splitlines() if row.startswith("|") and row[1:].strip()[:1].isdigit()]
    assert [row.split("|")[1].strip() for row in table] == ["1"]
    saved = json.loads(out.read_text())
    assert saved["interrupted"] is True and [level["concurrency"] for level in saved["results"]] == [1]
    assert saved["results"][0]["num_ok"] >= 1 and saved["results"][0]["output_tokens"] % 32 == 0


def test_structured_output_cut_off_at_length_exits_3(address, tmp_path):
    schema = tmp_path / "n.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}')
    run = cli("--address", address, "generate", "Give me a number.", "--chat", "--json-schema", str(schema),
              "--max-new-tokens", "3", "--temperature", "0")
    assert run.returncode == 3, run.stderr
    assert "Traceback" not in run.stderr
    assert "error: incomplete output: sequence 0 ended at LENGTH after 3 tokens, before the --json-schema structure " \
           "was complete (the text above is cut off)." in run.stderr
    assert "maxLength for strings, maximum for numbers, maxItems for arrays" in run.stderr
    whole = cli("--address", address, "generate", "Give me a number.", "--chat", "--json-schema", str(schema),
                "--max-new-tokens", "64", "--temperature", "0")
    assert whole.returncode == 0, whole.stderr
    assert isinstance(json.loads(whole.stdout)["n"], int)


def test_lora_list_with_none_loaded_says_so(address):
    run = cli("--address", address, "lora", "list")
    assert (run.returncode, run.stdout) == (0, "no adapters loaded (load one: tokenloop-cli lora load NAME PATH)\n")


def test_lora_load_names_the_path_as_typed(address):
    run = cli("--address", address, "lora", "load", "x", "/no/such/dir")
    assert run.returncode == 1
    # the server (no --lora-root here) says `path`; the CLI puts back the path as typed
    assert run.stderr == ("error: NOT_FOUND: LoRA adapter `x`: /no/such/dir names no PEFT adapter under this server's "
                          "--lora-root directories (not found, or not allowed)\n"), run.stderr


def test_an_address_without_a_port_and_options_after_the_command(address):
    host, port = address.rsplit(":", 1)
    run = cli("info", "--address", address, "--json")  # global options after the command
    assert run.returncode == 0, run.stderr
    if port == "50051":  # only then does HOST alone reach the server
        assert cli("--address", host, "info").returncode == 0
