"""Where the front's two Python threads run: the event-loop thread and the looper thread share one CPU.

Both threads run Python, so the GIL lets only one of them run at any moment, however many CPUs they have.
Left to the OS they sit on two CPUs, and every hand-off of the GIL between them (the looper takes it each
time a gRPC send on the event loop releases it) wakes a thread on the other CPU: a futex wake-up across
CPUs, on a VM an inter-processor interrupt, while the thread that let go spins or sleeps until it gets the
GIL back. Measured with `perf trace` on the 2-vCPU bench VM, the event loop spent ~20 % of its time blocked
on the GIL. On one CPU the hand-off is a context switch on the spot, and the other CPUs stay free for the
threads that work without the GIL: gRPC's core threads, the tokenizer threads, the engine, and, on a
shared machine, whatever else runs there (bench/RESULTS-overhead.md, round 11, has the numbers).

While the event loop is behind its readers (most streams of a hand-off had not read the one before:
`Looper.readers_behind`), the looper thread runs as SCHED_BATCH on their shared CPU (`looper_behind`). The event
loop wakes the looper many times a second (taking a hand-off lets the looper poll again), and the kernel lets a
thread that wakes preempt the one running: the looper took the CPU from the busy event loop at each wake-up and held
the GIL through its poll while the event loop, the thread that sends, waited. A SCHED_BATCH thread does not preempt
on waking: it runs when the event loop blocks (in epoll, waiting for gRPC) or its time slice ends. Once the readers
keep up, the looper is SCHED_OTHER again: then its wake-up (a token due) is the token's latency, and a batch thread
could wait out the event loop's slice (docs/performance.md has both measurements).

`--front-cpu auto` (the default) pins the two threads to the CPU the server is running on when the looper
starts, if the process may use two CPUs or more; `off` leaves placement (and scheduling) to the OS; a number picks
that CPU. Every other thread keeps the process's CPUs and policy. A thread inherits the CPUs of the thread that starts it, so
the pools the server starts afterwards (asyncio's default executor, the tokenizer threads) widen their own
threads first (`release_this_thread`).
"""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger("tokenloop.service")

CHOICES = ("auto", "off")


def check_spec(spec: str) -> None:
    """Raise ValueError unless `spec` is 'auto', 'off' or a CPU number."""
    if spec not in CHOICES and not (spec.isascii() and spec.isdigit()):
        raise ValueError(f"--front-cpu must be 'auto', 'off' or a CPU number; got {spec!r}")


def cpu_list(cpus: set[int]) -> str:
    """`{0, 1, 2, 5}` -> '0-2,5' (the kernel's notation, as in /proc/*/status Cpus_allowed_list)."""
    out, run = [], []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(cpu)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def _current_cpu() -> int | None:
    try:
        cpu = ctypes.CDLL(None).sched_getcpu()
    except (OSError, AttributeError):
        return None
    return cpu if cpu >= 0 else None


class FrontPlacement:
    """Pins the event-loop thread and the looper thread to one CPU (`pin`), and undoes it (`restore`)."""

    def __init__(self, spec: str = "auto"):
        check_spec(spec)
        self.spec = spec
        self.cpu: int | None = None  # the shared CPU, once pinned
        self._wide: set[int] | None = None  # the process's CPUs before pinning
        self._pinned: list[int] = []
        self._looper: int | None = None  # the pinned looper thread
        self._no_batch = False  # the system refused SCHED_BATCH

    @property
    def enabled(self) -> bool:
        return self.spec != "off" and hasattr(os, "sched_setaffinity")

    def choose(self) -> int | None:
        """The CPU to share, or None when nothing is to be pinned. A CPU number outside the process's CPUs is a
        ValueError (a start-up error naming the flag)."""
        if not self.enabled:
            return None
        wide = os.sched_getaffinity(0)
        if self.spec == "auto":
            if len(wide) < 2:  # one CPU: the threads share it already
                return None
            cpu = _current_cpu()
            return cpu if cpu in wide else min(wide)
        cpu = int(self.spec)
        if cpu not in wide:
            raise ValueError(f"--front-cpu {cpu} is not one of the CPUs this process may use ({cpu_list(wide)})")
        return cpu

    def pin(self, event_loop_tid: int, looper_tid: int) -> int | None:
        """Call on the event-loop thread once the looper thread runs. Returns the shared CPU, or None."""
        cpu = self.choose()
        if cpu is None:
            return None
        self._wide = os.sched_getaffinity(0)
        try:
            for tid in (event_loop_tid, looper_tid):
                os.sched_setaffinity(tid, {cpu})
                self._pinned.append(tid)
        except OSError as exc:  # e.g. a seccomp profile that forbids it
            self.restore()
            self._wide = None
            if self.spec != "auto":
                raise ValueError(f"--front-cpu {cpu}: cannot pin the threads ({exc})") from exc
            log.warning("--front-cpu auto: cannot pin the event-loop and looper threads (%s); the OS places them", exc)
            return None
        self.cpu = cpu
        self._looper = looper_tid
        log.info("event-loop and looper threads share CPU %d (--front-cpu %s; other threads: CPUs %s)", cpu,
                 self.spec, cpu_list(self._wide))
        return cpu

    def looper_behind(self, behind: bool, tid: int = 0) -> None:
        """The Looper's `on_behind`, on the looper thread (`tid` 0: the calling thread): SCHED_BATCH while the event
        loop is behind its readers, SCHED_OTHER once they keep up (the module's doc). Only while the threads are
        pinned; where the system refuses the policy, one warning and the looper keeps its policy from then on."""
        if self.cpu is None or self._no_batch or not hasattr(os, "SCHED_BATCH"):
            return
        try:
            os.sched_setscheduler(tid, os.SCHED_BATCH if behind else os.SCHED_OTHER, os.sched_param(0))
        except OSError as exc:
            self._no_batch = True
            log.warning("--front-cpu %s: cannot run the looper thread as SCHED_BATCH (%s); it keeps preempting the "
                        "event loop when woken", self.spec, exc)

    def release_this_thread(self) -> None:
        """A pool's thread initializer: give the calling thread the process's CPUs back (a thread started by a
        pinned thread inherits its one CPU)."""
        if self._wide is not None:
            try:
                os.sched_setaffinity(0, self._wide)
            except OSError:
                pass

    def restore(self) -> None:
        """Give the pinned threads (those still alive) the process's CPUs back, and the looper its normal policy."""
        if self._looper is not None and not self._no_batch:
            try:
                os.sched_setscheduler(self._looper, os.SCHED_OTHER, os.sched_param(0))
            except OSError:  # the looper thread has exited
                pass
        self._looper = None
        for tid in reversed(self._pinned):
            try:
                os.sched_setaffinity(tid, self._wide)
            except OSError:  # the looper thread has exited
                pass
        self._pinned.clear()
        self.cpu = None
