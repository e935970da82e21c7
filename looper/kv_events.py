"""KV-cache events: what an executor's prefix cache stored and removed, for routers that route by prefix.

Executor-neutral (the embedded engine and the TensorRT-LLM adapters both publish here); the service turns
them into `smg.grpc.common.KvEventBatch` messages. The shapes follow vLLM's `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` (vllm/distributed/kv_events.py) and TensorRT-LLM's `KVCacheStoredData` /
`KVCacheRemovedData`, which SMG's `SubscribeKvEvents` relays.

`KvEventHub` numbers batches (1, 2, ...), keeps a bounded history for subscribers that resume from a
sequence number, and gives each subscriber a bounded queue: a subscriber that falls `max_queued` batches
behind is cut off (it may resubscribe from its last sequence number); the publisher never waits.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_HISTORY = 1024  # batches kept for resuming subscribers
DEFAULT_MAX_QUEUED = 2048  # batches one subscriber may fall behind before it is cut off (> DEFAULT_HISTORY: a replay fits)


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One full block newly registered in the prefix cache."""

    block_hash: int  # signed 64-bit
    token_ids: tuple[int, ...]
    extra_key: str | None = None  # what besides tokens went into the hash (a LoRA adapter name)


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Consecutive blocks of one sequence; the first one's parent is `parent_hash` (None: a first block)."""

    blocks: tuple[StoredBlock, ...]
    parent_hash: int | None
    block_size: int


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    """Blocks evicted from the prefix cache (their slots were reused)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """Every cached block is gone (a reset, or a fresh start)."""


KvEvent = BlocksStored | BlocksRemoved | CacheCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of one engine step, numbered."""

    sequence_number: int
    timestamp: float
    events: tuple[KvEvent, ...]


@dataclass(eq=False)
class Subscription:
    """One subscriber's queue. `notify` is called (from the publishing thread) after each append."""

    notify: Callable[[], None]
    max_queued: int
    queue: collections.deque[EventBatch] = field(default_factory=collections.deque)
    cut_off: bool = False

    def pop_all(self) -> list[EventBatch]:
        out = []
        while self.queue:
            out.append(self.queue.popleft())
        return out


class KvEventHub:
    """Numbered batches, a bounded history, bounded per-subscriber queues. Thread-safe."""

    def __init__(self, history: int = DEFAULT_HISTORY, max_queued: int = DEFAULT_MAX_QUEUED):
        self._lock = threading.Lock()
        self._history: collections.deque[EventBatch] = collections.deque(maxlen=history)
        self._subs: list[Subscription] = []
        self.max_queued = max_queued
        self.last_sequence_number = 0
        self.num_cut_off = 0

    def publish(self, events: list[KvEvent]) -> EventBatch | None:
        """Number `events` as the next batch and hand it to every subscriber; never blocks on one."""
        if not events:
            return None
        with self._lock:
            self.last_sequence_number += 1
            batch = EventBatch(self.last_sequence_number, time.time(), tuple(events))
            self._history.append(batch)
            subs = list(self._subs)
            for sub in subs:
                if sub.cut_off:
                    continue
                if len(sub.queue) >= sub.max_queued:
                    sub.cut_off = True
                    sub.queue.clear()  # a dead subscriber must not hold memory
                    self.num_cut_off += 1
                else:
                    sub.queue.append(batch)
        for sub in subs:
            try:
                sub.notify()
            except Exception:  # e.g. its event loop closed at shutdown: never the publisher's (engine's) problem
                self.unsubscribe(sub)
        return batch

    def subscribe(self, notify: Callable[[], None], start_sequence_number: int = 0) -> Subscription:
        """A new subscription. `start_sequence_number` > 0 replays kept batches numbered from it on;
        0 starts with the next batch."""
        sub = Subscription(notify, self.max_queued)
        with self._lock:
            if start_sequence_number > 0:
                sub.queue.extend(b for b in self._history if b.sequence_number >= start_sequence_number)
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
            sub.queue.clear()

    @property
    def num_subscribers(self) -> int:
        with self._lock:
            return len(self._subs)

    @property
    def oldest_kept(self) -> int:
        """The smallest sequence number a resuming subscriber can still get (0: none kept)."""
        with self._lock:
            return self._history[0].sequence_number if self._history else 0
