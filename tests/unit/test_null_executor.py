"""The benchmark's null executor (bench/null_executor.py): protocol, pacing, cancellation, emission stamps, and the
looper delivering its text. The front's fast paths it measures are tested with their modules: merge_steps in
test_executor.py, the detokenizer's in test_detokenizer.py, the sequence writer in test_convert.py (through a server:
tests/integration/test_stream_interval.py)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.conftest import run
from tokenloop.bench.null_executor import NullExecutor, sample_token_ids
from tokenloop.core.executor import Executor
from tokenloop.core.request import FinishReason, StoppingParams, ValidRequest
from tokenloop.looper.looper import Looper
from tokenloop.looper.stream import Chunk, Complete


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
        mine = [s for s in steps if s.executor_id == rid and s.seq_index == seq]
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
            out = []
            for s in streams:
                out.append([e async for e in s.events()])
            return out
        finally:
            looper.stop()

    for events in run(body()):
        chunks = [e for e in events if isinstance(e, Chunk)]
        done = events[-1]
        assert isinstance(done, Complete) and done.finish_reason == FinishReason.LENGTH
        assert "".join(c.text for c in chunks) == done.text == tokenizer.decode(ids)


def test_wake_ends_a_paced_wait_early_and_is_not_lost_when_nobody_waits():
    ex = NullExecutor([5, 6, 7], rate=0.01)  # the first token is due in 100 s
    ex.enqueue(request("r", max_new=3))
    ex.wake()  # set before the wait: the next wait returns at once instead of being lost
    assert ex.await_responses(60.0) == []
    threading.Timer(0.05, ex.wake).start()
    assert ex.await_responses(60.0) == []  # returned when woken, not after 60 s (the test would hang)


def test_looper_wakes_a_waiting_executor_for_a_new_request_and_a_cancel(tokenizer):
    # rate 0.01 tokens/s and poll_timeout 60 s: without wake() the looper would sit in the executor's wait
    # for a minute before taking the second request or the cancel, and this test would time out.
    ex = NullExecutor(sample_token_ids(tokenizer), rate=0.01)

    async def body():
        looper = Looper(ex, tokenizer, poll_timeout=60.0)
        looper.start()
        try:
            first = looper.submit(request("a", max_new=4))
            await asyncio.sleep(0.05)  # the looper is now waiting in await_responses
            second = looper.submit(request("b", max_new=4))
            while second.executor_id is None:  # enqueued: the wait was interrupted
                await asyncio.sleep(0.01)
            second.cancel()
            first.cancel()
            return [e async for e in second.events()], [e async for e in first.events()]
        finally:
            looper.stop()

    for events in run(asyncio.wait_for(body(), 20)):
        assert isinstance(events[-1], Complete) and events[-1].finish_reason == FinishReason.CANCELLED
