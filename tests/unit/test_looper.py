"""The looper against a scripted executor: ordering, fan-out, cancellation, per-request errors, death."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import run
from tests.scripted_executor import ScriptedExecutor
from tokenloop.core.executor import ErrorKind, ExecutorStats, Step
from tokenloop.core.request import FinishReason, OutputParams, StoppingParams, ValidRequest
from tokenloop.looper.looper import Looper
from tokenloop.looper.outputs import Outbox, RequestState
from tokenloop.looper.stream import Chunk, Complete, RequestFailed, RequestStream


def make_request(tok, rid="r", text="Hello world", max_new=8, n=1, stream=True, **stopping):
    return ValidRequest(request_id=rid, prompt_token_ids=tuple(tok.encode(text)), n=n, stream=stream,
                        stopping=StoppingParams(max_new_tokens=max_new, **stopping))


async def collect(stream):
    return [e async for e in stream.events()]


async def with_looper(tok, body, executor=None, **kw):
    executor = executor or ScriptedExecutor()
    deaths = []
    looper = Looper(executor, tok, on_death=deaths.append, **kw)
    looper.start()
    try:
        return await body(looper, executor, deaths)
    finally:
        looper.stop()
        executor.shutdown()


def test_stream_events_in_order_and_text_matches_tokens(tokenizer):
    async def body(looper, ex, _):
        events = await collect(looper.submit(make_request(tokenizer, max_new=12)))
        chunks = [e for e in events if isinstance(e, Chunk)]
        (done,) = [e for e in events if isinstance(e, Complete)]
        assert events[-1] is done
        assert "".join(c.text for c in chunks) == done.text
        assert sum((c.token_ids for c in chunks), []) == done.token_ids
        assert len(done.token_ids) == 12 and done.finish_reason == FinishReason.LENGTH
        assert done.text == tokenizer.decode(done.token_ids)
        assert 0 <= done.timing.queue_s <= done.timing.ttft_s <= done.timing.total_s
        assert ex.await_threads == {"tokenloop-looper"}
        assert looper.num_in_flight == 0
    run(with_looper(tokenizer, body))


def test_non_streaming_gets_only_complete(tokenizer):
    async def body(looper, ex, _):
        events = await collect(looper.submit(make_request(tokenizer, stream=False)))
        assert [type(e) for e in events] == [Complete]
    run(with_looper(tokenizer, body))


def test_the_looper_thread_has_an_os_level_name(tokenizer):
    """`tokenloop-loopr` in top -H, ps -L and /proc (where --front-cpu's pinning can be checked)."""
    async def body(looper, ex, _):
        await collect(looper.submit(make_request(tokenizer)))  # the thread is running its loop
        with open(f"/proc/self/task/{looper.thread_id}/comm") as f:
            assert f.read().strip() == "tokenloop-loopr"
    run(with_looper(tokenizer, body))


def test_fan_out_to_200_concurrent_requests(tokenizer):
    async def body(looper, ex, _):
        prompts = [f"Hello world {i}" for i in range(200)]
        streams = [looper.submit(make_request(tokenizer, rid=f"r{i}", text=p, max_new=6)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        for prompt, events in zip(prompts, results):
            done = events[-1]
            assert isinstance(done, Complete) and done.finish_reason == FinishReason.LENGTH
            # each request got its own tokens: the scripted executor echoes that request's prompt
            assert done.token_ids == tokenizer.encode(prompt)[:6] or len(tokenizer.encode(prompt)) < 6
        assert looper.num_in_flight == 0 and looper.num_open == 0
    run(with_looper(tokenizer, body))


def test_n_sequences_each_complete_once(tokenizer):
    async def body(looper, ex, _):
        events = await collect(looper.submit(make_request(tokenizer, n=3, max_new=5)))
        completes = [e for e in events if isinstance(e, Complete)]
        assert sorted(c.index for c in completes) == [0, 1, 2]
        assert len({tuple(c.token_ids) for c in completes}) == 3  # the script rotates per sequence
    run(with_looper(tokenizer, body))


def test_stop_string_ends_sequence_and_cancels_executor(tokenizer):
    async def body(looper, ex, _):
        req = make_request(tokenizer, text="The quick brown fox jumps", max_new=50, stop=("brown",))
        events = await collect(looper.submit(req))
        done = events[-1]
        assert done.finish_reason == FinishReason.STOP_SEQUENCE and done.matched_stop_str == "brown"
        assert done.text == "The quick "
        assert "".join(e.text for e in events if isinstance(e, Chunk)) == "The quick "
        await asyncio.sleep(0.05)
        assert ex.cancels, "the executor should be told to stop generating"
        assert looper.num_in_flight == 0
    run(with_looper(tokenizer, body))


def test_stop_token_and_eos_finish_reasons(tokenizer):
    ids = tokenizer.encode("Hello world")
    async def body(looper, ex, _):
        done = (await collect(looper.submit(make_request(tokenizer, stop_token_ids=(ids[1],)))))[-1]
        assert done.finish_reason == FinishReason.STOP_TOKEN and done.matched_stop_token == ids[1]
        ex.eos_token_id = ids[2]
        done = (await collect(looper.submit(make_request(tokenizer, rid="e"))))[-1]
        assert done.finish_reason == FinishReason.EOS and done.token_ids[-1] == ids[2]
    run(with_looper(tokenizer, body))


def test_cancel_before_submission_never_reaches_executor(tokenizer):
    async def body():
        ex = ScriptedExecutor()
        looper = Looper(ex, tokenizer)
        # submit and cancel before the thread runs, so the request is still in the channel
        looper.open()
        stream = looper.submit(make_request(tokenizer, rid="early"))
        stream.cancel()
        looper.start()
        try:
            events = await collect(stream)
            assert [e.finish_reason for e in events if isinstance(e, Complete)] == [FinishReason.CANCELLED]
            assert ex.enqueued == [] and ex.cancels == []
        finally:
            looper.stop()
            ex.shutdown()
    run(body())


def test_cancel_after_submission_frees_within_one_step(tokenizer):
    async def body(looper, ex, _):
        stream = looper.submit(make_request(tokenizer, max_new=10_000))
        first = None
        async for ev in stream.events():
            first = ev
            break
        assert isinstance(first, Chunk)
        stream.cancel()
        for _ in range(100):
            if looper.num_in_flight == 0 and ex.num_active == 0:
                break
            await asyncio.sleep(0.01)
        assert looper.num_in_flight == 0 and ex.num_active == 0
        assert ex.cancels == [1]
        rest = await collect(stream)
        assert isinstance(rest[-1], Complete) and rest[-1].finish_reason == FinishReason.CANCELLED
    run(with_looper(tokenizer, body, executor=ScriptedExecutor(tick=0.01)))


def test_executor_error_on_one_request_leaves_others(tokenizer):
    async def body(looper, ex, _):
        good = looper.submit(make_request(tokenizer, rid="good", max_new=40))
        bad = looper.submit(make_request(tokenizer, rid="bad", max_new=40))
        await asyncio.sleep(0.05)
        ex.fail_request(bad.executor_id, "device error")
        with pytest.raises(RequestFailed) as err:
            await collect(bad)
        assert err.value.kind == ErrorKind.INTERNAL and "device error" in err.value.message
        events = await collect(good)
        assert events[-1].finish_reason == FinishReason.LENGTH and len(events[-1].token_ids) == 40
        assert looper.alive
    run(with_looper(tokenizer, body, executor=ScriptedExecutor(tick=0.005)))


def test_enqueue_refusal_fails_only_that_request(tokenizer):
    async def body(looper, ex, _):
        refused = ValidRequest(request_id="x", prompt_token_ids=(0, 1), stopping=StoppingParams(max_new_tokens=13))
        with pytest.raises(RequestFailed) as err:
            await collect(looper.submit(refused))
        assert err.value.kind == ErrorKind.INVALID_ARGUMENT
        assert (await collect(looper.submit(make_request(tokenizer))))[-1].finish_reason == FinishReason.LENGTH
    run(with_looper(tokenizer, body))


def test_executor_death_fails_all_open_streams_and_reports(tokenizer):
    async def body(looper, ex, deaths):
        streams = [looper.submit(make_request(tokenizer, rid=f"d{i}", max_new=10_000)) for i in range(5)]
        await asyncio.sleep(0.05)
        ex.die("GPU fell off the bus")
        for s in streams:
            with pytest.raises(RequestFailed) as err:
                await collect(s)
            assert err.value.kind == ErrorKind.UNAVAILABLE and "GPU fell off the bus" in err.value.message
        await asyncio.sleep(0.01)
        assert deaths == ["GPU fell off the bus"] and not looper.alive
        with pytest.raises(RequestFailed):
            await collect(looper.submit(make_request(tokenizer, rid="late")))
    run(with_looper(tokenizer, body))


def test_deadline_expiry_cancels_in_executor(tokenizer):
    async def body(looper, ex, _):
        req = ValidRequest(request_id="dl", prompt_token_ids=(5, 6), stopping=StoppingParams(max_new_tokens=100_000),
                           deadline=time.monotonic() + 0.05, stream=True)
        with pytest.raises(RequestFailed) as err:
            await collect(looper.submit(req))
        assert err.value.kind == ErrorKind.DEADLINE_EXCEEDED
        for _ in range(100):
            if ex.num_active == 0 and looper.num_in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert ex.num_active == 0 and looper.num_in_flight == 0
    run(with_looper(tokenizer, body))


def test_logprobs_flow_through(tokenizer):
    async def body(looper, ex, _):
        req = ValidRequest(request_id="lp", prompt_token_ids=tuple(tokenizer.encode("Hello")), stream=False,
                           stopping=StoppingParams(max_new_tokens=3), output=OutputParams(logprobs=True, top_logprobs=2))
        done = (await collect(looper.submit(req)))[-1]
        assert [lp.token_id for lp in done.logprobs] == done.token_ids
        assert all(len(lp.top) == 2 for lp in done.logprobs)
    run(with_looper(tokenizer, body))


def test_idle_looper_blocks_instead_of_spinning(tokenizer):
    async def body(looper, ex, _):
        await collect(looper.submit(make_request(tokenizer)))
        polls_before = ex.num_steps
        await asyncio.sleep(0.3)
        # the executor is idle and the looper blocks on the channel: no steps, no polling
        assert ex.num_steps == polls_before
        assert looper.num_in_flight == 0
    run(with_looper(tokenizer, body))


def test_outbox_merges_later_polls_in_order_and_keeps_the_first_error():
    """A hand-off the event loop has not taken yet absorbs the next poll's: a stream's events stay in order, a stream
    that ended keeps the error that ended it first, and the events are read before the end."""
    ok, failed = (RequestStream(ValidRequest(request_id=rid, prompt_token_ids=(1,)), lambda s: None)
                  for rid in ("ok", "failed"))
    first, error = RequestFailed(ErrorKind.INTERNAL, "first"), RequestFailed(ErrorKind.UNAVAILABLE, "second")
    one, two, three = (Chunk(0, text, [i]) for i, text in enumerate("abc"))
    pending, later, last = Outbox(), Outbox(), Outbox()
    pending.add(ok, [one])
    later.add(ok, [two, three], end=True)
    later.add(failed, [], True, first)
    last.add(failed, [], True, error)
    pending.merge(later)
    pending.merge(last)
    assert pending.events == {ok: [one, two, three]} and pending.ends == {ok: None, failed: first}
    pending.deliver()

    async def read(stream):
        return [batch async for batch in stream.batches()]
    assert asyncio.run(read(ok)) == [[one, two, three]] and ok.finished
    with pytest.raises(RequestFailed) as err:
        asyncio.run(read(failed))
    assert err.value is first


def test_take_hands_over_what_arrived_without_waiting(tokenizer):
    stream = RequestStream(make_request(tokenizer), lambda s: None)
    assert stream.take() == []
    first = Chunk(0, "a", [1])
    stream.push([first])
    stream.push([Chunk(0, "b", [2])])
    assert [e.text for e in stream.take()] == ["a", "b"]
    assert stream.take() == [] and stream.pending() == 0


class ScriptedPolls:
    """An executor whose every `await_responses` returns the next scripted poll of steps (then nothing)."""

    def __init__(self, polls):
        self.polls = list(polls)

    def enqueue(self, request):
        return 1

    def await_responses(self, timeout):
        if self.polls:
            return self.polls.pop(0)
        time.sleep(timeout)
        return []

    def cancel(self, executor_id):
        pass

    def stats(self):
        return ExecutorStats()

    def shutdown(self):
        pass


@pytest.mark.parametrize("n,stream", [(1, True), (2, True), (1, False)])
def test_a_plain_requests_token_steps_decoded_in_line_give_what_apply_gives(tokenizer, n, stream):
    """The looper decodes the token steps of a plain request (no stop strings, no logprobs) in line as it goes
    through a poll; each step through RequestState.apply alone gives the same events: the first step (with the
    executor's cached-prompt count), a speculative step's counts, several ids in one step, a character split over
    tokens, the final step; for one sequence or two, streaming or not."""
    ids = tokenizer.encode(" the café 日本語 works, 🚀 and more words after it")

    def polls():
        def poll(seq_steps):
            return [Step(1, i, list(seq_ids), **kw) for i in range(n) for seq_ids, kw in seq_steps]
        return [poll([(ids[:1], {"num_cached_prompt_tokens": 2})]), poll([(ids[1:2], {})]),
                poll([(ids[2:4], {"num_draft_tokens": 2, "num_accepted_draft_tokens": 1})]),
                *[poll([([t], {})]) for t in ids[4:-1]],
                poll([(ids[-1:], {"is_final": True, "finish_reason": FinishReason.LENGTH})])]
    request = make_request(tokenizer, max_new=len(ids), n=n, stream=stream)

    async def body(looper, ex, _):
        return await collect(looper.submit(request))
    got = run(with_looper(tokenizer, body, executor=ScriptedPolls(polls())))
    state = RequestState(RequestStream(request, lambda stream: None), tokenizer, 0.0)
    want = [e for poll in polls() for step in poll for e in state.apply(step, 1.0)]
    for e in got + want:
        if isinstance(e, Complete):
            e.timing = None
    assert got == want
    completes = [e for e in got if isinstance(e, Complete)]
    assert [c.text for c in completes] == [tokenizer.decode(ids)] * n
    assert [c.index for c in completes] == list(range(n))
    if stream:
        assert "".join(e.text for e in got if isinstance(e, Chunk) and e.index == n - 1) == tokenizer.decode(ids)
        assert [e.cached_prompt_tokens for e in got if isinstance(e, Chunk)][-1] == 2
    else:
        assert all(isinstance(e, Complete) for e in got)


def test_a_hand_off_counts_the_readers_still_behind(tokenizer):
    """Outbox.deliver says how many streams it gave events to had not read the events before (Looper.readers_behind
    is made of it)."""
    streams = [RequestStream(make_request(tokenizer, rid=str(i)), lambda s: None) for i in range(5)]

    def hand_off():
        outbox = Outbox()
        for s in streams:
            outbox.add(s, [Chunk(0, "a", [1])])
        return outbox.deliver()
    assert hand_off() == 0  # nothing was pending
    assert hand_off() == 5  # nobody read the first
    for s in streams[:3]:
        s.take()
    assert hand_off() == 2


def test_the_looper_says_when_the_event_loop_falls_behind_its_readers_and_when_it_catches_up(tokenizer):
    """on_behind(True) on the looper thread once most readers of a hand-off (at least four) had not read the one
    before; on_behind(False) once they keep up again; nothing while it stays the same."""
    import threading
    calls = []

    def on_behind(behind):
        calls.append((behind, threading.current_thread().name))

    async def body(looper, ex, _):
        unread = [looper.submit(make_request(tokenizer, rid=f"u{i}", max_new=32)) for i in range(6)]
        while not all(s.ended for s in unread):  # nobody reads: every hand-off after the first finds them behind
            await asyncio.sleep(0.01)
        assert calls and calls[0] == (True, "tokenloop-looper")
        for s in unread:
            await collect(s)
        for round_ in range(3):  # readers that keep up
            await asyncio.gather(*(collect(looper.submit(make_request(tokenizer, rid=f"r{round_}.{i}", max_new=16)))
                                   for i in range(6)))
            if calls[-1][0] is False:
                break
        assert calls[-1] == (False, "tokenloop-looper")
        assert all(a[0] != b[0] for a, b in zip(calls, calls[1:]))  # told only when it changes
    run(with_looper(tokenizer, body, on_behind=on_behind))
