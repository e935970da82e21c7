"""KV-cache events: what an executor's prefix cache stored and removed, for routers that route by prefix.

Executor-neutral (the embedded engine and the TensorRT-LLM adapters both publish here); the service turns
them into `smg.grpc.common.KvEventBatch` messages. The shapes follow vLLM's `BlockStored` / `BlockRemoved` /
`AllBlocksCleared` (vllm/distributed/kv_events.py) and TensorRT-LLM's `KVCacheStoredData` /
`KVCacheRemovedData`, which SMG's `SubscribeKvEvents` relays.

`KvEventHub` numbers batches, keeps a bounded history for subscribers that resume, and gives each subscriber a
bounded queue: a subscriber that falls `max_queued` batches behind is cut off; the publisher never waits.
Resuming follows the Shepherd Model Gateway's servicers (smg crates/engine_servicer/src/kv_events.rs):

- `start_sequence_number` is the last batch the subscriber applied; it gets the kept batches after it, then live
  ones. A number outside the history (older than the oldest kept, or past the newest: another life of the
  worker) raises `ResumeOutOfRange`, which the service answers with OUT_OF_RANGE: the subscriber drops what it
  knew of this cache and subscribes from 0.
- 0 means no cursor: the whole history when it still holds the first batch (the executor's whole state: the
  embedded engine's first batch is a `CacheCleared`, TensorRT-LLM's `created` becomes one), else live only.
- Numbering starts at the hub's creation time in microseconds, not at 1, so a restarted worker never reuses the
  numbers of its previous life: a router's cursor from before a restart is always outside the new history.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_HISTORY = 1024  # batches kept for resuming subscribers
DEFAULT_MAX_QUEUED = 2048  # batches one subscriber may fall behind before it is cut off (> DEFAULT_HISTORY: a replay fits)


def lora_cache_key(name: str, digest: str) -> str:
    """The extra key of a LoRA adapter's blocks (in their hashes and `StoredBlock.extra_key`): its name and the digest
    of its files, the same on every worker that loads the same files. `lora_of_cache_key` reads the name back."""
    return f"lora:{name}:{digest}"


def lora_of_cache_key(key: str | None) -> str:
    """The adapter name in a `lora_cache_key` ("" for any other key, or none)."""
    if key is None or not key.startswith("lora:"):
        return ""
    return key[len("lora:"):].rpartition(":")[0]


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
    first_event_id: int = 0  # events are numbered across batches: this batch's i-th is first_event_id + i


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


class ResumeOutOfRange(ValueError):
    """A subscriber's `start_sequence_number` is not in the history: its view of this cache is stale."""

    def __init__(self, start: int, oldest: int, last: int):
        kept = f"{oldest}..{last}" if oldest <= last else f"none; the last batch was {last}"
        super().__init__(f"start_sequence_number {start} is not in this worker's KV-event history (kept: {kept}); "
                         "it is from before a restart or too old: drop what you know of this worker's cache "
                         "and subscribe from 0")
        self.start, self.oldest, self.last = start, oldest, last


class KvEventHub:
    """Numbered batches, a bounded history, bounded per-subscriber queues. Thread-safe."""

    def __init__(self, history: int = DEFAULT_HISTORY, max_queued: int = DEFAULT_MAX_QUEUED,
                 first_sequence_number: int | None = None):
        self._lock = threading.Lock()
        self._history: collections.deque[EventBatch] = collections.deque(maxlen=history)
        self._subs: list[Subscription] = []
        if first_sequence_number is not None and first_sequence_number < 1:
            raise ValueError(f"first_sequence_number must be >= 1 (0 means no cursor); got {first_sequence_number}")
        self.max_queued = max_queued
        # unique across restarts (see the module docstring); tests pass 1
        self.first_sequence_number = time.time_ns() // 1000 if first_sequence_number is None else first_sequence_number
        self.last_sequence_number = self.first_sequence_number - 1  # none published yet
        self._num_events = 0
        self.num_cut_off = 0

    def publish(self, events: list[KvEvent]) -> EventBatch | None:
        """Number `events` as the next batch and hand it to every subscriber; never blocks on one."""
        if not events:
            return None
        with self._lock:
            self.last_sequence_number += 1
            batch = EventBatch(self.last_sequence_number, time.time(), tuple(events), self._num_events + 1)
            self._num_events += len(events)
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
        """A new subscription, its queue filled with the replay `start_sequence_number` asks for (module
        docstring); raises `ResumeOutOfRange` for a number outside the history."""
        sub = Subscription(notify, self.max_queued)
        with self._lock:
            sub.queue.extend(self._replay(start_sequence_number))
            self._subs.append(sub)
        return sub

    def _replay(self, start: int) -> list[EventBatch]:
        kept = list(self._history)
        if start == 0:  # no cursor: everything, if everything is still here
            return kept if kept and kept[0].sequence_number == self.first_sequence_number else []
        oldest = kept[0].sequence_number if kept else self.last_sequence_number + 1
        if not oldest - 1 <= start <= self.last_sequence_number:
            raise ResumeOutOfRange(start, oldest, self.last_sequence_number)
        return [b for b in kept if b.sequence_number > start]

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
        """The oldest batch kept for resuming subscribers (0: none kept)."""
        with self._lock:
            return self._history[0].sequence_number if self._history else 0
