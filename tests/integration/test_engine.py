"""The Engine through its Executor protocol, on a tiny random-weight checkpoint."""

from __future__ import annotations

import json
import time

import pytest

from tests.engine_helpers import collect, final, greedy_request, run_all, sampled_request, tokens, with_output
from tests.tiny_model import make_tiny_model
from tokenloop.core.executor import EngineDeadError, Executor
from tokenloop.core.request import FinishReason
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine

PROMPT = [5, 17, 99, 3, 250, 7, 42]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def engine(checkpoint):
    eng = Engine.from_dir(checkpoint, EngineConfig(kv_cache_tokens=4096, max_num_tokens=64, max_batch_size=16))
    yield eng
    eng.shutdown()


def greedy_alone(engine, prompt, max_new_tokens=32) -> list[int]:
    _, steps = run_all(engine, [greedy_request(prompt, max_new_tokens)])
    (got,) = steps.values()
    return tokens(got)


def test_implements_the_executor_protocol(engine):
    assert isinstance(engine, Executor)


def test_wake_ends_a_wait_at_once_and_is_not_lost_before_one(engine):
    import threading
    import time

    threading.Timer(0.05, engine.wake).start()
    start = time.monotonic()
    assert engine.await_responses(10.0) == []  # woken, not timed out
    assert time.monotonic() - start < 5.0
    engine.wake()  # before the wait: level-triggered, the next wait returns at once
    start = time.monotonic()
    assert engine.await_responses(10.0) == []
    assert time.monotonic() - start < 5.0
    start = time.monotonic()
    assert engine.await_responses(0.2) == []  # consumed: this one waits out its timeout
    assert time.monotonic() - start >= 0.15


def test_length_finish_and_stats_return_to_idle(engine):
    ids, steps = run_all(engine, [greedy_request(PROMPT, 12)])
    got = steps[(ids[0], 0)]
    assert len(tokens(got)) == 12
    assert final(got).finish_reason is FinishReason.LENGTH
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_blocks_total == 4096 // 16 and stats.tokens_per_block == 16 and stats.num_steps >= 12


def test_cancel_ends_with_cancelled_and_frees_blocks_at_the_next_step(engine):
    request_id = engine.enqueue(greedy_request(PROMPT * 20, max_new_tokens=900))
    deadline = time.monotonic() + 30
    seen = []
    while not seen and time.monotonic() < deadline:
        seen = engine.await_responses(0.5)
    assert engine.stats().kv_blocks_used > 0
    engine.cancel(request_id)
    engine.cancel(request_id)  # idempotent
    steps = collect(engine, {request_id: 1})[(request_id, 0)]
    assert final(steps).finish_reason is FinishReason.CANCELLED
    assert engine.stats().kv_blocks_used == 0
    engine.cancel(request_id)  # after the end: ignored
    engine.cancel(12345)  # unknown: ignored
    assert engine.await_responses(0.3) == []


def test_stop_token_ends_with_the_matched_token(engine):
    reference = greedy_alone(engine, PROMPT)
    stop = reference[5]
    first = reference.index(stop)
    ids, steps = run_all(engine, [greedy_request(PROMPT, 32, stop_token_ids=(stop,))])
    got = steps[(ids[0], 0)]
    assert tokens(got) == reference[:first + 1]
    assert final(got).finish_reason is FinishReason.STOP_TOKEN and final(got).matched_stop_token == stop


@pytest.fixture
def eos_checkpoint(checkpoint, tmp_path, engine):
    """The tiny checkpoint with its 6th greedy token (for PROMPT) declared an EOS id."""
    eos = greedy_alone(engine, PROMPT)[5]
    for f in checkpoint.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    return tmp_path, eos


def test_eos_ignore_eos_and_min_new_tokens(eos_checkpoint):
    model_dir, eos = eos_checkpoint
    eng = Engine.from_dir(model_dir, EngineConfig(kv_cache_tokens=2048))
    try:
        ids, steps = run_all(eng, [greedy_request(PROMPT, 32, ignore_eos=False),
                                   greedy_request(PROMPT, 32, ignore_eos=True),
                                   greedy_request(PROMPT, 32, ignore_eos=False, min_new_tokens=20)])
    finally:
        eng.shutdown()
    stopped, ignored, delayed = (steps[(i, 0)] for i in ids)
    assert final(stopped).finish_reason is FinishReason.EOS and tokens(stopped)[-1] == eos
    assert len(tokens(stopped)) <= 6
    assert final(ignored).finish_reason is FinishReason.LENGTH and len(tokens(ignored)) == 32
    assert eos not in tokens(delayed)[:20] and len(tokens(delayed)) >= 20


