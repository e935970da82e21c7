"""Fault injection for tests and the soak suite: an executor proxy that fails on purpose.

Enabled by the debug environment variable `TOKENLOOP_DEBUG_FAULT` (never set it in production),
a comma-separated list of:

- `step:N` — after N polls with requests in flight, `await_responses` raises EngineDeadError
  (the executor "dies": every open stream gets UNAVAILABLE and `tokenloop serve` exits 1).
- `request:MARKER` — a request whose prompt text contains MARKER fails alone with
  "generation failed: injected fault" (INTERNAL), as if the engine step failed only that request.
- `forward:N` (embedded engine only) — every model forward after the first N raises: a fault no request
  explains, so after MAX_CONSECUTIVE_STEP_FAILURES failed steps the engine dies (also while idle afterwards).
- `position:N` (embedded engine only) — a model forward over a batch that reaches position N raises: the engine
  runs each sequence alone, and only a request whose prompt (or output) reaches N tokens fails (INTERNAL).
"""

from __future__ import annotations

import logging
import threading

from tokenloop.core.executor import EngineDeadError, Executor, ExecutorStats, Step
from tokenloop.core.request import ValidRequest

log = logging.getLogger("tokenloop.faults")

FAULT_ENV = "TOKENLOOP_DEBUG_FAULT"


def parse_fault_spec(spec: str) -> dict[str, object]:
    """`"step:40,request:BOOM"` -> {"step": 40, "request": "BOOM"}; ValueError on anything else."""
    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        kind, _, value = part.partition(":")
        if kind == "step" and value.isdigit():
            out["step"] = int(value)
        elif kind == "request" and value:
            out["request"] = value
        elif kind in ("forward", "position") and value.isdigit():
            out[kind] = int(value)
        else:
            raise ValueError(f"{FAULT_ENV}: expected step:N, request:MARKER, forward:N or position:N, got {part!r}")
    return out


class FaultyExecutor:
    """Delegates to `inner`, injecting the faults of a parsed spec."""

    def __init__(self, inner: Executor, die_after_polls: int | None = None, request_marker: str = ""):
        self.inner = inner
        self.die_after_polls = die_after_polls
        self.request_marker = request_marker
        self.num_polls = 0
        self._doomed: list[int] = []
        self._lock = threading.Lock()

    def __getattr__(self, name):  # dtype, config, ... of the real executor
        return getattr(self.inner, name)

    def enqueue(self, request: ValidRequest) -> int:
        rid = self.inner.enqueue(request)
        if self.request_marker and self.request_marker in request.prompt_text:
            with self._lock:
                self._doomed.append(rid)
        return rid

    def await_responses(self, timeout: float) -> list[Step]:
        self.num_polls += 1
        if self.die_after_polls is not None and self.num_polls > self.die_after_polls:
            raise EngineDeadError(f"injected fault after {self.die_after_polls} polls ({FAULT_ENV})")
        with self._lock:
            doomed, self._doomed = self._doomed, []
        steps = [s for s in self.inner.await_responses(timeout) if s.executor_id not in doomed]
        return steps + [Step(rid, 0, [], is_final=True, error="injected fault") for rid in doomed]

    def cancel(self, request_id: int) -> None:
        self.inner.cancel(request_id)

    def stats(self) -> ExecutorStats:
        return self.inner.stats()

    def shutdown(self) -> None:
        self.inner.shutdown()


def break_forward(engine, after: int | None = None, position: int | None = None) -> None:
    """Make the embedded engine's model forward raise: every forward after the first `after`, and every forward
    over a batch that reaches `position`."""
    model = getattr(engine, "model", None)
    if model is None:
        raise ValueError(f"{FAULT_ENV}: forward:N and position:N need the embedded engine")
    real, count = model.forward, [0]

    def forward(batch):
        count[0] += 1
        if after is not None and count[0] > after:
            raise RuntimeError(f"injected forward fault after {after} forwards ({FAULT_ENV})")
        if position is not None and int(batch.positions.max()) >= position:
            raise RuntimeError(f"injected forward fault: position {position} in the batch ({FAULT_ENV})")
        return real(batch)

    model.forward = forward


def with_faults(executor: Executor, spec: str) -> Executor:
    """Wrap `executor` when `spec` (the value of TOKENLOOP_DEBUG_FAULT) asks for faults."""
    faults = parse_fault_spec(spec)
    if not faults:
        return executor
    log.warning("%s=%s: injecting faults (debug only)", FAULT_ENV, spec)
    if "forward" in faults or "position" in faults:
        break_forward(executor, faults.get("forward"), faults.get("position"))
    if "step" not in faults and "request" not in faults:
        return executor
    return FaultyExecutor(executor, faults.get("step"), faults.get("request", ""))
