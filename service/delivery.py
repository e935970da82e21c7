"""Delivery of one generation call's stream: the stall watchdog and the admission slot given back while its reader
stalls (service.frontdoor runs it for every generation API)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from tokenloop.looper.stream import Complete

log = logging.getLogger("tokenloop.service")


class StallWatchdog:
    """Acts when the handler's writes make no progress (a reader that stopped reading): after `grace` it calls
    `on_slow` once per stall (the stream gives back its slot), after `timeout` it cancels the handler's task.

    grpc.aio resumes a streaming handler only after its yielded message was accepted, so a reader
    that stops reading (and HTTP/2 flow control filling up) parks the handler at `yield`; the
    cancellation then runs its cleanup, which cancels the request and frees its KV blocks.
    The handler (FrontDoor.generate) sets `writing` while it writes a batch and counts each accepted message in
    `sent`: two attribute writes per batch and an increment per message, no call. One timer per stream, from its
    creation to `close()`, looks every `period` (a quarter of the grace, else the timeout): a look that finds the
    handler writing, `sent` where the previous look left it, and the previous look writing too, counts one still
    period; any other look starts over. So a write that stopped is seen a grace to a grace and a quarter after its
    last progress, and cut off once the still periods add up to `timeout` (without a grace: one to two timeouts).
    """

    __slots__ = ("timeout", "grace", "period", "on_slow", "task", "timer", "loop", "writing", "sent", "seen",
                 "was_writing", "still_s")

    def __init__(self, timeout: float, grace: float = 0.0, on_slow: Callable[[], None] | None = None):
        self.timeout = timeout  # 0: never cancel
        use_grace = on_slow is not None and grace > 0 and (timeout == 0 or grace < timeout)
        self.grace = grace if use_grace else 0.0
        self.period = grace / 4 if use_grace else timeout
        self.on_slow = on_slow if use_grace else None
        self.task = asyncio.current_task()
        self.loop = asyncio.get_running_loop()
        self.writing = False  # the handler is writing a batch (set and cleared by it)
        self.sent = 0  # messages grpc accepted (the handler counts them)
        self.seen = 0  # `sent` when the timer last looked
        self.was_writing = False  # `writing` when the timer last looked
        self.still_s = 0.0  # seconds of looks in a row that found no progress
        self.timer = self.loop.call_later(self.period, self._check) if self.period > 0 else None

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check(self) -> None:
        self.timer = None
        if self.task.done():
            return  # the handler is gone
        if not (self.writing and self.was_writing) or self.sent != self.seen:
            # waiting for tokens, a write that began since the last look, or progress: look again one period later
            self.seen, self.still_s = self.sent, 0.0
            self.period = self.grace / 4 or self.timeout
        else:
            slow = self.still_s < self.grace  # not yet a slow reader
            self.still_s += self.period
            if self.timeout > 0 and self.still_s >= self.timeout - 1e-9:
                log.warning("a reader stopped reading for %.1fs: aborting its stream", self.timeout)
                self.task.cancel()
                return
            if slow and self.still_s >= self.grace - 1e-9:
                self.on_slow()
                self.period = self.grace if self.timeout > 0 else self.grace / 4  # till the timeout, look less often
        self.was_writing = self.writing
        self.timer = self.loop.call_later(self.period, self._check)


class Delivery:
    """One Generate call's delivery of its request stream, shared by both APIs' handlers: the stall watchdog, the
    admission slot (given back while the reader stalls, taken again when it reads), the `Complete`s seen, and on
    the way out (a return, an error, a cancellation at `yield`) the cancel of a request that did not finish and
    `app.observe_end`. The per-message loop stays in each handler: a shared async generator would be one more
    frame to resume for every message."""

    __slots__ = ("app", "valid", "stream", "slot", "watchdog", "completes", "streamed", "paused")

    def __init__(self, app, valid, stream, slot=None):
        self.app, self.valid, self.stream, self.slot = app, valid, stream, slot
        self.watchdog = StallWatchdog(app.config.stall_timeout, getattr(app.config, "slow_reader_grace", 0.0),
                                      self._slow if slot is not None else None)
        self.completes: list[Complete] = []
        self.streamed: dict[int, int] = {}  # sequence index -> tokens its chunks carried (what a cut-short one made)
        self.paused = False  # the slot was given back; `resume()` before reading the stream again

    def __enter__(self) -> Delivery:
        return self

    def delivered(self, batch: list) -> None:
        """Every message of `batch` was written: its `Complete`s are kept (for `app.observe_end`), its streamed
        tokens counted per sequence."""
        for e in batch:
            if type(e) is tuple:  # a TokenDelta
                self.streamed[e[0]] = self.streamed.get(e[0], 0) + len(e[2])
            elif type(e) is Complete:
                self.completes.append(e)
            else:
                self.streamed[e.index] = self.streamed.get(e.index, 0) + len(e.token_ids)

    def _slow(self) -> None:
        """The reader stopped reading: give the slot to another request, pausing this one's generation (an
        executor that cannot pause keeps generating: the slot stays, as before --slow-reader-grace)."""
        stream = self.stream
        if self.paused or not (stream.ended or self.app.looper.can_pause):
            return
        self.paused = True
        stream.pause()  # no-op once generation ended
        self.slot.give_back()

    async def resume(self) -> None:
        """The reader reads again: take a slot (in line, within --max-queue-wait) and resume generation."""
        if not (self.stream.ended or self.stream.cancelled):  # a cancelled one only delivers its end
            await self.slot.take_again()
            self.stream.resume()
        self.paused = False

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.watchdog.close()
        stream = self.stream
        if not stream.finished:
            stream.cancel()  # client gone, deadline, stalled reader, or server abort
        self.app.observe_end(self.valid, self.completes, grpc.StatusCode.OK if stream.finished else None,
                             self.streamed)
        return False
