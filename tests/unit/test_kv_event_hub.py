"""KvEventHub: numbering, resuming from a sequence number (or not), bounded queues, a notify that fails. No server."""

from __future__ import annotations

import time

import pytest

from tokenloop.core.kv_events import CacheCleared, KvEventHub, ResumeOutOfRange


def seqs(sub) -> list[int]:
    return [b.sequence_number for b in sub.pop_all()]


def test_batches_are_numbered_and_replayed_after_the_subscribers_last_sequence_number():
    hub = KvEventHub(history=3, first_sequence_number=1)
    assert hub.publish([]) is None and hub.last_sequence_number == 0  # nothing to say: no batch
    for _ in range(5):
        hub.publish([CacheCleared(), CacheCleared()])
    assert hub.oldest_kept == 3
    sub = hub.subscribe(lambda: None, start_sequence_number=3)  # 3 applied: 4 and 5 follow, no `cleared` of ours
    batches = sub.pop_all()
    assert [b.sequence_number for b in batches] == [4, 5] and [b.first_event_id for b in batches] == [7, 9]
    assert not hub.subscribe(lambda: None, start_sequence_number=5).queue  # up to date: nothing to replay
    assert seqs(hub.subscribe(lambda: None, start_sequence_number=2)) == [3, 4, 5]  # just before the oldest kept
    live = hub.subscribe(lambda: None)  # 0 with the first batch gone from the history: live only
    assert not live.queue
    hub.publish([CacheCleared()])
    assert seqs(live) == [6] and seqs(sub) == [6]


def test_a_number_the_hub_never_issued_or_no_longer_keeps_is_out_of_range():
    hub = KvEventHub(history=3, first_sequence_number=1)
    with pytest.raises(ResumeOutOfRange, match="kept: none"):
        hub.subscribe(lambda: None, start_sequence_number=7)  # a cursor from a previous life, before any batch
    for _ in range(5):
        hub.publish([CacheCleared()])
    for start in (6, 500, 1):  # ahead of the newest; older than the history
        with pytest.raises(ResumeOutOfRange, match=rf"start_sequence_number {start} is not in .*\(kept: 3\.\.5\)"):
            hub.subscribe(lambda: None, start_sequence_number=start)
    assert hub.num_subscribers == 0  # a refused subscriber is not left behind


def test_zero_replays_the_whole_history_while_it_starts_at_the_first_batch():
    hub = KvEventHub(history=3, first_sequence_number=1)
    hub.publish([CacheCleared()])
    hub.publish([CacheCleared()])
    assert seqs(hub.subscribe(lambda: None)) == [1, 2]  # the executor's whole state, from its first batch


def test_numbering_starts_at_the_creation_time_so_a_restarted_worker_never_reuses_numbers():
    before = time.time_ns() // 1000
    first = KvEventHub()
    first.publish([CacheCleared()])
    second = KvEventHub()  # the same worker after a restart
    second.publish([CacheCleared()])
    assert before <= first.first_sequence_number < second.first_sequence_number
    assert first.last_sequence_number < second.first_sequence_number
    with pytest.raises(ResumeOutOfRange):  # the router's cursor from the first life
        second.subscribe(lambda: None, start_sequence_number=first.last_sequence_number)
    with pytest.raises(ValueError, match="first_sequence_number must be >= 1"):
        KvEventHub(first_sequence_number=0)


def test_a_subscriber_that_falls_behind_is_cut_off_and_holds_nothing():
    hub = KvEventHub(max_queued=4)
    slow, fast = hub.subscribe(lambda: None), hub.subscribe(lambda: None)
    for _ in range(10):
        hub.publish([CacheCleared()])
        fast.pop_all()
    assert slow.cut_off and not slow.queue and hub.num_cut_off == 1
    assert not fast.cut_off


def test_a_failing_notify_drops_that_subscriber_not_the_publisher():
    hub = KvEventHub()

    def closed_loop():
        raise RuntimeError("Event loop is closed")

    hub.subscribe(closed_loop)
    ok = hub.subscribe(lambda: None)
    hub.publish([CacheCleared()])
    assert hub.num_subscribers == 1 and len(ok.queue) == 1


def test_the_lora_cache_key_is_made_and_read_in_one_place():
    """core.kv_events makes an adapter's block key (the engine's `LoraWeights.cache_key`) and reads its name back
    (the service's `lora_name`): a name with a colon survives, any other key names no adapter."""
    from tokenloop.core.kv_events import lora_cache_key, lora_of_cache_key

    assert lora_of_cache_key(lora_cache_key("sql", "ab12")) == "sql"
    assert lora_of_cache_key(lora_cache_key("team:sql", "ab12")) == "team:sql"
    assert lora_of_cache_key(None) == lora_of_cache_key("salt:x") == ""
