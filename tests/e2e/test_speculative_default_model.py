"""Speculative decoding on the real default model: greedy output token for token the same with `--speculative ngram`
as without, for the 16 chat prompts and the grounded prompts (bench/spec_cases.py), each alone and all in one batch;
and on the grounded prompts drafts are accepted (the reason the feature exists). Needs `make model`."""

from __future__ import annotations

import pytest

from tests.engine_helpers import CHAT_QUESTIONS, greedy_request, run_all, tokens
from tokenloop.bench.spec_cases import grounded_messages
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
NUM_NEW = 32


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> dict[str, list[list[int]]]:
    tok = Tokenizer.from_dir(default_model_dir)
    chat = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in CHAT_QUESTIONS]
    grounded = [tok.encode(tok.apply_chat_template(m)) for m in grounded_messages().values()]
    return {"chat": chat, "grounded": grounded}


def greedy(model_dir, mode: str, prompts: list[list[int]], weights: str):
    """Each prompt's greedy tokens alone, then all in one batch; and the engine's stats."""
    engine = Engine.from_dir(model_dir, EngineConfig(kv_cache_tokens=16384, max_num_tokens=512, max_batch_size=32,
                                                     speculative=mode, weights=weights))
    try:
        alone = []
        for p in prompts:
            ids, steps = run_all(engine, [greedy_request(p, NUM_NEW)], timeout=600)
            alone.append(tokens(steps[(ids[0], 0)]))
        ids, steps = run_all(engine, [greedy_request(p, NUM_NEW) for p in prompts], timeout=600)
        return alone, [tokens(steps[(i, 0)]) for i in ids], engine.stats()
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("kind", "weights"), [("grounded", "fp32"), ("grounded", "int4"), ("chat", "int4")])
def test_greedy_output_is_the_same_with_speculation(default_model_dir, prompts, kind, weights):
    off_alone, off_batched, _ = greedy(default_model_dir, "off", prompts[kind], weights)
    on_alone, on_batched, stats = greedy(default_model_dir, "ngram", prompts[kind], weights)
    assert on_alone == off_alone
    assert on_batched == off_batched
    if kind == "grounded":  # the output copies the passage: most drafts are the model's own tokens
        # how long the drafts are follows the row cost measured on this machine; that they are accepted does not
        assert stats.spec_num_drafts > 0 and stats.spec_acceptance_rate > 0.7
