"""The engine's prefix cache end to end with a tiny model: a hit changes no token, usage counts it, events say it.

Greedy float32 output of a request served partly from the cache equals the same request without caching and
transformers' generate(); `num_cached_prompt_tokens` and the stats report the hit; the KV events name exactly the
full blocks computed, chained by parent hash.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
import torch
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tests.conftest import run
from tests.engine_helpers import greedy_request, run_all, tokens
from tests.integration.service_harness import serving
from tests.tiny_model import make_tiny_model
from tokenloop.core.kv_events import BlocksStored, CacheCleared
from tokenloop.engine import runner as runner_module
from tokenloop.engine.block_manager import block_hash
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.v1 import tokenloop_pb2 as pb

transformers = pytest.importorskip("transformers")
BLOCK = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama", tied=True)


def engine(checkpoint, caching: bool) -> Engine:
    return Engine.from_dir(checkpoint, EngineConfig(dtype="float32", kv_cache_tokens=4096, block_size=BLOCK,
                                                    enable_prefix_caching=caching))


def test_a_cache_hit_changes_no_token_and_is_reported(checkpoint):
    rng = random.Random(3)
    system = [rng.randrange(3, 250) for _ in range(45)]  # 5 full blocks and a partial one
    first, second = system + [11, 12, 13], system + [21, 22, 23, 24]
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([second])
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                               do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(second):].tolist()
    plain = engine(checkpoint, caching=False)
    try:
        _, steps = run_all(plain, [greedy_request(second, 24)])
        (without,) = steps.values()
        assert without[0].num_cached_prompt_tokens == 0
    finally:
        plain.shutdown()
    cached = engine(checkpoint, caching=True)
    seen = []
    sub = cached.kv_events.subscribe(lambda: None)
    try:
        run_all(cached, [greedy_request(first, 24)])
        _, steps = run_all(cached, [greedy_request(second, 24)])
        (hit,) = steps.values()
        seen = sub.pop_all()
        stats = cached.stats()
    finally:
        cached.shutdown()
    assert tokens(hit) == tokens(without) == expected
    assert hit[0].num_cached_prompt_tokens == 40  # 5 full blocks of the shared 45 tokens; the tail is not shared
    assert stats.kv_blocks_cached > 0 and stats.num_prefix_cache_hit_tokens == 40
    assert stats.prefix_cache_hit_rate == pytest.approx(40 / (len(first) + len(second)))
    stored = [b for batch in seen for e in batch.events if isinstance(e, BlocksStored) for b in e.blocks]
    assert [b.token_ids for b in stored[:5]] == [tuple(system[i:i + BLOCK]) for i in range(0, 40, BLOCK)]
    parent = None
    for b in stored[:5]:  # one chain from the first block on, hashes any consumer can recompute
        assert b.block_hash == block_hash(parent, b.token_ids)
        parent = b.block_hash
    first = cached.kv_events.first_sequence_number  # the engine's start in microseconds: unique across restarts
    assert [batch.sequence_number for batch in seen] == list(range(first, first + len(seen)))
    assert seen[0].events == (CacheCleared(),)  # the first batch: a fresh cache, replayed to a subscriber from 0


def test_equal_tails_over_one_cached_prefix_run_as_one_group_and_match_transformers(checkpoint):
    """Tails of the same length over the same cached context share one attention group (runner.prepare); float64
    on both sides, so batching cannot flip an argmax through rounding alone."""
    rng = random.Random(5)
    system = [rng.randrange(3, 250) for _ in range(32)]
    prompts = [system + [rng.randrange(3, 250) for _ in range(12)] for _ in range(4)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    expected = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            expected.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist())
    eng = Engine.from_dir(checkpoint, EngineConfig(dtype="float64", kv_cache_tokens=4096, block_size=BLOCK))
    seen_groups = []
    real_prepare = runner_module.prepare

    def spy(scheduled, block_size, **options):
        batch, samplers = real_prepare(scheduled, block_size, **options)
        seen_groups.append([g.num_seqs for g in batch.groups if g.max_q > 1])
        return batch, samplers

    runner_module.prepare = spy
    try:
        run_all(eng, [greedy_request(system + [7], 2)])  # the system prompt's 4 blocks are now cached
        ids, steps = run_all(eng, [greedy_request(p, 16) for p in prompts])
    finally:
        runner_module.prepare = real_prepare
        eng.shutdown()
    assert [tokens(steps[(i, 0)]) for i in ids] == expected
    assert [4] in seen_groups  # the four 12-token tails over 32 cached tokens: one group


def test_both_apis_report_the_hit_and_the_router_stream_shows_the_blocks(checkpoint):
    prompt = list(range(20, 61))  # 41 tokens: 5 full blocks of 8 and one more
    ids_v1 = pb.TokenIds(ids=prompt)

    async def body():
        async with serving(checkpoint, engine(checkpoint, caching=True)) as (server, stub, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                router = tpb_grpc.TrtllmServiceStub(channel)
                events = router.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
                request = pb.GenerateRequest(token_ids=ids_v1, stopping=pb.StoppingCriteria(max_new_tokens=3))
                first = [m async for m in stub.Generate(request)][-1].complete
                second = [m async for m in stub.Generate(request)][-1].complete
                assert (first.usage.cached_prompt_tokens, second.usage.cached_prompt_tokens) == (0, 40)
                out = [m async for m in router.Generate(tpb.GenerateRequest(
                    tokenized=tpb.TokenizedInput(input_token_ids=prompt), max_tokens=3))]
                assert out[-1].complete.cached_tokens == 40 and out[-1].complete.prompt_tokens == 41
                streamed = [m async for m in router.Generate(tpb.GenerateRequest(
                    tokenized=tpb.TokenizedInput(input_token_ids=prompt), max_tokens=3, streaming=True))]
                chunks = [m.chunk for m in streamed if m.HasField("chunk")]
                assert chunks and all(c.cached_tokens == 40 and c.prompt_tokens == 41 for c in chunks)
                assert streamed[-1].complete.cached_tokens == 40
                cleared = await asyncio.wait_for(events.read(), 10)  # from 0: the engine's first batch, replayed
                assert [e.WhichOneof("data") for e in cleared.events] == ["cleared"]
                stored = []
                while len(stored) < 5:
                    batch = await asyncio.wait_for(events.read(), 10)
                    stored += [b for e in batch.events if e.HasField("stored") for b in e.stored.blocks]
                assert [list(b.token_ids) for b in stored[:5]] == [prompt[i:i + BLOCK] for i in range(0, 40, BLOCK)]
                assert all(b.block_size == BLOCK for b in stored)
                events.cancel()
                load = await stub.GetLoad(pb.GetLoadRequest())
                assert load.kv_blocks_cached >= 5 and load.prefix_cache_hit_rate == pytest.approx(120 / 164)  # 4 requests, 3 hits
    run(body())
