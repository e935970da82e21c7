"""The LLM API adapter (trtllm/llmapi.py) on the fake tensorrt_llm.LLM.

The fake keeps the real result quirks (token_ids_diff refreshed only for the sequence a response
carries; finish_reason set only when the whole request is done), so these tests fail if the
adapter leans on them. A real GPU run is `make gpu-smoke` (docs/trtllm.md).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from tests.conftest import run
from tests.fakes import scenarios
from tokenloop.core.executor import EngineDeadError, Step
from tokenloop.core.request import FinishReason, OutputParams, StoppingParams, ValidRequest
from tokenloop.trtllm import create_trtllm_executor
from tokenloop.trtllm.llmapi_outputs import completion_logprobs, finish_step

THREAD = "tokenloop-trtllm-llmapi"


@pytest.fixture
def adapter(fake, tokenizer_dir):
    executor = create_trtllm_executor(str(tokenizer_dir))
    yield executor
    executor.shutdown()


def steps_until_final(executor, num_final: int = 1, timeout: float = 10.0) -> list[Step]:
    steps: list[Step] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps += executor.await_responses(0.01)
        if sum(s.is_final for s in steps) >= num_final:
            return steps
    raise AssertionError(f"no final step: {steps}")


def llm_of(fake):
    return fake.LLM.instances[-1]


# -- through the looper ------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", scenarios.SCENARIOS, ids=lambda s: s.__name__)
def test_scenario_through_the_looper(scenario, fake, tokenizer_dir, tokenizer):
    run(scenarios.drive(create_trtllm_executor(str(tokenizer_dir)), tokenizer, scenario))


# -- what the adapter sends ----------------------------------------------------------------------
def test_llm_gets_the_flags_on_the_adapter_thread(fake, tokenizer_dir):
    executor = create_trtllm_executor(str(tokenizer_dir), max_batch_size=16, max_num_tokens=2048,
                                      kv_cache_free_gpu_memory_fraction=0.5, enable_block_reuse=False,
                                      enable_chunked_context=True, scheduler_policy="guaranteed_no_evict",
                                      tensor_parallel_size=2, pipeline_parallel_size=1)
    try:
        llm = llm_of(fake)
        a = llm.args
        assert llm.model == str(tokenizer_dir) and llm.create_thread == THREAD
        assert (a["backend"], a["skip_tokenizer_init"], a["enable_iter_perf_stats"]) == ("pytorch", True, True)
        assert (a["tensor_parallel_size"], a["pipeline_parallel_size"]) == (2, 1)
        assert (a["max_batch_size"], a["max_num_tokens"], a["enable_chunked_prefill"]) == (16, 2048, True)
        assert (a["kv_cache_config"].free_gpu_memory_fraction, a["kv_cache_config"].enable_block_reuse) == (0.5, False)
        assert a["scheduler_config"].capacity_scheduler_policy == "GUARANTEED_NO_EVICT"
        assert "max_beam_width" not in a
    finally:
        executor.shutdown()


def test_sampling_params_mapping(fake, adapter):
    adapter.enqueue(scenarios.request(max_new=5, logprobs=True, stop_token_ids=(13,), min_new_tokens=1))
    prompt, sp, streaming = llm_of(fake).submits[-1]
    assert prompt == [20] and streaming is True and llm_of(fake).generate_threads == {THREAD}
    assert (sp.end_id, sp.pad_id, sp.max_tokens, sp.n, sp.stop_token_ids) == (2, 2, 5, 1, [13])
    assert (sp.top_k, sp.temperature, sp.seed, sp.min_tokens, sp.logprobs) == (1, None, 7, 1, 1)
    assert sp.include_stop_str_in_output is True and sp.detokenize is False and sp.ignore_eos is False
    adapter.enqueue(scenarios.request(greedy=False, n=2, ignore_eos=True))
    _, sp, _ = llm_of(fake).submits[-1]
    assert (sp.top_k, sp.top_p, sp.temperature, sp.n, sp.best_of, sp.ignore_eos) == (0, 1.0, 0.8, 2, 2, True)


def test_n_with_greedy_is_refused(adapter):
    with pytest.raises(ValueError, match="n > 1 needs sampling"):
        adapter.enqueue(scenarios.request(n=2, greedy=True))


def test_refusals_are_value_errors(adapter):
    with pytest.raises(ValueError, match="TensorRT-LLM refused the request: The sum of prompt length"):
        adapter.enqueue(scenarios.request(prompt=(1,) * 201))


def test_beam_search_is_not_streamed(fake, tokenizer_dir):
    executor = create_trtllm_executor(str(tokenizer_dir), beam_width=3)
    try:
        assert llm_of(fake).args["max_beam_width"] == 3
        executor.enqueue(scenarios.request(n=2, max_new=3))
        _, sp, streaming = llm_of(fake).submits[-1]
        assert (sp.use_beam_search, sp.best_of, sp.n, streaming) == (True, 3, 2, False)
        steps = steps_until_final(executor, num_final=2)
        assert [(s.seq_index, s.token_ids) for s in steps] == [(0, scenarios.expected(20, 3, 0)),
                                                                (1, scenarios.expected(20, 3, 1))]
    finally:
        executor.shutdown()


# -- what the adapter makes of results -----------------------------------------------------------
def test_sequences_are_tracked_with_own_offsets(adapter):
    adapter.enqueue(scenarios.request(n=3, greedy=False, max_new=4))
    steps = steps_until_final(adapter, num_final=3)
    for seq in range(3):
        mine = [s for s in steps if s.seq_index == seq]
        assert [t for s in mine for t in s.token_ids] == scenarios.expected(20, 4, seq)  # no stale diffs repeated
        assert [s.is_final for s in mine].count(True) == 1
        assert mine[-1].finish_reason == FinishReason.LENGTH  # inferred: the LLM API left it unset


def test_logprobs_and_top_alternatives(fake, adapter):
    from tensorrt_llm import _fake
    adapter.enqueue(ValidRequest("t", (20,), stopping=StoppingParams(max_new_tokens=3),
                                 output=OutputParams(logprobs=True, top_logprobs=2)))
    steps = steps_until_final(adapter)
    assert llm_of(fake).submits[-1][1].logprobs == 2
    tokens = [t for s in steps for t in s.token_ids]
    assert [lp for s in steps for lp in s.logprobs] == [_fake.logprob(t) for t in tokens]
    assert [top for s in steps for top in s.top_logprobs] == [
        list(_fake.top_logprobs(t, 2).items()) for t in tokens]


def test_logprob_entries_as_floats_or_dicts():
    request = ValidRequest("t", (1,), output=OutputParams(logprobs=True, top_logprobs=1))
    old = SimpleNamespace(token_ids=[5, 6], logprobs=[-0.5, -0.25])
    assert completion_logprobs(old, 0, 2, request) == ([-0.5, -0.25], [[], []])
    lp = lambda v, r: SimpleNamespace(logprob=v, rank=r)
    new = SimpleNamespace(token_ids=[5, 6], logprobs=[{9: lp(-0.1, 1), 5: lp(-0.7, 2)}, {6: lp(-0.2, 1)}])
    assert completion_logprobs(new, 1, 1, request) == ([-0.2], [[(6, -0.2)]])
    assert completion_logprobs(new, 0, 1, request) == ([-0.7], [[(9, -0.1)]])


@pytest.mark.parametrize("reason, stop_reason, tokens, aborted, expected", [
    ("stop", None, [4, 2], False, (FinishReason.EOS, None)),
    ("stop", 13, [4, 13], False, (FinishReason.STOP_TOKEN, 13)),
    ("stop", 22, [4, 22], False, (FinishReason.EOS, None)),  # a further EOS id passed as a stop token
    ("length", None, [4, 5, 6], False, (FinishReason.LENGTH, None)),
    ("timeout", None, [4], False, (FinishReason.CANCELLED, None)),
    ("cancelled", None, [4], True, (FinishReason.CANCELLED, None)),
    (None, None, [4, 5, 6], False, (FinishReason.LENGTH, None)),
    (None, None, [4, 13], False, (FinishReason.STOP_TOKEN, 13)),
    (None, None, [4], True, (FinishReason.CANCELLED, None)),
])
def test_finish_reasons_map_to_ours(reason, stop_reason, tokens, aborted, expected):
    request = ValidRequest("t", (1,), stopping=StoppingParams(max_new_tokens=3, stop_token_ids=(13,)))
    step = Step(1, 0, [], is_final=True)
    finish_step(step, SimpleNamespace(finish_reason=reason, stop_reason=stop_reason, token_ids=tokens),
                         request, aborted)
    assert (step.finish_reason, step.matched_stop_token) == expected and step.error is None


def test_unknown_finish_reason_is_an_error():
    step = Step(1, 0, [], is_final=True)
    finish_step(step, SimpleNamespace(finish_reason="eaten", stop_reason=None, token_ids=[1]),
                         ValidRequest("t", (1,)), False)
    assert step.error == "TensorRT-LLM finished sequence 0 with an unknown reason 'eaten'"


def test_cancel_aborts_once_and_ends_every_sequence(adapter):
    request_id = adapter.enqueue(scenarios.request(n=2, greedy=False, max_new=300))
    deadline = time.monotonic() + 10
    while not adapter.await_responses(0.01) and time.monotonic() < deadline:
        pass  # until the request is running
    adapter.cancel(request_id)
    adapter.cancel(request_id)
    finals = [s for s in steps_until_final(adapter, num_final=2) if s.is_final]
    assert sorted(s.seq_index for s in finals) == [0, 1]
    assert {s.finish_reason for s in finals} == {FinishReason.CANCELLED}
    adapter.cancel(request_id)  # finished: ignored
    assert adapter.await_responses(0.05) == []


def test_wake_ends_a_wait_at_once_and_is_not_lost_before_one(adapter):
    import threading

    threading.Timer(0.05, adapter.wake).start()
    start = time.monotonic()
    assert adapter.await_responses(10.0) == []  # woken: returns no step, long before its timeout
    assert time.monotonic() - start < 5.0
    adapter.wake()  # before the wait: the next one returns at once
    start = time.monotonic()
    assert adapter.await_responses(10.0) == []
    assert time.monotonic() - start < 5.0


def test_death_without_check_health_is_seen_in_the_results(fake, adapter):
    """The cited LLM API (llm.py @ 00966934) has no _check_health: an engine failure is raised from the results."""
    assert not hasattr(llm_of(fake), "_check_health")
    adapter.enqueue(scenarios.request(prompt=(5, scenarios.DIE_TOKEN)))
    with pytest.raises(EngineDeadError, match=r"^the TensorRT-LLM executor failed: \[TensorRT-LLM\]\[ERROR\] fake "
                                              "engine failure: the executor loop died$"):
        steps_until_final(adapter)
    with pytest.raises(EngineDeadError):
        adapter.enqueue(scenarios.request())


def test_death_is_seen_by_generate_async(fake, adapter):
    """A failure queued while nothing was in flight is raised by the next generate_async (proxy.submit)."""
    llm_of(fake)._error_queue.put(RuntimeError("[TensorRT-LLM][ERROR] MPI worker 1 exited"))
    with pytest.raises(EngineDeadError, match="^the TensorRT-LLM executor failed: .*MPI worker 1 exited$"):
        adapter.enqueue(scenarios.request())
    with pytest.raises(EngineDeadError):
        adapter.await_responses(0.01)


def test_a_request_error_fails_that_request_only(fake, adapter):
    adapter.enqueue(scenarios.request(prompt=(5, scenarios.ERROR_TOKEN)))
    [step] = steps_until_final(adapter)
    assert step.error == "[TensorRT-LLM][ERROR] fake request failure"
    adapter.enqueue(scenarios.request(max_new=3))
    assert steps_until_final(adapter)[-1].finish_reason == FinishReason.LENGTH


def test_check_health_is_used_where_the_release_has_it(fake, tokenizer_dir):
    fake._fake.LLM_CHECK_HEALTH = True  # releases since PR #9057
    executor = create_trtllm_executor(str(tokenizer_dir))
    try:
        llm_of(fake)._shut_down = True  # what `_executor.is_shutdown()` reports after a shutdown
        with pytest.raises(EngineDeadError, match="no longer healthy"):
            executor.enqueue(scenarios.request())
    finally:
        executor.shutdown()


def test_stats_come_from_get_stats_async(fake, adapter):
    assert adapter.stats().num_running == 0  # nothing submitted: no stats polling yet
    adapter.enqueue(scenarios.request(max_new=300))
    deadline = time.monotonic() + 10
    while adapter.stats().kv_blocks_total == 0 and time.monotonic() < deadline:
        adapter.await_responses(0.05)
    stats = adapter.stats()
    assert (stats.num_running, stats.kv_blocks_total, stats.tokens_per_block) == (1, 500, 64)
    assert stats.kv_blocks_used == 1 and stats.step_latency_s == pytest.approx(0.0025) and stats.num_steps > 0
    adapter.cancel(1)
    steps_until_final(adapter)
    deadline = time.monotonic() + 5
    while adapter.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert adapter.stats().num_running == 0 and adapter.stats().kv_blocks_total == 500


def test_shutdown_stops_the_llm_and_the_loop_thread(fake, tokenizer_dir):
    before = set(threading.enumerate())
    executor = create_trtllm_executor(str(tokenizer_dir))
    (loop_thread,) = [t for t in set(threading.enumerate()) - before if t.name == THREAD]  # the adapter's own
    executor.shutdown()
    assert llm_of(fake)._stopped and not loop_thread.is_alive()
    with pytest.raises(EngineDeadError):
        executor.await_responses(0.01)
