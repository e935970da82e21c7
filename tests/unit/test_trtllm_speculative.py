"""TensorRT-LLM's own speculative decoding through both adapters (trtllm/speculative.py), on the fake tensorrt_llm:
the LLM API gets `speculative_config` of the documented class and fields, the C++ executor gets lookahead's
DecodingConfig; what TensorRT-LLM cannot run is refused at start-up naming the flag."""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes import scenarios
from tests.fakes.fixtures import make_engine_dir
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.service.cli import build_parser, config_from_args
from tokenloop.service.config import parse_lookahead_flag
from tokenloop.trtllm import TrtllmConfig, create_trtllm_executor
from tokenloop.trtllm.speculative import SpecCounts, describe, draft_counts


def speculative_config_of(fake, tokenizer_dir, **options):
    executor = create_trtllm_executor(str(tokenizer_dir), trtllm_api="llm", **options)
    try:
        return fake.LLM.instances[-1].args.get("speculative_config")
    finally:
        executor.shutdown()


def test_ngram_on_the_llm_api(fake, tokenizer_dir):
    config = speculative_config_of(fake, tokenizer_dir, speculative="ngram", num_speculative_tokens=5,
                                   speculative_max_batch_size=8)
    assert type(config).__name__ == "NGramDecodingConfig"
    assert (config.max_draft_len, config.max_concurrency) == (5, 8)
    assert (config.is_keep_all, config.is_use_oldest, config.is_public_pool) == (True, True, True)  # its defaults


def test_ngram_drafts_four_tokens_unless_told(fake, tokenizer_dir):
    assert speculative_config_of(fake, tokenizer_dir, speculative="ngram").max_draft_len == 4


def test_draft_target_and_lookahead_on_the_llm_api(fake, tokenizer_dir):
    config = speculative_config_of(fake, tokenizer_dir, speculative="draft_target", speculative_model="/m/draft",
                                   num_speculative_tokens=3)
    assert type(config).__name__ == "DraftTargetDecodingConfig"
    assert (config.max_draft_len, config.speculative_model, config.max_concurrency) == (3, "/m/draft", None)
    config = speculative_config_of(fake, tokenizer_dir, speculative="lookahead", lookahead_config=(7, 5, 6))
    assert type(config).__name__ == "LookaheadDecodingConfig"
    assert (config.max_window_size, config.max_ngram_size, config.max_verification_set_size) == (7, 5, 6)


def test_off_sends_nothing(fake, tokenizer_dir):
    assert speculative_config_of(fake, tokenizer_dir) is None


def test_lookahead_on_the_executor(fake, tmp_path, tokenizer_dir):
    engine_dir = make_engine_dir(tmp_path / "engine", tokenizer_dir)
    executor = create_trtllm_executor(str(engine_dir), speculative="lookahead", lookahead_config=(4, 3, 2))
    try:
        decoding = fake.bindings.executor.Executor.instances[-1].config.decoding_config
        assert decoding.decoding_mode.name == "Lookahead"
        sizes = decoding.lookahead_decoding_config
        assert (sizes.max_window_size, sizes.max_ngram_size, sizes.max_verification_set_size) == (4, 3, 2)
        executor.enqueue(scenarios.request(max_new=3))  # requests go as before
    finally:
        executor.shutdown()
    executor = create_trtllm_executor(str(engine_dir))
    try:
        assert fake.bindings.executor.Executor.instances[-1].config.decoding_config is None
    finally:
        executor.shutdown()


def test_the_executor_refuses_ngram_and_draft_target(fake, tmp_path, tokenizer_dir):
    engine_dir = make_engine_dir(tmp_path / "engine", tokenizer_dir)
    with pytest.raises(ValueError, match=r"--speculative ngram needs TensorRT-LLM's LLM API \(--trtllm-api llm\)"):
        create_trtllm_executor(str(engine_dir), speculative="ngram")  # api auto: an engine dir -> executor


@pytest.mark.parametrize(("options", "message"), [
    ({"speculative": "eagle"}, "--speculative must be one of off, ngram, lookahead, draft_target; got 'eagle'"),
    ({"speculative": "draft_target"}, "--speculative draft_target needs --speculative-model DIR"),
    ({"speculative": "ngram", "speculative_model": "/m"}, "--speculative-model is read only with --speculative "
                                                          "draft_target"),
    ({"speculative": "ngram", "num_speculative_tokens": 0}, "--num-speculative-tokens must be >= 1; got 0"),
    ({"speculative": "lookahead", "api": "executor"}, None),
    ({"speculative": "ngram", "api": "executor"}, "needs TensorRT-LLM's LLM API"),
])
def test_config_checks(options, message):
    if message is None:
        TrtllmConfig(**options)
        return
    with pytest.raises(ValueError, match=message):
        TrtllmConfig(**options)


def test_lookahead_flag_parsing():
    assert parse_lookahead_flag("4,3,2") == (4, 3, 2)
    for bad in ("4,3", "a,b,c", "4,0,2", "4,3,2,1"):
        with pytest.raises(ValueError, match="expected W,N,G, three integers >= 1"):
            parse_lookahead_flag(bad)


def test_flags_reach_each_backend():
    args = build_parser().parse_args(["serve", "--backend", "trtllm", "--speculative", "lookahead", "--lookahead-config",
                                 "4,3,2", "--speculative-max-batch-size", "16"])
    options = config_from_args(args).executor_options
    assert (options["speculative"], options["lookahead_config"], options["speculative_max_batch_size"]) == \
        ("lookahead", (4, 3, 2), 16)
    args = build_parser().parse_args(["serve", "--speculative", "ngram", "--num-speculative-tokens", "6"])
    options = config_from_args(args).executor_options
    assert (options["speculative"], options["num_speculative_tokens"]) == ("ngram", 6)
    assert "lookahead_config" not in options
    args = build_parser().parse_args(["serve", "--speculative", "lookahead"])
    with pytest.raises(ValueError, match="--speculative lookahead is TensorRT-LLM's"):
        config_from_args(args)


