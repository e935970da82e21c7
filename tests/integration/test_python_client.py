"""The Python client (`tokenloop_client`) against a real in-process server and against fakes.

The real server runs on a background thread with the scripted executor (no model); fakes built on
the client's own stubs inject UNAVAILABLE before / after the first token, check the API key and TLS.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parents[2]
try:
    import tokenloop_client
except ImportError:  # not pip-installed: use the source tree
    sys.path.insert(0, str(ROOT / "clients" / "python"))
    import tokenloop_client

from tests.integration.client_fakes import FlakyServicer
from tokenloop_client import AsyncClient, Client, FinishReason, RetryPolicy
from tokenloop_client._gen import tokenloop_pb2 as pb
from tokenloop_client._gen import tokenloop_pb2_grpc as pb_grpc

FAST_RETRY = RetryPolicy(max_retries=3, initial_backoff_s=0.01, max_backoff_s=0.02)


class _ServerThread:
    """Runs the shared in-process server (tests/integration/service_harness.py) on its own loop thread."""

    def __init__(self, model_dir: Path, tick: float) -> None:
        from tests.integration.service_harness import serving
        from tests.scripted_executor import ScriptedExecutor

        async def start() -> int:
            self.serving = serving(model_dir, ScriptedExecutor(tick=tick))
            server, _stub, _executor = await self.serving.__aenter__()
            return server.port

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.serving.__aexit__(None, None, None), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def address(tokenizer_dir):
    """HOST:PORT of a real tokenloop server on loopback, scripted executor behind it."""
    srv = _ServerThread(tokenizer_dir, tick=0.002)
    yield f"127.0.0.1:{srv.port}"
    srv.close()


@pytest.fixture(scope="module")
def slow_address(tokenizer_dir):
    """The same server with a slow executor, for cancelling mid-stream."""
    srv = _ServerThread(tokenizer_dir, tick=0.05)
    yield f"127.0.0.1:{srv.port}"
    srv.close()


# -- request building (no server) -----------------------------------------------------------------

def test_every_option_lands_in_its_proto_field():
    from tokenloop_client._request import PARAM_NAMES, build_generate

    params = {"temperature": 0.5, "top_k": 4, "top_p": 0.9, "min_p": 0.1, "repetition_penalty": 1.1,
              "presence_penalty": 0.2, "frequency_penalty": 0.3, "seed": 7, "max_new_tokens": 12,
              "min_new_tokens": 2, "stop": "\n", "stop_token_ids": [5, 6], "ignore_eos": True,
              "include_stop_str_in_output": True, "logprobs": True, "top_logprobs": 3,
              "skip_special_tokens": False, "echo": True, "n": 2, "lora": "ad-1"}
    structured = {"json_schema", "json_object", "regex", "grammar", "structural_tag"}  # test_structured_client.py
    assert set(params) | structured == PARAM_NAMES
    req = build_generate(None, messages=[("user", "hi")], stream=True, request_id="r1", params=params)
    assert req.request_id == "r1" and req.stream and req.n == 2 and req.lora == "ad-1"
    assert req.chat.messages[0].role == "user" and req.WhichOneof("input") == "chat"
    assert req.sampling.top_k == 4 and req.sampling.seed == 7 and req.sampling.HasField("temperature")
    assert list(req.stopping.stop) == ["\n"] and list(req.stopping.stop_token_ids) == [5, 6]
    assert req.stopping.max_new_tokens == 12 and req.stopping.include_stop_str_in_output
    assert req.output.HasField("skip_special_tokens") and not req.output.skip_special_tokens
    assert req.output.top_logprobs == 3 and req.output.echo
    unset = build_generate("x", stream=False, params={})
    assert not unset.sampling.HasField("temperature") and not unset.stopping.HasField("max_new_tokens")
    assert unset.request_id  # the client picks an id so abort() works before the first response
    with pytest.raises(TypeError):
        build_generate("x", stream=False, params={"max_tokens": 5})
    with pytest.raises(ValueError):
        build_generate("x", token_ids=[1], stream=False, params={})


# -- real server: sync -----------------------------------------------------------------------------

def test_sync_generate_returns_typed_result(address):
    with Client(address) as client:
        result = client.generate("hello world", max_new_tokens=6, request_id="req-sync-1")
    assert isinstance(result, tokenloop_client.GenerateResult)
    assert result.request_id == "req-sync-1"
    assert result.finish_reason is FinishReason.LENGTH
    assert result.usage.completion_tokens == 6 == len(result.completions[0].token_ids)
    assert result.usage.prompt_tokens > 0
    assert result.text.startswith("hello world")  # the scripted executor echoes the prompt
    assert result.timing.total_s >= result.timing.ttft_s >= 0


def test_sync_stream_deltas_add_up_to_the_final_text(address):
    with Client(address) as client:
        stream = client.stream("hello world", max_new_tokens=8)
        deltas = list(stream)
        result = stream.result
    assert len(deltas) >= 2
    assert all(isinstance(d, tokenloop_client.Delta) for d in deltas)
    assert "".join(d.text for d in deltas) == result.text
    assert sum(len(d.token_ids) for d in deltas) == 8
    assert result.finish_reason is FinishReason.LENGTH


def test_sync_unary_calls(address):
    with Client(address) as client:
        info = client.model_info()
        tok = client.tokenize("hello world")
        text = client.detokenize(list(tok.token_ids))
        chat_tok = client.tokenize(messages=[{"role": "user", "content": "hi"}])
        load = client.load()
        found = client.abort("no-such-request")
        health = client.health()
    assert isinstance(info, tokenloop_client.ModelInfo) and info.vocab_size > 0 and info.has_chat_template
    assert len(tok.token_ids) == len(tok.tokens) > 0
    assert text == "hello world"
    assert "hi" in chat_tok.text and len(chat_tok.token_ids) > len(tok.token_ids)
    assert isinstance(load, tokenloop_client.Load) and load.max_concurrent_requests > 0
    assert found is False
    assert health == "SERVING"


def test_sync_chat_uses_the_template(address):
    with Client(address) as client:
        result = client.chat([("user", "hi")], max_new_tokens=4)
        rendered = client.tokenize(messages=[("user", "hi")])
    assert result.usage.prompt_tokens == len(rendered.token_ids)


def test_invalid_argument_is_typed_and_keeps_the_status(address):
    with Client(address) as client:
        with pytest.raises(tokenloop_client.InvalidArgumentError) as info:
            client.generate("hello", temperature=-1.0)
        with pytest.raises(tokenloop_client.InvalidArgumentError):
            list(client.stream("hello", top_p=0.0))
    err = info.value
    assert isinstance(err, tokenloop_client.TokenloopError)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in err.message


def test_cancelling_a_stream_frees_the_request(slow_address):
    with Client(slow_address) as client:
        with client.stream("hello world", max_new_tokens=200) as stream:
            first = next(stream)
        assert first.text
        assert _eventually(lambda: client.load().num_in_flight == 0)


def test_abort_by_request_id_ends_the_stream(slow_address):
    with Client(slow_address) as client:
        stream = client.stream("hello world", max_new_tokens=200, request_id="to-abort")
        next(stream)
        assert client.abort("to-abort") is True
        try:
            result = stream.final()
            assert result.finish_reason is FinishReason.CANCELLED
            assert result.usage.completion_tokens < 200
        except tokenloop_client.CancelledError as err:
            assert err.code == grpc.StatusCode.CANCELLED


def _eventually(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


# -- real server: asyncio --------------------------------------------------------------------------

def test_async_generate_and_stream_with_n(address):
    async def go():
        async with AsyncClient(address) as client:
            result = await client.generate("hello world", max_new_tokens=5)
            stream = client.stream("hello world", max_new_tokens=5, n=2)
            texts = {0: "", 1: ""}
            async for delta in stream:
                texts[delta.index] += delta.text
            return result, stream.result, texts, await client.model_info()

    result, streamed, texts, info = asyncio.run(go())
    assert result.usage.completion_tokens == 5 and result.finish_reason is FinishReason.LENGTH
    assert [c.index for c in streamed.completions] == [0, 1]
    assert texts == {c.index: c.text for c in streamed.completions}
    assert texts[0] != texts[1]  # the scripted executor rotates each sequence differently
    assert info.max_n >= 2


def test_async_errors_are_typed(address):
    async def go():
        async with AsyncClient(address) as client:
            with pytest.raises(tokenloop_client.InvalidArgumentError) as info:
                async for _ in client.stream("hello", max_new_tokens=0):
                    pass
            return info.value

    err = asyncio.run(go())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in err.message


# -- fakes: retries, API key, TLS ------------------------------------------------------------------

def test_unavailable_before_the_first_token_is_retried(fake):
    servicer = FlakyServicer(num_failures=2)
    with Client(fake(servicer), retry=FAST_RETRY) as client:
        result = client.generate("x")
        assert client.load().num_running == 7
    assert result.text == "Hello" and result.finish_reason is FinishReason.EOS
    assert servicer.num_calls == 3 and servicer.num_load_calls == 3  # two failures, then success


def test_retries_are_bounded(fake):
    servicer = FlakyServicer(num_failures=10)
    policy = RetryPolicy(max_retries=1, initial_backoff_s=0.01)
    with Client(fake(servicer), retry=policy) as client, pytest.raises(tokenloop_client.UnavailableError) as info:
        client.generate("x")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert servicer.num_calls == 2


def test_unavailable_after_the_first_token_is_not_retried(fake):
    servicer = FlakyServicer(num_failures=1, after_first_chunk=True)
    with Client(fake(servicer), retry=FAST_RETRY) as client:
        stream = client.stream("x")
        assert next(stream).text == "Hel"
        with pytest.raises(tokenloop_client.UnavailableError):
            next(stream)
    assert servicer.num_calls == 1


def test_other_codes_are_not_retried(fake):
    servicer = FlakyServicer(num_failures=1, code=grpc.StatusCode.RESOURCE_EXHAUSTED)
    with Client(fake(servicer), retry=FAST_RETRY) as client, \
            pytest.raises(tokenloop_client.ResourceExhaustedError) as info:
        client.generate("x")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.message == "injected failure"
    assert servicer.num_calls == 1


def test_async_retry_only_before_the_first_token(fake):
    before = FlakyServicer(num_failures=2)
    after = FlakyServicer(num_failures=1, after_first_chunk=True)
    addr_before, addr_after = fake(before), fake(after)

    async def go():
        async with AsyncClient(addr_before, retry=FAST_RETRY) as client:
            texts = [d.text async for d in client.stream("x")]
        async with AsyncClient(addr_after, retry=FAST_RETRY) as client:
            got = []
            with pytest.raises(tokenloop_client.UnavailableError):
                async for d in client.stream("x"):
                    got.append(d.text)
        return texts, got

    texts, got = asyncio.run(go())
    assert texts == ["Hel", "lo"] and before.num_calls == 3
    assert got == ["Hel"] and after.num_calls == 1


def test_api_key_is_sent_as_bearer_metadata(fake):
    servicer = FlakyServicer(num_failures=0)
    with Client(fake(servicer), api_key="s3cret") as client:
        client.generate("x")
    assert servicer.metadata[0]["authorization"] == "Bearer s3cret"


def test_tls_with_a_private_ca(fake, tmp_path):
    key_pem, cert_pem = _self_signed_cert()
    (tmp_path / "ca.pem").write_bytes(cert_pem)
    creds = grpc.ssl_server_credentials([(key_pem, cert_pem)])
    servicer = FlakyServicer(num_failures=0)
    addr = fake(servicer, creds)
    with Client(addr, tls_ca=str(tmp_path / "ca.pem"), retry=RetryPolicy(max_retries=0)) as client:
        assert client.generate("x").text == "Hello"
    with Client(addr, retry=RetryPolicy(max_retries=0), timeout=5) as plain, \
            pytest.raises(tokenloop_client.TokenloopError):
        plain.generate("x")  # plaintext against a TLS port fails


def _self_signed_cert() -> tuple[bytes, bytes]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    san = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1)).add_extension(san, critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


# -- the CLI in-process ----------------------------------------------------------------------------

class ChatRecorder(pb_grpc.TextGenerationServicer):
    """Records each chat request and answers "ok" as two chunks."""

    def __init__(self):
        self.requests: list[list[tuple[str, str]]] = []

    def Generate(self, request, context):
        self.requests.append([(m.role, m.content) for m in request.chat.messages])
        yield pb.GenerateResponse(chunk=pb.Chunk(text="o"))
        yield pb.GenerateResponse(chunk=pb.Chunk(text="k"))
        yield pb.GenerateResponse(complete=pb.Complete(text="ok", finish_reason=pb.EOS))


def test_cli_chat_keeps_the_conversation(fake, monkeypatch, capsys):
    from tokenloop_client import cli

    recorder = ChatRecorder()
    addr = fake(recorder)
    monkeypatch.setattr(sys, "stdin", io.StringIO("apple\n/reset\nbanana\ncherry\n"))
    assert cli.main(["--address", addr, "chat", "--system", "be brief"]) == 0
    assert capsys.readouterr().out == "ok\nok\nok\n"
    system = ("system", "be brief")
    assert recorder.requests == [
        [system, ("user", "apple")],
        [system, ("user", "banana")],  # /reset dropped the first exchange, kept the system prompt
        [system, ("user", "banana"), ("assistant", "ok"), ("user", "cherry")],
    ]


def test_cli_generate_sends_zero_values_and_leaves_the_rest_unset(fake, capsys):
    from tokenloop_client import cli

    servicer = FlakyServicer(num_failures=0)
    args = ["--address", fake(servicer), "generate", "x", "--temperature", "0", "--seed", "0", "--stream"]
    assert cli.main(args) == 0
    assert capsys.readouterr().out == "Hello\n"
    [req] = servicer.requests
    assert req.stream and req.text == "x"
    assert req.sampling.HasField("temperature") and req.sampling.temperature == 0.0  # 0 = greedy, not unset
    assert req.sampling.HasField("seed") and req.sampling.seed == 0
    assert not req.sampling.HasField("top_p") and not req.stopping.HasField("max_new_tokens")
    assert not req.stopping.ignore_eos and list(req.stopping.stop) == []


def test_cli_bench_json_and_plot(address, capsys, tmp_path):
    from tokenloop_client import cli

    args = ["--address", address, "bench", "-c", "1,3", "-r", "6", "--prompt-tokens", "8",
            "--max-new-tokens", "5", "--json"]
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if has_matplotlib:
        args += ["--plot", str(tmp_path / "bench.png")]
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["concurrency"] for r in report["results"]] == [1, 3]
    for level in report["results"]:
        assert level["num_ok"] == 6 and level["output_tokens"] == 30
        assert level["ttft_s"]["p50"] <= level["ttft_s"]["p99"]
        assert level["config"]["prompt_tokens"] == 8
    if has_matplotlib:
        assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_bench_counts_errors_by_status_code(fake, capsys):
    from tokenloop_client import cli

    servicer = FlakyServicer(num_failures=3, code=grpc.StatusCode.RESOURCE_EXHAUSTED)
    servicer.Tokenize = lambda request, context: pb.TokenizeResponse(token_ids=[5, 6, 7])
    servicer.GetModelInfo = lambda request, context: pb.ModelInfo(model_id="fake")
    assert cli.main(["--address", fake(servicer), "bench", "-r", "5", "--json"]) == 0
    [level] = json.loads(capsys.readouterr().out)["results"]
    assert level["errors_by_code"] == {"RESOURCE_EXHAUSTED": 3}
    assert level["num_ok"] == 2


def test_client_imports_without_the_server_package_and_stubs_are_fresh():
    client_dir = ROOT / "clients" / "python"
    code = "import sys; sys.modules['tokenloop'] = None; import tokenloop_client.cli; print('ok')"
    alone = subprocess.run([sys.executable, "-c", code], cwd=client_dir, check=False, capture_output=True, text=True)
    assert alone.stdout.strip() == "ok", alone.stderr
    check = subprocess.run([sys.executable, str(client_dir / "generate.py"), "--check"],
                           check=False, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
