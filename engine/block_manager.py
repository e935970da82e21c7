"""KV-cache block bookkeeping in plain Python (no tensors), with prefix caching of full blocks (vLLM's model).

A block holds `block_size` consecutive tokens of one sequence. A full block is registered under a
stable hash of its tokens chained with the previous block's hash (and an optional extra key, such as a
LoRA adapter's name), so a later sequence whose prompt starts with the same tokens reuses it
(reference-counted). A partial tail block is never shared. Freed blocks keep their hash and stay in the
cache; free blocks that hold nothing cached are reused first, then cached ones least recently used first,
so a cached block is evicted only when the pool needs its slots. Every change to the cache is recorded as a KV event (stored / removed / cleared) for routers.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

from tokenloop.core.kv_events import BlocksRemoved, BlocksStored, CacheCleared, KvEvent, StoredBlock

from .sequence import Sequence


@dataclass(slots=True)
class Block:
    """One block of cache slots."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def block_hash(parent: int | None, token_ids: tuple[int, ...], extra: str | None = None) -> int:
    """Stable across processes and restarts (unlike `hash()`): blake2b of parent, extra key and tokens,
    as a signed 64-bit integer (the `int64 block_hash` of SMG's KvBlock)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"-" if parent is None else struct.pack("<q", parent))
    if extra is not None:
        h.update(b"x" + extra.encode() + b"\0")
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return struct.unpack("<q", h.digest())[0]


class BlockManager:
    """Allocates blocks to sequences; `num_blocks` blocks of `block_size` slots each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks, two ordered sets: never-cached ones are taken first, then cached ones least recently used
        self.free_empty: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.free_cached: dict[int, None] = {}
        self.cached: dict[int, int] = {}  # hash -> block id
        self.events: list[KvEvent] = []  # since the last take_events()
        self.num_query_tokens = 0  # prompt tokens looked up in the cache (first admissions)
        self.num_hit_tokens = 0  # of those, tokens served from the cache
        self.num_evictions = 0  # cached blocks whose slots were reused

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_empty) + len(self.free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a reusable prefix, in use or evictable."""
        return len(self.cached)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events

    def _take_free(self) -> int:
        free = self.free_empty or self.free_cached
        block_id = next(iter(free))
        del free[block_id]
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]  # evict: its contents are about to be overwritten
            self.num_evictions += 1
            self._event_removed(block.hash)
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    def _event_removed(self, h: int) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlocksRemoved):  # one event per run of evictions
            self.events[-1] = BlocksRemoved(last.block_hashes + (h,))
        else:
            self.events.append(BlocksRemoved((h,)))

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_cached[block_id]
        block.ref_count += 1

    def allocate_prefix(self, seq: Sequence) -> int:
        """For a sequence with no blocks yet: reuse cached blocks of its leading full blocks.

        Sets `num_computed_tokens` to the tokens found and returns it. The last token is never taken
        from the cache, so the sequence always computes at least one token (its logits).
        """
        if seq.block_table:
            raise ValueError("allocate_prefix needs a sequence without blocks")
        if not self.enable_prefix_caching or not seq.reuses_prefix:
            return 0
        prev = None
        for start in range(0, len(seq) - 1 - self.block_size + 1, self.block_size):
            tokens = tuple(seq.token_ids[start:start + self.block_size])
            h = block_hash(prev, tokens, seq.cache_key)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._ref(block_id)
            seq.block_table.append(block_id)
            prev = h
        seq.num_cached_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens

    def record_admission(self, seq: Sequence) -> None:
        """Count a sequence's first admission for the hit rate, and remember its cached prompt tokens."""
        if seq.num_cached_prompt_tokens is None:
            seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            if self.enable_prefix_caching:
                self.num_query_tokens += seq.num_prompt_tokens
                self.num_hit_tokens += seq.num_cached_prompt_tokens

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq`; all or nothing. False when out of blocks."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:  # a decode inside its last block (most steps)
            return True
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks at the end of `seq`'s table that its first `num_tokens` tokens do not reach (a
        speculative verification's rejected positions; never registered, so nothing cached is lost)."""
        keep = max(self.blocks_needed(num_tokens), seq.num_cached_blocks)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def _release(self, block_id: int) -> None:
        """One reference to a block less; at none it is free (cached or not)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            cached = block.hash is not None and self.cached.get(block.hash) == block_id
            (self.free_cached if cached else self.free_empty)[block_id] = None

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that `seq`'s computed tokens have filled, for later prefix hits."""
        num_full = seq.num_computed_tokens // self.block_size
        first = seq.num_cached_blocks
        if not self.enable_prefix_caching or num_full <= first:  # no block filled since the last call (most steps)
            return
        prev = self.blocks[seq.block_table[first - 1]].hash if first else None
        run: list[StoredBlock] = []  # newly cached consecutive blocks, announced as one event
        run_parent = None
        for i in range(first, num_full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block = self.blocks[seq.block_table[i]]
            h = block_hash(prev, tokens, seq.cache_key)
            block.hash, block.token_ids = h, tokens
            if h not in self.cached:
                if not run:
                    run_parent = prev
                self.cached[h] = block.block_id
                run.append(StoredBlock(h, tokens, seq.cache_key))
            elif run:  # a duplicate (another sequence computed the same block first) was announced already
                self._event_stored(run, run_parent)
                run = []
            prev = h
        if run:
            self._event_stored(run, run_parent)
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)

    def _event_stored(self, stored: list[StoredBlock], parent: int | None) -> None:
        self.events.append(BlocksStored(tuple(stored), parent, self.block_size))

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq` (last block first, so the tail of a prefix is evicted before its head)."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def flush_unused(self) -> int:
        """Forget every cached block no sequence uses (reference count 0: evictable), emitting one "removed" event
        for them; blocks in use stay cached. Returns how many were dropped."""
        dropped = []
        for block_id in self.free_cached:
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                dropped.append(block.hash)
            block.hash, block.token_ids = None, ()
        self.free_empty.update(self.free_cached)
        self.free_cached.clear()
        if dropped:
            self.events.append(BlocksRemoved(tuple(dropped)))
        return len(dropped)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only when none is in use). True when done; emits CacheCleared."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.hash, block.token_ids = None, ()
        self.cached.clear()
        self.free_empty.update(self.free_cached)
        self.free_cached.clear()
        self.events.append(CacheCleared())
        return True
