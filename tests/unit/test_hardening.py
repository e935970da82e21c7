"""Hardening pieces without a server: flags -> config, fault injection, API keys, JSON logs, tracing off."""

from __future__ import annotations

import json
import logging
import time

import pytest

from tests.scripted_executor import ScriptedExecutor
from tokenloop.core.executor import EngineDeadError
from tokenloop.core.request import OutputParams, SamplingParams, StoppingParams, ValidRequest
from tokenloop.looper.faults import FaultyExecutor, parse_fault_spec, with_faults
from tokenloop.service.cli import _parser, config_from_args
from tokenloop.service.config import ServerConfig
from tokenloop.service.logs import JsonFormatter, TextFormatter
from tokenloop.service.security import _bearer, key_matches
from tokenloop.service.tracing import tracing_interceptor


def test_security_and_limit_flags_reach_the_config():
    args = _parser().parse_args([
        "serve", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-client-ca", "ca.pem", "--api-key-file", "keys",
        "--log-format", "json", "--log-level", "DEBUG", "--max-stop-strings", "3", "--max-stop-string-length", "9",
        "--max-prompt-tokens", "100", "--max-n", "2", "--max-new-tokens", "50", "--max-message-bytes", "4096",
        "--otel-endpoint", "http://collector:4317"])
    c = config_from_args(args)
    assert (c.tls_cert, c.tls_key, c.tls_client_ca, c.api_key_file) == ("c.pem", "k.pem", "ca.pem", "keys")
    assert (c.log_format, c.log_level, c.otel_endpoint) == ("json", "DEBUG", "http://collector:4317")
    assert (c.max_stop_strings, c.max_stop_string_length, c.max_prompt_tokens, c.max_n, c.max_new_tokens,
            c.max_message_bytes) == (3, 9, 100, 2, 50, 4096)


@pytest.mark.parametrize("kw, message", [
    ({"tls_cert": "c.pem"}, "--tls-cert and --tls-key go together"),
    ({"tls_client_ca": "ca.pem"}, "--tls-client-ca needs --tls-cert and --tls-key"),
    ({"log_format": "xml"}, "--log-format must be 'text' or 'json'; got 'xml'")])
def test_config_refuses_half_configured_security(kw, message):
    with pytest.raises(ValueError) as err:
        ServerConfig(**kw)
    assert str(err.value) == message


def test_fault_spec():
    assert parse_fault_spec("step:40, request:BOOM") == {"step": 40, "request": "BOOM"}
    assert parse_fault_spec("") == {}
    with pytest.raises(ValueError):
        parse_fault_spec("step:soon")
    assert parse_fault_spec("forward:3,position:200") == {"forward": 3, "position": 200}
    with pytest.raises(ValueError, match="forward:N or position:N"):
        parse_fault_spec("position:far")
    inner = ScriptedExecutor()
    assert with_faults(inner, "") is inner
    with pytest.raises(ValueError, match="need the embedded engine"):
        with_faults(inner, "forward:1")  # the scripted executor has no model forward to break
    inner.shutdown()


def request(text: str, rid: str = "r") -> ValidRequest:
    return ValidRequest(request_id=rid, prompt_token_ids=(5, 6, 7), sampling=SamplingParams(seed=1),
                        stopping=StoppingParams(max_new_tokens=50), output=OutputParams(), prompt_text=text)


def poll_until(ex, predicate, timeout=5.0):
    steps, end = [], time.monotonic() + timeout
    while time.monotonic() < end and not predicate(steps):
        steps += ex.await_responses(0.01)
    return steps


def test_faulty_executor_fails_one_request_then_dies_after_n_polls():
    ex = FaultyExecutor(ScriptedExecutor(), die_after_polls=30, request_marker="BOOM")
    ok, doomed = ex.enqueue(request("fine")), ex.enqueue(request("BOOM here"))
    steps = poll_until(ex, lambda s: any(x.error for x in s) and any(x.executor_id == ok for x in s))
    assert [s.error for s in steps if s.executor_id == doomed] == ["injected fault"]
    assert all(s.error is None for s in steps if s.executor_id == ok)
    with pytest.raises(EngineDeadError, match="injected fault after 30 polls"):
        poll_until(ex, lambda s: False)
    assert ex.stats().kv_blocks_total == 64  # everything else is the real executor's
    ex.shutdown()


def test_bearer_parsing_and_constant_time_match():
    keys = [b"alpha", b"beta"]
    assert _bearer((("authorization", "Bearer beta"),)) == b"beta"
    assert _bearer((("authorization", "bearer   beta "),)) == b"beta"
    assert _bearer((("authorization", "Basic beta"),)) == b"" and _bearer(()) == b""
    assert key_matches(b"beta", keys) and not key_matches(b"bet", keys) and not key_matches(b"", keys + [b""])


def test_json_and_text_log_lines_carry_the_request_fields():
    record = logging.LogRecord("tokenloop.requests", logging.INFO, __file__, 1, "request end", (), None)
    record.request_id, record.status, record.output_tokens = "abc", "OK", 7
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "request end" and line["request_id"] == "abc" and line["output_tokens"] == 7
    assert line["level"] == "INFO" and line["time"].endswith("Z")
    assert TextFormatter().format(record).endswith("request end request_id=abc status=OK output_tokens=7")


def test_tracing_is_off_without_an_endpoint(monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    assert tracing_interceptor("") is None


def test_an_empty_or_missing_api_key_file_stops_start_up(tmp_path, monkeypatch):
    from tests.conftest import run
    from tokenloop.service.server import interceptors
    from tokenloop.service.server import run as serve
    monkeypatch.delenv("TOKENLOOP_API_KEYS", raising=False)
    (tmp_path / "keys").write_text("# nothing here yet\n\n")
    with pytest.raises(ValueError, match="holds no API key"):
        interceptors(ServerConfig(api_key_file=str(tmp_path / "keys")))
    for path in (tmp_path / "keys", tmp_path / "missing"):
        assert run(serve(ServerConfig(api_key_file=str(path), port=0))) == 2  # not an open server


def test_client_messages_lose_paths_stack_frames_and_excess_length():
    from tokenloop.core.executor import ErrorKind
    from tokenloop.looper.stream import RequestFailed
    from tokenloop.service.errors import Unavailable, ValidationError, status_of
    trt = ("generation failed: [TensorRT-LLM][ERROR] Assertion failed: bad shape "
           "(/home/jenkins/agent/cpp/tensorrt_llm/runtime/gptDecoder.cpp:231)\n1  0x7f3 tensorrt_llm::common::throw")
    code, message, _ = status_of(RequestFailed(ErrorKind.INTERNAL, trt))
    assert code.name == "INTERNAL" and "/home" not in message and "0x7f3" not in message
    assert message == "generation failed: [TensorRT-LLM][ERROR] Assertion failed: bad shape (<path>:231)"
    died = Unavailable("the executor died: RuntimeError: C:\\models\\x.bin unreadable" + "!" * 900)
    assert "models" not in status_of(died)[1] and len(status_of(died)[1]) <= 503
    rule = "`top_p` must be > 0 and <= 1"  # the service's own messages pass unchanged
    assert status_of(ValidationError("top_p", rule))[1] == rule


def test_tune_gc_freezes_what_is_alive_and_keeps_collecting_cycles():
    import gc

    from tokenloop.service.app import GC_GEN0_THRESHOLD, tune_gc
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] >= GC_GEN0_THRESHOLD and gc.get_threshold()[1:] == before[1:]

        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after the freeze is still garbage the collector finds
        del a, b
        assert gc.collect() >= 2
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
