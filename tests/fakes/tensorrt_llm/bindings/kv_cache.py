"""Fake `tensorrt_llm.bindings.executor.kv_cache`: KV-cache events as the C++ executor hands them out.

Shapes after NVIDIA/TensorRT-LLM tensorrt_llm/bindings/executor.pyi (`KVCacheEvent.event_id / data / window_size`;
`KVCacheCreatedData.num_blocks_per_cache_level`; `KVCacheStoredData.parent_hash / blocks`;
`KVCacheStoredBlockData.block_hash / tokens / lora_id / cache_level / priority`; `UniqueToken.token_id /
token_extra_id`; `KVCacheRemovedData.block_hashes`) and `KVCacheEventManager.get_latest_events(timeout_ms=None)`
(tests/bindings/test_executor_bindings.py: the first event is `KVCacheCreatedData` with event id 0). Also the dict
form the LLM API returns (`KVCacheEventSerializer`, tensorrt_llm/_utils.py). Hashes are unsigned 64-bit (size_t).

`FakeKvCache` is the bookkeeping both fakes share: full blocks of each submitted prompt are stored (chained), and
beyond `capacity` stored blocks the oldest are removed.
"""

from __future__ import annotations

import hashlib
import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class UniqueToken:
    token_id: int
    token_extra_id: int = 0


@dataclass
class KVCacheStoredBlockData:
    block_hash: int
    tokens: list[UniqueToken]
    lora_id: int | None = None
    cache_level: int = 0
    priority: int = 35


@dataclass
class KVCacheStoredData:
    parent_hash: int | None
    blocks: list[KVCacheStoredBlockData]


@dataclass
class KVCacheRemovedData:
    block_hashes: list[int]


@dataclass
class KVCacheCreatedData:
    num_blocks_per_cache_level: list[int]


@dataclass
class KVCacheUpdatedData:
    block_hash: int
    cache_level: object = None
    priority: object = None


@dataclass
class KVCacheEvent:
    event_id: int
    data: object
    window_size: int = 4096


def to_dict(event: KVCacheEvent) -> dict:
    """KVCacheEventSerializer.serialize's format (what LLM.get_kv_cache_events[_async] yields)."""
    d = event.data
    if isinstance(d, KVCacheStoredData):
        data = {"type": "stored", "parent_hash": d.parent_hash, "blocks": [
            {"type": "stored_block", "block_hash": b.block_hash, "cache_level": b.cache_level, "priority": b.priority,
             "tokens": [{"type": "unique_token", "token_id": t.token_id, "token_extra_id": t.token_extra_id}
                        for t in b.tokens]} for b in d.blocks]}
    elif isinstance(d, KVCacheRemovedData):
        data = {"type": "removed", "block_hashes": list(d.block_hashes)}
    elif isinstance(d, KVCacheCreatedData):
        data = {"type": "created", "num_blocks_per_cache_level": list(d.num_blocks_per_cache_level)}
    else:
        data = {"type": "updated", "block_hash": d.block_hash, "cache_level": None, "priority": None}
    return {"event_id": event.event_id, "data": data, "window_size": event.window_size}


def uhash(parent: int | None, tokens: list[int]) -> int:
    """An unsigned 64-bit hash, like TensorRT-LLM's size_t block hashes (most have the top bit set half the time)."""
    digest = hashlib.sha256(repr((parent, tokens)).encode()).digest()
    return int.from_bytes(digest[:8], "little")


@dataclass
class FakeKvCache:
    """Stores each prompt's full blocks (once), evicts the oldest beyond `capacity`; buffers events (bounded)."""

    tokens_per_block: int
    buffer_size: int
    capacity: int = 6
    events: deque = field(default_factory=deque)
    stored: deque = field(default_factory=deque)
    _ids: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        self.events = deque(maxlen=self.buffer_size)
        self._emit(KVCacheCreatedData([1000, 0]))

    def _emit(self, data) -> None:
        self.events.append(KVCacheEvent(self._ids, data))
        self._ids += 1

    def on_prompt(self, prompt: list[int]) -> None:
        with self._lock:
            parent, new, first_parent = None, [], None
            for start in range(0, len(prompt) - self.tokens_per_block + 1, self.tokens_per_block):
                tokens = list(prompt[start:start + self.tokens_per_block])
                h = uhash(parent, tokens)
                if h not in self.stored:
                    if not new:
                        first_parent = parent
                    new.append(KVCacheStoredBlockData(h, [UniqueToken(t) for t in tokens]))
                    self.stored.append(h)
                parent = h
            if new:
                self._emit(KVCacheStoredData(first_parent, new))
            gone = []
            while len(self.stored) > self.capacity:
                gone.append(self.stored.popleft())
            if gone:
                self._emit(KVCacheRemovedData(gone))

    def take(self) -> list[KVCacheEvent]:
        with self._lock:
            out = list(self.events)
            self.events.clear()
            return out


class KVCacheEventManager:
    """Fake `KVCacheEventManager`: `get_latest_events(timeout_ms=None)` drains the buffered events."""

    def __init__(self, cache: FakeKvCache):
        self._cache = cache

    def get_latest_events(self, timeout_ms: float | None = None) -> list[KVCacheEvent]:
        return self._cache.take()
