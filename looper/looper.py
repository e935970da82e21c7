"""The looper: one thread between the gRPC event loop and the executor.

A port of TGI's `backends/trtllm/src/looper.rs`, with its faults fixed: it blocks on the
channel when idle and on the executor's own wait when busy (no spinning), every request
leaves the in-flight map on every path, stop strings are honoured, and a dead executor
fails every open stream and is reported to health.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable

from tokenloop.core.capabilities import Capabilities
from tokenloop.core.executor import EngineDeadError, Executor, Step, merge_steps
from tokenloop.core.request import ValidRequest
from tokenloop.core.threads import name_this_thread

from .commands import Cancel, Command, ExecutorDied, FailAll, Pause, Stop, Submit
from .detokenizer import Decoder
from .outputs import Outbox, RequestState
from .stream import ErrorKind, Event, RequestFailed, RequestStream

log = logging.getLogger("tokenloop.looper")

_DEADLINE_CHECK_S = 0.005  # deadlines are checked at most this often (a scan of the in-flight map)
# the event loop is behind its readers when most streams a hand-off gives events to (and at least this many) had not
# read the events of the hand-off before (Looper.readers_behind)
_BEHIND_MIN = 4


class Looper:
    """Drains the channel, drives the executor, fans steps out to request streams."""

    def __init__(self, executor: Executor, tokenizer: Decoder, *, poll_timeout: float = 0.02,
                 on_death: Callable[[str], None] | None = None, capabilities: Capabilities | None = None,
                 on_behind: Callable[[bool], None] | None = None):
        """`on_behind(behind)` is called on the looper thread when the event loop falls behind its readers (True) and
        when it catches up (False); the server gives the looper thread a scheduling policy by it (service.placement)."""
        self.executor = executor
        self._tokenizer = tokenizer
        self._poll_timeout = poll_timeout
        self._on_death = on_death
        self._channel: queue.SimpleQueue = queue.SimpleQueue()
        abilities = capabilities or Capabilities.of(executor)  # the service reads them where it builds the executor
        # an executor may offer wake(): a command then interrupts its wait instead of waiting up to poll_timeout
        self._wake_executor: Callable[[], None] | None = abilities.wake
        # an executor may offer pause(id) / resume(id): a stalled reader's generation then stops and frees its KV
        self.can_pause = abilities.pause
        self._death_callback = abilities.death_callback
        self._in_flight: dict[int, RequestState] = {}  # executor id -> state (looper thread only)
        self._outbox = Outbox()  # what the next hand-off pushes (looper thread)
        self._handoff = Outbox()  # the hand-off awaiting the event loop (_handoff_lock)
        self._handoff_lock = threading.Lock()
        self._handoff_scheduled = False  # a _deliver is queued on the event loop
        # held from the moment a hand-off is scheduled until the event loop takes it (released by _deliver): the
        # looper waits on it, GIL released, when the event loop is behind (a plain lock: no Python per wait)
        self._handoff_pending = threading.Lock()
        # the last hand-off found most of its readers behind (written by _deliver on the event loop)
        self.readers_behind = False
        self._on_behind = on_behind
        self._told_behind = False  # what on_behind was last told (looper thread)
        self._streams: dict[str, RequestStream] = {}  # request id -> open stream (event loop only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.alive = False
        self.death_reason = ""
        self._next_deadline_check = 0.0

    # -- event-loop side -------------------------------------------------------------------
    def open(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Take requests from now on (they wait in the channel until `start`); events are delivered on `loop`
        (default: the running loop)."""
        self._loop = loop or asyncio.get_running_loop()
        self.alive = True

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the looper thread (`open` first, unless it was); events are delivered on `loop`."""
        if loop is not None or not self.alive:
            self.open(loop)
        if self._death_callback is not None:  # a death while idle wakes the channel wait (see ReportsDeath)
            self._death_callback(lambda reason: self._channel.put(ExecutorDied(reason)))
        self._thread = threading.Thread(target=self._run, name="tokenloop-looper", daemon=True)
        self._thread.start()

    @property
    def thread_id(self) -> int | None:
        """The looper thread's OS id (for placement and per-thread CPU accounting), once started."""
        return self._thread.native_id if self._thread is not None else None

    def submit(self, request: ValidRequest, arrival: float | None = None) -> RequestStream:
        """Queue a validated request; returns its stream (already failed if the looper is dead)."""
        stream = RequestStream(request, self._request_cancel, self._request_pause if self.can_pause else None)
        if not self.alive:
            stream.end(self._dead_error())
            return stream
        self._streams[request.request_id] = stream
        self._command(Submit(stream, arrival if arrival is not None else time.monotonic()))
        return stream

    def find(self, request_id: str) -> RequestStream | None:
        """The open stream of a request id, if any."""
        return self._streams.get(request_id)

    def abort(self, request_id: str) -> bool:
        """Cancel a request by id; False when no open request has that id."""
        stream = self._streams.get(request_id)
        if stream is None or stream.finished or stream.cancelled:
            return False
        stream.cancel()
        return True

    @property
    def num_open(self) -> int:
        """Requests submitted and not yet delivered to the end."""
        return len(self._streams)

    @property
    def num_in_flight(self) -> int:
        """Requests the executor still holds (a racy read of the looper's map, fine for reporting)."""
        return len(self._in_flight)

    def fail_all(self, kind: ErrorKind, message: str) -> None:
        """End every request (queued or running) with an error, cancelling it in the executor."""
        self._command(FailAll(RequestFailed(kind, message)))

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (after failing what is left) and wait for it."""
        if self._thread is None:
            return
        self.fail_all(ErrorKind.UNAVAILABLE, "the server is shutting down")
        self._command(Stop())
        self._thread.join(timeout)
        self.alive = False

    def _request_cancel(self, stream: RequestStream) -> None:
        self._command(Cancel(stream))

    def _request_pause(self, stream: RequestStream, pause: bool) -> None:
        self._command(Pause(stream, pause))

    def _command(self, cmd: Command) -> None:
        """Queue a command for the looper thread; wake the executor's wait when it can be woken, so that a
        new request is submitted now rather than after up to `poll_timeout`."""
        self._channel.put(cmd)
        if self._wake_executor is not None:
            self._wake_executor()

    def _deliver(self) -> None:
        """One hand-off per poll (or fewer, when the event loop is behind): push every stream's events."""
        with self._handoff_lock:
            outbox, self._handoff = self._handoff, Outbox()
            self._handoff_scheduled = False
            self._handoff_pending.release()
        behind = outbox.deliver()
        self.readers_behind = behind >= _BEHIND_MIN and 2 * behind > len(outbox.events)
        for stream in outbox.ends:  # ended for the client: the id is free again
            if self._streams.get(stream.request.request_id) is stream:
                del self._streams[stream.request.request_id]

    def _dead_error(self) -> RequestFailed:
        return RequestFailed(ErrorKind.UNAVAILABLE, f"the executor is not available: {self.death_reason}")

    # -- looper thread ---------------------------------------------------------------------
    def _run(self) -> None:
        """while running: drain the channel, pull steps, fan out."""
        name_this_thread("tokenloop-loopr")
        try:
            while self._drain_channel():  # 1) new requests, cancels
                if self._in_flight:
                    if self._handoff_scheduled and self._handoff_pending.acquire(timeout=self._poll_timeout):
                        self._handoff_pending.release()  # the event loop was behind: it took the hand-off
                    self._pull_steps()  # 2+3) executor steps -> events
                    self._expire_deadlines()
                self._fan_out()  # 4) one hand-off to the event loop
                if self.readers_behind is not self._told_behind and self._on_behind is not None:
                    self._told_behind = self.readers_behind  # 5) the event loop fell behind, or caught up
                    self._on_behind(self._told_behind)
            self._fan_out()  # stopping: deliver what _fail_all queued
        except EngineDeadError as exc:
            self._die(str(exc) or "the executor died")
        except Exception as exc:  # a bug here must not leave streams hanging
            log.exception("looper failed")
            self._die(f"looper failed ({type(exc).__name__})")

    def _drain_channel(self) -> bool:
        """Block for a command when idle, else take what is there. False on stop."""
        channel = self._channel
        idle = not self._in_flight and not self._outbox
        while idle or not channel.empty():  # only this thread takes: a queue not empty has a command now
            cmd = channel.get()
            idle = False
            match cmd:
                case Submit(stream, arrival):
                    self._submit(stream, arrival)
                case Cancel(stream):
                    self._cancel(stream)
                case Pause(stream, pause):
                    self._pause(stream, pause)
                case FailAll(error):
                    self._fail_all(error)
                case ExecutorDied(reason):
                    raise EngineDeadError(reason)
                case Stop():
                    return False
        return True

    def _submit(self, stream: RequestStream, arrival: float) -> None:
        state = RequestState(stream, self._tokenizer, arrival)
        if stream.cancelled:  # cancelled while still in the channel: never reaches the executor
            self._send(state, state.cancel_all(time.monotonic()))
            return
        try:
            state.executor_id = self.executor.enqueue(stream.request)
        except ValueError as exc:
            self._send(state, [], RequestFailed(ErrorKind.INVALID_ARGUMENT, str(exc)))
            return
        except EngineDeadError:
            raise
        except Exception as exc:
            log.exception("enqueue failed for %s", stream.request.request_id)
            self._send(state, [], RequestFailed(ErrorKind.INTERNAL, f"the executor refused the request ({type(exc).__name__})"))
            return
        state.t_enqueued = time.monotonic()
        stream.executor_id = state.executor_id
        self._in_flight[state.executor_id] = state

    def _cancel(self, stream: RequestStream) -> None:
        state = self._in_flight.get(stream.executor_id) if stream.executor_id is not None else None
        if state is not None and state.stream is stream:
            self.executor.cancel(state.executor_id)

    def _pause(self, stream: RequestStream, pause: bool) -> None:
        """Pause or resume a request the executor holds (one that ended or never reached it is left alone)."""
        state = self._in_flight.get(stream.executor_id) if stream.executor_id is not None else None
        if state is not None and state.stream is stream and not state.closed:
            (self.executor.pause if pause else self.executor.resume)(state.executor_id)

    def _pull_steps(self) -> None:
        """2+3) Wait for the executor's steps; each becomes its request's events, queued in the outbox."""
        steps = self.executor.await_responses(self._poll_timeout)
        in_flight = self._in_flight
        if len(steps) > len(in_flight):  # some request got several steps (the merge is optional)
            steps = merge_steps(steps)
        now = time.monotonic()
        queued = self._outbox.events
        for step in steps:
            state = in_flight.get(step.executor_id)
            if state is None:
                continue  # the request already left (it failed)
            if (state.decoding and not step.is_final and step.error is None and step.num_cached_prompt_tokens is None
                    and step.num_draft_tokens is None):
                # decode (the common step): a plain request's new tokens, nothing ends: the text, and a TokenDelta
                # when the request streams, in line (a sequence of a plain request ends only at its final step)
                ids = step.token_ids
                if ids:
                    seq = state.seqs[step.seq_index]
                    text = seq.detok.push(ids)
                    seq.token_ids += ids
                    if text:
                        seq.text_parts.append(text)
                    if state.streaming:
                        delta = (seq.index, text, ids, seq.cached_prompt_tokens)  # a TokenDelta: no Chunk per token
                        events = queued.get(state.stream)
                        if events is None:
                            queued[state.stream] = [delta]
                        else:
                            events.append(delta)
                continue
            # general: a request's first tokens, stop strings, logprobs, a sequence's end, an error
            if step.error is not None:
                self._fail_request(state, step)
                continue
            if not state.closed:
                events = state.apply(step, now)
                if events:  # with its end for the client when apply closed it (its last Complete)
                    self._outbox.add(state.stream, events, state.closed)
                if state.num_open == 0 and not step.is_final:
                    self.executor.cancel(state.executor_id)  # a stop string matched: free the executor's work
            if step.is_final:
                state.num_exec_open -= 1
                if state.num_exec_open == 0:  # the executor is done with it: leave the map
                    del in_flight[state.executor_id]

    def _fail_request(self, state: RequestState, step: Step) -> None:
        """The executor failed this request (and only it): it leaves the map, the client gets the error."""
        del self._in_flight[state.executor_id]
        self.executor.cancel(state.executor_id)
        if not state.closed:
            kind = step.error_kind or ErrorKind.INTERNAL
            message = step.error if kind is ErrorKind.INVALID_ARGUMENT else f"generation failed: {step.error}"
            self._send(state, [], RequestFailed(kind, message))

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        if now < self._next_deadline_check:
            return
        self._next_deadline_check = now + _DEADLINE_CHECK_S
        for state in self._in_flight.values():
            deadline = state.request.deadline
            if deadline is not None and now > deadline and not state.closed:
                self.executor.cancel(state.executor_id)
                self._send(state, [], RequestFailed(ErrorKind.DEADLINE_EXCEEDED, "the request's deadline passed"))

    def _send(self, state: RequestState, events: list[Event], error: RequestFailed | None = None) -> None:
        """Queue events for the next hand-off; marks the request closed when it ends for the client."""
        end = error is not None or state.num_open == 0
        self._outbox.add(state.stream, events, end, error)
        if end:
            state.close()

    def _fan_out(self) -> None:
        """Hand this poll's events to the event loop; merged into the pending hand-off if it has not run yet."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, Outbox()
        with self._handoff_lock:
            if self._handoff:
                self._handoff.merge(outbox)
            else:
                self._handoff = outbox
            if self._handoff_scheduled:
                return
            self._handoff_scheduled = True
            self._handoff_pending.acquire(blocking=False)  # free: the last hand-off was taken
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _fail_all(self, error: RequestFailed) -> None:
        for state in list(self._in_flight.values()):
            if not state.closed:
                self._send(state, [], error)
            self.executor.cancel(state.executor_id)

    def _die(self, reason: str) -> None:
        """The executor is gone: fail every open stream, tell health, keep refusing new work."""
        self.alive = False
        self.death_reason = reason
        log.error("executor died: %s", reason)
        error = self._dead_error()
        for state in self._in_flight.values():
            if not state.closed:
                self._send(state, [], error)
        self._in_flight.clear()
        self._fan_out()
        if self._on_death is not None:
            try:
                self._loop.call_soon_threadsafe(self._on_death, reason)
            except RuntimeError:
                pass
        self._refuse_until_stop(error)

    def _refuse_until_stop(self, error: RequestFailed) -> None:
        """After death: fail whatever still arrives in the channel until stop()."""
        while True:
            match self._channel.get():
                case Stop():
                    return
                case Submit(stream, arrival):
                    self._send(RequestState(stream, self._tokenizer, arrival), [], error)
                    self._fan_out()

