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

from tokenloop_client.machine import ISA_FLAGS, cpu_record  # noqa: F401  (one reader: the client's bench records it too)


def add_out_argument(parser: argparse.ArgumentParser, current: str) -> None:
    """`--out FILE`; `current` names the file that holds the recorded figures (for the help text)."""
    parser.add_argument("--out", default=None, metavar="FILE",
                        help=f"write the figures as JSON to FILE (none by default; recorded runs go to bench/{current})")


def describe(record: dict) -> str:
    """One line for a table: 'AMD EPYC (family 25 model 17; avx2 fma ... avx512_bf16)', as bench/RESULTS*.md say it."""
    where = f"family {record.get('cpu_family')} model {record.get('cpu_model')}"
    return f"{record['cpu']} ({where}; {' '.join(record.get('isa') or ['no flags recorded'])})"


def machine() -> dict:
    """The date and the machine a run was on: the CPU (cpu_record), CPUs, OS."""
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **cpu_record(), "cpus": os.cpu_count(),
            "machine": platform.platform()}


def write(path: str | None, figures: dict) -> None:
    """Write `figures` (with the date and machine, unless they carry them) to `path`; nothing when it is None."""
    if path:
        Path(path).write_text(json.dumps({**machine(), **figures}, indent=1) + "\n")
        print(f"wrote {path}")
