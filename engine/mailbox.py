"""The engine's handoff between the looper thread and the engine thread: commands in, steps out, the engine's death.

One lock and a condition per direction: the looper thread posts (`post_request`, `post_cancel`, ...) and waits for
steps (`await_steps`); the engine thread takes the posted commands (`take`, blocking while it has nothing to do) and
publishes steps (`publish`). The engine's load record (`ExecutorStats`) is written and read under the same lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from tokenloop.core.executor import EngineDeadError, ExecutorStats, Step, merge_steps
from tokenloop.core.request import ValidRequest

SHUTTING_DOWN = "the engine is shutting down"


@dataclass
class Commands:
    """What the looper thread posted since the engine thread last took: in the order of each kind's calls."""

    new: list[tuple[int, ValidRequest, Any]] = field(default_factory=list)  # (request id, request, its LoRA or None)
    cancels: list[int] = field(default_factory=list)
    pauses: list[tuple[int, bool]] = field(default_factory=list)  # (request id, pause?): pause() / resume()
    flushes: list[Future] = field(default_factory=list)  # flush_cache() calls waiting for the engine thread

    def __bool__(self) -> bool:
        return bool(self.new or self.cancels or self.pauses or self.flushes)


class Mailbox:
    """The engine's two-way handoff (module docstring); `dead` is the reason the engine died, or None."""

    def __init__(self, stats: ExecutorStats):
        self.stats = stats  # written by `publish`'s refresh, under the lock
        self.dead: str | None = None
        self._lock = threading.Lock()
        self._has_input = threading.Condition(self._lock)
        self._has_output = threading.Condition(self._lock)
        self._commands = Commands()
        self._outputs: list[Step] = []
        self._stopping = False
        self._woken = False  # wake() was called: the next (or current) await_steps returns at once
        self._on_death: Callable[[str], None] | None = None

    # --- the looper thread (and any other caller of the Executor protocol) ---

    def post_request(self, request_id: int, request: ValidRequest, lora: Any) -> None:
        """Hand a request to the engine thread; EngineDeadError once the engine is dead or shutting down."""
        self._post(lambda c: c.new.append((request_id, request, lora)), refuse_when_dead=True)

    def post_cancel(self, request_id: int) -> None:
        self._post(lambda c: c.cancels.append(request_id))

    def post_pause(self, request_id: int, pause: bool) -> None:
        self._post(lambda c: c.pauses.append((request_id, pause)))

    def post_flush(self, done: Future) -> None:
        """`done` gets the number of dropped blocks from the engine thread; EngineDeadError as for post_request."""
        self._post(lambda c: c.flushes.append(done), refuse_when_dead=True)

    def _post(self, add: Callable[[Commands], None], refuse_when_dead: bool = False) -> None:
        with self._lock:
            if refuse_when_dead and (self.dead or self._stopping):
                raise EngineDeadError(self.dead or SHUTTING_DOWN)
            add(self._commands)
            self._has_input.notify()

    def await_steps(self, timeout: float) -> list[Step]:
        """Block up to `timeout` s for steps; EngineDeadError once the engine is dead and its steps are taken."""
        with self._lock:
            if not self._outputs and not self.dead and not self._woken:
                self._has_output.wait(timeout)
            self._woken = False
            if self.dead and not self._outputs:
                raise EngineDeadError(self.dead)
            outputs, self._outputs = self._outputs, []
        return merge_steps(outputs)

    def wake(self) -> None:
        """Make a blocked (or the next) `await_steps` return now."""
        with self._lock:
            self._woken = True
            self._has_output.notify_all()

    def snapshot(self) -> ExecutorStats:
        """The load record as of the last publish, the requests posted and not yet taken counted as waiting."""
        with self._lock:
            return dataclasses.replace(self.stats, num_waiting=self.stats.num_waiting + len(self._commands.new))

    def stop(self) -> None:
        """The engine thread's next `take` returns None; later requests and flushes are refused."""
        with self._lock:
            self._stopping = True
            self._has_input.notify()

    def set_death_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` once, when the engine dies (at once when it is dead already)."""
        with self._lock:
            self._on_death = callback
            dead = self.dead
        if dead is not None:
            callback(dead)

    # --- the engine thread ---

    def take(self, has_work: Callable[[], bool], wait: bool = True) -> Commands | None:
        """The commands posted since the last take; with `wait`, blocks while there are none and not `has_work()`.
        None once `stop()` was called."""
        with self._lock:
            while wait and not (self._stopping or self._commands or has_work()):
                self._has_input.wait()
            if self._stopping:
                return None
            commands, self._commands = self._commands, Commands()
        return commands

    def publish(self, steps: list[Step], refresh: Callable[[ExecutorStats], None]) -> None:
        """Hand `steps` to await_steps, with `refresh(stats)` (the engine's load as it is now) done under the lock."""
        with self._lock:
            self._outputs.extend(steps)
            refresh(self.stats)
            if steps:
                self._has_output.notify_all()

    def fail_flushes(self, message: str) -> None:
        """The flushes still waiting get EngineDeadError(message) (the engine stopped or died)."""
        with self._lock:
            flushes, self._commands.flushes = self._commands.flushes, []
        for done in flushes:
            done.set_exception(EngineDeadError(message))

    def die(self, message: str) -> None:
        """The engine is dead: waiters wake to EngineDeadError(message), flushes fail, the death callback runs."""
        with self._lock:
            self.dead = message
            self._has_output.notify_all()
            callback = self._on_death
        self.fail_flushes(message)
        if callback is not None:
            callback(message)
