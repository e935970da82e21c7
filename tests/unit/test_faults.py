"""Fault injection (looper/faults.py, TOKENLOOP_DEBUG_FAULT): the spec parsed and checked, one request failed by its
marker, the executor dead after N polls. A real process with faults: tests/e2e/test_lifecycle.py."""

from __future__ import annotations

import time

import pytest

from tests.scripted_executor import ScriptedExecutor
from tokenloop.core.executor import EngineDeadError
from tokenloop.core.request import OutputParams, SamplingParams, StoppingParams, ValidRequest
from tokenloop.looper.faults import FaultyExecutor, parse_fault_spec, with_faults


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
