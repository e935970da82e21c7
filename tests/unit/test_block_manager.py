"""BlockManager: allocation, all-or-nothing growth, freeing, prefix caching. No tensors."""

from __future__ import annotations

import pytest

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.sequence import Sequence


def seq(tokens) -> Sequence:
    return Sequence(request_id=1, seq_index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens))


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """Pretend the model ran `n` more tokens of `s`."""
    assert bm.append_slots(s, n)
    s.num_computed_tokens += n
    bm.commit_full_blocks(s)


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
