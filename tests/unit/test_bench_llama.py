"""bench/llama_server.py's client against a recorded llama-server response (no llama.cpp needed), and how
bench/engine_bench.py puts llama-server beside the engine: the table's "vs llama.cpp" column and issue 32's summary.
tests/e2e/test_llama_bench.py runs it against a real llama-server where one is built."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
from itertools import count

import pytest

from tests.conftest import ROOT
from tokenloop.bench import bandwidth, engine_bench
from tokenloop.bench.harness import HttpError, sse_lines
from tokenloop.bench.llama_server import LlamaClient, LlamaError, LlamaServer, parse_stream, request_body

# The body of `POST /completion` with request_body(RECORDED_PROMPT, 8), streamed by the llama-server that
# ../shared/tools/build_llamacpp.sh builds (llama-cpp-python 0.3.36's tree) on the Q4_1 GGUF, 2026-12-06 02:45 UTC
RECORDED = ROOT / "tests" / "data" / "llama_server_completion_stream.txt"
# "The history of computing is a story of ideas that became machines and machines that changed ideas."
RECORDED_PROMPT = [504, 1463, 282, 7867, 314, 253, 1977, 282, 2821, 338, 2163, 6120, 284, 6120, 338, 4247, 2821, 30]


def parse(lines: list[bytes], sent: float, clock=None):
    """parse_stream over `lines` served as an async iterable, as sse_lines gives them."""
    async def served():
        for line in lines:
            yield line
    return asyncio.run(parse_stream(served(), sent, clock) if clock else parse_stream(served(), sent))


def clock_from(start: float = 10.0):
    ticks = count()
    return lambda: start + next(ticks)


def test_parse_stream_reads_a_recorded_response():
    lines = RECORDED.read_bytes().splitlines(keepends=True)
    done = parse(lines, sent=9.5, clock=clock_from(10.0))
    assert done.num_tokens == 8 and len(done.token_ids) == 8  # tokens_predicted, and one id per streamed event
    assert done.ttft_s == 0.5  # the first event with a token, on the clock: read once, at that event
    assert done.token_ids == [198, 198, 504, 1977, 282, 7867, 314, 253]  # greedy: "\n\nThe story of computing is a"
    assert done.timings["predicted_n"] == 8 and done.timings["prompt_n"] == len(RECORDED_PROMPT)
    assert done.cached_prompt_tokens == done.timings["cache_n"] == 0


def _events(*events: dict) -> list[bytes]:
    return [f"data: {json.dumps(e)}\n".encode() + b"\n" for e in events]


def test_parse_stream_counts_tokens_from_the_final_event():
    """A token ending in half a UTF-8 character is sent with the next one: the count is tokens_predicted."""
    lines = _events({"content": "a", "tokens": [1], "stop": False}, {"content": "\u00e9", "tokens": [3], "stop": False},
                    {"content": "", "tokens": [], "stop": True, "tokens_predicted": 3, "timings": {"cache_n": 16}})
    done = parse(lines, sent=0.0, clock=clock_from(2.0))
    assert (done.num_tokens, done.token_ids, done.ttft_s, done.cached_prompt_tokens) == (3, [1, 3], 2.0, 16)


@pytest.mark.parametrize("lines, message", [
    (_events({"error": {"code": 400, "message": "the request exceeds the available context size"}}), "exceeds"),
    (_events({"content": "a", "tokens": [1], "stop": False}), "without its final event"),
    (_events({"content": "", "tokens": [], "stop": True, "tokens_predicted": 0}), "without sending a token"),
])
def test_parse_stream_rejects_broken_streams(lines, message):
    with pytest.raises(LlamaError, match=message):
        parse(lines, sent=0.0)


def test_the_request_is_greedy_token_ids_ignoring_eos():
    body = request_body([5, 6, 7], 128)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 128 and body["stream"] is True
    assert body["temperature"] == 0.0 and body["top_k"] == 1 and body["ignore_eos"] is True


class _Replay(http.server.BaseHTTPRequestHandler):
    """Answers /completion with the recorded stream (in HTTP/1.1 chunks of 100 bytes, as llama-server sends its
    events chunked), /tokenize with fixed ids; remembers the bodies."""

    protocol_version = "HTTP/1.1"

    bodies: list[dict] = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        self.send_response(200 if self.path in ("/completion", "/tokenize") else 404)
        self.send_header("Content-Type", "text/event-stream" if self.path == "/completion" else "application/json")
        self.send_header("Connection", "close")
        if self.path == "/completion":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            data = RECORDED.read_bytes()
            for i in range(0, len(data), 100):  # chunk borders fall inside events and lines
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data[i:i + 100]), data[i:i + 100]))
            self.wfile.write(b"0\r\n\r\n")
        else:
            payload = json.dumps({"tokens": [1, 2, 3]}).encode() if self.path == "/tokenize" else b"{}"
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    def log_message(self, *args):
        pass


def test_the_client_streams_requests_over_http_in_order():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Replay)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = LlamaClient(f"http://127.0.0.1:{server.server_address[1]}")
        wall, done = asyncio.run(client.run([[1, 2], [3, 4, 5], [6]], [8, 8, 8], concurrency=2))
        assert wall > 0 and [c.num_tokens for c in done] == [8, 8, 8] and all(c.ttft_s > 0 for c in done)
        assert all(c.token_ids == [198, 198, 504, 1977, 282, 7867, 314, 253] for c in done)  # every chunk read
        assert sorted(b["prompt"] for b in _Replay.bodies) == [[1, 2], [3, 4, 5], [6]]
        assert client.tokenize("text") == [1, 2, 3]
        with pytest.raises(LlamaError, match="HTTP 404"):
            client.call("POST", "/nothing", {})
        with pytest.raises(HttpError, match="POST /nothing: HTTP 404"):
            asyncio.run(anext(sse_lines(client.host, client.port, "/nothing", {})))
    finally:
        server.shutdown()


def test_llama_server_names_the_build_script_when_it_is_not_built(tmp_path):
    with pytest.raises(FileNotFoundError, match="build_llamacpp.sh"):
        LlamaServer(tmp_path, 8082)


def test_scenarios_that_do_not_fit_its_slots_are_left_out():
    scenarios = engine_bench.make_scenarios(list(range(5000)))
    assert [len(scenarios[n].prompts) for n in ("single", "eight", "uniform")] == [1, 8, 32]
    assert [scenarios[n].concurrency for n in ("single", "eight", "uniform")] == [1, 8, 32]
    assert all(engine_bench.llama_fits(scenarios[n]) for n in ("single", "eight", "uniform"))
    assert not engine_bench.llama_fits(scenarios["mixed"])  # prompts up to 512 tokens in 256-token slots


def _result(system: str, scenario: str, tokens_per_s: float, ttft: float, streams: int) -> engine_bench.Result:
    return engine_bench.Result(system, scenario, int(tokens_per_s * 10), 10.0, [ttft] * streams)


def test_the_table_and_summary_compare_the_fastest_mode_with_llama_server():
    llama = engine_bench.LLAMA
    results = [_result(llama, "single", 100, 0.1, 1), _result("tokenloop int8", "single", 90, 0.05, 1),
               _result("tokenloop int4", "single", 140, 0.05, 1),
               _result(llama, "uniform", 200, 2.4, 32), _result("tokenloop int8", "uniform", 420, 0.6, 32),
               _result("tokenloop fp32", "uniform", 250, 0.5, 32), _result("transformers", "uniform", 200, 3.0, 32),
               _result("tokenloop fp32", "mixed", 120, 2.0, 64), _result("transformers", "mixed", 40, 100, 64)]
    table = engine_bench.table(results).splitlines()
    assert table[0].endswith("| vs fp32 | vs llama.cpp |")
    assert "| single | tokenloop int4 | 1400 |" in table[4] and table[4].endswith("| 1.40x |")
    assert table[1].count("---") == 9
    figures = {"weight_bytes_per_token": {"int4": 100e6, "int8": 150e6}, "limit_bytes_per_s": 20e9}
    summary, text = engine_bench.must_show(results, figures)
    assert summary["vs_llama_single"]["system"] == "tokenloop int4" and summary["vs_llama_single"]["ratio"] == 1.4
    assert summary["vs_llama_uniform"]["ratio"] == 2.1 and summary["vs_llama_uniform"]["ttft_p50_s"] == 0.6
    assert "vs_llama_eight" not in summary  # not run: no row
    assert summary["int4_bandwidth_share"] == pytest.approx(0.7) == bandwidth.share(figures, "int4", 140)
    # after the first token: 1399 tokens in the 9.95 s after a 0.05 s first token
    decode = results[2].decode_tokens_per_s
    assert decode == pytest.approx(1399 / 9.95) and results[3].decode_tokens_per_s is None
    assert summary["int4_decode_bandwidth_share"] == pytest.approx(bandwidth.share(figures, "int4", decode))
    assert "(after the first token)" in text and "(whole request)" in text
    decode_row = next(line for line in text.splitlines() if "int4, one stream (after the first token)" in line)
    whole_row = next(line for line in text.splitlines() if "int4, one stream (whole request)" in line)
    assert decode_row.endswith(">= 60 % |") and whole_row.endswith("(for comparison) |")  # the target is per decode step
    assert summary["fp32_vs_transformers_uniform"] == 1.25 and summary["fp32_vs_transformers_mixed"] == 3.0
    assert "**2.10x**" in text and "**70 %**" in text and ">= 2.4x" in text



def test_a_one_stream_scenario_reports_the_median_of_its_repeats():
    single = engine_bench.make_scenarios(list(range(5000)))["single"]
    rates = iter([150.0, 90.0, 120.0])

    prompts = []

    def run(scenario):
        prompts.append(scenario.prompts[0])
        rate = next(rates)
        return engine_bench.Result("tokenloop int4", "single", 128, 128 / rate, [0.05])
    median = engine_bench.median_of(single, 3, run)
    assert median.tokens_per_s == pytest.approx(120.0) and [r[0] for r in median.repeats] == pytest.approx([150, 90, 120])
    assert engine_bench.spread(median) == ", median of 3 repeats (90.0-150.0)"
    # each repeat the same tokens, no two with a common first token (no prompt-cache hit)
    assert prompts[0] == single.prompts[0] and all(sorted(p) == sorted(prompts[0]) for p in prompts)
    assert len({p[0] for p in prompts}) == 3
    # the warm-up request starts like no repeat (its tokens would otherwise come from the prompt cache)
    warm = engine_bench.warm_up_prompt(single)
    assert len(warm) == 16 and set(warm) <= set(single.prompts[0])
    assert all(warm[0] != engine_bench.rotated(single, shift).prompts[0][0] for shift in range(16))
    eight = engine_bench.make_scenarios(list(range(5000)))["eight"]
    assert engine_bench.median_of(eight, 3, lambda s: s.name) == "eight"  # several streams: one run


def test_the_decode_share_is_held_against_the_median_decode_rate():
    """The repeat that is median by whole-request tok/s need not be median after the first token: the summary's
    decode share uses the median of the decode rates."""
    single = engine_bench.make_scenarios(list(range(5000)))["single"]
    runs = iter([(100.0, 0.30), (120.0, 0.02), (110.0, 0.01)])  # (tok/s, TTFT): 110 is the median by tok/s

    def run(scenario):
        rate, ttft = next(runs)
        return engine_bench.Result("tokenloop int4", "single", 128, 128 / rate, [ttft])
    median = engine_bench.median_of(single, 3, run)
    decode = sorted(127 / (128 / rate - ttft) for rate, ttft in ((100.0, 0.30), (120.0, 0.02), (110.0, 0.01)))
    assert median.tokens_per_s == pytest.approx(110.0)
    assert median.median_decode_tokens_per_s == pytest.approx(decode[1]) != median.decode_tokens_per_s
    figures = {"weight_bytes_per_token": {"int4": 100e6}, "limit_bytes_per_s": 20e9}
    summary, _ = engine_bench.must_show([median], figures)
    assert summary["int4_decode_bandwidth_share"] == pytest.approx(bandwidth.share(figures, "int4", decode[1]))
