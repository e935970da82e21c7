"""The `buf curl` session from docs/clients.md, run against a real server through reflection only.

Every command runs in an empty directory with no --schema: buf learns the API from the server's
reflection service, as a user with no proto files would.
"""

from __future__ import annotations

import base64
import json
import subprocess

import pytest

from tests.e2e.live_server import live_address
from tests.e2e.tools import curl, messages

pytestmark = pytest.mark.e2e



@pytest.fixture(scope="module")
def url() -> str:
    return f"http://{live_address()}"


def test_list_services_and_methods(buf, url, tmp_path):
    services = curl(buf, tmp_path, "--list-services", url)
    methods = curl(buf, tmp_path, "--list-methods", url)
    assert services.returncode == 0, services.stderr
    assert {"tokenloop.v1.TextGeneration", "grpc.health.v1.Health"} <= set(services.stdout.split())
    assert "tokenloop.v1.TextGeneration/Generate" in methods.stdout.split()


def test_describe_generate_request_through_reflection(buf, url, tmp_path):
    run = curl(buf, tmp_path, "-d", '{"fileContainingSymbol":"tokenloop.v1.GenerateRequest"}',
               f"{url}/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
    assert run.returncode == 0, run.stderr
    encoded = messages(run.stdout)[0]["fileDescriptorResponse"]["fileDescriptorProto"][0]
    (tmp_path / "tokenloop.binpb").write_bytes(base64.b64decode(encoded))
    convert = subprocess.run([buf, "convert", "--type", "google.protobuf.FileDescriptorProto",
                              "--from", "tokenloop.binpb#format=binpb", "--to", "-#format=json"],
                             cwd=tmp_path, check=False, capture_output=True, text=True, timeout=120)
    assert convert.returncode == 0, convert.stderr
    file = json.loads(convert.stdout)
    request = next(m for m in file["messageType"] if m["name"] == "GenerateRequest")
    names = [f["name"] for f in request["field"]]
    assert names[:3] == ["request_id", "text", "token_ids"]
    assert {"chat", "stream", "sampling", "stopping", "output", "n"} <= set(names)


def test_unary_generate(buf, url, tmp_path):
    body = '{"text":"The capital of France is","sampling":{"temperature":0},"stopping":{"maxNewTokens":16}}'
    run = curl(buf, tmp_path, "-d", body, f"{url}/tokenloop.v1.TextGeneration/Generate")
    assert run.returncode == 0, run.stderr
    [only] = messages(run.stdout)  # stream false: a single `complete`
    assert only["complete"]["finishReason"] in ("LENGTH", "EOS")
    assert 0 < only["complete"]["usage"]["completionTokens"] <= 16
    assert "Paris" in only["complete"]["text"]


def test_streaming_generate(buf, url, tmp_path):
    body = ('{"chat":{"messages":[{"role":"user","content":"What is the capital of France?"}]},'
            '"stream":true,"sampling":{"temperature":0}}')
    run = curl(buf, tmp_path, "-d", body, f"{url}/tokenloop.v1.TextGeneration/Generate")
    assert run.returncode == 0, run.stderr
    got = messages(run.stdout)
    chunks, last = got[:-1], got[-1]
    assert len(chunks) >= 2 and all("chunk" in m for m in chunks)
    assert last["complete"]["finishReason"] == "EOS"
    assert "Paris" in last["complete"]["text"]
    assert "".join(m["chunk"].get("text", "") for m in chunks) == last["complete"]["text"]


def test_tokenize_and_health(buf, url, tmp_path):
    tok = curl(buf, tmp_path, "-d", '{"text":"Hello world"}', f"{url}/tokenloop.v1.TextGeneration/Tokenize")
    health = curl(buf, tmp_path, "-d", "{}", f"{url}/grpc.health.v1.Health/Check")
    assert tok.returncode == 0, tok.stderr
    [res] = messages(tok.stdout)
    assert len(res["tokenIds"]) == len(res["tokens"]) >= 2
    assert messages(health.stdout) == [{"status": "SERVING"}]


def test_errors_show_the_status_code(buf, url, tmp_path):
    run = curl(buf, tmp_path, "-d", '{"text":"Hi","sampling":{"temperature":-1}}',
               f"{url}/tokenloop.v1.TextGeneration/Generate")
    assert run.returncode != 0
    error = messages(run.stderr)[0]
    assert error["code"] == "invalid_argument" and "temperature" in error["message"]
