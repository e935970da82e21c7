"""BlockManager: allocation, all-or-nothing growth, freeing, prefix caching. No tensors."""

from __future__ import annotations

import pytest

from tests.engine_helpers import compute
from tokenloop.core.kv_events import BlocksRemoved, BlocksStored, CacheCleared
from tokenloop.engine.block_manager import BlockManager, block_hash
from tokenloop.engine.sequence import Sequence


def seq(tokens) -> Sequence:
    return Sequence(executor_id=1, seq_index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens))


def test_append_slots_allocates_whole_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(range(10))
    assert bm.append_slots(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 1
    s.num_computed_tokens = 10
    assert bm.append_slots(s, 2)  # 12 tokens still fit in 3 blocks
    assert len(s.block_table) == 3
    assert bm.append_slots(s, 3)  # 13 need a fourth
    assert bm.num_free_blocks == 0
    bm.free(s)
    assert bm.num_free_blocks == 4 and s.block_table == []


def test_append_slots_is_all_or_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(range(12))
    assert not bm.append_slots(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_prefix_cache_shares_full_blocks_but_never_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = seq(range(10))
    compute(bm, first, 10)  # blocks [0-3] [4-7] full, [8-9] partial
    second = seq(list(range(8)) + [50, 51, 52])
    assert bm.allocate_prefix(second) == 8
    assert second.block_table == first.block_table[:2]
    assert bm.blocks[first.block_table[0]].ref_count == 2
    exact = seq(range(8))  # the whole prompt is cached: the last block is recomputed for its logits
    assert bm.allocate_prefix(exact) == 4


def test_prefix_cache_requires_the_same_preceding_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    compute(bm, seq(range(8)), 8)
    other = seq([99, 98, 97, 96] + list(range(4, 8)) + [1])  # same second block, different first
    assert bm.allocate_prefix(other) == 0


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=3, block_size=4)
    first = seq(range(9))
    compute(bm, first, 9)
    bm.free(first)
    assert bm.num_free_blocks == 3
    again = seq(list(range(8)) + [7])
    assert bm.allocate_prefix(again) == 8 and bm.num_free_blocks == 1
    bm.free(again)
    filler = seq([200 + i for i in range(12)])
    compute(bm, filler, 12)  # takes every block, evicting the cached ones
    bm.free(filler)
    assert bm.allocate_prefix(seq(list(range(8)) + [7])) == 0


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    compute(bm, seq(range(10)), 10)
    assert bm.allocate_prefix(seq(range(10))) == 0


def test_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=4)


# --- the prefix cache as vLLM keeps it: stable hashes, LRU eviction, events ---

def test_block_hash_is_stable_chained_and_keyed():
    # a fixed value: the same in every process and every restart (Python's hash() of a tuple would not be)
    assert block_hash(None, (1, 2, 3, 4)) == block_hash(None, (1, 2, 3, 4)) == 7559807116225165343
    first = block_hash(None, (1, 2, 3, 4))
    assert block_hash(first, (5, 6, 7, 8)) != block_hash(None, (5, 6, 7, 8))  # the parent is part of it
    assert block_hash(None, (1, 2, 3, 4), "adapter-a") != first  # so is the extra key (a LoRA adapter)
    assert block_hash(None, (1, 2, 3, 4), "adapter-a") != block_hash(None, (1, 2, 3, 4), "adapter-b")


def test_extra_key_separates_caches():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(9))
    a.cache_key = "adapter-a"
    compute(bm, a, 9)
    assert bm.allocate_prefix(seq(range(9))) == 0  # no key: not the same K/V
    keyed = seq(range(9))
    keyed.cache_key = "adapter-a"
    assert bm.allocate_prefix(keyed) == 8


def test_eviction_is_least_recently_used_and_only_under_pressure():
    bm = BlockManager(num_blocks=4, block_size=4)
    old, recent = seq(range(0, 5)), seq(range(100, 105))
    compute(bm, old, 5)
    bm.free(old)
    compute(bm, recent, 5)
    bm.free(recent)
    assert bm.num_cached_blocks == 2 and bm.num_evictions == 0  # freed, still cached: nothing needed the slots
    filler = seq(range(200, 208))
    compute(bm, filler, 8)  # needs 2 blocks: the 2 never-cached tails are taken, no cached one
    assert bm.num_evictions == 0 and bm.num_cached_blocks == 4
    bm.free(filler)
    touched = seq(list(range(0, 4)) + [9])
    assert bm.allocate_prefix(touched) == 4  # `old` is used again: now the most recently used
    bm.free(touched)
    compute(bm, seq(range(300, 304)), 4)  # one block: the least recently used cached block goes
    assert bm.num_evictions == 1
    assert bm.allocate_prefix(seq(list(range(100, 104)) + [9])) == 0  # `recent` was evicted...
    assert bm.allocate_prefix(seq(list(range(0, 4)) + [9])) == 4  # ...not the re-used `old`


def test_events_announce_stored_chains_and_removals():
    bm = BlockManager(num_blocks=3, block_size=4)
    s = seq(range(10))
    compute(bm, s, 6)  # one full block
    compute(bm, s, 4)  # the second fills up: one more event, its parent the first
    (e1, e2) = bm.take_events()
    assert isinstance(e1, BlocksStored) and e1.parent_hash is None and e1.block_size == 4
    assert [b.token_ids for b in e1.blocks] == [(0, 1, 2, 3)]
    assert isinstance(e2, BlocksStored) and e2.parent_hash == e1.blocks[0].block_hash
    assert e2.blocks[0].block_hash == block_hash(e1.blocks[0].block_hash, (4, 5, 6, 7))
    assert bm.take_events() == []
    twin = seq(range(10))  # computes the same blocks again without a lookup: no duplicate announcement
    bm.free(s)
    compute(bm, twin, 8)
    removed = [e for e in bm.take_events() if isinstance(e, BlocksRemoved)]
    assert removed and set(removed[0].block_hashes) <= {e1.blocks[0].block_hash, e2.blocks[0].block_hash}
    bm.free(twin)
    assert bm.reset_prefix_cache() and bm.num_cached_blocks == 0
    assert isinstance(bm.take_events()[-1], CacheCleared)


def test_reset_refuses_while_blocks_are_in_use():
    bm = BlockManager(num_blocks=3, block_size=4)
    s = seq(range(5))
    compute(bm, s, 5)
    assert not bm.reset_prefix_cache() and bm.num_cached_blocks == 1


def test_hit_rate_counts_first_admissions_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(9))
    bm.allocate_prefix(a)
    bm.record_admission(a)
    compute(bm, a, 9)
    b = seq(list(range(8)) + [50, 51, 52, 53])
    bm.allocate_prefix(b)
    bm.record_admission(b)
    bm.record_admission(b)  # a preempted sequence comes back: counted once
    assert b.num_cached_prompt_tokens == 8
    assert (bm.num_query_tokens, bm.num_hit_tokens) == (9 + 12, 8)
    assert bm.hit_rate == 8 / 21
