"""Scheduler policy with no model: budgets, chunked prefill, decode priority, preemption by recompute."""

from __future__ import annotations

from tokenloop.engine.block_manager import BlockManager
from tokenloop.engine.scheduler import Scheduler
from tokenloop.engine.sequence import Sequence, SequenceStatus


def seq(num_prompt: int, request_id: int = 1) -> Sequence:
    return Sequence(executor_id=request_id, seq_index=0, token_ids=list(range(100, 100 + num_prompt)),
                    num_prompt_tokens=num_prompt)


def make(num_blocks=64, block_size=4, max_num_tokens=16, max_batch_size=8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=False), max_num_tokens,
                     max_batch_size)


def step(sched: Scheduler, sample_token: int = 7) -> list[tuple[Sequence, int]]:
    """schedule + advance + append a token to every sequence that reached its end (like the engine)."""
    scheduled = sched.schedule()
    sched.advance(scheduled)
    for s, _ in scheduled:
        if s.num_computed_tokens == len(s):
            s.token_ids.append(sample_token)
    return scheduled


def test_long_prompt_is_chunked_by_the_token_budget():
    sched = make(max_num_tokens=16)
    long = seq(40)
    sched.add(long)
    assert [n for _, n in step(sched)] == [16]
    assert [n for _, n in step(sched)] == [16]
    assert [n for _, n in step(sched)] == [8]  # finishes the prompt, samples
    assert [n for _, n in step(sched)] == [1]  # decode


def test_running_decodes_are_never_stalled_by_a_long_prompt():
    sched = make(max_num_tokens=16)
    short = seq(3, request_id=1)
    sched.add(short)
    step(sched)  # short prefilled, now decoding
    sched.add(seq(100, request_id=2))
    for _ in range(5):
        scheduled = dict((s.executor_id, n) for s, n in step(sched))
        assert scheduled[1] == 1  # the decode runs every step
        assert scheduled[2] == 15  # the long prompt gets what is left of the budget


def test_max_batch_size_caps_running_sequences():
    sched = make(max_batch_size=2, max_num_tokens=64)
    for i in range(4):
        sched.add(seq(3, request_id=i))
    scheduled = step(sched)
    assert {s.executor_id for s, _ in scheduled} == {0, 1}
    assert len(sched.waiting) == 2


def test_preemption_frees_the_newest_and_recomputes_it_later():
    sched = make(num_blocks=4, block_size=4, max_num_tokens=32)
    old, new = seq(8, request_id=1), seq(8, request_id=2)
    sched.add(old)
    sched.add(new)
    step(sched)  # both prefilled: 8 tokens each = 2 blocks each, cache full
    assert sched.block_manager.num_free_blocks == 0
    scheduled = step(sched)  # both at token 9: old needs a third block -> new is preempted
    assert [s.executor_id for s, _ in scheduled] == [1]
    assert sched.num_preemptions == 1
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert list(sched.waiting) == [new]
    assert len(new) == 9  # its sampled token is kept and will be recomputed
    sched.finish(old)
    scheduled = step(sched)
    assert scheduled == [(new, 9)]  # prompt and output recomputed in one chunk


def test_waiting_sequence_does_not_preempt_running_ones():
    sched = make(num_blocks=2, block_size=4, max_num_tokens=32)
    running = seq(6, request_id=1)
    sched.add(running)
    step(sched)
    sched.add(seq(6, request_id=2))
    scheduled = step(sched)
    assert [s.executor_id for s, _ in scheduled] == [1]
    assert sched.num_preemptions == 0 and len(sched.waiting) == 1


def test_finish_frees_blocks_and_removes_from_queues():
    sched = make()
    a, b = seq(5, 1), seq(5, 2)
    sched.add(a)
    sched.add(b)
    step(sched)
    used = sched.block_manager.num_used_blocks
    sched.finish(a)
    assert a.status is SequenceStatus.FINISHED and a not in sched.running
    assert sched.block_manager.num_used_blocks == used - 2
    waiting = seq(5, 3)
    sched.add(waiting)
    sched.finish(waiting)
    assert not sched.waiting


def cached_sched(num_blocks=16, block_size=4, max_num_tokens=8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), max_num_tokens, max_batch_size=8)


def test_cancel_mid_prefill_leaves_nothing_referenced_and_keeps_the_computed_blocks_cached():
    sched = cached_sched(max_num_tokens=8)
    bm = sched.block_manager
    long = seq(30, request_id=1)
    sched.add(long)
    step(sched)  # 8 of 30 prompt tokens computed: 2 full blocks registered
    assert bm.num_cached_blocks == 2 and bm.num_used_blocks == 2
    sched.finish(long)  # cancelled mid-prefill
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)
    assert bm.num_free_blocks == bm.num_blocks
    again = seq(30, request_id=2)  # the computed part serves the same prompt later
    sched.add(again)
    step(sched)
    assert again.num_cached_prompt_tokens == 8


def test_preemption_keeps_the_pool_consistent_and_recompute_hits_the_cache():
    sched = cached_sched(num_blocks=4, block_size=4, max_num_tokens=32)
    bm = sched.block_manager
    old, new = seq(8, request_id=1), seq(8, request_id=2)
    new.token_ids = list(range(500, 508))
    sched.add(old)
    sched.add(new)
    step(sched)
    step(sched)  # old needs a third block: new is preempted; its tail block is evicted (LRU), its head stays cached
    assert sched.num_preemptions == 1 and new.block_table == [] and bm.num_evictions == 1
    assert sum(b.ref_count for b in bm.blocks) == len(old.block_table)
    sched.finish(old)
    scheduled = step(sched)  # new comes back: its first block is found again, the other 5 tokens recomputed
    assert scheduled == [(new, 5)]
    assert new.num_cached_prompt_tokens == 0  # what it was served at its first admission
    sched.finish(new)
    assert bm.num_used_blocks == 0 and all(b.ref_count == 0 for b in bm.blocks)


def test_pause_frees_blocks_and_resume_recomputes_the_same_tokens():
    sched = make(num_blocks=16, block_size=4, max_num_tokens=16)
    a, b = seq(6, request_id=1), seq(6, request_id=2)
    sched.add(a)
    sched.add(b)
    for _ in range(3):
        step(sched)
    tokens_before = list(a.token_ids)
    used = sched.block_manager.num_used_blocks
    sched.pause(a)
    sched.pause(a)  # idempotent
    assert a not in sched.running and a not in sched.waiting and a in sched.paused
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert sched.block_manager.num_used_blocks < used
    for _ in range(3):  # b goes on alone; a does not run
        assert [s for s, _ in step(sched)] == [b]
    assert a.token_ids == tokens_before
    sched.resume(a)
    sched.resume(a)  # idempotent: queued once
    assert list(sched.waiting) == [a] and not sched.paused
    scheduled = dict(step(sched))
    assert scheduled[a] == len(tokens_before)  # prompt and output so far, recomputed in one chunk
    assert a.token_ids[:len(tokens_before)] == tokens_before


def test_a_paused_sequence_can_be_finished_and_a_finished_one_is_not_paused():
    sched = make()
    a = seq(5)
    sched.add(a)
    step(sched)
    sched.pause(a)
    sched.finish(a)  # cancelled while paused
    assert not sched.paused and a.status is SequenceStatus.FINISHED and sched.block_manager.num_used_blocks == 0
    sched.pause(a)
    sched.resume(a)
    assert not sched.paused and not sched.waiting and not sched.has_work()
