"""Greedy output of the engine equals transformers' greedy generate(), token for token.

Tiny random-weight Llama / Qwen2 / Mistral / Qwen3 / Gemma 3 / Phi-3 checkpoints (tests/tiny_model.py); each request
alone, and 16 mixed-length requests at once with a small token budget (chunked prefill next to running decodes,
paged KV, prefix caching). The batch runs in float64 on both sides, so that a near-tie between two
logits cannot flip an argmax through rounding alone; the single-request runs are float32.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine_helpers import engine_on, greedy_batch, greedy_request, hf_greedy, run_all, tokens
from tests.tiny_model import make_tiny_model
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine

transformers = pytest.importorskip("transformers")

CASES = [("llama", True), ("qwen2", False), ("mistral", False), ("qwen3", True), ("gemma3", False), ("phi3", False)]


def mixed_prompts(num: int, vocab_size: int, seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 160))] for _ in range(num)]
    prompts[1] = prompts[0][:40] + prompts[1][:20]  # a shared prefix, for the prefix cache
    prompts[2] = prompts[0][:48] + prompts[2][:5]
    return prompts


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in CASES])
def checkpoint(request, tmp_path_factory):
    arch, tied = request.param
    return make_tiny_model(tmp_path_factory.mktemp(arch), arch, tied=tied)


def test_alone_float32(checkpoint):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    engine = Engine.from_dir(checkpoint, EngineConfig(dtype="float32", kv_cache_tokens=2048))
    try:
        for prompt in ([5, 17, 99, 3, 250, 7], list(range(10, 110))):
            _, steps = run_all(engine, [greedy_request(prompt)])
            (got,) = steps.values()
            assert tokens(got) == hf_greedy(hf, prompt)
    finally:
        engine.shutdown()


def test_batch_of_16_mixed_lengths_float64(checkpoint):
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    prompts = mixed_prompts(16, hf.config.vocab_size)
    expected = [hf_greedy(hf, p) for p in prompts]
    config = EngineConfig(dtype="float64", kv_cache_tokens=8192, max_num_tokens=96, max_batch_size=16,
                          block_size=8)
    engine = Engine.from_dir(checkpoint, config)
    try:
        ids, steps = run_all(engine, [greedy_request(p) for p in prompts])
        got = [tokens(steps[(i, 0)]) for i in ids]
        assert engine.block_manager.num_hit_tokens > 0  # the shared prefixes came from the cache
    finally:
        engine.shutdown()
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"request {i} (prompt of {len(prompts[i])} tokens) differs from transformers"


def test_native_decode_attention_equals_the_torch_path_in_a_float32_batch(checkpoint):
    """The C kernel (reads the paged cache in place, batch split over two threads) against gather + SDPA."""
    prompts = mixed_prompts(16, 200, seed=11)
    got = {}
    for backend in ("native", "torch"):
        with engine_on(checkpoint, backend, kv_cache_tokens=8192, max_num_tokens=96, max_batch_size=16,
                       block_size=8) as engine:
            got[backend] = greedy_batch(engine, prompts)
    assert got["native"] == got["torch"]
