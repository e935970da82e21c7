"""Bounded admission: slots, a bounded FIFO waiting line, refusal past both, closing for drain."""

import asyncio

import grpc
import pytest

from tests.conftest import run
from tokenloop.service.admission import Admission, Slot
from tokenloop.service.errors import AlreadyExists, Cancelled, Overloaded, QueueTimeout, Unavailable


def test_slots_then_queue_then_refusal_in_fifo_order():
    async def body():
        adm = Admission(max_concurrent=2, max_queue=2)
        await adm.acquire()
        await adm.acquire()
        order = []

        async def wait(name):
            await adm.acquire()
            order.append(name)

        waiters = [asyncio.ensure_future(wait("a")), asyncio.ensure_future(wait("b"))]
        await asyncio.sleep(0)
        assert adm.num_active == 2 and adm.num_waiting == 2
        with pytest.raises(Overloaded) as err:
            await adm.acquire()
        assert err.value.trailers == (("grpc-retry-pushback-ms", "500"),)
        adm.release()
        await asyncio.sleep(0)
        assert order == ["a"] and adm.num_active == 2 and adm.num_waiting == 1
        adm.release()
        await asyncio.gather(*waiters)
        assert order == ["a", "b"]
        adm.release()
        adm.release()
        assert adm.num_active == 0
    run(body())


def test_cancelled_waiter_leaves_the_line():
    async def body():
        adm = Admission(max_concurrent=1, max_queue=1)
        await adm.acquire()
        waiter = asyncio.ensure_future(adm.acquire())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.sleep(0)
        assert adm.num_waiting == 0
        adm.release()
        assert adm.num_active == 0
    run(body())


def test_closed_admission_refuses_with_unavailable():
    async def body():
        adm = Admission(max_concurrent=1, max_queue=1)
        adm.close("the server is shutting down")
        with pytest.raises(Unavailable, match="shutting down"):
            await adm.acquire()
    run(body())


def test_limits_checked():
    with pytest.raises(ValueError):
        Admission(0, 1)


# -- the wait bound, Abort while waiting, a slot's accounting on every path (issue 28) --------------------------

def test_a_wait_past_max_wait_is_refused_with_its_own_message_and_pushback():
    async def body():
        adm = Admission(max_concurrent=1, max_queue=4)
        async with adm.slot("first", max_wait=0.05):
            with pytest.raises(QueueTimeout) as err:
                async with adm.slot("second", max_wait=0.05):
                    pytest.fail("the second request got a slot")
            assert isinstance(err.value, Overloaded)  # RESOURCE_EXHAUSTED, like a full line
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "waited 0.05 s for a slot (--max-queue-wait)" in err.value.message
            assert "capacity" not in err.value.message  # not the "queue full" message
            assert err.value.trailers == (("grpc-retry-pushback-ms", "500"),)
            assert adm.num_waiting == 0 and adm.num_active == 1
        assert adm.num_active == 0
    run(body())


def test_no_wait_bound_with_zero_and_a_slot_handed_over_in_time_is_kept():
    async def body():
        adm = Admission(max_concurrent=1, max_queue=4)
        first = await _enter(adm.slot("first", max_wait=0.0))
        waiting = asyncio.ensure_future(_hold(adm.slot("second", max_wait=0.0), asyncio.Event()))
        await asyncio.sleep(0.1)  # longer than any bound the other tests use: nothing expires
        assert not waiting.done() and adm.num_waiting == 1
        await first.__aexit__(None, None, None)
        await asyncio.sleep(0)
        assert adm.num_active == 1 and adm.num_waiting == 0  # handed over, not expired
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert adm.num_active == 0
    run(body())


def test_abort_while_waiting_ends_it_cancelled_and_it_leaves_the_line():
    async def body():
        adm = Admission(max_concurrent=1, max_queue=4)
        async with adm.slot("running", max_wait=5.0):
            waiting = asyncio.ensure_future(_hold(adm.slot("queued", max_wait=5.0), asyncio.Event()))
            await asyncio.sleep(0)
            assert adm.num_waiting == 1
            assert adm.abort("queued") is True
            assert adm.abort("queued") is False  # once
            with pytest.raises(Cancelled, match="'queued' was aborted \\(Abort\\) while waiting for admission"):
                await waiting
            assert adm.num_waiting == 0 and adm.num_active == 1
            assert adm.abort("unknown") is False
        assert adm.num_active == 0
    run(body())


