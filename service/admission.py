"""Bounded admission: at most `max_concurrent` requests in flight and `max_queue` waiting for a slot.

Past both limits a request is refused at once with RESOURCE_EXHAUSTED (TGI's
`try_acquire_owned()` at the door), never parked in an unbounded queue.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager

from .errors import Overloaded, Unavailable

RETRY_PUSHBACK_MS = "500"


class Admission:
    """A FIFO slot counter with a bounded waiting line, closed while draining."""

    def __init__(self, max_concurrent: int, max_queue: int):
        if max_concurrent < 1 or max_queue < 0:
            raise ValueError("max_concurrent must be >= 1 and max_queue >= 0")
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.num_active = 0
        self._waiters: deque[asyncio.Future] = deque()
        self.closed_reason = ""

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    def close(self, reason: str) -> None:
        """Refuse every new request (draining); requests already admitted carry on."""
        self.closed_reason = reason

    def _refuse_if_closed(self) -> None:
        if self.closed_reason:
            raise Unavailable(self.closed_reason)

    async def acquire(self) -> None:
        self._refuse_if_closed()
        if self.num_active < self.max_concurrent and not self._waiters:
            self.num_active += 1
            return
        if len(self._waiters) >= self.max_queue:
            raise Overloaded(
                f"the server is at capacity ({self.max_concurrent} requests in flight, {self.max_queue} "
                "waiting); retry later", trailers=(("grpc-retry-pushback-ms", RETRY_PUSHBACK_MS),))
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # the releasing request hands its slot over (num_active unchanged)
        except BaseException:
            if not waiter.cancelled() and waiter.done():
                self.release()  # got the slot as we were cancelled: pass it on
            else:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.num_active -= 1

    @asynccontextmanager
    async def slot(self):
        """`async with admission.slot():` holds one slot for the body."""
        await self.acquire()
        try:
            yield
        finally:
            self.release()
