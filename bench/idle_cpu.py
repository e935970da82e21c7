"""CPU used by an idle tokenloop server: the whole process and the looper thread alone.

    .venv/bin/tokenloop-bench idle_cpu                      # the real engine and the default model
    .venv/bin/tokenloop-bench idle_cpu --executor null      # the null executor (no model weights)

Starts a server in this process, serves a few requests, then sleeps `--seconds` and reads
utime + stime from /proc/self/stat (every thread) and /proc/self/task/<tid>/stat (the looper
thread, by its native id). Figures are % of one core; they are measured, not asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

import grpc

from tokenloop.bench.harness import DEFAULT_MODEL, add_out_argument, stat_cpu_s, threads_cpu_s, write
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc


def executor_factory(kind: str):
    if kind == "engine":
        from tokenloop.service.executors import default_executor_factory
        return default_executor_factory
    from tokenloop.bench.null_executor import NullExecutor, sample_token_ids
    from tokenloop.core.tokenizer import Tokenizer
    return lambda cfg: NullExecutor(sample_token_ids(Tokenizer.from_dir(cfg.model)), rate=200.0)


async def measure(model: str, kind: str, seconds: float) -> dict:
    """Start, warm up with 4 short requests, then measure `seconds` of idleness."""
    from tokenloop.service.config import ServerConfig
    from tokenloop.service.server import Server
    server = Server(ServerConfig(model=model, port=0), executor_factory=executor_factory(kind))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.TextGenerationStub(channel)
            req = pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_new_tokens=8))
            await asyncio.gather(*(stub.Generate(req).read() for _ in range(4)))
        await asyncio.sleep(1.0)  # let the last hand-offs settle
        tid = server.app.looper.thread_id
        task = f"/proc/self/task/{tid}"
        p0, l0, n0, t0 = stat_cpu_s("/proc/self/stat"), stat_cpu_s(f"{task}/stat"), threads_cpu_s(), time.monotonic()
        await asyncio.sleep(seconds)
        p1, l1, n1, t1 = stat_cpu_s("/proc/self/stat"), stat_cpu_s(f"{task}/stat"), threads_cpu_s(), time.monotonic()
    finally:
        await server.stop(grace=0)
    wall = t1 - t0
    proc_s = sum(n1[t] - n0.get(t, 0.0) for t in n1)
    return {"executor": kind, "seconds": round(wall, 2), "num_threads": len(n1),
            "process_pct": round(100 * proc_s / wall, 4),
            "looper_pct": round(100 * (n1[tid] - n0[tid]) / wall, 4),
            "process_ticks_pct": round(100 * (p1 - p0) / wall, 3),
            "looper_ticks_pct": round(100 * (l1 - l0) / wall, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--executor", choices=("engine", "null"), default="engine")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--json", action="store_true")
    add_out_argument(p, "RESULTS.md (idle CPU is recorded there)")
    args = p.parse_args(argv)
    import uvloop
    res = uvloop.run(measure(args.model, args.executor, args.seconds))
    write(args.out, res)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"idle {res['executor']} server over {res['seconds']} s: process {res['process_pct']} % of a core, "
              f"looper thread {res['looper_pct']} % ({res['num_threads']} threads; from schedstat)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