def test_abort_after_the_line_but_before_submit_refuses_it_and_after_submit_is_not_found():
    async def body():
        adm = Admission(max_concurrent=2, max_queue=0)
        async with adm.slot("tokenizing") as slot:  # admitted, not yet submitted (tokenizing, compiling)
            assert adm.abort("tokenizing") is True
            with pytest.raises(Cancelled):
                slot.check_aborted()
        async with adm.slot("running") as slot:
            slot.check_aborted()  # not aborted: no error
            adm.submitted(slot)
            assert adm.abort("running") is False  # the looper answers for it now
        assert adm.num_active == 0
    run(body())


def test_a_request_id_already_waiting_is_refused():
    async def body():
        adm = Admission(max_concurrent=1, max_queue=1)
        async with adm.slot("same"):
            with pytest.raises(AlreadyExists, match="already waiting for admission"):
                async with adm.slot("same"):
                    pass
        async with adm.slot("same"):  # free again afterwards
            pass
        assert adm.num_active == 0
    run(body())


def test_slot_given_back_and_taken_again_is_counted_once_on_every_path():
    async def body():
        adm = Admission(max_concurrent=1, max_queue=1)
        # 1) given back (paused), body ends: no second release
        async with adm.slot("a") as slot:
            slot.give_back()
            slot.give_back()
            assert adm.num_active == 0 and not slot.held
        assert adm.num_active == 0
        # 2) given back, another request takes the slot, the first takes it again in line after it
        async with adm.slot("a") as a:
            a.give_back()
            async with adm.slot("b"):
                again = asyncio.ensure_future(a.take_again())
                await asyncio.sleep(0)
                assert adm.num_waiting == 1 and not again.done()
            await again
            assert a.held and adm.num_active == 1
        assert adm.num_active == 0
        # 3) taking it again is not refused for a full line nor while draining (it was admitted once)
        async with adm.slot("a") as a:
            a.give_back()
            async with adm.slot("b"):
                queued = asyncio.ensure_future(_hold(adm.slot("c"), asyncio.Event()))
                await asyncio.sleep(0)
                assert adm.num_waiting == 1  # the line (max_queue 1) is full
                adm.close("the server is shutting down")
                again = asyncio.ensure_future(a.take_again())
                await asyncio.sleep(0)
                assert adm.num_waiting == 2 and not again.done()
            await asyncio.sleep(0)  # b's slot went to c (first in line)
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            await again
            assert a.held
        assert adm.num_active == 0
        # 4) cancelled while waiting to take it again: not held, nothing released twice
        adm = Admission(max_concurrent=1, max_queue=1)
        async with adm.slot("a") as a:
            a.give_back()
            async with adm.slot("b"):
                again = asyncio.ensure_future(a.take_again())
                await asyncio.sleep(0)
                again.cancel()
                await asyncio.gather(again, return_exceptions=True)
                assert adm.num_waiting == 0 and not a.held
        assert adm.num_active == 0
        # 5) a wait bound applies when taking it again too
        async with adm.slot("a", max_wait=0.05) as a:
            a.give_back()
            async with adm.slot("b"):
                with pytest.raises(QueueTimeout):
                    await a.take_again()
        assert adm.num_active == 0 and adm.num_waiting == 0
    run(body())


def test_body_errors_and_cancellation_release_the_slot_exactly_once():
    async def body():
        adm = Admission(max_concurrent=1, max_queue=2)
        with pytest.raises(RuntimeError):
            async with adm.slot("a"):
                raise RuntimeError("finish with an error")
        assert adm.num_active == 0
        holding = asyncio.Event()
        task = asyncio.ensure_future(_hold(adm.slot("b"), holding))
        await holding.wait()
        task.cancel()  # a deadline or a client that hung up, while holding
        await asyncio.gather(task, return_exceptions=True)
        assert adm.num_active == 0 and adm.num_pending == 0
    run(body())


async def _enter(cm):
    await cm.__aenter__()
    return cm


async def _hold(cm, entered: asyncio.Event):
    async with cm:
        entered.set()
        await asyncio.Event().wait()


def test_stall_watchdog_gives_back_after_the_grace_then_cancels_after_the_timeout():
    from tokenloop.service.delivery import StallWatchdog

    async def body():
        slow, progressed = [], []

        async def handler(progress: bool):
            dog = StallWatchdog(timeout=0.6, grace=0.1, on_slow=lambda: slow.append(progress))
            dog.writing = True  # a write that never completes (or, with progress, completes every 20 ms for a while)
            for _ in range(25 if progress else 0):
                await asyncio.sleep(0.02)
                dog.sent += 1
            progressed.append(progress)
            await asyncio.sleep(30)

        stalled = asyncio.ensure_future(handler(False))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(stalled, 10)
        assert slow == [False]  # once, before the cancel
        writing = asyncio.ensure_future(handler(True))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(writing, 10)
        assert slow == [False, True] and progressed == [False, True]  # progress held both off while it lasted
    run(body())


