"""TensorRT-LLM's own KV-cache events, passed through to `SubscribeKvEvents` (core/kv_events.py).

TensorRT-LLM records block reuse events when `KvCacheConfig(event_buffer_max_size=N)` is > 0 (with
`enable_block_reuse`, its default). The adapters read them from:

- the C++ executor: `Executor.get_kv_cache_event_manager()` -> `KVCacheEventManager` (None when events are off),
  whose `get_latest_events(timeout_ms)` returns `KVCacheEvent` objects (`event_id`, `data`, `window_size`);
  `data` is `KVCacheCreatedData(num_blocks_per_cache_level)`, `KVCacheStoredData(parent_hash, blocks)` with
  `KVCacheStoredBlockData(block_hash, tokens: [UniqueToken(token_id, token_extra_id)], lora_id, cache_level,
  priority)`, `KVCacheRemovedData(block_hashes)` or `KVCacheUpdatedData` (tensorrt_llm/bindings/executor.pyi);
- the LLM API: `LLM.get_kv_cache_events(timeout)` -> the same events as dicts, `KVCacheEventSerializer`'s format
  (tensorrt_llm/_utils.py): {"event_id", "data": {"type": "created" | "stored" | "removed" | "updated", ...},
  "window_size"}, stored blocks as {"type": "stored_block", "block_hash", "tokens": [{"type": "unique_token",
  "token_id", "token_extra_id"}], "cache_level", "priority"}.

TensorRT-LLM's hashes are unsigned 64-bit (`size_t`); SMG's `KvBlock.block_hash` is int64, so they are mapped
two's-complement. `created` (a fresh cache) becomes CacheCleared; `updated` (a block moved between cache
levels or changed priority) changes nothing a prefix index holds and is dropped.
"""

from __future__ import annotations

from tokenloop.core.kv_events import BlocksRemoved, BlocksStored, CacheCleared, KvEvent, StoredBlock


def signed64(value: int) -> int:
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _field(obj, name: str):
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _kind(data) -> str:
    if isinstance(data, dict):
        return str(data.get("type", ""))
    name = type(data).__name__  # KVCacheStoredData -> stored
    return name.removeprefix("KVCache").removesuffix("Data").lower()


def _token_id(token) -> int:
    return int(_field(token, "token_id"))


def convert(events) -> list[KvEvent]:
    """TensorRT-LLM events (binding objects or the LLM API's dicts), in order, as ours."""
    out: list[KvEvent] = []
    for event in events or ():
        data = _field(event, "data")
        kind = _kind(data)
        if kind == "stored":
            blocks = tuple(StoredBlock(signed64(int(_field(b, "block_hash"))),
                                       tuple(_token_id(t) for t in _field(b, "tokens")))
                           for b in _field(data, "blocks"))
            if not blocks:
                continue
            parent = _field(data, "parent_hash")
            out.append(BlocksStored(blocks, None if parent is None else signed64(int(parent)),
                                    len(blocks[0].token_ids)))
        elif kind == "removed":
            hashes = tuple(signed64(int(h)) for h in _field(data, "block_hashes"))
            if hashes:
                out.append(BlocksRemoved(hashes))
        elif kind == "created":
            out.append(CacheCleared())
    return out