def test_logprobs_and_top_alternatives(engine):
    request = with_output(greedy_request(PROMPT, 8), logprobs=True, top_logprobs=3)
    ids, steps = run_all(engine, [request])
    got = steps[(ids[0], 0)]
    lps = [lp for s in got for lp in s.logprobs]
    tops = [t for s in got for t in s.top_logprobs]
    assert len(lps) == len(tops) == 8
    for token, lp, top in zip(tokens(got), lps, tops):
        assert len(top) == 3 and top[0] == (token, lp) and lp <= 0.0  # greedy: the chosen token is the best
        assert top[0][1] >= top[1][1] >= top[2][1]


def test_seeded_sampling_is_reproducible_across_runs_and_batches(engine, checkpoint):
    request = sampled_request(PROMPT, seed=1234, top_p=0.95)
    alone = tokens(next(iter(run_all(engine, [request])[1].values())))
    others = [sampled_request(PROMPT[:3], seed=s, max_new_tokens=30) for s in range(5)]
    others += [greedy_request(list(range(20, 80)), 10)]
    ids, steps = run_all(engine, others[:3] + [request] + others[3:])
    in_batch = tokens(steps[(ids[3], 0)])
    fresh = Engine.from_dir(checkpoint, EngineConfig(kv_cache_tokens=1024, max_batch_size=4, max_num_tokens=16))
    try:
        again = tokens(next(iter(run_all(fresh, [request])[1].values())))
    finally:
        fresh.shutdown()
    other_seed = tokens(next(iter(run_all(engine, [sampled_request(PROMPT, seed=1235, top_p=0.95)])[1].values())))
    assert alone == in_batch == again
    assert alone != other_seed


def test_n_sequences_differ_and_each_is_reproducible(engine):
    request = sampled_request(PROMPT, seed=7, n=3)
    ids, steps = run_all(engine, [request])
    outs = [tokens(steps[(ids[0], i)]) for i in range(3)]
    assert all(len(o) == 24 for o in outs) and len({tuple(o) for o in outs}) == 3
    ids, steps = run_all(engine, [request])
    assert [tokens(steps[(ids[0], i)]) for i in range(3)] == outs


def test_kv_exhaustion_preempts_and_every_request_finishes_correctly(checkpoint):
    prompts = [[(7 * i + j) % 300 + 3 for j in range(30 + 5 * i)] for i in range(10)]
    big = Engine.from_dir(checkpoint, EngineConfig(dtype="float64", kv_cache_tokens=8192))
    try:
        expected = [greedy_alone(big, p, 60) for p in prompts]
    finally:
        big.shutdown()
    # 160 tokens of cache; each request needs 90-135 of them
    tiny = Engine.from_dir(checkpoint, EngineConfig(dtype="float64", kv_cache_tokens=160, block_size=8,
                                                    max_num_tokens=64, max_batch_size=10))
    try:
        ids, steps = run_all(tiny, [greedy_request(p, 60) for p in prompts])
        assert tiny.stats().num_preemptions > 0
        assert tiny.stats().kv_blocks_used == 0
    finally:
        tiny.shutdown()
    for i, request_id in enumerate(ids):
        assert final(steps[(request_id, 0)]).finish_reason is FinishReason.LENGTH
        assert tokens(steps[(request_id, 0)]) == expected[i], f"request {i} changed under preemption"


def test_context_end_finishes_with_length(checkpoint):
    eng = Engine.from_dir(checkpoint, EngineConfig(kv_cache_tokens=1024, max_model_len=20))
    try:
        ids, steps = run_all(eng, [greedy_request(PROMPT, 100)])
        with pytest.raises(ValueError, match="at most 19"):
            eng.enqueue(greedy_request(list(range(3, 23)), 5))
    finally:
        eng.shutdown()
    got = steps[(ids[0], 0)]
    assert len(PROMPT) + len(tokens(got)) == 20 and final(got).finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("prompt, max_new, match", [
    ([], 5, "empty"), ([3, 99999], 5, "`prompt_token_ids` must be in"), (PROMPT, 5000, "must fit the KV cache")])
def test_enqueue_rejects_requests_it_cannot_serve(checkpoint, prompt, max_new, match):
    eng = Engine(checkpoint, EngineConfig(kv_cache_tokens=512), start=False)
    with pytest.raises(ValueError, match=match):
        eng.enqueue(greedy_request(prompt, max_new))


def test_a_failing_step_fails_its_requests_then_the_engine_dies(engine):
    def broken(batch):
        raise RuntimeError("boom")
    engine.model.forward = broken
    for _ in range(3):  # three failing steps in a row: the engine gives up
        request_id = engine.enqueue(greedy_request(PROMPT, 5))
        steps = collect(engine, {request_id: 1})[(request_id, 0)]
        assert steps[-1].is_final and "boom" in steps[-1].error
    with pytest.raises(EngineDeadError, match="boom"):
        engine.await_responses(5.0)
    with pytest.raises(EngineDeadError):
        engine.enqueue(greedy_request(PROMPT, 5))
