"""Engine embeddings (ValidRequest.embed) equal transformers' final hidden states pooled the same way, alone and
batched beside generation (whose tokens they leave unchanged); FlushCache drops the unused prefix-cache blocks
through the engine thread."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine_helpers import greedy_request, run_all, tokens
from tests.tiny_model import make_tiny_model
from tokenloop.core.kv_events import BlocksRemoved
from tokenloop.core.request import EmbedParams, SamplingParams, StoppingParams, ValidRequest
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4


def embed_request(prompt, pooling: str, normalize: bool) -> ValidRequest:
    return ValidRequest(request_id="e", prompt_token_ids=tuple(prompt), sampling=SamplingParams(temperature=0.0),
                        stopping=StoppingParams(max_new_tokens=0), embed=EmbedParams(pooling, normalize))


def hf_embedding(model, prompt, pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' last_hidden_state (after the final norm), pooled: the last token's, or the mean."""
    with torch.inference_mode():
        states = model(torch.tensor([prompt])).last_hidden_state[0].double()
    vec = states[-1] if pooling == "last" else states.mean(0)
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


def vector(steps) -> torch.Tensor:
    (final,) = steps
    assert final.is_final and final.error is None and final.token_ids == []
    return torch.tensor(final.embedding, dtype=torch.float64)


