"""The benchmark's null executor (protocol, pacing, cancellation, emission stamps) and the front's fast paths
it measures: steps merged per poll, the byte-level detokenizer, coalescing and --stream-interval."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from bench.null_executor import NullExecutor, sample_token_ids
from tests.conftest import run
from tests.integration.service_harness import serving
from tests.scripted_executor import ScriptedExecutor
from tokenloop.core.executor import Executor, Step, merge_steps
from tokenloop.core.request import FinishReason, StoppingParams, ValidRequest
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.looper.detokenizer import IncrementalDetokenizer, is_byte_level, token_texts
from tokenloop.looper.looper import Looper
from tokenloop.looper.stream import Chunk, Complete, Timing, TokenLogprob
from tokenloop.service.convert import StreamWriter
from tokenloop.v1 import tokenloop_pb2 as pb


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


def test_merge_steps_joins_a_sequences_steps_of_one_poll():
    steps = [Step(1, 0, [5]), Step(2, 0, [7]), Step(1, 0, [6], logprobs=None), Step(1, 1, [8]),
             Step(1, 0, [9], is_final=True, finish_reason=FinishReason.LENGTH),
             Step(2, 0, [], is_final=True, error="boom")]
    out = merge_steps(steps)
    assert [(s.executor_id, s.seq_index, s.token_ids) for s in out] == [(1, 0, [5, 6, 9]), (2, 0, [7]), (1, 1, [8]),
                                                                      (2, 0, [])]
    assert out[0].is_final and out[0].finish_reason == FinishReason.LENGTH
    assert out[3].error == "boom"  # an error step is never folded into a token step
    single = [Step(1, 0, [5]), Step(2, 0, [6])]
    assert merge_steps(single) is single


def test_byte_level_fast_path_matches_the_offset_algorithm(tokenizer, metaspace_dir):
    assert is_byte_level(tokenizer)
    assert not is_byte_level(Tokenizer.from_dir(metaspace_dir))
    ids = sample_token_ids(tokenizer)
    fast = IncrementalDetokenizer(tokenizer, [1, 2])
    slow = IncrementalDetokenizer(tokenizer, [1, 2])
    slow._fast = False
    for i in range(0, len(ids), 2):
        assert fast.push(ids[i:i + 2]) == slow.push(ids[i:i + 2])
    assert fast.flush() == slow.flush()


def test_token_table_fast_path_matches_the_offset_algorithm(tokenizer):
    """One token per push (the common step) is served from the per-tokenizer table of whole-character tokens;
    emoji and CJK split across byte-level tokens still go through decoding and match the offset algorithm."""
    ids = sample_token_ids(tokenizer)
    slow = IncrementalDetokenizer(tokenizer, [1, 2])
    slow._fast, slow._texts = False, None
    expected = [slow.push([t]) for t in ids] + [slow.flush()]
    table = token_texts(tokenizer, True)
    for _ in range(2):  # the first pass fills the table, the second reads it
        fast = IncrementalDetokenizer(tokenizer, [1, 2])
        assert [fast.push([t]) for t in ids] + [fast.flush()] == expected
    assert table and all("\ufffd" not in text for text in table.values())
    partial = {t for t in ids if "\ufffd" in tokenizer.decode([t])}
    assert partial and not partial & table.keys()  # tokens of part of an emoji or CJK character are never kept
    assert token_texts(tokenizer, False) is not table  # skip_special_tokens=False keeps its own texts


def _done(index=0, ids=()):
    return Complete(index, "", list(ids), FinishReason.LENGTH, 3, 0, Timing())


def test_stream_writer_coalesces_a_batch_and_honours_the_interval():
    req = request("w")
    batch = [Chunk(0, "a", [1]), Chunk(0, "b", [2]), Chunk(0, "c", [3])]
    msgs = StreamWriter(req).messages(batch)
    assert [(m.chunk.text, list(m.chunk.token_ids)) for m in msgs] == [("abc", [1, 2, 3])]
    assert len(StreamWriter(req, coalesce=False).messages(batch)) == 3
    w = StreamWriter(req, interval=4)
    assert w.messages(batch) == []  # 3 < 4 tokens: held while the reader keeps up
    msgs = w.messages([Chunk(0, "d", [4]), Chunk(0, "e", [5])])
    assert [(m.chunk.text, list(m.chunk.token_ids)) for m in msgs] == [("abcde", [1, 2, 3, 4, 5])]
    w.messages([Chunk(0, "f", [6])])
    msgs = w.messages([_done(ids=range(1, 7))])  # the end flushes what is held, then completes
    assert [m.WhichOneof("response") for m in msgs] == ["chunk", "complete"]
    assert msgs[0].chunk.text == "f"


def test_stream_writer_encode_refills_one_message_and_sends_what_messages_sends():
    """encode() (the front door's path) serializes chunks other than the commonest from one chunk message it
    refills; the bytes equal those of messages(), for every mode and across sequences and logprobs."""
    lp = [TokenLogprob(3, -0.5, [(3, -0.5), (4, -1.0)])]
    batches = [[Chunk(0, "a", [1]), Chunk(1, "b", [2]), Chunk(0, "", [])],
               [Chunk(1, "x", [9, 10], lp), Chunk(1, "y", [11]), Chunk(1, "z", [12, 13, 14])],
               [Chunk(0, "c", [3], lp), Chunk(0, "d", [4]), _done(0, [1, 3, 4])],
               [Chunk(1, "e", [5]), _done(1, [2, 9, 10, 11, 12, 13, 14, 5])]]
    for kw in ({}, {"coalesce": False}, {"interval": 2}):
        req = request("w")
        a, b = StreamWriter(req, **kw), StreamWriter(req, **kw)
        seen = set()
        for batch in batches:
            wire = b.encode(batch)
            if b._msg is not None:
                seen.add(id(b._msg))
            assert wire == [m.SerializeToString() for m in a.messages(batch)], kw
        assert len(seen) <= 1  # one chunk message object per writer


def test_stream_writer_refilled_message_carries_nothing_into_the_next():
    """The refilled chunk message must not carry one message's token ids or logprobs into the next one."""
    lp = [TokenLogprob(3, -0.5, [(3, -0.5)])]
    req = request("w")
    w = StreamWriter(req, coalesce=False)
    w.encode([Chunk(0, "a", [1, 2], lp)])  # two ids and logprobs
    wire = w.encode([Chunk(0, "c", [4]), Chunk(1, "d", [5])])
    assert wire == [m.SerializeToString() for m in StreamWriter(req, coalesce=False).messages(
        [Chunk(0, "c", [4]), Chunk(1, "d", [5])])]
    w = StreamWriter(req, coalesce=False)
    w.encode([Chunk(1, "a", [1, 2], lp)])
    assert list(w.encode([Chunk(1, "c", [4]), Chunk(1, "d", [5, 6])])) == [
        m.SerializeToString() for m in StreamWriter(req, coalesce=False).messages(
            [Chunk(1, "c", [4]), Chunk(1, "d", [5, 6])])]


def test_stream_writer_encode_writes_the_bytes_protobuf_writes(monkeypatch):
    """encode() (the servicer's path) yields each message serialized, with one-token chunks of sequence 0 built from
    a table shared by every stream: byte for byte what protobuf writes for messages(), for every mode, on a first
    pass (the table filling) and a second (hits), for a token seen again with another text (held-back UTF-8),
    ids that take several varint bytes, logprobs, sequences other than 0, and request ids empty, non-ASCII and
    longer than 127 bytes."""
    lp = [TokenLogprob(3, -0.5, [(3, -0.5), (4, -1.0)])]
    batches = [[Chunk(0, " the", [1000]), Chunk(0, "é", [1001]), Chunk(0, "", [1002]), Chunk(0, "\U0001f680", [1002])],
               [Chunk(0, " the", [1000]), Chunk(1, " the", [1000]), Chunk(0, "x", [16384]), Chunk(0, "y", [2 ** 31])],
               [Chunk(0, "a", [5], lp), Chunk(0, "bc", [6, 7]), Chunk(0, "", []), Chunk(0, " the", [1000])],
               [Chunk(0, "d", [8]), _done(0, [1000, 8]), Chunk(1, "e", [9]), _done(1, [1000, 9])]]
    for rid in ("w", "", "ré-1", "r" * 200):
        for kw in ({}, {"coalesce": False}, {"interval": 2}):
            for _ in range(2):
                a, b = StreamWriter(request(rid), **kw), StreamWriter(request(rid), **kw)
                for batch in batches:
                    wire = list(b.encode(batch))
                    assert all(type(m) is bytes for m in wire)
                    assert wire == [m.SerializeToString() for m in a.messages(batch)], (rid, kw)
    from tokenloop.service import convert
    monkeypatch.setattr(convert, "_MAX_CHUNK_FIELDS", len(convert._CHUNK_FIELDS))  # the table is full
    a, b = StreamWriter(request("w"), coalesce=False), StreamWriter(request("w"), coalesce=False)
    batch = [Chunk(0, "new", [424242]), Chunk(0, "new", [424242])]
    assert list(b.encode(batch)) == [m.SerializeToString() for m in a.messages(batch)]
    assert 424242 not in convert._CHUNK_FIELDS


def test_stream_interval_end_to_end(tokenizer_dir):
    async def body():
        ex = ScriptedExecutor(tick=0.001)
        async with serving(tokenizer_dir, executor=ex, stream_interval=4) as (_, stub, _):
            call = stub.Generate(pb.GenerateRequest(text="Hello world, this is a longer prompt", stream=True,
                                                    stopping=pb.StoppingCriteria(max_new_tokens=18)))
            out = []
            while (msg := await call.read()) is not grpc.aio.EOF:
                out.append(msg)
            return out
    msgs = run(body())
    sizes = [len(m.chunk.token_ids) for m in msgs if m.WhichOneof("response") == "chunk"]
    assert sum(sizes) == 18 and all(n >= 4 for n in sizes[:-1]), sizes
    assert msgs[-1].complete.text == "".join(m.chunk.text for m in msgs[:-1])


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
