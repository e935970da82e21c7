"""Does the embedded engine's GIL use show at the front? A real `tokenloop serve` on the default model, probed.

    .venv/bin/tokenloop-bench engine_gil               # the table (about a minute)
    .venv/bin/tokenloop-bench engine_gil --json        # one JSON line

The engine steps the model on its own thread (`tokenloop-engine`) in the server process: torch releases the GIL
inside its kernels, but scheduling, sampling and building each step's tensors are Python and hold it. While they
do, the event loop (every RPC, every message) waits. Issue 8 asks to move the engine into its own process if that
shows in the numbers; this measures it. One server and a control (a gRPC server in its own process that only
answers `GetLoad`: it shares the machine's cores with the engine, not its GIL), in phases:

- idle: a probe calls `GetLoad` (a unary RPC served entirely on the event loop) on each every 10 ms; the latency;
- loaded: `--streams` Generate streams kept busy (each `--tokens` new tokens, EOS ignored; a new request as soon
  as one ends) while the probe runs: the probe's latency, the tokens/s delivered, and the CPU of each server
  thread (event loop, looper, engine, the rest: torch's worker threads and gRPC's);
- then, under the same load and when `py-spy` is found (PATH or next to this Python), the share of the time each
  thread holds the GIL (`py-spy record --gil --threads`, 100 samples/s). It runs after the timed phase because it
  pauses the process at every sample: probed while it ran, the server's p99 rose from ~10 to ~60 ms and its
  tokens/s fell by a third, while the control's did not move.

Under load, the server's probe latency minus the control's is what the engine sharing the event loop's GIL costs
every RPC and message (CPU contention hits both alike); the GIL shares say which thread holds it.
"""

from __future__ import annotations

import asyncio
import collections
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from tokenloop.bench.harness import (
    ROOT,
    TokenloopServer,
    free_port,
    parser,
    report,
    stop_process,
    threads_cpu_s,
)
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

PROMPT = "Write a short story about a looper thread that never spins."


def role(tid: int, pid: int, name: str) -> str:
    """A server thread's role from its Python name: event loop (the main thread), looper, engine, or other."""
    return ("event loop" if tid == pid else "looper" if name == "tokenloop-looper"
            else "engine" if name == "tokenloop-engine" else "other")


async def probe(stub, stop: asyncio.Event, period: float = 0.01) -> list[float]:
    """GetLoad latencies (s) until `stop`."""
    lat = []
    while not stop.is_set():
        t = time.perf_counter()
        await stub.GetLoad(pb.GetLoadRequest())
        lat.append(time.perf_counter() - t)
        await asyncio.sleep(period)
    return lat


async def stream_loop(stub, tokens: int, stop: asyncio.Event, counts: list[int]) -> None:
    while not stop.is_set():
        call = stub.Generate(pb.GenerateRequest(text=PROMPT, stream=True, stopping=pb.StoppingCriteria(
            max_new_tokens=tokens, ignore_eos=True)))
        async for msg in call:
            counts[0] += len(msg.chunk.token_ids)


def quantiles_ms(lat: list[float]) -> dict[str, float]:
    q = statistics.quantiles(lat, n=100)
    return {"p50_ms": round(1e3 * q[49], 3), "p99_ms": round(1e3 * q[98], 3), "max_ms": round(1e3 * max(lat), 3),
            "num": len(lat)}


def py_spy() -> str | None:
    near = Path(sys.executable).parent / "py-spy"
    return str(near) if near.exists() else shutil.which("py-spy")


def gil_samples(raw: Path) -> tuple[collections.Counter, dict[int, str]]:
    """Samples per thread id in which it held the GIL, and the threads' Python names (py-spy raw output)."""
    held: collections.Counter = collections.Counter()
    names: dict[int, str] = {}
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        head = stack.split(";", 1)[0]  # with --threads: "thread (TID): name"
        if not head.startswith("thread ("):
            continue
        tid_text, _, name = head[len("thread ("):].partition("): ")
        tid = int(tid_text, 0)
        held[tid] += int(n)
        names[tid] = name
    return held, names


class ControlServicer(pb_grpc.TextGenerationServicer):
    """GetLoad alone, in a process of its own: a probe target that shares the machine's cores with the loaded
    server but not its GIL."""

    async def GetLoad(self, request, context):
        return pb.Load()


