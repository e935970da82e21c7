"""Bounded admission: slots, a bounded FIFO waiting line, refusal past both, closing for drain."""

import asyncio

import pytest

from tests.conftest import run
from tokenloop.service.admission import Admission
from tokenloop.service.errors import Overloaded, Unavailable


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
