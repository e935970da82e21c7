"""The machine a benchmark ran on: its CPU model and the ISA flags that decide which kernels run, recorded next to
every figure (`tokenloop-cli bench --out`; the repository's bench/harness.py uses the same reader)."""

from __future__ import annotations

import platform
from pathlib import Path

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
