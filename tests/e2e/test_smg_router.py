"""The real Shepherd Model Gateway (PyPI `smg`, pinned) in front of a real `tokenloop serve` on the default model.

SMG speaks OpenAI HTTP to clients and gRPC to tokenloop, on each of smg's worker protocols tokenloop serves:
`vllm.grpc.engine.VllmEngine` (what smg detects when the worker serves both, the default) and
`trtllm.TrtllmService` (`--router-protocol trtllm`). It applies the chat template, sends token ids, detokenizes
what comes back, aborts requests whose HTTP client left, and probes the worker's health. The tests run in file
order, once per protocol; the last one stops tokenloop.
"""

from __future__ import annotations

import http.client
import json
import re
import time

import grpc
import pytest
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from tests.e2e.gateway import Router, generate_records, poll, post, worker_and_router
from tests.e2e.live_server import DEFAULT_MODEL, ROOT, LiveServer
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France?"
DEFAULT_MAX_NEW_TOKENS = 24  # the worker's --default-max-new-tokens


@pytest.fixture(scope="module", params=["vllm", "trtllm"])
def stack(request, tmp_path_factory):
    """(tokenloop LiveServer, Router) on loopback, the worker serving both protocols (smg detects vLLM) or only
    TrtllmService; both stopped at the end of the module."""
    flags = ("--log-format", "json", "--default-max-new-tokens", str(DEFAULT_MAX_NEW_TOKENS))
    yield from worker_and_router(tmp_path_factory, request.param,
                                 flags + (() if request.param == "vllm" else ("--router-protocol", "trtllm")))


def chat_body(stream: bool, **extra) -> bytes:
    return json.dumps({"model": DEFAULT_MODEL.name, "messages": [{"role": "user", "content": QUESTION}],
                       "temperature": 0, "max_tokens": 24, "stream": stream, **extra}).encode()


def load(worker: LiveServer) -> pb.Load:
    with grpc.insecure_channel(worker.address) as channel:
        return pb_grpc.TextGenerationStub(channel).GetLoad(pb.GetLoadRequest(), timeout=10)


