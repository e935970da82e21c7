"""How the engine times its choices of matrix-product kernels at start-up (matmul.MatmulPolicy's calibrations) and
caches them: the step sizes compared, interleaved best-of timing, the other processes' share of the CPUs, and the
cache records (provisional when timed on a busy machine)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time

import torch

from .kernels import cpu_id

log = logging.getLogger(__name__)

BUCKETS = (1, 4, 16, 64, 256, 1024)  # tokens per step at which the backends are compared
COLD_TOKENS = 4  # buckets up to this many tokens are timed over every layer's weights (memory-bound)
CACHE_ENV = "TOKENLOOP_MATMUL_CACHE"  # "off": time the routes at every start, never read or write the cache file
# A choice timed while other processes used more than this share of the CPUs is cached as provisional: a later start
# on a quiet machine (others within LOAD_LIMIT over QUIET_SAMPLE_S, measured then) times the routes again.
LOAD_LIMIT = 0.15
QUIET_SAMPLE_S = 0.3


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used since boot: /proc/stat's first line, all of user nice
    system idle iowait irq softirq steal but idle and iowait (bench/harness.py uses it too)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class OthersLoad:
    """The share of the machine's CPUs that other processes (and, on a VM, the hypervisor's steal) used from
    construction to `share()`: /proc/stat's busy time less this process's CPU time, over wall time x CPUs.
    None where /proc/stat cannot be read."""

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            busy = machine_busy_s()
        except (OSError, ValueError):
            return None
        return busy, time.process_time(), time.perf_counter()

    def share(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        busy, mine, wall = (e - s for e, s in zip(end, self._start))
        return max(0.0, busy - mine) / (wall * (os.cpu_count() or 1))


def quiet_now() -> bool:
    """The machine is idle now: other processes used at most LOAD_LIMIT of the CPUs over the next QUIET_SAMPLE_S.
    (Not the load average: it trails by a minute, so a start right after other work, as in a benchmark that runs
    one server after another, would still read as busy.)"""
    load = OthersLoad()
    time.sleep(QUIET_SAMPLE_S)
    share = load.share()
    return share is not None and share <= LOAD_LIMIT


def fastest(candidates: dict, rounds: int = 7):
    """The key of the fastest callable (best_times)."""
    best = best_times(candidates, rounds)
    return min(best, key=best.get)


def best_times(candidates: dict, rounds: int = 7) -> dict:
    """Each callable's best time in seconds. Rounds interleave the candidates (A B C A B C ...) and each keeps its
    best time, so a burst of load from elsewhere cannot land on one candidate's runs only. Each timed call
    follows an untimed one of the same candidate: a helper thread that just slept through the others' turns
    is awake, as it is in a running engine, where every product uses it."""
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(rounds):
        for key, fn in candidates.items():
            fn()
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


def cache_key(what: list[str], weights: list) -> str:
    """What a cached choice depends on: `what` (the mode, the kernel builds) and this CPU (model and flags), its
    count, torch's version and the weights' number and shape."""
    shape = [f"{tuple(w.shape)}/{getattr(w, 'group_size', '-')}" for w in weights[:1]]
    what = [what[0], cpu_id(), str(os.cpu_count()), torch.__version__, *what[1:], str(len(weights)), *shape]
    return hashlib.sha256("\0".join(what).encode()).hexdigest()[:16]


def cached_choice(path, read, time_choice, use_cache: bool | None) -> tuple[dict, str]:
    """A calibration's record: read from `path` (read(path) -> record or None), or timed now (time_choice() -> a
    JSON-able record) and written there; and how it was chosen. A record timed while other processes used more than
    LOAD_LIMIT of the CPUs is provisional: it serves until a start finds the machine quiet, which times again.
    use_cache None: TOKENLOOP_MATMUL_CACHE (off: time at every start, never read or write)."""
    use_cache = os.environ.get(CACHE_ENV, "").lower() != "off" if use_cache is None else use_cache
    record = read(path) if use_cache else None
    chosen = f"cached in {path}"
    under_load = provisional(record) if record is not None else 0.0
    retime = bool(under_load) and quiet_now()
    if under_load and not retime:
        chosen += f" (timed while other processes used {under_load:.0%} of the CPUs; timed again " \
                  "at a start on a quiet machine)"
    if record is None or retime:
        started, load = time.perf_counter(), OthersLoad()
        record = time_choice()
        record["others_load"] = load.share()
        chosen = f"timed in {time.perf_counter() - started:.1f} s" + (" (the cached choice was timed under load)"
                                                                    if retime else "")
        if provisional(record):
            chosen += f" while other processes used {record['others_load']:.0%} of the CPUs: cached as provisional"
            log.warning("matmul: routes %s", chosen)
        if use_cache:
            write_record(path, record)
    return record, chosen


def provisional(record: dict) -> float:
    """The other processes' share of the CPUs while `record` was timed, when over LOAD_LIMIT (else 0.0)."""
    share = record.get("others_load")
    return share if isinstance(share, (int, float)) and share > LOAD_LIMIT else 0.0


def write_record(path, record: dict) -> None:
    """Write a calibration record to `path` atomically; a read-only cache directory only warns."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache directory: time again next start
        log.warning("matmul: cannot write the route cache %s: %s", path, exc)
