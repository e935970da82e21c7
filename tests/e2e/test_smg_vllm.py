"""The real Shepherd Model Gateway (`smg`, pinned) in front of a real `tokenloop serve` that serves smg's vLLM protocol
beside TrtllmService (the default, `--router-protocol both`), with no `runtime_type` given: smg detects vLLM, and
what a client leaves unset reaches the worker unset, so the model's defaults and `--default-max-new-tokens` apply.

What the worker ran with is read from its request log (`--log-format json`: one `request end` line per Generate with
the temperature, top_p, seed and max_new_tokens it used). The default model's generation_config.json carries its
publishers' temperature 0.2 / top_p 0.9 (`make model`).
"""

from __future__ import annotations

import http.client
import json
import re
import time

import pytest

from tests.e2e.gateway import Router, generate_records, poll, worker_and_router
from tests.e2e.live_server import DEFAULT_MODEL, LiveServer
from tokenloop.core.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e

DEFAULT_MAX_NEW_TOKENS = 20
VLLM_GENERATE = "/vllm.grpc.engine.VllmEngine/Generate"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(tokenloop LiveServer, Router) on loopback; both stopped at the end of the module."""
    gen = (json.loads((DEFAULT_MODEL / "generation_config.json").read_text())
           if (DEFAULT_MODEL / "generation_config.json").is_file() else {})
    if (gen.get("temperature"), gen.get("top_p")) != (0.2, 0.9):
        pytest.skip("the default model's generation_config.json lacks temperature 0.2 / top_p 0.9: run `make model`")
    yield from worker_and_router(tmp_path_factory, "vllm", ("--default-max-new-tokens", str(DEFAULT_MAX_NEW_TOKENS),
                                                            "--log-format", "json"))


def post(router: Router, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(router.base, timeout=120)
    conn.request("POST", path, body=json.dumps(body).encode(), headers={"content-type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, {"raw": raw.decode(errors="replace")}


def chat(router: Router, content: str, **extra) -> tuple[int, dict]:
    return post(router, "/v1/chat/completions", {"model": DEFAULT_MODEL.name,
                                                 "messages": [{"role": "user", "content": content}], **extra})


def request_log(worker: LiveServer) -> list[dict]:
    """The worker's `request end` records of vLLM Generate calls, in order."""
    return [rec for rec in generate_records(worker) if rec["rpc"] == VLLM_GENERATE]


def last_record(worker: LiveServer, before: int) -> dict:
    """The first vLLM Generate record logged after the first `before` ones."""
    deadline = time.monotonic() + 10
    while len(records := request_log(worker)) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(records) > before, "no request-log line for the request"
    return records[before]


def test_smg_detects_the_worker_as_vllm(stack):
    worker, router = stack
    (w,) = router.workers()
    assert w["runtime_type"] == "vllm" and w["is_healthy"] and w["url"] == f"grpc://{worker.address}", w
    log = re.sub(r"\x1b\[[0-9;]*m", "", router.log_path.read_text(errors="replace"))
    assert f"gRPC client (vllm) for worker: grpc://{worker.address}" in log, router.log_tail()


def test_a_chat_without_temperature_or_top_p_samples_at_the_models_defaults(stack):
    worker, router = stack
    before = len(request_log(worker))
    status, body = chat(router, "What is the capital of France?", max_tokens=8)
    assert status == 200, body
    rec = last_record(worker, before)
    assert (rec["temperature"], rec["top_p"], rec["max_new_tokens"]) == (0.2, 0.9, 8), rec
    before += 1
    status, body = chat(router, "What is the capital of France?", max_tokens=8, temperature=0.7, top_p=0.5)
    assert status == 200, body
    rec = last_record(worker, before)
    assert (rec["temperature"], rec["top_p"]) == (0.7, 0.5), rec


def test_without_max_tokens_generation_stops_at_default_max_new_tokens(stack):
    worker, router = stack
    before = len(request_log(worker))
    status, body = chat(router, "Tell me a very long story.", ignore_eos=True, temperature=1.0)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == DEFAULT_MAX_NEW_TOKENS, body
    assert body["choices"][0]["finish_reason"] == "length"
    assert last_record(worker, before)["max_new_tokens"] == DEFAULT_MAX_NEW_TOKENS
    status, body = post(router, "/v1/completions", {"model": DEFAULT_MODEL.name, "prompt": "Once upon a time",
                                                    "ignore_eos": True})  # OpenAI's 16 is not sent on vLLM
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == DEFAULT_MAX_NEW_TOKENS, body


def test_the_same_seed_gives_the_same_text_and_another_seed_another(stack):
    worker, router = stack

    def text(seed: int) -> str:
        status, body = chat(router, "Write a short poem about the sea.", temperature=1.0, top_p=1.0, max_tokens=32,
                            seed=seed)
        assert status == 200, body
        return body["choices"][0]["message"]["content"]

    first, again, other = text(1234), text(1234), text(4321)
    assert first == again and first != other, (first, again, other)
    assert poll(lambda: {r["seed"] for r in request_log(worker)} >= {1234, 4321})  # the log is read on a thread


def test_response_format_json_schema_validates(stack):
    worker, router = stack
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "capital": {"type": "boolean"}},
              "required": ["city", "capital"], "additionalProperties": False}
    status, body = chat(router, "Name a French city as JSON.", temperature=0, max_tokens=60,
                        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert status == 200, body
    value = json.loads(body["choices"][0]["message"]["content"])
    assert set(value) == {"city", "capital"} and isinstance(value["city"], str) and len(value["city"]) <= 20
    assert isinstance(value["capital"], bool)


def test_a_field_the_worker_refuses_is_named_through_the_router(stack):
    worker, router = stack
    status, body = chat(router, "Hi", max_tokens=5000)  # within the model's context, past --max-new-tokens (4096)
    assert status == 400 and "`sampling_params.max_tokens` must be between 1 and 4096" in json.dumps(body), body


def test_embeddings_through_smg_equal_transformers(stack):
    """smg's /v1/embeddings calls the worker's `Embed` (on TrtllmService smg answers 501: docs/router.md): the vector
    is the default model's final hidden state at the last token, normalized, within 1e-4 of transformers'."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    worker, router = stack
    text = "The capital of France is Paris, and the capital of Japan is Tokyo."
    status, body = post(router, "/v1/embeddings", {"model": DEFAULT_MODEL.name, "input": text})
    assert status == 200, body
    (item,) = body["data"]
    ids = Tokenizer.from_dir(DEFAULT_MODEL).encode(text)
    assert body["usage"]["prompt_tokens"] == len(ids)
    model = transformers.AutoModel.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()
    with torch.inference_mode():
        last = model(torch.tensor([ids])).last_hidden_state[0, -1]
    expected = torch.nn.functional.normalize(last, dim=0)
    assert len(item["embedding"]) == expected.numel()
    assert torch.tensor(item["embedding"]).sub(expected).abs().max().item() < 1e-4
