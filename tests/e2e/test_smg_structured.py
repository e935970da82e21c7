"""OpenAI `response_format` through the real Shepherd Model Gateway to a real `tokenloop serve` on the default model.

SMG detects the worker as vLLM (it serves both of smg's protocols) and turns `response_format` (json_schema,
json_object) into `vllm.grpc.engine.VllmEngine` `sampling_params.json_schema` / `json_object` (on TrtllmService,
`guided_decoding`); tokenloop compiles it and the engine masks every step, so the
chat completion's content is JSON that validates, streamed or not. The router fronts the session's shared server
(tests/e2e/live_server.py); `tokenloop-cli --json-schema` and the `buf curl` call in docs/structured-output.md run against that
server too.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.e2e.gateway import Router, post, smg_binary
from tests.e2e.live_server import DEFAULT_MODEL, ROOT, live_address
from tests.e2e.tools import cli, curl, messages

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
    "properties": {"city": {"type": "string", "maxLength": 40}, "country": {"type": "string", "maxLength": 40},
                   "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
}
MESSAGES = [{"role": "user", "content": "Describe the capital of France as JSON with its city, country and population."}]


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("the default model is not prepared: run `make model`")
    smg_binary()
    gateway = Router(live_address(), tmp_path_factory.mktemp("smg-structured") / "smg.log")
    try:
        gateway.wait_ready()
        yield gateway
    finally:
        gateway.stop()


def completion(router: Router, stream: bool, response_format: dict) -> tuple[str, str]:
    """(content, finish reason) of one chat completion, greedy."""
    body = json.dumps({"model": DEFAULT_MODEL.name, "messages": MESSAGES, "temperature": 0, "max_tokens": 160,
                       "stream": stream, "response_format": response_format}).encode()
    resp = post(router, body)
    raw = resp.read()
    assert resp.status == 200, raw[-500:]
    if not stream:
        choice = json.loads(raw)["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    events = [line[len(b"data: "):].strip() for line in raw.splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    choices = [c["choices"][0] for c in map(json.loads, events[:-1]) if c["choices"]]
    assert sum(bool(c["delta"].get("content")) for c in choices) > 2  # it really streamed
    return "".join(c["delta"].get("content") or "" for c in choices), choices[-1]["finish_reason"]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_response_format_json_schema_through_the_router(router, stream):
    content, reason = completion(router, stream, {"type": "json_schema",
                                                  "json_schema": {"name": "capital", "schema": SCHEMA}})
    jsonschema.validate(json.loads(content), SCHEMA)
    assert reason == "stop"
    assert json.loads(content)["city"]  # the model filled it in; the structure only shaped it


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "streamed"])
def test_response_format_json_object_through_the_router(router, stream):
    content, reason = completion(router, stream, {"type": "json_object"})
    assert isinstance(json.loads(content), dict) and reason == "stop"


def test_an_invalid_schema_is_refused_through_the_router(router):
    body = json.dumps({"model": DEFAULT_MODEL.name, "messages": MESSAGES, "max_tokens": 16, "response_format": {
        "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objec"}}}}).encode()
    resp = post(router, body)
    text = resp.read().decode()
    assert resp.status >= 400 and "Invalid type: objec" in text, text


def test_cli_json_schema_against_the_server(tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    done = cli("--address", live_address(), "generate", MESSAGES[0]["content"], "--chat", "--temperature", "0",
               "--max-new-tokens", "160", "--json-schema", str(schema_file), "--quiet")
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), SCHEMA)


def test_the_docs_buf_curl_call(buf, tmp_path):  # noqa: F811 - the fixture
    section = (ROOT / "docs" / "structured-output.md").read_text()
    body = re.search(r"-d '([^']*jsonSchema[^']*)'", section).group(1)
    run = curl(buf, tmp_path, "-d", body, f"http://{live_address()}/tokenloop.v1.TextGeneration/Generate")
    assert run.returncode == 0, run.stderr
    [only] = messages(run.stdout)
    schema = json.loads(json.loads(body)["jsonSchema"])
    value = json.loads(only["complete"]["text"])
    jsonschema.validate(value, schema)
    assert only["complete"]["finishReason"] == "STRUCTURE_COMPLETE" and value["city"] == "Paris", value
    assert value["country"].lower() == "france", value  # greedy, but the shared server's batch may shift a logit
