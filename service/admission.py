"""Bounded admission: at most `max_concurrent` requests in flight and `max_queue` waiting for a slot.

Past both limits a request is refused at once with RESOURCE_EXHAUSTED (TGI's
`try_acquire_owned()` at the door), never parked in an unbounded queue; one that waits
longer than its wait bound (--max-queue-wait) is refused the same way, with its own message.
A request holds its claim as a `Slot`: abortable by id until it reaches the looper, given back
while its reader stalls (its generation paused) and taken again, through the same line, when
the reader reads again.

The line is fair between peers (a peer is one client connection, grpc's `context.peer()`), as a
fair queue is between flows: a freed slot goes to the waiting request whose peer holds the fewest
slots (first come, first served among equals), and when the line is full, a newcomer from a peer
with fewer waiting requests than the peer with the most takes the place of that peer's newest
waiter (which is refused as a full line would refuse it). One connection opening hundreds of
streams therefore cannot keep another connection's request waiting behind all of them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from contextlib import asynccontextmanager

from .errors import AlreadyExists, Cancelled, Overloaded, QueueTimeout, Unavailable

RETRY_PUSHBACK_MS = "500"
PUSHBACK = (("grpc-retry-pushback-ms", RETRY_PUSHBACK_MS),)


class Slot:
    """One request's claim: waiting, held, or given back while its generation is paused."""

    __slots__ = ("admission", "request_id", "max_wait", "peer", "held", "aborted", "waiter")

    def __init__(self, admission: Admission, request_id: str, max_wait: float, peer: str = ""):
        self.admission = admission
        self.request_id = request_id
        self.max_wait = max_wait  # seconds a wait for the slot may take (0: no bound)
        self.peer = peer  # the client connection (grpc's context.peer()): the unit of fairness
        self.held = False
        self.aborted = False  # Abort named it before it reached the looper
        self.waiter: asyncio.Future | None = None  # while it waits in the line

    def give_back(self) -> None:
        """Release the slot for another request (the caller paused this one's generation)."""
        if self.held:
            self.held = False
            self.admission.release(self.peer)

    async def take_again(self) -> None:
        """Wait for a slot again, in line with new arrivals (not refused for a full line or while draining: this
        request was admitted once), within the same wait bound."""
        if not self.held:
            await self.admission.acquire(self, again=True)

    def check_aborted(self) -> None:
        """Raise Cancelled when Abort named this request while it waited (call it right before the submit)."""
        if self.aborted:
            raise Cancelled(f"request {self.request_id!r} was aborted (Abort) while waiting for admission")


class _Waiter:
    """A place in the line."""

    __slots__ = ("future", "peer")

    def __init__(self, future: asyncio.Future, peer: str):
        self.future, self.peer = future, peer