@pytest.fixture(scope="module", params=[("llama", True), ("qwen2", False)], ids=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    arch, tied = request.param
    return make_tiny_model(tmp_path_factory.mktemp(arch), arch, tied=tied)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_alone_equals_transformers_float32(checkpoint, pooling):
    """Each pooling, normalized or not; a prompt longer than one step's budget (chunked prefill: the mean sums over
    chunks), a one-token prompt, and a prompt whose prefix is cached (last: served from the cache; mean: not)."""
    hf = transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    engine = Engine.from_dir(checkpoint, EngineConfig(dtype="float32", kv_cache_tokens=2048, max_num_tokens=32,
                                                      block_size=8))
    try:
        for prompt in ([5, 17, 99, 3, 250, 7], list(range(10, 110)), [42], list(range(10, 90)) + [7, 8, 9]):
            for normalize in (False, True):
                _, steps = run_all(engine, [embed_request(prompt, pooling, normalize)])
                (got,) = steps.values()
                expected = hf_embedding(hf, prompt, pooling, normalize)
                assert vector(got).shape == expected.shape
                torch.testing.assert_close(vector(got), expected, rtol=0, atol=TOLERANCE)
                cached = got[-1].num_cached_prompt_tokens
                if pooling == "mean":
                    assert cached == 0  # every token's state is needed: nothing from the cache
                elif prompt[:80] == list(range(10, 90)) and len(prompt) == 83:
                    assert cached == 80  # the leading blocks of range(10, 110) were cached
                assert engine.block_manager.num_used_blocks == 0  # its blocks were freed at once
        assert engine.stats().num_running == 0
    finally:
        engine.shutdown()


def test_batched_beside_generation_float64(checkpoint):
    """Embeddings of both poolings and generation requests in the same steps (small token budget: chunked prefills
    next to decodes, a shared prefix in the cache): the vectors equal transformers', and the generated tokens equal
    those of the same generation requests run without the embeddings (and transformers' greedy ones). float64 on
    both sides, so that batching cannot flip an argmax through rounding alone."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(4, 90))] for _ in range(6)]
    prompts[1] = prompts[0][:40] + prompts[1][:10]  # shares blocks with the first
    hf_lm = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    config = EngineConfig(dtype="float64", kv_cache_tokens=4096, max_num_tokens=48, max_batch_size=16, block_size=8)
    gens = [greedy_request(p, max_new_tokens=24) for p in prompts[:3]]
    embeds = [embed_request(p, pooling, normalize)
              for p, (pooling, normalize) in zip(prompts, [("last", True), ("mean", False), ("mean", True),
                                                          ("last", False), ("mean", True), ("last", True)])]

    def generated(requests):
        engine = Engine.from_dir(checkpoint, config)
        try:
            ids, steps = run_all(engine, requests)
            assert engine.block_manager.num_used_blocks == 0
            return ids, steps
        finally:
            engine.shutdown()

    alone_ids, alone = generated(gens)
    mixed = [embeds[0], gens[0], embeds[1], embeds[2], gens[1], embeds[3], gens[2], embeds[4], embeds[5]]
    mixed_ids, beside = generated(mixed)
    gen_ids = [i for i, r in zip(mixed_ids, mixed) if r.embed is None]
    for k, (a, b) in enumerate(zip(alone_ids, gen_ids)):
        assert tokens(beside[(b, 0)]) == tokens(alone[(a, 0)]), f"generation {k} changed beside embeddings"
        with torch.inference_mode():
            ids = torch.tensor([prompts[k]])
            expected = hf_lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                                      do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompts[k]):]
        assert tokens(beside[(b, 0)]) == expected.tolist()
    hf = hf_lm.model
    for i, r in zip(mixed_ids, mixed):
        if r.embed is not None:
            expected = hf_embedding(hf, list(r.prompt_token_ids), r.embed.pooling, r.embed.normalize)
            torch.testing.assert_close(vector(beside[(i, 0)]), expected, rtol=0, atol=TOLERANCE)


def test_preempted_embedding_pools_again_from_its_recompute(checkpoint):
    """An embedding preempted after its first prefill chunk (its blocks freed, its tokens to recompute) drops what it
    had pooled: its vector still equals transformers'. The engine is stepped by hand (not started), so the
    preemption falls exactly there."""
    hf = transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float64).eval()
    prompt = list(range(20, 120))
    for pooling in ("mean", "last"):
        engine = Engine(checkpoint, EngineConfig(dtype="float64", kv_cache_tokens=1024, max_num_tokens=32,
                                                 block_size=8), start=False)
        try:
            request_id = engine.enqueue(embed_request(prompt, pooling, True))
            engine.apply()
            engine.step()  # the first 32 tokens
            (seq,) = engine.scheduler.running
            assert seq.num_computed_tokens == 32 and (seq.pooled is not None) == (pooling == "mean")
            engine.scheduler.preempt(seq)
            while engine.scheduler.has_work():
                engine.step()
            (final,) = engine.await_responses(0)
            assert final.executor_id == request_id
            torch.testing.assert_close(vector([final]), hf_embedding(hf, prompt, pooling, True), rtol=0,
                                       atol=TOLERANCE)
            assert engine.block_manager.num_used_blocks == 0
        finally:
            engine.shutdown()


def test_flush_cache_drops_unused_blocks_and_keeps_those_in_use(checkpoint):
    """flush_cache() runs on the engine thread: the finished request's cached blocks go (one "removed" event naming
    them, their count returned); a running request's blocks stay cached and it finishes unchanged."""
    engine = Engine.from_dir(checkpoint, EngineConfig(dtype="float32", kv_cache_tokens=2048, block_size=8))
    seen = []
    sub = engine.kv_events.subscribe(lambda: None)
    try:
        first = list(range(10, 50))  # 40 tokens: 5 full blocks cached once it ran
        run_all(engine, [greedy_request(first, max_new_tokens=1)])
        cached = engine.stats().kv_blocks_cached
        assert cached >= 5
        long_running = engine.enqueue(greedy_request(list(range(100, 140)), max_new_tokens=400))
        while engine.stats().num_running == 0 or engine.block_manager.num_used_blocks < 5:
            engine.await_responses(0.05)
        in_use = {engine.block_manager.blocks[b].hash for s in engine.scheduler.running for b in s.block_table
                  if engine.block_manager.blocks[b].hash is not None}
        dropped = engine.flush_cache()
        assert dropped == cached  # exactly the first request's blocks: every other cached one is in use
        assert engine.flush_cache() == 0
        assert in_use <= set(engine.block_manager.cached)  # the running request's blocks are still cached
        seen += [e for batch in sub.pop_all() for e in batch.events if isinstance(e, BlocksRemoved)]
        assert sum(len(e.block_hashes) for e in seen) == dropped
        assert not in_use & {h for e in seen for h in e.block_hashes}
        engine.cancel(long_running)
        (again_id,), again = run_all(engine, [greedy_request(first, max_new_tokens=1)])
        assert again[(again_id, 0)][0].num_cached_prompt_tokens == 0  # its blocks were dropped: computed again
    finally:
        engine.kv_events.unsubscribe(sub)
        engine.shutdown()
