"""The garbage collector tuned at start-up (service/app.py tune_gc): what is alive frozen, cycles still collected."""

from __future__ import annotations


def test_tune_gc_freezes_what_is_alive_and_keeps_collecting_cycles():
    import gc

    from tokenloop.service.app import GC_GEN0_THRESHOLD, tune_gc
    before = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] >= GC_GEN0_THRESHOLD and gc.get_threshold()[1:] == before[1:]

        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after the freeze is still garbage the collector finds
        del a, b
        assert gc.collect() >= 2
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
