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


# The ISA flags that decide which kernels run (ours, torch's, llama.cpp's): recorded with every figure.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512vbmi", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")


def cpu_record(cpuinfo: str | None = None) -> dict:
    """The CPU from /proc/cpuinfo (its first processor): model name, vendor, family, model, stepping, and which
    of ISA_FLAGS it reports, in ISA_FLAGS' order. Off Linux: the platform's processor name and no flags."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor is enough: a VM's vCPUs report the same
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    number = lambda key: int(fields[key]) if fields.get(key, "").isdigit() else None  # noqa: E731
    return {"cpu": fields.get("model name") or platform.processor() or platform.machine(),
            "cpu_vendor": fields.get("vendor_id"), "cpu_family": number("cpu family"), "cpu_model": number("model"),
            "cpu_stepping": number("stepping"), "isa": [f for f in ISA_FLAGS if f in flags]}


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
