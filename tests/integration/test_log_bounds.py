"""What clients send reaches the log bounded, through an in-process server: a 7,000-character `x-request-id` (refused)
leaves one bounded line, and a flood of refused calls writes no more lines than the budget of failed-request lines
(50 at once, then 5 a second). The formatter and the budget alone: tests/unit/test_logs.py."""

from __future__ import annotations

import logging
import time

import grpc
import pytest

from tests.conftest import run
from tests.integration.service_harness import serving
from tokenloop.service import logs
from tokenloop.service.logs import JsonFormatter, LineBudget, TextFormatter
from tokenloop.v1 import tokenloop_pb2 as pb

GEN = pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_new_tokens=2))


def test_a_7000_character_request_id_leaves_one_bounded_log_line(tokenizer_dir, caplog, monkeypatch):
    monkeypatch.setattr(logs, "FAILED_LINES", LineBudget())
    rid = "i" * 7000

    async def body():
        async with serving(tokenizer_dir) as (_, stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in stub.Generate(GEN, metadata=(("x-request-id", rid),))]
            return err.value

    with caplog.at_level(logging.INFO):
        err = run(body())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "`request_id`" in err.details()
    records = [r for r in caplog.records if r.getMessage() == "request end"]
    assert len(records) == 1
    for formatter in (TextFormatter(), JsonFormatter()):
        line = formatter.format(records[0])
        assert len(line) < 1000 and "i" * 256 + "...[cut: 7000 characters]" in line
    assert max(len(TextFormatter().format(r)) for r in caplog.records) < 1000


def test_a_flood_of_refused_calls_writes_only_the_budget_of_lines(tokenizer_dir, caplog, monkeypatch):
    monkeypatch.setattr(logs, "FAILED_LINES", LineBudget(rate=5.0, burst=50.0))
    bad = pb.GenerateRequest(text="Hello", sampling=pb.SamplingParams(top_p=7.0))

    async def body():
        async with serving(tokenizer_dir) as (_, stub, _):
            start = time.monotonic()
            for i in range(400):
                with pytest.raises(grpc.aio.AioRpcError):
                    [m async for m in stub.Generate(bad, metadata=(("x-request-id", f"flood-{i}" * 50),))]
            elapsed = time.monotonic() - start
            [m async for m in stub.Generate(GEN)]  # a good one is logged whatever the budget
            return elapsed

    with caplog.at_level(logging.INFO):
        elapsed = run(body())
    ends = [r for r in caplog.records if r.getMessage() == "request end"]
    refused = [r for r in ends if r.status == "INVALID_ARGUMENT"]
    assert 50 <= len(refused) <= 50 + 5 * elapsed + 1
    assert ends[-1].status == "OK"
    said = [getattr(r, "not_logged_before", 0) for r in refused]
    assert said[:50] == [0] * 50  # the burst
    assert len(refused) + sum(said) <= 400 and sum(said) > 0  # later lines count those left out before them
    assert sum(len(TextFormatter().format(r)) for r in caplog.records) < 1200 * (len(caplog.records) + 1)
