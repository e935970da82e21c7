"""What the event loop (and an executor's death callback) asks of the looper thread: one small type per command,
put in the looper's channel and dispatched by type in `Looper._drain_channel`."""

from __future__ import annotations

from dataclasses import dataclass

from .stream import RequestFailed, RequestStream


@dataclass(frozen=True, slots=True)
class Submit:
    """Enqueue the stream's request in the executor (`arrival`: time.monotonic() when the call arrived)."""

    stream: RequestStream
    arrival: float


@dataclass(frozen=True, slots=True)
class Cancel:
    """Cancel the stream's request in the executor (it then ends CANCELLED); a request not yet enqueued never is."""

    stream: RequestStream


@dataclass(frozen=True, slots=True)
class Pause:
    """Pause (`pause=True`) or resume the stream's generation: a stalled reader's request frees its KV blocks."""

    stream: RequestStream
    pause: bool


@dataclass(frozen=True, slots=True)
class FailAll:
    """End every request, queued or running, with `error` (shutting down)."""

    error: RequestFailed


@dataclass(frozen=True, slots=True)
class ExecutorDied:
    """The executor reported its death while the looper waited on the channel."""

    reason: str


@dataclass(frozen=True, slots=True)
class Stop:
    """Leave the loop (after FailAll): the looper thread ends."""


Command = Submit | Cancel | Pause | FailAll | ExecutorDied | Stop
