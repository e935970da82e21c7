"""Per-request output streams: what the looper hands to the event loop, and how it is read.

The looper thread never touches asyncio objects directly: it batches the events of one
poll for every request and makes one `loop.call_soon_threadsafe` hand-off per poll
(`Looper._fan_out`). On the event loop, `RequestStream.batches()` yields every event that
arrived since the last read, so a slow reader naturally gets coalesced batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from tokenloop.core.executor import ErrorKind
from tokenloop.core.request import FinishReason, ValidRequest


@dataclass(slots=True)
class TokenLogprob:
    """Log probability of one generated token and its best alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Chunk:
    """New text and tokens of one sequence."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    cached_prompt_tokens: int = 0  # prompt tokens served from the executor's prefix cache (the router API's chunks)


@dataclass(slots=True)
class Timing:
    """Seconds from arrival: to executor acceptance, to first token, to the end."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0


@dataclass(slots=True)
class Complete:
    """The end of one sequence: the whole output and why it ended."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    prompt_tokens: int
    seed: int
    timing: Timing
    matched_stop_str: str | None = None
    matched_stop_token: int | None = None
    logprobs: list[TokenLogprob] | None = None
    cached_prompt_tokens: int = 0  # prompt tokens served from the executor's prefix cache
    draft_tokens: int = 0  # speculative decoding: tokens drafted for this sequence
    accepted_draft_tokens: int = 0  # of which its verifications accepted
    embedding: list[float] | None = None  # an embedding request's vector (ValidRequest.embed); no tokens, no text

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


# One plain decode step of a streamed sequence as the looper's in-line decode queues it (Looper._pull_steps):
# (sequence index, text, token ids, cached prompt tokens), the fields of the Chunk it stands for. A tuple, made once
# per token, costs a sixth of a Chunk to make and free; a writer sends it as it is (StreamWriter) or as
# `as_chunk(delta)` (SequenceWriter).
TokenDelta = tuple[int, str, list[int], int]

Event = Chunk | Complete | TokenDelta


def as_chunk(event: Event) -> Chunk | Complete:
    """The event, a TokenDelta as the Chunk it stands for."""
    return Chunk(event[0], event[1], event[2], None, event[3]) if type(event) is tuple else event


class RequestFailed(Exception):
    """Raised from `RequestStream.batches()` when a request ends in an error."""

    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


class RequestStream:
    """The event-loop side of one request: events pushed by the looper, read by a servicer."""

    __slots__ = ("request", "_events", "_waiter", "_done", "_error", "_on_cancel", "_on_pause", "cancelled",
                 "executor_id")

    def __init__(self, request: ValidRequest, on_cancel: Callable[[RequestStream], None],
                 on_pause: Callable[[RequestStream, bool], None] | None = None):
        self.request = request
        self._events: list[Event] = []  # pushed, not yet read
        self._waiter: asyncio.Future | None = None
        self._done = False
        self._error: RequestFailed | None = None
        self._on_cancel = on_cancel
        self._on_pause = on_pause
        self.cancelled = False
        self.executor_id: int | None = None  # written by the looper thread only

    # -- event-loop side, called by the looper's batched hand-off --------------------------
    def push(self, events: list[Event]) -> bool:
        """Append events (the list is the stream's from now on) and wake the reader. True when the reader had not
        yet read the events pushed before (it is behind)."""
        if self._events:
            self._events += events
            return True
        self._events = events
        waiter = self._waiter  # as _wake(), inline: one call less per stream per hand-off
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return False

    def end(self, error: RequestFailed | None = None) -> None:
        """No more events will come: the request finished, or failed with `error`; wake the reader."""
        if error is not None and self._error is None:
            self._error = error
        self._done = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- reader side -----------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._done and not self._events

    @property
    def ended(self) -> bool:
        """No more events will come (some may still be unread)."""
        return self._done

    def pending(self) -> int:
        """Events waiting to be read."""
        return len(self._events)

    def take(self) -> list[Event]:
        """Every event that arrived since the last read, without waiting (empty when none: then `next_batch`)."""
        batch = self._events
        if batch:
            self._events = []
        return batch

    async def next_batch(self) -> list[Event] | None:
        """Every event that arrived since the last read (waiting for one); None at the end; raises
        RequestFailed on error. A plain coroutine: cheaper per read than the `batches()` generator."""
        while True:
            if self._events:
                batch, self._events = self._events, []
                return batch
            if self._error is not None:
                raise self._error
            if self._done:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Yield every event that arrived since the last read; raise RequestFailed on error."""
        while (batch := await self.next_batch()) is not None:
            yield batch

    async def events(self) -> AsyncIterator[Chunk | Complete]:
        """Yield events one at a time, a TokenDelta as its Chunk."""
        async for batch in self.batches():
            for event in batch:
                yield as_chunk(event)

    def cancel(self) -> None:
        """Ask the looper to cancel this request (idempotent; no-op once finished)."""
        if self.cancelled or self._done:
            return
        self.cancelled = True
        self._on_cancel(self)

    def pause(self) -> None:
        """Ask the looper to pause generation (the executor frees the request's KV blocks); no-op once ended."""
        if self._on_pause is not None and not self._done and not self.cancelled:
            self._on_pause(self, True)

    def resume(self) -> None:
        """Ask the looper to resume a paused generation where it stopped."""
        if self._on_pause is not None and not self._done and not self.cancelled:
            self._on_pause(self, False)
