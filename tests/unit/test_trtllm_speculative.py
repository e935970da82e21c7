"""TensorRT-LLM's own speculative decoding through both adapters (trtllm/speculative.py), on the fake tensorrt_llm:
the LLM API gets `speculative_config` of the documented class and fields, the C++ executor gets lookahead's
DecodingConfig; what TensorRT-LLM cannot run is refused at start-up naming the flag."""

from __future__ import annotations

import pytest

from tests.fakes import scenarios
from tests.fakes.fixtures import fake_trtllm, make_engine_dir
from tokenloop.service.cli import build_parser, config_from_args
from tokenloop.service.config import parse_lookahead_flag
from tokenloop.trtllm import TrtllmConfig, create_trtllm_executor
from tokenloop.trtllm.speculative import describe


@pytest.fixture
def fake():
    with fake_trtllm() as module:
        yield module


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