def test_stall_watchdog_without_a_grace_only_cancels():
    from tokenloop.service.delivery import StallWatchdog

    async def body():
        slow = []

        async def handler():
            dog = StallWatchdog(timeout=0.1, grace=0.5, on_slow=lambda: slow.append(1))  # grace >= timeout: unused
            dog.writing = True
            await asyncio.sleep(30)

        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.ensure_future(handler()), 10)
        assert slow == []
    run(body())


@pytest.mark.parametrize("field, flag", [("slow_reader_grace", "--slow-reader-grace"),
                                         ("max_queue_wait", "--max-queue-wait"), ("stall_timeout", "--stall-timeout")])
def test_negative_waits_are_refused_naming_the_flag(field, flag):
    from tokenloop.service.config import ServerConfig

    with pytest.raises(ValueError, match=f"^{flag} must be >= 0"):
        ServerConfig(**{field: -1.0})
    with pytest.raises(ValueError, match=f"^{flag} must be >= 0"):
        ServerConfig(**{field: float("nan")})
    assert getattr(ServerConfig(**{field: 0.0}), field) == 0.0  # 0: off / no bound


def test_the_flags_reach_the_config():
    from tokenloop.service.cli import build_parser, config_from_args

    args = build_parser().parse_args(["serve", "--slow-reader-grace", "0.5", "--max-queue-wait", "12"])
    config = config_from_args(args)
    assert (config.slow_reader_grace, config.max_queue_wait) == (0.5, 12.0)
    defaults = config_from_args(build_parser().parse_args(["serve"]))
    assert (defaults.slow_reader_grace, defaults.max_queue_wait) == (1.0, 30.0)


def test_a_freed_slot_goes_to_the_peer_holding_fewest_so_one_connection_cannot_queue_another_out():
    """Peer A holds both slots and has three requests waiting; B's request, arriving after them, gets the next
    freed slot. Among peers holding equally many, the line is first come, first served."""
    async def body():
        adm = Admission(max_concurrent=2, max_queue=8)
        held = [Slot(adm, f"a{i}", 0.0, "A") for i in range(2)]
        for s in held:
            await adm.acquire(s)
        order = []

        async def wait(name, peer):
            await adm.acquire(Slot(adm, name, 0.0, peer))
            order.append(name)

        tasks = [asyncio.ensure_future(wait(n, "A")) for n in ("a2", "a3", "a4")]
        await asyncio.sleep(0)
        tasks.append(asyncio.ensure_future(wait("b0", "B")))
        await asyncio.sleep(0)
        held[0].give_back()  # A now holds 1, B 0: B first
        await asyncio.sleep(0)
        assert order == ["b0"]
        held[1].give_back()  # A holds 0, B 1: A's earliest
        await asyncio.sleep(0)
        assert order == ["b0", "a2"]
        for _ in range(3):
            adm.release("A")
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["b0", "a2", "a3", "a4"]
    run(body())


def test_a_full_line_sheds_the_newest_waiter_of_the_peer_with_most_waiting():
    async def body():
        adm = Admission(max_concurrent=1, max_queue=3)
        await adm.acquire(Slot(adm, "a0", 0.0, "A"))
        tasks = [asyncio.ensure_future(adm.acquire(Slot(adm, f"a{i}", 0.0, "A"))) for i in (1, 2, 3)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):  # A itself is refused when its own line is full
            await adm.acquire(Slot(adm, "a4", 0.0, "A"))
        b = asyncio.ensure_future(adm.acquire(Slot(adm, "b0", 0.0, "B")))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="at capacity"):  # A's newest waiter gave B its place
            await tasks[2]
        assert adm.num_waiting == 3 and not b.done()
        c = asyncio.ensure_future(adm.acquire(Slot(adm, "c0", 0.0, "C")))  # A: 2 waiting, C: 0 -> A sheds again
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await tasks[1]
        with pytest.raises(Overloaded):  # now A 1, B 1, C 1 waiting: nobody has more than D would, D is refused
            await adm.acquire(Slot(adm, "d0", 0.0, "D"))
        adm.release("A")
        await asyncio.sleep(0)
        assert b.done() or c.done() or tasks[0].done()
        for t in (b, c, tasks[0]):
            if not t.done():
                adm.release("")
                await asyncio.sleep(0)
        await asyncio.gather(b, c, tasks[0])
    run(body())
