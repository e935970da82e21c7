"""The C++ executor adapter (trtllm/executor.py) and trtllm/__init__.py, on the fake tensorrt_llm.

What this proves and what it cannot: the adapter speaks the binding's documented Python API
(keyword arguments, `has_error()`, delta tokens with full log probs, finish reasons, stats) as
the fake reproduces it; a real GPU run is `make gpu-smoke` (docs/trtllm.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

import pytest

from tests.conftest import ROOT, run
from tests.fakes import scenarios
from tests.fakes.fixtures import FAKES, make_engine_dir
from tokenloop.core.executor import EngineDeadError, Step
from tokenloop.core.request import FinishReason, OutputParams, ValidRequest
from tokenloop.trtllm import MISSING_TRTLLM, TrtllmConfig, create_trtllm_executor


@pytest.fixture
def engine_dir(tmp_path, tokenizer_dir):
    return make_engine_dir(tmp_path / "engine", tokenizer_dir)


def steps_until_final(executor, num_final: int = 1, limit: int = 500) -> list[Step]:
    steps: list[Step] = []
    for _ in range(limit):
        steps += executor.await_responses(0.01)
        if sum(s.is_final for s in steps) >= num_final:
            return steps
    raise AssertionError(f"no final step: {steps}")


def last_request(fake):
    engine = fake.bindings.executor.Executor.instances[-1]
    return engine, engine.requests[max(engine.requests)]


# -- through the looper ------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", scenarios.SCENARIOS, ids=lambda s: s.__name__)
def test_scenario_through_the_looper(scenario, fake, engine_dir, tokenizer):
    run(scenarios.drive(create_trtllm_executor(str(engine_dir)), tokenizer, scenario))


# -- what the adapter sends ----------------------------------------------------------------------
def test_request_is_built_with_keywords_and_mapped_fields(fake, engine_dir):
    from tensorrt_llm import _fake
    executor = create_trtllm_executor(str(engine_dir))
    executor.enqueue(scenarios.request(max_new=5, logprobs=True, stop_token_ids=(13,), min_new_tokens=2))
    _, req = last_request(fake)
    assert req.input_token_ids == [20] and req.max_tokens == 5 and req.streaming is True
    assert req.end_id == 2 and req.pad_id == 2 and req.stop_words == [[13]]
    assert req.output_config.return_log_probs is True and req.output_config.exclude_input_from_output is True
    sc = req.sampling_config
    assert (sc.beam_width, sc.top_k, sc.temperature, sc.seed, sc.min_tokens) == (1, 1, None, 7, 2)
    executor.enqueue(scenarios.request(greedy=False, n=2))
    _, req = last_request(fake)
    sc = req.sampling_config
    assert (sc.top_k, sc.top_p, sc.temperature, sc.num_return_sequences) == (0, 1.0, 0.8, 2)
    assert not _fake.LEGACY_NAMES


def test_extra_eos_ids_become_stop_words_and_map_to_eos(fake, engine_dir):
    from tokenloop.trtllm.executor import TrtllmExecutor
    executor = TrtllmExecutor(str(engine_dir), TrtllmConfig(), eos_token_ids=(2, 22))
    executor.enqueue(scenarios.request(max_new=10, stop_token_ids=(30,)))
    assert last_request(fake)[1].stop_words == [[30], [22]]
    final = steps_until_final(executor)[-1]
    assert (final.finish_reason, final.matched_stop_token, final.token_ids) == (FinishReason.EOS, None, [22])
    executor.enqueue(scenarios.request(max_new=3, ignore_eos=True))
    req = last_request(fake)[1]
    assert req.end_id == -1 and req.stop_words is None


def test_legacy_binding_names_are_detected(fake, engine_dir):
    from tensorrt_llm import _fake
    _fake.LEGACY_NAMES = True  # 0.1x: Request(max_new_tokens=...), SamplingConfig(random_seed=...)
    executor = create_trtllm_executor(str(engine_dir))
    executor.enqueue(scenarios.request(max_new=3))
    _, req = last_request(fake)
    assert req.max_new_tokens == 3 and req.sampling_config.random_seed == 7
    assert [s.token_ids for s in steps_until_final(executor)] == [[21], [22], [23]]


def test_executor_config_passes_the_flags_through(fake, engine_dir):
    tle = fake.bindings.executor
    create_trtllm_executor(str(engine_dir), trtllm_api="executor", max_batch_size=8, max_num_tokens=4096,
                           kv_cache_free_gpu_memory_fraction=0.7, enable_block_reuse=False,
                           enable_chunked_context=True, scheduler_policy="max_utilization", beam_width=2)
    engine = tle.Executor.instances[-1]
    c = engine.config
    assert engine.model_path == str(engine_dir) and engine.model_type == tle.ModelType.DECODER_ONLY
    assert (c.max_batch_size, c.max_num_tokens, c.max_beam_width, c.enable_chunked_context) == (8, 4096, 2, True)
    assert (c.kv_cache_config.free_gpu_memory_fraction, c.kv_cache_config.enable_block_reuse) == (0.7, False)
    assert c.scheduler_config.capacity_scheduler_policy == tle.CapacitySchedulerPolicy.MAX_UTILIZATION
    assert c.parallel_config is None  # a single-GPU engine: leader mode, no MPI workers


def test_multi_gpu_engine_uses_orchestrator_mode(fake, tmp_path, tokenizer_dir):
    tle = fake.bindings.executor
    engine_dir = make_engine_dir(tmp_path / "tp2", tokenizer_dir, world_size=2)
    create_trtllm_executor(str(engine_dir), tensor_parallel_size=2)
    parallel = tle.Executor.instances[-1].config.parallel_config
    assert parallel.communication_mode == tle.CommunicationMode.ORCHESTRATOR
    assert parallel.orchestrator_config.worker_executable_path.endswith(os.path.join("bin", "executorWorker"))
    with pytest.raises(ValueError, match="built for 2 GPUs"):
        create_trtllm_executor(str(engine_dir), tensor_parallel_size=4)


# -- what the adapter makes of responses ---------------------------------------------------------
def test_streaming_deltas_take_the_tail_of_the_full_log_probs(fake, engine_dir):
    from tensorrt_llm import _fake
    executor = create_trtllm_executor(str(engine_dir))
    executor.enqueue(scenarios.request(max_new=4, logprobs=True))
    steps = steps_until_final(executor)
    assert [s.token_ids for s in steps] == [[21], [22], [23], [24]]
    assert [s.logprobs for s in steps] == [[_fake.logprob(t)] for t in (21, 22, 23, 24)]
    assert steps[-1].finish_reason == FinishReason.LENGTH and steps[-1].is_final


def test_n_sequences_map_sequence_index(fake, engine_dir):
    executor = create_trtllm_executor(str(engine_dir))
    executor.enqueue(scenarios.request(n=3, greedy=False, max_new=3))
    steps = steps_until_final(executor, num_final=3)
    for seq in range(3):
        mine = [s for s in steps if s.seq_index == seq]
        assert [t for s in mine for t in s.token_ids] == scenarios.expected(20, 3, seq)
        assert [s.is_final for s in mine].count(True) == 1 and mine[-1].is_final


def test_beam_search_returns_whole_beams_at_the_end(fake, engine_dir):
    executor = create_trtllm_executor(str(engine_dir), beam_width=2)
    executor.enqueue(scenarios.request(n=2, max_new=3))
    _, req = last_request(fake)
    assert req.streaming is False and req.sampling_config.beam_width == 2
    steps = steps_until_final(executor, num_final=2)
    assert [(s.seq_index, s.token_ids, s.is_final) for s in steps] == [
        (0, scenarios.expected(20, 3, 0), True), (1, scenarios.expected(20, 3, 1), True)]
    with pytest.raises(ValueError, match="beam width"):
        executor.enqueue(scenarios.request(n=3))


def test_cancel_is_idempotent_and_ends_every_sequence_cancelled(fake, engine_dir):
    executor = create_trtllm_executor(str(engine_dir))
    request_id = executor.enqueue(scenarios.request(n=2, greedy=False, max_new=100))
    assert executor.await_responses(0.01)
    executor.cancel(request_id)
    executor.cancel(request_id)
    finals = [s for s in steps_until_final(executor, num_final=2) if s.is_final]
    assert sorted(s.seq_index for s in finals) == [0, 1]
    assert {s.finish_reason for s in finals} == {FinishReason.CANCELLED}
    executor.cancel(request_id)  # after the end: ignored
    executor.cancel(12345)  # never seen: ignored
    assert last_request(fake)[0].cancel_calls == [request_id]


def test_error_response_and_unknown_reason_fail_only_their_request(fake, engine_dir):
    executor = create_trtllm_executor(str(engine_dir))
    bad = executor.enqueue(scenarios.request(prompt=(5, scenarios.ERROR_TOKEN)))
    odd = executor.enqueue(scenarios.request(prompt=(5, scenarios.UNKNOWN_REASON_TOKEN)))
    good = executor.enqueue(scenarios.request(max_new=2))
    steps = steps_until_final(executor, num_final=3)
    errors = {s.executor_id: s.error for s in steps if s.error}
    assert "fake request failure" in errors[bad] and "unknown reason SOMETHING_NEW" in errors[odd]
    assert [s.token_ids for s in steps if s.executor_id == good] == [[21], [22]]
    executor.cancel(bad)  # the looper cancels a failed request: already forgotten, not sent
    assert bad not in last_request(fake)[0].cancel_calls


def test_refusals_are_value_errors(fake, engine_dir):
    executor = create_trtllm_executor(str(engine_dir))
    with pytest.raises(ValueError, match="TensorRT-LLM refused the request"):
        executor.enqueue(scenarios.request(prompt=(1,) * 201))
    with pytest.raises(ValueError, match="top_logprobs"):
        executor.enqueue(ValidRequest("t", (1,), output=OutputParams(logprobs=True, top_logprobs=2)))


def test_a_failing_executor_is_engine_dead(fake, engine_dir):
    executor = create_trtllm_executor(str(engine_dir))
    executor.enqueue(scenarios.request(prompt=(5, scenarios.DIE_TOKEN)))
    with pytest.raises(EngineDeadError, match="illegal memory access"):
        executor.await_responses(0.01)


def test_stats_come_from_the_latest_iteration(fake, engine_dir):
    executor = create_trtllm_executor(str(engine_dir))
    assert executor.stats().num_running == 0
    executor.enqueue(scenarios.request(max_new=50))
    executor.enqueue(scenarios.request(prompt=tuple(range(40)), max_new=50))
    executor.await_responses(0.01)
    stats = executor.stats()
    assert (stats.num_running, stats.num_waiting, stats.tokens_per_block, stats.kv_blocks_total) == (2, 0, 32, 1000)
    assert stats.kv_blocks_used == 3 and stats.step_latency_s == pytest.approx(0.00125) and stats.num_steps == 1
    for request_id in (1, 2):
        executor.cancel(request_id)
    steps_until_final(executor, num_final=2)
    idle = executor.stats()  # no iterations while idle: counts come from the adapter's own bookkeeping
    assert (idle.num_running, idle.num_waiting, idle.kv_blocks_total) == (0, 0, 1000)


def test_await_responses_takes_what_the_nanobind_binding_takes(fake, engine_dir):
    """std::optional<std::chrono::milliseconds>: None, a timedelta, or a float of seconds (nanobind's duration
    caster, include/nanobind/stl/chrono.h: PyFloat_Check, so an int is refused)."""
    executor = create_trtllm_executor(str(engine_dir))
    engine = fake.bindings.executor.Executor.instances[-1]
    assert engine.await_responses(timeout=0.001) == []
    assert engine.await_responses(timeout=timedelta(milliseconds=1)) == []
    with pytest.raises(TypeError, match="incompatible function arguments"):
        engine.await_responses(timeout=1)
    assert executor.await_responses(0.01) == []


def test_constructors_take_positional_arguments_where_the_binding_does(fake):
    """nanobind request.cpp / executorConfig.cpp @ 008b2b8d: nb::kw_only() after Request's first two arguments,
    SamplingConfig's first and KvCacheConfig's first ten; the other configs take every argument by position."""
    tle = fake.bindings.executor
    request = tle.Request([1, 2], 5)
    assert (request.input_token_ids, request.max_tokens) == ([1, 2], 5)
    assert tle.SamplingConfig(2).beam_width == 2
    assert tle.KvCacheConfig(False, 128).max_tokens == 128
    assert tle.OutputConfig(True).return_log_probs is True
    assert tle.ExecutorConfig(4).max_beam_width == 4
    for call in (lambda: tle.Request([1], 5, True), lambda: tle.SamplingConfig(1, 5),
                 lambda: tle.KvCacheConfig(*[None] * 11), lambda: tle.Request([1], 5, max_tokens=6)):
        with pytest.raises(TypeError, match="incompatible function arguments"):
            call()


# -- configuration and import hygiene -----------------------------------------------------------
@pytest.mark.parametrize("options, message", [
    ({"api": "gpu"}, "--trtllm-api must be one of auto, executor, llm"),
    ({"max_batch_size": 0}, "--max-batch-size must be >= 1"),
    ({"max_num_tokens": -5}, "--max-num-tokens must be >= 1"),
    ({"kv_cache_free_gpu_memory_fraction": 1.5}, "--kv-cache-free-gpu-memory-fraction must be > 0 and <= 1"),
    ({"kv_cache_free_gpu_memory_fraction": 0.0}, "--kv-cache-free-gpu-memory-fraction must be > 0 and <= 1"),
    ({"scheduler_policy": "fifo"}, "--scheduler-policy must be one of max_utilization, guaranteed_no_evict"),
    ({"tensor_parallel_size": 0}, "--tensor-parallel-size must be >= 1"),
    ({"pipeline_parallel_size": 0}, "--pipeline-parallel-size must be >= 1"),
    ({"beam_width": 0}, "--beam-width must be >= 1"),
])
def test_config_rejects_bad_values(options, message):
    with pytest.raises(ValueError) as exc:
        TrtllmConfig(**options)
    assert str(exc.value).startswith(message)


def test_auto_picks_the_adapter_from_the_directory(fake, engine_dir, tokenizer_dir):
    from tokenloop.trtllm.executor import TrtllmExecutor
    from tokenloop.trtllm.llmapi import TrtllmLlmApi
    assert isinstance(create_trtllm_executor(str(engine_dir)), TrtllmExecutor)
    llm = create_trtllm_executor(str(tokenizer_dir))
    try:
        assert isinstance(llm, TrtllmLlmApi)
    finally:
        llm.shutdown()
    forced = create_trtllm_executor(str(engine_dir), trtllm_api="llm")
    try:
        assert isinstance(forced, TrtllmLlmApi)
    finally:
        forced.shutdown()


def test_without_tensorrt_llm_start_up_fails_with_one_sentence(monkeypatch, engine_dir):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # as if not installed, even where it is
    with pytest.raises(RuntimeError) as exc:
        create_trtllm_executor(str(engine_dir))
    assert str(exc.value) == MISSING_TRTLLM
    assert "pip install tensorrt-llm" in MISSING_TRTLLM and "\n" not in MISSING_TRTLLM
    assert MISSING_TRTLLM.count(". ") == 0  # one sentence


def test_importing_tokenloop_never_imports_tensorrt_llm():
    """Every tokenloop module imports cleanly with the fake on the path and never pulls it in."""
    code = (
        "import importlib, pkgutil, sys\n"
        "import tokenloop, tokenloop.looper, tokenloop.service, tokenloop.engine\n"
        "for pkg in (tokenloop.looper, tokenloop.service, tokenloop.engine):\n"
        "    for m in pkgutil.iter_modules(pkg.__path__):\n"
        "        try:\n"
        "            importlib.import_module(f'{pkg.__name__}.{m.name}')\n"
        "        except Exception as exc:  # a module broken for another reason is not this test's business\n"
        "            if 'tensorrt_llm' in str(exc): raise\n"
        "bad = sorted(n for n in sys.modules if n.split('.')[0] == 'tensorrt_llm')\n"
        "assert not bad, bad\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FAKES, str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_broken_install_is_told_apart_from_a_missing_one(tmp_path, monkeypatch, engine_dir):
    package = tmp_path / "broken" / "tensorrt_llm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.delitem(sys.modules, "tensorrt_llm", raising=False)
    with pytest.raises(RuntimeError, match=r"TensorRT-LLM is installed but does not import \(libcuda\.so\.1"):
        create_trtllm_executor(str(engine_dir))