def test_router_lists_the_worker_with_the_protocol_it_detected(stack):
    worker, router = stack
    status, models = router.get("/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [DEFAULT_MODEL.name]
    (w,) = router.workers()
    assert w["runtime_type"] == worker.protocol and w["is_healthy"] and w["url"] == f"grpc://{worker.address}"


def test_non_streaming_chat_completion_through_the_router(stack):
    worker, router = stack
    resp = post(router, chat_body(stream=False))
    assert resp.status == 200
    body = json.loads(resp.read())
    choice = body["choices"][0]
    assert "Paris" in choice["message"]["content"] and choice["finish_reason"] == "stop"
    assert body["usage"]["prompt_tokens"] > 0 and 0 < body["usage"]["completion_tokens"] <= 24


def test_streaming_chat_completion_through_the_router(stack):
    worker, router = stack
    resp = post(router, chat_body(stream=True))
    assert resp.status == 200 and resp.getheader("content-type", "").startswith("text/event-stream")
    events = [line[len(b"data: "):].strip() for line in resp.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "Paris" in text and len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 2
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


def test_stop_strings_and_refused_fields_through_the_router(stack):
    worker, router = stack
    resp = post(router, chat_body(stream=False, stop=[" Paris"]))
    assert resp.status == 200
    choice = json.loads(resp.read())["choices"][0]
    assert choice["finish_reason"] == "stop" and "Paris" not in choice["message"]["content"]
    assert choice["message"]["content"].startswith("The capital of France is")
    resp = post(router, chat_body(stream=False, min_p=2.0))
    body = resp.read().decode()
    assert resp.status >= 400 and "min_p" in body, body  # refused by name, not ignored (test_smg_structured.py:
    # response_format, once refused here, is served)


def protocol_table() -> dict[str, dict[str, str]]:
    """docs/router.md's table of what each protocol gets: row label -> {"trtllm": cell, "vllm": cell}."""
    lines = (ROOT / "docs" / "router.md").read_text().split("<!-- protocol-table -->", 1)[1].strip().splitlines()
    assert lines[0].split(" | ")[1:] == ["reaches a `trtllm.TrtllmService` worker",
                                         "reaches a `vllm.grpc.engine.VllmEngine` worker |"], lines[0]
    out = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        label, trtllm, vllm = (cell.strip() for cell in line.strip().strip("|").split(" | "))
        out[label] = {"trtllm": trtllm, "vllm": vllm}
    return out


def received(worker: LiveServer, router: Router, path: str, **body) -> dict:
    """Send one OpenAI request through the router; the worker's request-log record of the Generate it caused, found
    by its request id (smg sends the response's `id` as the Generate's `request_id`). Not by counting the records
    that arrive after the request: a record is logged once its stream ends, after smg may have answered, and is read
    from the worker's output on a thread, so under load an earlier test's record (its refused request's) arrived
    after the count and was taken for a second Generate (issue 44)."""
    conn = http.client.HTTPConnection(router.base, timeout=120)
    conn.request("POST", path, body=json.dumps({"model": DEFAULT_MODEL.name, **body}).encode(),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[-500:]
    rid = json.loads(resp.read())["id"]
    records = poll(lambda: [r for r in generate_records(worker) if r["request_id"] == rid], timeout=10)
    time.sleep(0.5)  # a second Generate of this id (a retry by smg) would be logged by now
    records = [r for r in generate_records(worker) if r["request_id"] == rid]
    assert len(records) == 1, (rid, records)
    return records[0]


def numbers(cell: str) -> list[float]:
    return [float(n) for n in re.findall(r"\d+(?:\.\d+)?", cell)]


def test_what_reaches_the_worker_matches_the_protocol_table_in_router_md(stack):
    """Each row of docs/router.md's protocol table, for this stack's protocol, against what the worker ran."""
    worker, router = stack
    table = {label: cells[worker.protocol] for label, cells in protocol_table().items()}
    gen = json.loads((DEFAULT_MODEL / "generation_config.json").read_text())
    chat = {"messages": [{"role": "user", "content": QUESTION}], "stop": ["."]}  # a short answer either way

    rec = received(worker, router, "/v1/chat/completions", **chat)
    cell = table["chat, no `temperature`, no `max_tokens`"]
    expected = [gen["temperature"], gen["top_p"], DEFAULT_MAX_NEW_TOKENS] if "unset" in cell else numbers(cell)
    assert [rec["temperature"], rec["top_p"], rec["max_new_tokens"]] == pytest.approx(expected), (cell, rec)

    rec = received(worker, router, "/v1/completions", prompt="The capital of France is", stop=["."])
    cell = table["completions, no `max_tokens`"]
    assert rec["max_new_tokens"] == (DEFAULT_MAX_NEW_TOKENS if "unset" in cell else numbers(cell)[0]), (cell, rec)

    rec = received(worker, router, "/v1/chat/completions", **chat, max_tokens=4, seed=777)
    cell = table["chat with `seed`"]
    assert cell in ("seed **dropped**", "seed forwarded") and (rec["seed"] == 777) == (cell == "seed forwarded")

    cell = table["model defaults"]
    if worker.protocol == "vllm":
        with grpc.insecure_channel(worker.address) as channel:
            info = vpb_grpc.VllmEngineStub(channel).GetModelInfo(vpb.GetModelInfoRequest(), timeout=10)
        assert f"`{info.default_sampling_params_json}`" in cell and json.loads(info.default_sampling_params_json) == {
            "temperature": gen["temperature"], "top_p": gen["top_p"]}
    else:
        assert cell.startswith("none") and not any(
            "default" in f.name for f in tpb.GetModelInfoResponse.DESCRIPTOR.fields)

    cell = table["`/v1/embeddings`"]
    conn = http.client.HTTPConnection(router.base, timeout=120)
    conn.request("POST", "/v1/embeddings", body=json.dumps({"model": DEFAULT_MODEL.name, "input": QUESTION}).encode(),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    if cell == "`Embed` called":
        assert resp.status == 200 and len(json.loads(raw)["data"][0]["embedding"]) > 0, raw[-500:]
    else:
        assert cell.startswith("HTTP 501") and resp.status == 501, (resp.status, raw[-500:])

    cell = table["`logit_bias`, `min_tokens`, LoRA"]
    rec = received(worker, router, "/v1/chat/completions", **chat, max_tokens=4, logit_bias={"5": 5.0})
    assert cell.startswith("dropped") and rec["status"] == "OK"  # not refused: it never reached the worker


def test_client_disconnect_at_the_router_ends_the_request_in_tokenloop(stack):
    worker, router = stack
    resp = post(router, chat_body(stream=True, max_tokens=2000, ignore_eos=True,
                                  messages=[{"role": "user", "content": "Tell me a very long story."}]))
    assert resp.status == 200
    for _ in range(5):  # the generation is under way
        assert resp.readline()
    assert load(worker).num_running == 1
    resp.close()  # the HTTP client goes away mid-stream
    assert poll(lambda: load(worker).num_running == 0 and load(worker).num_in_flight == 0), load(worker)


def test_stopping_tokenloop_marks_the_worker_unhealthy(stack):
    worker, router = stack
    worker.stop()
    assert poll(lambda: router.workers() and not router.workers()[0]["is_healthy"]), router.workers()
    assert router.get("/readiness")[0] == 503
