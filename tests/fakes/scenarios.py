"""Looper-level scenarios run against each TensorRT-LLM adapter (on the fake tensorrt_llm).

Each scenario is `async def scenario(looper, tokenizer, deaths)`; the test files build the
adapter, start a `Looper` on it and run every scenario. The fake model continues a prompt
ending in t with t+1+s, t+2(1+s), ... for sequence s (see tensorrt_llm/_fake.py).
"""

from __future__ import annotations

import asyncio
import time

from tokenloop.core.executor import ErrorKind
from tokenloop.core.request import FinishReason, OutputParams, SamplingParams, StoppingParams, ValidRequest
from tokenloop.looper.stream import Chunk, Complete, RequestFailed

EOS = 2  # <|im_end|> of tests/tiny_tokenizer.py
ERROR_TOKEN, UNKNOWN_REASON_TOKEN, DIE_TOKEN, MAX_INPUT_LEN = 397, 398, 399, 200  # as in _fake.py


def expected(last: int, count: int, seq: int = 0) -> list[int]:
    return [(last + k * (1 + seq)) % 400 for k in range(1, count + 1)]


def request(rid: str = "r", prompt=(20,), max_new: int = 6, n: int = 1, stream: bool = True, greedy: bool = True,
            logprobs: bool = False, **stopping) -> ValidRequest:
    return ValidRequest(request_id=rid, prompt_token_ids=tuple(prompt), n=n, stream=stream,
                        sampling=SamplingParams(temperature=0.0 if greedy else 0.8, seed=7),
                        stopping=StoppingParams(max_new_tokens=max_new, **stopping),
                        output=OutputParams(logprobs=logprobs))


async def collect(stream) -> list:
    return [event async for event in stream.events()]


async def failure(stream) -> RequestFailed:
    try:
        await collect(stream)
    except RequestFailed as exc:
        return exc
    raise AssertionError("the request did not fail")


async def drained(looper, timeout: float = 5.0) -> bool:
    """The executor ended every request (the looper's in-flight map is empty)."""
    deadline = time.monotonic() + timeout
    while looper.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return looper.num_in_flight == 0


async def streaming(looper, tok, deaths):
    from tensorrt_llm import _fake  # the fake the test put on sys.path
    events = await collect(looper.submit(request(max_new=6, logprobs=True)))
    chunks, done = events[:-1], events[-1]
    assert all(isinstance(c, Chunk) for c in chunks) and isinstance(done, Complete)
    assert [t for c in chunks for t in c.token_ids] == done.token_ids == expected(20, 6)
    assert "".join(c.text for c in chunks) == done.text == tok.decode(expected(20, 6))
    assert [lp.logprob for c in chunks for lp in c.logprobs] == [_fake.logprob(t) for t in expected(20, 6)]
    assert done.finish_reason == FinishReason.LENGTH and done.completion_tokens == 6
    assert await drained(looper)


async def non_streaming(looper, tok, deaths):
    events = await collect(looper.submit(request(stream=False, max_new=4)))
    assert [type(e) for e in events] == [Complete]
    assert events[0].token_ids == expected(20, 4) and events[0].text == tok.decode(expected(20, 4))


async def n_sequences(looper, tok, deaths):
    events = await collect(looper.submit(request(n=3, greedy=False, max_new=5)))
    completes = sorted((e for e in events if isinstance(e, Complete)), key=lambda c: c.index)
    assert [c.index for c in completes] == [0, 1, 2]
    for seq, done in enumerate(completes):
        assert done.token_ids == expected(20, 5, seq) and done.finish_reason == FinishReason.LENGTH
        chunks = [e for e in events if isinstance(e, Chunk) and e.index == seq]
        assert [t for c in chunks for t in c.token_ids] == done.token_ids
    assert await drained(looper)


async def stop_string(looper, tok, deaths):
    tokens = expected(20, 12)
    before, stop = tok.decode(tokens[:4]), tok.decode([tokens[4]])
    assert stop and stop not in before  # precondition of the scenario
    events = await collect(looper.submit(request(max_new=12, stop=(stop,))))
    done = events[-1]
    assert done.finish_reason == FinishReason.STOP_SEQUENCE and done.matched_stop_str == stop
    assert done.text == before and stop not in "".join(e.text for e in events if isinstance(e, Chunk))
    assert await drained(looper)  # the looper cancelled the rest and the executor ended it


async def stop_token_and_eos(looper, tok, deaths):
    stopped = (await collect(looper.submit(request(rid="s", max_new=10, stop_token_ids=(23,)))))[-1]
    assert stopped.finish_reason == FinishReason.STOP_TOKEN and stopped.matched_stop_token == 23
    assert stopped.token_ids[:2] == [21, 22]
    eos = (await collect(looper.submit(request(rid="e", prompt=(0,), max_new=10))))[-1]
    assert eos.finish_reason == FinishReason.EOS and eos.token_ids == [1]
    ignored = (await collect(looper.submit(request(rid="i", prompt=(0,), max_new=3, ignore_eos=True))))[-1]
    assert ignored.finish_reason == FinishReason.LENGTH and ignored.token_ids == [1, 2, 3]


async def cancel(looper, tok, deaths):
    stream = looper.submit(request(max_new=100_000))
    events = []
    async for event in stream.events():
        events.append(event)
        if len(events) == 1:
            stream.cancel()
    done = events[-1]
    assert isinstance(done, Complete) and done.finish_reason == FinishReason.CANCELLED
    assert done.completion_tokens < 100_000
    assert await drained(looper)


async def request_error(looper, tok, deaths):
    bad = looper.submit(request(rid="bad", prompt=(5, ERROR_TOKEN), max_new=20))
    good = looper.submit(request(rid="good", max_new=5))
    exc = await failure(bad)
    assert exc.kind == ErrorKind.INTERNAL and "fake request failure" in exc.message
    assert (await collect(good))[-1].token_ids == expected(20, 5)
    unknown = await failure(looper.submit(request(rid="unknown", prompt=(5, UNKNOWN_REASON_TOKEN))))
    assert unknown.kind == ErrorKind.INTERNAL and "reason" in unknown.message.lower()
    refused = await failure(looper.submit(request(rid="long", prompt=(7,) * (MAX_INPUT_LEN + 1))))
    assert refused.kind == ErrorKind.INVALID_ARGUMENT and "TensorRT-LLM refused" in refused.message
    assert await drained(looper) and looper.alive and not deaths


async def death(looper, tok, deaths):
    exc = await failure(looper.submit(request(rid="die", prompt=(5, DIE_TOKEN))))
    assert exc.kind == ErrorKind.UNAVAILABLE
    for _ in range(100):
        if deaths:
            break
        await asyncio.sleep(0.01)
    assert deaths and not looper.alive
    after = await failure(looper.submit(request(rid="after")))
    assert after.kind == ErrorKind.UNAVAILABLE


SCENARIOS = [streaming, non_streaming, n_sequences, stop_string, stop_token_and_eos, cancel, request_error, death]


async def drive(executor, tokenizer, scenario) -> None:
    """Start a Looper on `executor`, run one scenario, stop both."""
    from tokenloop.looper.looper import Looper
    deaths: list[str] = []
    looper = Looper(executor, tokenizer, on_death=deaths.append)
    looper.start()
    try:
        await scenario(looper, tokenizer, deaths)
    finally:
        looper.stop()
        executor.shutdown()