class Admission:
    """A slot counter with a bounded waiting line, fair between peers, closed while draining."""

    def __init__(self, max_concurrent: int, max_queue: int):
        if max_concurrent < 1 or max_queue < 0:
            raise ValueError("max_concurrent must be >= 1 and max_queue >= 0")
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.num_active = 0
        self._waiters: deque[_Waiter] = deque()  # arrival order
        self._held: dict[str, int] = {}  # peer -> slots its requests hold
        self._pending: dict[str, Slot] = {}  # request id -> claim, from arrival until the looper has it
        self.closed_reason = ""

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @property
    def num_pending(self) -> int:
        """Requests that claimed their id (`slot`) and are not yet with the looper (`submitted`) nor gone."""
        return len(self._pending)

    def close(self, reason: str) -> None:
        """Refuse every new request (draining); requests already admitted carry on."""
        self.closed_reason = reason

    def _refuse_if_closed(self) -> None:
        if self.closed_reason:
            raise Unavailable(self.closed_reason)

    async def acquire(self, slot: Slot | None = None, again: bool = False) -> None:
        """Take a slot (for `slot`, which then holds it); raises Overloaded when the line is full, QueueTimeout
        past `slot.max_wait`, Cancelled when aborted while waiting."""
        if not again:
            self._refuse_if_closed()
        peer = slot.peer if slot is not None else ""
        if self.num_active < self.max_concurrent and not self._waiters:
            self.num_active += 1
            self._held[peer] = self._held.get(peer, 0) + 1
            if slot is not None:
                slot.held = True
            return
        if len(self._waiters) >= self.max_queue and not again:
            self._make_room(peer)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop.create_future(), peer)
        self._waiters.append(waiter)
        timer = None
        if slot is not None:
            slot.waiter = waiter.future
            if slot.max_wait > 0:
                timer = loop.call_later(slot.max_wait, _expire, waiter.future, slot.max_wait)
        try:
            await waiter.future  # the releasing request hands its slot over (num_active unchanged)
        except BaseException:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(peer)  # got the slot as we were cancelled: pass it on
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if slot is not None:
                slot.waiter = None
        if slot is not None:
            slot.held = True

    def _make_room(self, peer: str) -> None:
        """The line is full: refuse the newcomer from `peer`, unless another peer has more requests waiting, whose
        newest waiter is then refused in its place."""
        counts: dict[str, int] = {}
        for w in self._waiters:
            if not w.future.done():
                counts[w.peer] = counts.get(w.peer, 0) + 1
        heaviest = max(counts, key=counts.__getitem__, default=None)
        refusal = Overloaded(
            f"the server is at capacity ({self.max_concurrent} requests in flight, {self.max_queue} "
            "waiting); retry later", trailers=PUSHBACK)
        if heaviest is None or counts[heaviest] <= counts.get(peer, 0) + 1:
            raise refusal
        victim = next(w for w in reversed(self._waiters) if w.peer == heaviest and not w.future.done())
        self._waiters.remove(victim)
        victim.future.set_exception(refusal)

    def release(self, peer: str = "") -> None:
        """A slot held for `peer` is free: hand it to the waiter whose peer holds the fewest slots (the earliest
        among equals), or count it free."""
        held = self._held.get(peer, 0) - 1
        if held > 0:
            self._held[peer] = held
        else:
            self._held.pop(peer, None)
        best = None
        for w in self._waiters:
            if w.future.done():
                continue
            if best is None or self._held.get(w.peer, 0) < self._held.get(best.peer, 0):
                best = w
                if not self._held.get(w.peer, 0):
                    break  # a peer that holds nothing: nobody comes before it
        if best is None:
            self._waiters.clear()  # only finished entries were left
            self.num_active -= 1
            return
        self._waiters.remove(best)
        self._held[best.peer] = self._held.get(best.peer, 0) + 1
        best.future.set_result(None)

    def abort(self, request_id: str) -> bool:
        """Abort a request that has not reached the looper yet: True when one had that id. Waiting in the line,
        it leaves it now; past the line (tokenizing, compiling), it is refused before it is submitted."""
        slot = self._pending.get(request_id)
        if slot is None or slot.aborted:
            return False
        slot.aborted = True
        if slot.waiter is not None and not slot.waiter.done():
            slot.waiter.set_exception(Cancelled(f"request {request_id!r} was aborted (Abort) while waiting for "
                                                "admission"))
        return True

    def submitted(self, slot: Slot) -> None:
        """The request reached the looper: Abort finds it there from now on."""
        if self._pending.get(slot.request_id) is slot:
            del self._pending[slot.request_id]

    @asynccontextmanager
    async def slot(self, request_id: str = "", max_wait: float = 0.0, peer: str = ""):
        """`async with admission.slot(rid, max_wait, peer) as slot:` holds one slot for the body (unless given
        back); `peer` is the client connection, the unit of fairness in the line."""
        claim = Slot(self, request_id, max_wait, peer)
        if request_id:
            if request_id in self._pending:
                raise AlreadyExists(f"`request_id` {request_id!r} is already waiting for admission")
            self._pending[request_id] = claim
        try:
            await self.acquire(claim)
            yield claim
        finally:
            self.submitted(claim)
            claim.give_back()


def _expire(waiter: asyncio.Future, max_wait: float) -> None:
    if not waiter.done():
        waiter.set_exception(QueueTimeout(
            f"the request waited {max_wait:g} s for a slot (--max-queue-wait) without getting one: the server is "
            "busy; retry later", trailers=PUSHBACK))
