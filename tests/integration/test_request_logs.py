"""Request log lines through an in-process server: a request id that tries to forge log lines makes one escaped
line (the formatter alone: tests/unit/test_logs.py); a stream cut short is logged with the tokens it streamed."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from tests.conftest import run
from tests.integration.service_harness import serving
from tests.scripted_executor import ScriptedExecutor
from tokenloop.service.logs import TextFormatter
from tokenloop.v1 import tokenloop_pb2 as pb


def test_a_request_id_with_control_characters_makes_one_escaped_log_line(tokenizer_dir, caplog):
    rid = "evil\n2026-12-05 00:00:00,000 INFO tokenloop.requests: forged\x1b[2J\x00"

    async def body():
        async with serving(tokenizer_dir) as (_, stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(pb.GenerateRequest(request_id=rid, text="Hello"))]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    with caplog.at_level(logging.INFO, logger="tokenloop.requests"):
        run(body())
    lines = [TextFormatter().format(r) for r in caplog.records if getattr(r, "request_id", None) == rid]
    assert len(lines) == 1 and lines[0].count("\n") == 0 and "\x1b" not in lines[0] and "\x00" not in lines[0]
    assert 'request_id="evil\\n2026-12-05 00:00:00,000 INFO tokenloop.requests: forged\\x1b[2J\\x00"' in lines[0]


def _records(caplog, rid: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == "request end" and getattr(r, "request_id", None) == rid]


async def started(stub, rid: str, n: int = 1):
    """A long stream under way: (the call, the tokens received so far: at least 20)."""
    call = stub.Generate(pb.GenerateRequest(request_id=rid, text="Hello", stream=True, n=n, stopping=pb.StoppingCriteria(
        max_new_tokens=1000, ignore_eos=True)))
    received = 0
    async for msg in call:
        received += len(msg.chunk.token_ids)
        if received >= 20:
            return call, received


def long_executor() -> ScriptedExecutor:
    return ScriptedExecutor(script=lambda request, seq: [5] * 1000, tick=0.005)


def test_a_stream_the_client_leaves_is_logged_with_the_tokens_it_streamed_and_cancelled(tokenizer_dir, caplog):
    """The log told `output_tokens=0 finish_reason=None` after hundreds of streamed tokens (issue 44)."""
    async def body():
        async with serving(tokenizer_dir, long_executor()) as (_, stub, _):
            call, received = await started(stub, "left")
            call.cancel()  # the client hangs up mid-stream
            for _ in range(200):
                if _records(caplog, "left"):
                    break
                await asyncio.sleep(0.02)
            return received

    with caplog.at_level(logging.INFO, logger="tokenloop.requests"):
        received = run(body())
    (rec,) = _records(caplog, "left")
    assert rec.status == "CANCELLED" and rec.finish_reason == "cancelled"
    assert received <= rec.output_tokens < 1000


def test_a_stream_cut_by_the_server_stopping_is_logged_with_its_tokens(tokenizer_dir, caplog):
    async def body():
        async with serving(tokenizer_dir, long_executor()) as (server, stub, _):
            _, received = await started(stub, "drained", n=2)
            await server.stop(grace=0.2)  # the drain's grace runs out with the stream in flight
            return received

    with caplog.at_level(logging.INFO, logger="tokenloop.requests"):
        received = run(body())
    (rec,) = _records(caplog, "drained")
    assert rec.finish_reason == "cancelled,cancelled", (rec.status, rec.finish_reason, rec.output_tokens)
    assert received <= rec.output_tokens < 2000