def test_start_up_log_words():
    assert describe(TrtllmConfig()) == "speculative decoding off"
    assert describe(TrtllmConfig(speculative="ngram")) == "speculative decoding ngram (up to 4 tokens)"
    assert describe(TrtllmConfig(speculative="lookahead", lookahead_config=(4, 3, 2))) == \
        "speculative decoding lookahead (W,N,G 4,3,2)"


# -- what TensorRT-LLM reports back: drafted and accepted tokens (trtllm/speculative.py SpecCounts, draft_counts) --

# The fake verifies K drafted tokens per sequence per iteration and accepts 2, 0, 3, 1 of them in turn (capped at K),
# so each iteration yields 3, 1, 4, 2 tokens: 20 tokens take 8 iterations, 12 accepted drafts.
NUM_NEW, ITERATIONS, ACCEPTED = 20, 8, 12


def spec_executor(api: str, tmp_path, tokenizer_dir, speculative: str):
    """An adapter on the fake: the LLM API drafting 4 tokens by n-gram, or the C++ executor running lookahead (the
    fake's lookahead drafts 3)."""
    if api == "llm":
        options = {"speculative": "ngram", "num_speculative_tokens": 4} if speculative != "off" else {}
        return create_trtllm_executor(str(tokenizer_dir), trtllm_api="llm", **options), 4
    engine_dir = make_engine_dir(tmp_path / "engine", tokenizer_dir)
    options = {"speculative": "lookahead", "lookahead_config": (4, 3, 2)} if speculative != "off" else {}
    return create_trtllm_executor(str(engine_dir), **options), 3


@pytest.mark.parametrize("api", ["llm", "executor"])
def test_drafted_and_accepted_tokens_reach_usage_and_the_stats(fake, tmp_path, tokenizer_dir, api):
    """With speculation on, each request asks for its perf metrics (`SamplingParams.return_perf_metrics`,
    `OutputConfig.return_perf_metrics`) and its Complete carries RequestPerfMetrics.speculative_decoding's totals;
    the executor's stats sum every iteration's specDecodingStats; the tokens are those of speculation off."""
    from tests.conftest import run

    async def one(looper, tok, deaths):
        events = await scenarios.collect(looper.submit(scenarios.request(max_new=NUM_NEW)))
        outcome["done"] = events[-1]
        for _ in range(300):  # the stats are read every half second
            if looper.executor.stats().spec_num_drafts == ITERATIONS or speculative == "off":
                break
            await asyncio.sleep(0.01)
        outcome["stats"] = looper.executor.stats()

    results = {}
    for speculative in ("off", "on"):
        outcome: dict = {}
        executor, k = spec_executor(api, tmp_path / speculative, tokenizer_dir, speculative)
        run(scenarios.drive(executor, Tokenizer.from_dir(tokenizer_dir), one))
        results[speculative] = (outcome["done"], outcome["stats"], k)
    off, on = results["off"][0], results["on"][0]
    assert on.token_ids == off.token_ids == scenarios.expected(20, NUM_NEW)
    assert (off.draft_tokens, off.accepted_draft_tokens) == (0, 0)
    done, stats, k = results["on"]
    assert (done.draft_tokens, done.accepted_draft_tokens) == (ITERATIONS * k, ACCEPTED)
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == \
        (ITERATIONS, ITERATIONS * k, ACCEPTED)
    assert stats.spec_tokens_per_step == 1 + ACCEPTED / ITERATIONS and stats.spec_acceptance_rate == ACCEPTED / (
        ITERATIONS * k)
    assert results["off"][1].spec_num_drafts == 0
    if api == "llm":
        submitted = [params.return_perf_metrics for _, params, _ in fake.LLM.instances[-1].submits]
    else:
        submitted = [r.output_config.return_perf_metrics for r in fake.bindings.executor.Executor.instances[-1]
                     .requests.values()]
    assert submitted == [True]


def test_draft_counts_read_the_documented_fields(fake):
    metrics = fake.bindings.executor.RequestPerfMetrics()
    metrics.speculative_decoding.total_draft_tokens, metrics.speculative_decoding.total_accepted_draft_tokens = 9, 4
    assert draft_counts(metrics) == (9, 4)
    assert draft_counts(None) is None  # a result without perf metrics (speculation off, or not asked)
    counts = SpecCounts()
    counts.add({"iter": 1})  # an iteration without specDecodingStats
    counts.add({"specDecodingStats": {"numDraftTokens": 8, "numAcceptedTokens": 5, "numRequestsWithDraftTokens": 2,
                                      "acceptanceLength": 3.5, "iterLatencyMS": 0.4, "draftOverhead": 0.1}})
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (2, 8, 5)



def test_perf_metrics_are_asked_only_when_speculating_and_where_the_release_takes_the_keyword(fake):
    from tokenloop.trtllm.speculative import perf_metrics_kwargs

    def older(**kwargs):  # a release whose SamplingParams / OutputConfig has no return_perf_metrics
        if kwargs:
            raise TypeError(f"__init__() got an unexpected keyword argument {next(iter(kwargs))!r}")
    assert perf_metrics_kwargs("ngram", fake.SamplingParams) == {"return_perf_metrics": True}
    assert perf_metrics_kwargs("lookahead", fake.bindings.executor.OutputConfig) == {"return_perf_metrics": True}
    assert perf_metrics_kwargs("off", fake.SamplingParams) == {}
    assert perf_metrics_kwargs("ngram", older) == {}  # no counts, but requests still go