async def serve_control(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_TextGenerationServicer_to_server(ControlServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def _probe_both(stubs: dict, seconds: float) -> dict[str, dict]:
    stop = asyncio.Event()
    tasks = {name: asyncio.ensure_future(probe(stub, stop)) for name, stub in stubs.items()}
    await asyncio.sleep(seconds)
    stop.set()
    return {name: quantiles_ms(await task) for name, task in tasks.items()}


async def measure(args) -> dict:
    control_port = free_port()
    served = TokenloopServer(args.model, ["--front-cpu", args.front_cpu] if args.front_cpu else [])
    port = served.port
    control = subprocess.Popen([sys.executable, "-m", "tokenloop.bench.engine_gil", "serve-control",
                                str(control_port)], cwd=ROOT)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel, \
                grpc.aio.insecure_channel(f"127.0.0.1:{control_port}") as control_channel:
            stub = pb_grpc.TextGenerationStub(channel)
            stubs = {"tokenloop": stub, "control": pb_grpc.TextGenerationStub(control_channel)}
            await served.start()  # health SERVING: the model is loaded
            server = served.proc
            await asyncio.wait_for(control_channel.channel_ready(), 120)
            await stub.Generate(pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(max_new_tokens=2))).read()
            out: dict = {"streams": args.streams, "tokens": args.tokens, "seconds": args.seconds}
            out["idle"] = await _probe_both(stubs, args.seconds)

            stop, counts = asyncio.Event(), [0]
            streams = [asyncio.ensure_future(stream_loop(stub, args.tokens, stop, counts))
                       for _ in range(args.streams)]
            await asyncio.sleep(args.warmup)
            th0, tok0, t0 = threads_cpu_s(server.pid), counts[0], time.monotonic()
            out["loaded"] = await _probe_both(stubs, args.seconds)
            wall, tok = time.monotonic() - t0, counts[0] - tok0
            th1 = threads_cpu_s(server.pid)
            out["tokens_per_s"] = round(tok / wall, 1)
            names: dict[int, str] = {}
            spy, raw = py_spy(), Path(tempfile.mktemp(suffix=".txt"))
            if spy and not args.no_py_spy:  # after the timed phase: py-spy pauses the process at every sample
                await asyncio.to_thread(subprocess.run, [
                    spy, "record", "--pid", str(server.pid), "--gil", "--threads", "--rate", "100", "--duration",
                    str(int(args.seconds)), "--format", "raw", "--output", str(raw)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=args.seconds + 60)
                if raw.exists():
                    held, names = gil_samples(raw)
                    gil: collections.Counter = collections.Counter()
                    for tid, n in held.items():
                        gil[role(tid, server.pid, names[tid])] += n
                    out["gil_pct"] = {r: round(100 * n / (100 * int(args.seconds)), 1) for r, n in gil.most_common()}
                    raw.unlink()
            cpu: collections.Counter = collections.Counter()
            for tid, c in th1.items():
                cpu[role(tid, server.pid, names.get(tid, ""))] += c - th0.get(tid, 0.0)
            out["cpu_pct"] = {r: round(100 * c / wall, 1) for r, c in cpu.most_common()}
            stop.set()
            await asyncio.gather(*streams, return_exceptions=True)
    finally:
        if served.proc:
            served.stop()
        stop_process(control, 30)
    return out


def main(argv=None) -> int:
    p = parser(__doc__, "results-engine-gil.json")
    p.add_argument("--streams", type=int, default=16, help="concurrent Generate streams in the loaded phase")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--seconds", type=float, default=15.0, help="length of each phase")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of load before the loaded phase is measured")
    p.add_argument("--front-cpu", default=None, help="the server's --front-cpu (default: its own, auto)")
    p.add_argument("--no-py-spy", action="store_true", help="skip the GIL sampling even when py-spy is found")
    if argv is None and sys.argv[1:2] == ["serve-control"]:  # (internal) the control probe target
        import uvloop
        uvloop.run(serve_control(int(sys.argv[2])))
        return 0
    args = p.parse_args(argv)
    if min(args.streams, args.tokens) < 1 or args.seconds < 1:
        p.error("--streams and --tokens must be >= 1 and --seconds >= 1")
    import uvloop
    res = uvloop.run(measure(args))
    return report(args, res, lambda: table(args, res))


def table(args, res: dict) -> str:
    rows = [f"| {phase} | {t['p50_ms']:.2f} / {t['p99_ms']:.2f} / {t['max_ms']:.2f} "
            f"| {c['p50_ms']:.2f} / {c['p99_ms']:.2f} / {c['max_ms']:.2f} |"
            for phase in ("idle", "loaded") for t, c in [(res[phase]["tokenloop"], res[phase]["control"])]]
    lines = ["| phase | tokenloop GetLoad p50 / p99 / max ms | control p50 / p99 / max ms (own process) |",
             "| --- | --- | --- |", *rows,
             f"\nloaded: {args.streams} streams, {res['tokens_per_s']:.0f} tokens/s; server CPU % of a core by "
             "thread: " + ", ".join(f"{k} {v}" for k, v in res["cpu_pct"].items())]
    if "gil_pct" in res:
        lines.append("GIL held, % of the time: " + ", ".join(f"{k} {v}" for k, v in res["gil_pct"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
