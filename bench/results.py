"""Where a benchmark's figures go: only to the file its `--out FILE` names, stamped with the date and machine.

No benchmark writes a file unless asked, so a run never leaves a new file to commit by accident. The current
figures of each benchmark live in one file (`bench/results-NAME.json`, written with `--out` when a run is
recorded); earlier runs are in git (`git log -p bench/results-NAME.json`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path


def add_out_argument(parser: argparse.ArgumentParser, current: str) -> None:
    """`--out FILE`; `current` names the file that holds the recorded figures (for the help text)."""
    parser.add_argument("--out", default=None, metavar="FILE",
                        help=f"write the figures as JSON to FILE (none by default; recorded runs go to bench/{current})")


def machine() -> dict:
    """The date and the machine a run was on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu": cpu, "cpus": os.cpu_count(),
            "machine": platform.platform()}


def write(path: str | None, figures: dict) -> None:
    """Write `figures` (with the date and machine, unless they carry them) to `path`; nothing when it is None."""
    if path:
        Path(path).write_text(json.dumps({**machine(), **figures}, indent=1) + "\n")
        print(f"wrote {path}")
