"""--front-cpu: the spec's rules, the CPU chosen, and pinning real threads of this process (and undoing it)."""

from __future__ import annotations

import os
import threading

import pytest

from tokenloop.service import placement
from tokenloop.service.cli import build_parser, config_from_args
from tokenloop.service.config import ServerConfig
from tokenloop.service.placement import FrontPlacement, cpu_list

CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs a process that may use two CPUs or more")


@pytest.mark.parametrize("spec", ["auto", "off", "0", "17"])
def test_accepted_specs(spec):
    assert ServerConfig(front_cpu=spec).front_cpu == spec


@pytest.mark.parametrize("spec", ["", "on", "-1", "1.5", "0-1", "٣"])
def test_refused_specs_name_the_flag_and_the_rule(spec):
    with pytest.raises(ValueError, match=r"--front-cpu must be 'auto', 'off' or a CPU number"):
        ServerConfig(front_cpu=spec)


def test_the_flag_reaches_the_config():
    assert config_from_args(build_parser().parse_args(["serve"])).front_cpu == "auto"
    assert config_from_args(build_parser().parse_args(["serve", "--front-cpu", "off"])).front_cpu == "off"


def test_cpu_list_uses_the_kernels_notation():
    assert cpu_list({0}) == "0"
    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def test_off_and_a_single_cpu_pin_nothing(monkeypatch):
    assert FrontPlacement("off").choose() is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert FrontPlacement("auto").choose() is None  # the two threads share the one CPU already
    assert FrontPlacement("3").choose() == 3


def test_a_cpu_outside_the_process_set_is_refused(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 5})
    with pytest.raises(ValueError, match=r"--front-cpu 4 is not one of the CPUs this process may use \(0-2,5\)"):
        FrontPlacement("4").choose()


def test_auto_takes_the_current_cpu_or_else_one_of_the_set(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3})
    monkeypatch.setattr(placement, "_current_cpu", lambda: 3)
    assert FrontPlacement("auto").choose() == 3
    monkeypatch.setattr(placement, "_current_cpu", lambda: 7)  # outside the set (it changed meanwhile)
    assert FrontPlacement("auto").choose() == 2


def _mask(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


@needs_two_cpus
def test_pin_puts_both_threads_on_one_cpu_and_restore_gives_every_cpu_back():
    """Real threads: the two pinned threads get one CPU (the same one); a thread started by a pinned thread
    inherits its CPU unless it calls `release_this_thread` first; the looper runs as SCHED_BATCH while told the event
    loop is behind; `restore` undoes both."""
    release, started = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def other():
        started.set()
        release.wait(10)

    looper = threading.Thread(target=other, name="tokenloop-looper")
    looper.start()
    started.wait(10)
    front = FrontPlacement(str(max(CPUS)))
    try:
        assert front.pin(threading.get_native_id(), looper.native_id) == max(CPUS)
        assert _mask(0) == _mask(looper.native_id) == {max(CPUS)}
        # while the event loop is behind its readers the looper does not preempt it when woken; then normal again
        assert os.sched_getscheduler(looper.native_id) == os.SCHED_OTHER
        front.looper_behind(True, looper.native_id)
        assert os.sched_getscheduler(looper.native_id) == os.SCHED_BATCH
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the event loop keeps the normal policy
        front.looper_behind(False, looper.native_id)
        assert os.sched_getscheduler(looper.native_id) == os.SCHED_OTHER
        front.looper_behind(True, looper.native_id)

        def child(key, widen):
            if widen:
                front.release_this_thread()
            seen[key] = _mask(0)
        for key, widen in (("inherits", False), ("released", True)):
            t = threading.Thread(target=child, args=(key, widen))
            t.start()
            t.join(10)
        assert seen == {"inherits": {max(CPUS)}, "released": CPUS}
    finally:
        front.restore()
        policy = os.sched_getscheduler(looper.native_id)  # restored while it still runs
        release.set()
        looper.join(10)
    assert policy == os.SCHED_OTHER
    assert _mask(0) == CPUS
    assert front.cpu is None


def test_a_refused_pin_is_a_warning_with_auto_and_an_error_with_a_cpu_number(monkeypatch, caplog):
    """Where the system forbids pinning (a seccomp profile), `auto` serves unpinned and says so; an explicit CPU
    is a start-up error naming the flag. Nothing stays half pinned."""
    calls = []

    def refuse_second(tid, cpus):
        calls.append((tid, set(cpus)))
        if len(calls) == 2:
            raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "sched_setaffinity", refuse_second)
    monkeypatch.setattr(placement, "_current_cpu", lambda: 1)
    front = FrontPlacement("auto")
    assert front.pin(101, 102) is None and front.cpu is None
    assert calls == [(101, {1}), (102, {1}), (101, {0, 1})]  # the first thread given its CPUs back
    assert "cannot pin the event-loop and looper threads" in caplog.text
    front.release_this_thread()  # nothing to widen: no call
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(ValueError, match=r"--front-cpu 0: cannot pin the threads \(.*not permitted"):
        FrontPlacement("0").pin(101, 102)


def test_a_refused_batch_policy_is_one_warning_and_the_threads_stay_pinned(monkeypatch, caplog):
    """Where the system refuses SCHED_BATCH for the looper thread, the server serves pinned and says so."""
    def refuse(tid, policy, param):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, cpus: None)
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    monkeypatch.setattr(placement, "_current_cpu", lambda: 1)
    front = FrontPlacement("auto")
    assert front.pin(101, 102) == 1 and front.cpu == 1
    front.looper_behind(True)
    assert "cannot run the looper thread as SCHED_BATCH" in caplog.text and front.cpu == 1
    caplog.clear()
    front.looper_behind(True)  # said once; not tried again
    assert caplog.text == ""
    front.restore()  # nothing to undo for the policy


def test_the_policy_follows_only_pinned_threads(monkeypatch):
    """Unpinned (--front-cpu off, one CPU, or before pin) the looper's policy is left to the OS."""
    calls = []
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: calls.append(a))
    FrontPlacement("off").looper_behind(True)
    FrontPlacement("auto").looper_behind(True)
    assert calls == []
