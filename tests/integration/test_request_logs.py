"""Request log lines through an in-process server: a request id that tries to forge log lines makes one escaped
line (the formatter alone: tests/unit/test_logs.py)."""

from __future__ import annotations

import logging

import grpc
import pytest

from tests.conftest import run
from tests.integration.service_harness import serving
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
