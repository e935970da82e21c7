"""The real Shepherd Model Gateway (`smg`, pinned) in front of `tokenloop serve --speculative ngram`, on each of smg's
worker protocols (vLLM's, what smg detects when the worker serves both; `trtllm.TrtllmService` with
`--router-protocol trtllm`), beside the same stack with speculation off: greedy chat completions of the grounded
prompts (bench/spec_cases.py, where drafts are accepted) and of free chat give the same text, token counts and finish
reasons, streamed or not; the worker's drafted and accepted tokens reach smg's usage and the worker's GetLoad."""

from __future__ import annotations

import http.client
import json

import grpc
import pytest

from tests.e2e.gateway import Router, worker_and_router
from tests.e2e.live_server import DEFAULT_MODEL, LiveServer
from tokenloop.bench.spec_cases import chat_messages, grounded_messages
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MAX_TOKENS = 64


@pytest.fixture(scope="module", params=["vllm", "trtllm"])
def stacks(request, tmp_path_factory):
    """{"off": (worker, router), "ngram": (worker, router)} for one protocol; all four stopped afterwards."""
    flags = ("--log-format", "json") + (() if request.param == "vllm" else ("--router-protocol", "trtllm"))
    started = []
    try:
        for mode in ("off", "ngram"):
            stack = worker_and_router(tmp_path_factory, request.param, flags + ("--speculative", mode))
            started.append((mode, stack, next(stack)))
        yield {mode: pair for mode, _, pair in started}
    finally:
        for _, stack, _ in reversed(started):
            stack.close()  # runs worker_and_router's `finally`: router and worker stopped


def chat(router: Router, messages: list[dict], stream: bool = False) -> dict:
    """One greedy chat completion: its content, finish_reason and usage (streamed: the deltas put together, and the
    usage of the chunk that carries one, if smg sends it for `stream_options.include_usage`)."""
    body = {"model": DEFAULT_MODEL.name, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection(router.base, timeout=600)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    assert resp.status == 200, raw[-500:]
    if not stream:
        out = json.loads(raw)
        choice = out["choices"][0]
        return {"content": choice["message"]["content"], "finish_reason": choice["finish_reason"],
                "usage": out["usage"]}
    chunks = [json.loads(line[len(b"data: "):]) for line in raw.splitlines()
              if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"]
    return {"content": "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]),
            "finish_reason": [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1],
            "usage": next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)}


def load(worker: LiveServer) -> pb.Load:
    with grpc.insecure_channel(worker.address) as channel:
        return pb_grpc.TextGenerationStub(channel).GetLoad(pb.GetLoadRequest(), timeout=10)


def comparable(result: dict) -> tuple:
    usage = result["usage"] or {}
    return result["content"], result["finish_reason"], usage.get("prompt_tokens"), usage.get("completion_tokens")


def test_greedy_output_through_smg_is_the_same_with_speculation(stacks):
    (_, off), (worker, on) = stacks["off"], stacks["ngram"]
    prompts = list(grounded_messages().values()) + chat_messages()[:2]
    for messages in prompts:
        assert comparable(chat(on, messages)) == comparable(chat(off, messages)), messages[0]["content"][:60]
    streamed = grounded_messages()["rewrite"]
    assert comparable(chat(on, streamed, stream=True)) == comparable(chat(off, streamed, stream=True))
    assert load(stacks["off"][0]).spec_tokens_per_step == 0  # the stack without speculation drafted nothing
    assert load(worker).spec_tokens_per_step > 1.5  # the grounded prompts' drafts were accepted


def test_drafted_and_accepted_tokens_reach_smgs_usage(stacks):
    """The router protocols' GenerateComplete.spec_draft_tokens / spec_accepted_tokens: smg reports the accepted
    drafts as `usage.completion_tokens_details.accepted_prediction_tokens` and the rejected ones as
    `rejected_prediction_tokens` (OpenAI's predicted-outputs fields)."""
    (_, off), (worker, on) = stacks["off"], stacks["ngram"]
    messages = grounded_messages()["continue"]
    details = chat(on, messages)["usage"].get("completion_tokens_details") or {}
    assert details.get("accepted_prediction_tokens", 0) > MAX_TOKENS // 4, details
    assert details.get("rejected_prediction_tokens", 0) >= 0
    off_details = chat(off, messages)["usage"].get("completion_tokens_details") or {}
    assert not off_details.get("accepted_prediction_tokens") and not off_details.get("rejected_prediction_tokens")
    started = "".join(worker.lines[:200])
    assert "speculative decoding ngram" in started  # the start-up log names the mode
