"""Load time and resident memory of the engine per model and weights mode: what a model costs to start, not speed.

    .venv/bin/tokenloop-bench model_load --model models/SmolLM2-135M-Instruct.Q4_1.gguf --weights int4,fp32
    .venv/bin/tokenloop-bench model_load --model DIR1,DIR2 --weights int4 --out bench/results-model-load.json

Each (model, mode) loads in a child process of its own (nice'd, one at a time): the Engine is built (weights, KV
cache, kernels, calibration) but not started, then the child reports the seconds that took, its peak resident memory
(ru_maxrss), its resident memory after loading (VmRSS), and the bytes of the engine's weights and KV cache; the table
gives peak / (weights + KV), which issue 43 wants within 1.3 for int4 and int8. A random-weight checkpoint in a
larger model's shape (../shared/tools/scale_models.py) loads like the real one. Not a speed claim, but memory and
time still move when the machine is loaded: record runs from a quiet machine, with the date, commit and CPU this
writes (`--model` takes a comma-separated list; default: the default model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tokenloop.bench import harness

CHILD = r"""
import dataclasses, json, resource, sys, time
import torch
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.quant import Q4Weight, QWeight

def nbytes(w):
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    if isinstance(w, (QWeight, Q4Weight)):
        return sum(t.numel() * t.element_size() for t in (w.q, w.scale if isinstance(w, QWeight) else w.sm))
    return 0

model, weights = sys.argv[1], sys.argv[2]
started = time.perf_counter()
engine = Engine(model, EngineConfig(weights=weights), start=False)
seconds = time.perf_counter() - started
m = engine.model
seen, total = set(), 0
for w in [m.embed, m.norm, m.lm_head] + [getattr(l, f.name) for l in m.layers for f in dataclasses.fields(l)]:
    if w is not None and id(w) not in seen:
        seen.add(id(w)); total += nbytes(w)
kv = sum(t.numel() * t.element_size() for t in (m.k_cache, m.v_cache))
rss = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS:"))
print(json.dumps({"load_s": seconds, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "rss": rss, "weights_bytes": total, "kv_bytes": kv}))
"""


def measure(model: str, weights: str, timeout: float) -> dict:
    """One child process: load `model` in `weights` mode and report."""
    run = subprocess.run(["nice", "-n", "10", sys.executable, "-c", CHILD, model, weights], capture_output=True,
                         text=True, timeout=timeout)
    if run.returncode != 0:
        raise RuntimeError(f"{model} --weights {weights} failed:\n{run.stderr[-2000:]}")
    return {"model": model, "weights": weights, **json.loads(run.stdout.strip().splitlines()[-1])}


def table(rows: list[dict]) -> str:
    """A Markdown table: each row's load time, bytes and memory, in GiB."""
    gib = 1 << 30
    lines = ["| model | mode | load s | weights GiB | KV GiB | RSS GiB | peak GiB | peak / (weights + KV) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = r["peak_rss"] / (r["weights_bytes"] + r["kv_bytes"])
        lines.append(f"| {os.path.basename(r['model'].rstrip('/'))} | {r['weights']} | {r['load_s']:.1f} | "
                     f"{r['weights_bytes'] / gib:.2f} | {r['kv_bytes'] / gib:.2f} | {r['rss'] / gib:.2f} | "
                     f"{r['peak_rss'] / gib:.2f} | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, "results-model-load.json")
    p.add_argument("--weights", default="int4", help="comma-separated modes: fp32, int8, int4")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per load")
    args = p.parse_args(argv)
    rows = [measure(m, w, args.timeout) for m in args.model.split(",") for w in args.weights.split(",")]
    return harness.report(args, {"rows": rows}, lambda: table(rows))


if __name__ == "__main__":
    sys.exit(main())
