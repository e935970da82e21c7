"""Online re-timing of the quantized products' routes, on real steps (`--route-retiming`; docs/engine.md,
"Re-timing routes while serving").

The start-up calibration (matmul.MatmulPolicy.calibrate_quant) times each route once; a server started while the
machine was busy keeps what it timed then (two threads lose to one under load, and the choice is cached). While
serving, `RouteTimer` runs one step in `period` of each step size (bucket) on another candidate route, measures
the whole step, and keeps a window of recent step times per candidate; when a candidate's median beats the
incumbent's by `margin` it becomes the bucket's route, with a log line. The candidates are the routes of the
incumbent's family that the calibration chose for some bucket, each on one thread and on two: they give the same
bits (a family's routes compute every output alike; a two-thread split divides the output channels), so switching
changes no token, only the time.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

from .calibration import BUCKETS

log = logging.getLogger(__name__)


def bucket_of(num_tokens: int) -> int:
    """The calibration's bucket of a step of `num_tokens` rows (the smallest that holds it, else the largest)."""
    return next((b for b in BUCKETS if num_tokens <= b), BUCKETS[-1])


@dataclass(slots=True)
class Trial:
    """What one step ran with: its bucket, and the candidate it tried (None: the incumbent, timed as usual)."""

    bucket: int
    candidate: tuple | None = None


@dataclass
class RouteTimer:
    """Re-times `policy.qroutes` (bucket -> (QuantRoute, split)) on real steps; `begin` before a step's forward,
    `end` with its duration after."""

    policy: object  # matmul.MatmulPolicy
    period: int = 25  # one step in `period` of a bucket tries a candidate (4 %)
    window: int = 9  # step times kept per candidate; compared once both sides have this many
    margin: float = 0.93  # a candidate whose median is below the incumbent's times this replaces it
    candidates: dict[int, list[tuple]] = field(default_factory=dict)
    samples: dict[tuple[int, tuple], deque] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)
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
            return Trial(bucket)
        candidate = others[(count // self.period) % len(others)]
        self.incumbent = self.policy.qroutes[bucket]
        self.policy.qroutes[bucket] = candidate
        return Trial(bucket, candidate)

    def end(self, trial: Trial, seconds: float) -> None:
        """After the step: put the incumbent back, keep the time, and switch when a candidate measures faster."""
        bucket = trial.bucket
        if trial.candidate is not None:
            self.policy.qroutes[bucket] = self.incumbent
        ran = trial.candidate if trial.candidate is not None else self.policy.qroutes.get(bucket)
        if ran is None:
            return
        self.samples.setdefault((bucket, ran), deque(maxlen=self.window)).append(seconds)
        if trial.candidate is not None:
            self._compare(bucket, trial.candidate)

    def _compare(self, bucket: int, candidate: tuple) -> None:
        incumbent = self.policy.qroutes[bucket]
        mine, theirs = self.samples.get((bucket, candidate)), self.samples.get((bucket, incumbent))
        if not mine or not theirs or len(mine) < self.window or len(theirs) < self.window:
            return
        new, old = statistics.median(mine), statistics.median(theirs)
        if new < old * self.margin:
            self.policy.qroutes[bucket] = candidate
            self.num_switches += 1
            log.info("matmul: steps of <=%d tokens switch from %s to %s (median step %.2f ms against %.2f ms over "
                     "the last %d steps each)", bucket, describe(incumbent), describe(candidate), new * 1e3,
                     old * 1e3, self.window)
            for key in [k for k in self.samples if k[0] == bucket]:
                del self.samples[key]  # start the comparison afresh around the new incumbent


def describe(route: tuple) -> str:
    name = getattr(route[0], "name", str(route[0]))
    return f"{name} {'2 threads' if route[1] else '1 thread'}"
