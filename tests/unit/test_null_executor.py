"""The benchmark's null executor: protocol, token counts, pacing, cancellation, emission stamps, and the looper on it."""

from __future__ import annotations

import time

import pytest
from tokenloop.looper.executor import Executor
from tokenloop.looper.looper import Looper
from tokenloop.looper.request import FinishReason, StoppingParams, ValidRequest
from tokenloop.looper.stream import Chunk, Complete

from bench.null_executor import NullExecutor, sample_token_ids
from tests.conftest import run


def request(rid="r", max_new=10, n=1, stream=True):
    return ValidRequest(request_id=rid, prompt_token_ids=(1, 2, 3), n=n, stream=stream,
                        stopping=StoppingParams(max_new_tokens=max_new))


def drain(ex, timeout=0.05, limit=10_000):
    steps = []
    for _ in range(limit):
        if not ex.stats().num_running:
            break
        steps += ex.await_responses(timeout)
    return steps


def test_is_an_executor_and_validates_its_arguments():
    assert isinstance(NullExecutor([5]), Executor)
    with pytest.raises(ValueError):
        NullExecutor([])
    with pytest.raises(ValueError):
        NullExecutor([5], rate=0)
    with pytest.raises(ValueError):
        NullExecutor([5], tokens_per_step=0)


def test_unlimited_emits_every_token_then_one_final_step_per_sequence():
    ex = NullExecutor([7, 8, 9], tokens_per_step=4)
    rid = ex.enqueue(request(max_new=10, n=2))
    steps = drain(ex)
    for seq in (0, 1):
        mine = [s for s in steps if s.request_id == rid and s.seq_index == seq]
        ids = [t for s in mine for t in s.token_ids]
        assert ids == [7, 8, 9, 7, 8, 9, 7, 8, 9, 7]
        assert [len(s.token_ids) for s in mine] == [4, 4, 2]
        assert [s.is_final for s in mine] == [False, False, True]
        assert mine[-1].finish_reason == FinishReason.LENGTH
    assert ex.stats().num_running == 0


def test_rate_paces_tokens_and_stamps_their_due_times():
    ex = NullExecutor([7], rate=200.0, record=True)
    t0 = time.monotonic()
    ex.enqueue(request("paced", max_new=10))
    steps = drain(ex)
    elapsed = time.monotonic() - t0
    assert sum(len(s.token_ids) for s in steps) == 10
    assert elapsed >= 10 / 200.0 - 0.005  # cannot be faster than the rate
    stamps = ex.emitted["paced"]
    assert len(stamps) == 10
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert all(abs(g - 1 / 200.0) < 1e-6 for g in gaps)  # due times, 5 ms apart
    assert t0 <= stamps[0] <= t0 + 0.05


def test_cancel_ends_open_sequences_as_cancelled():
    ex = NullExecutor([7], rate=10.0)
    rid = ex.enqueue(request(max_new=1000, n=2))
    ex.cancel(rid)
    ex.cancel(12345)  # unknown ids are ignored
    steps = ex.await_responses(0.01)
    assert sorted(s.seq_index for s in steps) == [0, 1]
    assert all(s.is_final and s.finish_reason == FinishReason.CANCELLED for s in steps)
    assert ex.stats().num_running == 0


def test_sample_ids_decode_to_real_text(tokenizer):
    ids = sample_token_ids(tokenizer)
    assert len(ids) > 30
    assert "🚀" in tokenizer.decode(ids)


def test_looper_on_null_executor_delivers_the_sample_text(tokenizer):
    ids = sample_token_ids(tokenizer)
    ex = NullExecutor(ids)

    async def body():
        looper = Looper(ex, tokenizer)
        looper.start()
        try:
            streams = [looper.submit(request(f"r{i}", max_new=len(ids))) for i in range(20)]
            return [[e async for e in s.events()] for s in streams]
        finally:
            looper.stop()

    for events in run(body()):
        chunks = [e for e in events if isinstance(e, Chunk)]
        done = events[-1]
        assert isinstance(done, Complete) and done.finish_reason == FinishReason.LENGTH
        assert "".join(c.text for c in chunks) == done.text == tokenizer.decode(ids)
