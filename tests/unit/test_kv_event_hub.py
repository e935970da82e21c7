"""KvEventHub: numbering, replay from a sequence number, bounded queues, a notify that fails. No server."""

from __future__ import annotations

from tokenloop.looper.kv_events import CacheCleared, KvEventHub


def test_batches_are_numbered_and_replayed_from_a_sequence_number():
    hub = KvEventHub(history=3)
    assert hub.publish([]) is None and hub.last_sequence_number == 0  # nothing to say: no batch
    for _ in range(5):
        hub.publish([CacheCleared()])
    assert hub.oldest_kept == 3
    sub = hub.subscribe(lambda: None, start_sequence_number=4)
    assert [b.sequence_number for b in sub.pop_all()] == [4, 5]
    live = hub.subscribe(lambda: None)  # 0: from the next batch on
    hub.publish([CacheCleared()])
    assert [b.sequence_number for b in live.pop_all()] == [6] and [b.sequence_number for b in sub.pop_all()] == [6]


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
