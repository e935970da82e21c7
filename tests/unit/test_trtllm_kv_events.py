"""TensorRT-LLM's KV-cache events passed through: the converter, and both adapters on the fake tensorrt_llm.

The fakes hand out events in the real shapes (tests/fakes/tensorrt_llm/bindings/kv_cache.py cites them): binding
objects from the C++ executor's `KVCacheEventManager.get_latest_events`, `KVCacheEventSerializer` dicts from
`LLM.get_kv_cache_events_async`. A real GPU run is `make gpu-smoke` (docs/trtllm.md).
"""

from __future__ import annotations

import time

import pytest

from tests.fakes import scenarios
from tests.fakes.fixtures import fake_trtllm, make_engine_dir
from tests.fakes.tensorrt_llm.bindings import kv_cache as fk
from tokenloop.core.kv_events import BlocksRemoved, BlocksStored, CacheCleared
from tokenloop.trtllm import TrtllmConfig, create_trtllm_executor
from tokenloop.trtllm.kv_events import convert, signed64

BIG = (1 << 64) - 5  # a size_t hash with the top bit set


def test_binding_objects_and_serialized_dicts_convert_alike():
    events = [
        fk.KVCacheEvent(0, fk.KVCacheCreatedData([100, 0])),
        fk.KVCacheEvent(1, fk.KVCacheStoredData(None, [fk.KVCacheStoredBlockData(BIG, [fk.UniqueToken(t) for t in
                                                                                    (1, 2, 3, 4)])])),
        fk.KVCacheEvent(2, fk.KVCacheStoredData(BIG, [fk.KVCacheStoredBlockData(7, [fk.UniqueToken(5)] * 4)])),
        fk.KVCacheEvent(3, fk.KVCacheUpdatedData(7)),
        fk.KVCacheEvent(4, fk.KVCacheRemovedData([BIG, 7])),
    ]
    ours = convert(events)
    assert ours == convert([fk.to_dict(e) for e in events])
    cleared, first, second, removed = ours  # `updated` changes nothing a prefix index holds
    assert isinstance(cleared, CacheCleared)
    assert isinstance(first, BlocksStored) and first.parent_hash is None and first.block_size == 4
    assert first.blocks[0].block_hash == -5 == signed64(BIG) and first.blocks[0].token_ids == (1, 2, 3, 4)
    assert second.parent_hash == -5 and second.blocks[0].token_ids == (5, 5, 5, 5)
    assert isinstance(removed, BlocksRemoved) and removed.block_hashes == (-5, 7)


def stored_tokens(hub_sub) -> list[tuple[int, ...]]:
    return [b.token_ids for batch in hub_sub.pop_all() for e in batch.events if isinstance(e, BlocksStored)
            for b in e.blocks]


def test_executor_adapter_passes_the_event_manager_events_on(tokenizer_dir, tmp_path):
    with fake_trtllm() as fake:
        executor = create_trtllm_executor(str(make_engine_dir(tmp_path / "engine", tokenizer_dir)))
        engine = fake.bindings.executor.Executor.instances[-1]
        assert engine.config.kv_cache_config.event_buffer_max_size == 1024
        sub = executor.kv_events.subscribe(lambda: None)
        prompt = tuple(range(10, 80))  # two full blocks of 32 and a partial one
        executor.enqueue(scenarios.request(prompt=prompt, max_new=2))
        for _ in range(50):
            executor.await_responses(0.01)
        assert stored_tokens(sub) == [prompt[:32], prompt[32:64]]
        executor.shutdown()


def test_llm_adapter_passes_the_llm_events_on(tokenizer_dir):
    with fake_trtllm() as fake:
        executor = create_trtllm_executor(str(tokenizer_dir))
        try:
            assert fake.LLM.instances[-1].args["kv_cache_config"].event_buffer_max_size == 1024
            sub = executor.kv_events.subscribe(lambda: None)
            prompts = [tuple(range(1, 140)), tuple(range(200, 270)), tuple(range(1, 70))]
            for p in prompts:
                executor.enqueue(scenarios.request(prompt=p, max_new=2))
            seen: list[tuple[int, ...]] = []
            deadline = time.monotonic() + 10
            while len(seen) < 3 and time.monotonic() < deadline:
                executor.await_responses(0.05)
                seen += stored_tokens(sub)
            assert seen == [prompts[0][:64], prompts[0][64:128], prompts[1][:64]]  # the third prompt was cached
        finally:
            executor.shutdown()


@pytest.mark.parametrize("options", [{"kv_event_buffer_max_size": 0}, {"enable_block_reuse": False}])
def test_events_off_means_no_event_stream(tokenizer_dir, options):
    with fake_trtllm() as fake:
        executor = create_trtllm_executor(str(tokenizer_dir), TrtllmConfig(**options))
        try:
            assert executor.kv_events is None
            assert "event_buffer_max_size" not in vars(fake.LLM.instances[-1].args["kv_cache_config"]) or \
                fake.LLM.instances[-1].args["kv_cache_config"].event_buffer_max_size == 0
        finally:
            executor.shutdown()


def test_negative_buffer_size_is_refused():
    with pytest.raises(ValueError, match="kv-event-buffer-max-size"):
        TrtllmConfig(kv_event_buffer_max_size=-1)
