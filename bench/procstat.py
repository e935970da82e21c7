"""CPU accounting from Linux /proc, shared by the benchmarks (engine_bench, service_overhead, idle_cpu)."""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def stat_cpu_s(stat_path: str | Path) -> float:
    """utime + stime from a /proc stat file (a process's or a thread's), in seconds (resolution 1 / CLK_TCK)."""
    fields = Path(stat_path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_cpu_s(pid: int | str = "self") -> float:
    """utime + stime of a whole process (every thread), in seconds."""
    return stat_cpu_s(f"/proc/{pid}/stat")


def threads_cpu_s(pid: int | str = "self") -> dict[int, float]:
    """Seconds on a CPU of each live thread of a process, by thread id (schedstat: nanosecond resolution)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (FileNotFoundError, ProcessLookupError):
            pass  # the thread ended while we read
    return out


def thread_names(pid: int | str = "self") -> dict[int, str]:
    """The OS-level name (comm) of each live thread of a process, by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = (task / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out
