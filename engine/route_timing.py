"""Online re-timing of the quantized products' routes, on real steps (`--route-retiming`; docs/engine.md,
"Re-timing routes while serving").

The start-up calibration (matmul.MatmulPolicy.calibrate_quant) times each route once; a server started while the
machine was busy keeps what it timed then (two threads lose to one under load, and the choice is cached). While
serving, `RouteTimer` runs one step in `period` of each step size (bucket) on another candidate route and compares
it like with like: with the incumbent's steps right before and right after it, of the same number of rows. Each
such trial gives one ratio (the candidate's step time over the mean of its neighbours'); when the median of a
candidate's last `window` ratios is below `margin`, it becomes the bucket's route, with a log line. Pairing
neighbours keeps what the machine was doing at the time out of the comparison: a candidate tried during a quiet
minute is not compared with an incumbent timed under load, nor the other way round.

The candidates are the routes of the incumbent's family that the calibration chose for some bucket, each on one
thread and on two: they give the same bits (a family's routes compute every output alike; a two-thread split
divides the output channels), so switching changes no token, only the time.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .calibration import BUCKETS

log = logging.getLogger(__name__)


def bucket_of(num_tokens: int) -> int:
    """The calibration's bucket of a step of `num_tokens` rows (the smallest that holds it, else the largest)."""
    return next((b for b in BUCKETS if num_tokens <= b), BUCKETS[-1])


@dataclass(slots=True)
class Trial:
    """One step: its rows, its bucket, the candidate it tried (None: the incumbent) and when it began."""

    num_tokens: int
    bucket: int
    candidate: tuple | None = None
    started: float = 0.0


@dataclass(slots=True)
class Pending:
    """A candidate's step waiting for the incumbent's step after it: its rows, its time, the one before it."""

    candidate: tuple
    num_tokens: int
    seconds: float
    before: float | None


@dataclass
class RouteTimer:
    """Re-times `policy.qroutes` (bucket -> (QuantRoute, split)) on real steps; `begin` before a step's forward,
    `end` after it (times read from `clock`)."""

    policy: object  # matmul.MatmulPolicy
    period: int = 25  # one step in `period` of a bucket tries a candidate (4 %)
    window: int = 9  # paired ratios kept per candidate; a switch needs this many
    margin: float = 0.93  # a candidate whose median ratio to the incumbent is below this replaces it
    clock: Callable[[], float] = time.perf_counter
    candidates: dict[int, list[tuple]] = field(default_factory=dict)
    ratios: dict[tuple[int, tuple], deque] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
    last: dict[int, tuple[int, float]] = field(default_factory=dict)  # bucket -> the incumbent's last (rows, s)
    pending: dict[int, Pending] = field(default_factory=dict)
    num_switches: int = 0
    incumbent: tuple | None = None  # the route a trial step displaced, put back by `end`

    def __post_init__(self):
        chosen = {route for route, _ in self.policy.qroutes.values()}
        for bucket, (route, _) in self.policy.qroutes.items():
            same_bits = sorted((r for r in chosen if r.family == route.family), key=lambda r: r.name)
            self.candidates[bucket] = [(r, split) for r in same_bits for split in (False, True)]

    def begin(self, num_tokens: int) -> Trial:
        """Before a step of `num_tokens` rows: every `period`-th step of its bucket runs the next candidate."""
        bucket = bucket_of(num_tokens)
        count = self.counts[bucket] = self.counts.get(bucket, 0) + 1
        others = [c for c in self.candidates.get(bucket, ()) if c != self.policy.qroutes[bucket]]
        if not others or count % self.period:
            return Trial(num_tokens, bucket, started=self.clock())
        candidate = others[(count // self.period) % len(others)]
        self.incumbent = self.policy.qroutes[bucket]
        self.policy.qroutes[bucket] = candidate
        return Trial(num_tokens, bucket, candidate, self.clock())

    def end(self, trial: Trial) -> None:
        """After the step: put the incumbent back; pair a candidate's time with the incumbent's neighbouring steps
        of the same size, and switch when a candidate measures faster."""
        seconds = self.clock() - trial.started
        bucket = trial.bucket
        if trial.candidate is not None:  # 1. a trial: wait for the incumbent's next step
            self.policy.qroutes[bucket] = self.incumbent
            rows, before = self.last.get(bucket, (None, None))
            self.pending[bucket] = Pending(trial.candidate, trial.num_tokens, seconds,
                                           before if rows == trial.num_tokens else None)
            return
        self.last[bucket] = (trial.num_tokens, seconds)  # 2. the incumbent: the trial before it gets its pair
        waiting = self.pending.pop(bucket, None)
        if waiting is None or waiting.num_tokens != trial.num_tokens:
            return
        around = seconds if waiting.before is None else (waiting.before + seconds) / 2
        self.ratios.setdefault((bucket, waiting.candidate), deque(maxlen=self.window)).append(
            waiting.seconds / around)
        self._compare(bucket, waiting.candidate)

    def _compare(self, bucket: int, candidate: tuple) -> None:
        mine = self.ratios[(bucket, candidate)]
        if len(mine) < self.window:
            return
        ratio = statistics.median(mine)
        if ratio < self.margin:
            incumbent = self.policy.qroutes[bucket]
            self.policy.qroutes[bucket] = candidate
            self.num_switches += 1
            log.info("matmul: steps of <=%d tokens switch from %s to %s (median %.3f of the step time on the "
                     "incumbent's neighbouring steps of the same size, over %d trials)", bucket,
                     describe(incumbent), describe(candidate), ratio, self.window)
            for key in [k for k in self.ratios if k[0] == bucket]:
                del self.ratios[key]  # start the comparison afresh around the new incumbent
            self.last.pop(bucket, None)


def describe(route: tuple) -> str:
    name = getattr(route[0], "name", str(route[0]))
    return f"{name} {'2 threads' if route[1] else '1 thread'}"
