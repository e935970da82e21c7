"""Instructions the server runs per streamed message, counted by valgrind's callgrind: the full tokenloop path (the
null executor, one token per message, as bench/service_overhead.py's `messages` scenario) against a bare grpc.aio
method that yields pre-built messages. A count of instructions does not depend on what else the machine runs, so
this compares two commits, or the front against bare grpc, on a loaded machine where timings cannot.

    .venv/bin/python scripts/front_instructions.py                     # both servers, 64 streams x 64 tokens
    .venv/bin/python scripts/front_instructions.py --mode full --streams 256 --tokens 32 --profile out.cg
    .venv/bin/python scripts/front_instructions.py --threads         # and each thread's share (1: the event loop)

Each server runs under `valgrind --tool=callgrind --instr-atstart=no` (the `serve` sub-command of this file); this
process is the client (grpc.aio, one channel; both on uvloop). After a warm-up load (one stream per stream slot, a few tokens),
`callgrind_control -i on` starts counting, the measured load runs, `-i off` stops it, and the server exits. The
count covers every thread of the server process (the event loop, the looper, gRPC's own threads) while the load
ran. `--profile FILE` keeps callgrind's output (read it with `callgrind_annotate FILE`).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"
PROMPT = "Write a short story about a looper thread that never spins."


class BareServicer(pb_grpc.TextGenerationServicer):
    """Yields max_new_tokens pre-built one-token chunks: the ceiling of grpc.aio streaming."""

    async def Generate(self, request, context):
        msg = pb.GenerateResponse(request_id=request.request_id,
                                  chunk=pb.Chunk(index=0, text=" token", token_ids=[1234]))
        for _ in range(request.stopping.max_new_tokens):
            yield msg


async def serve(mode: str, model: str) -> None:
    """One server until SIGTERM; prints `READY <port>`."""
    from tokenloop.service.config import ServerConfig
    if mode == "bare":
        from tokenloop.service.server import grpc_options
        server = grpc.aio.server(options=grpc_options(ServerConfig()))
        pb_grpc.add_TextGenerationServicer_to_server(BareServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        stop = server.stop
    else:
        from tokenloop.bench.null_executor import NullExecutor, sample_token_ids
        from tokenloop.core.tokenizer import Tokenizer
        from tokenloop.service.server import Server
        ex = NullExecutor(sample_token_ids(Tokenizer.from_dir(model)))
        full = Server(ServerConfig(model=model, port=0, max_concurrent_requests=4096, max_queue=4096,
                                   max_new_tokens=1 << 16, stall_timeout=600.0, coalesce=False),
                      executor_factory=lambda cfg: ex)
        port = await full.start()
        stop = full.stop
    done = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, done.set)
    print(f"READY {port}", flush=True)
    await done.wait()
    await stop(0)


async def load(port: int, num_streams: int, num_tokens: int, tag: str) -> int:
    """`num_streams` concurrent Generate streams of `num_tokens` tokens; returns the messages read."""
    async def one(stub, rid: str) -> int:
        call = stub.Generate(pb.GenerateRequest(request_id=rid, text=PROMPT, stream=True, stopping=pb.StoppingCriteria(
            max_new_tokens=num_tokens, ignore_eos=True)))
        count = 0
        async for msg in call:
            count += msg.HasField("chunk")
        return count

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        counts = await asyncio.gather(*(one(stub, f"{tag}-{i}") for i in range(num_streams)))
    if sum(counts) != num_streams * num_tokens:
        raise RuntimeError(f"{tag}: {sum(counts)} chunks, expected {num_streams * num_tokens}")
    return sum(counts)


def run(coroutine):
    """As `tokenloop serve` and bench/service_overhead.py run both sides: on uvloop."""
    import uvloop
    return uvloop.run(coroutine)


def count(mode: str, args) -> dict:
    """Run one server under callgrind; instructions per message of the measured load."""
    out = args.profile or tempfile.mktemp(suffix=".cg")
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--separate-threads={'yes' if args.threads else 'no'}",
           f"--callgrind-out-file={out}", sys.executable, __file__, "serve", mode, "--model", str(args.model)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"the {mode} server did not start: {line!r}")
        port = int(line.split()[1])
        run(load(port, args.streams, 4, "warm"))
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        t0 = time.monotonic()
        num_msgs = run(load(port, args.streams, args.tokens, mode))
        wall = time.monotonic() - t0
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(300)
    files = sorted(Path(out).parent.glob(Path(out).name + "-*")) if args.threads else [Path(out)]
    per_thread = {}  # callgrind's thread number (1: the main thread, the event loop) -> instructions
    for f in files:
        text = f.read_text(errors="replace")
        per_thread[int(f.name.rpartition("-")[2]) if args.threads else 1] = sum(
            int(m) for m in re.findall(r"^totals: (\d+)", text, re.M))
        if not args.profile:
            f.unlink()
    if not args.profile:
        Path(out).unlink(missing_ok=True)  # with --threads, callgrind leaves an empty file under the plain name
    total = sum(per_thread.values())
    return {"mode": mode, "messages": num_msgs, "instructions": total, "per_message": total / num_msgs,
            "per_thread": per_thread, "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    s = sub.add_parser("serve")
    s.add_argument("mode", choices=("bare", "full"))
    s.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--mode", choices=("bare", "full", "both"), default="both")
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--profile", help="keep callgrind's output in this file (one mode only)")
    parser.add_argument("--threads", action="store_true",
                        help="also count each thread apart (callgrind --separate-threads; 1 is the event loop)")
    args = parser.parse_args()
    if args.command == "serve":
        run(serve(args.mode, args.model))
        return
    rows = [count(m, args) for m in (("bare", "full") if args.mode == "both" else (args.mode,))]
    print(f"{'server':<6} {'messages':>9} {'instructions':>14} {'per message':>12}")
    for r in rows:
        print(f"{r['mode']:<6} {r['messages']:>9} {r['instructions']:>14,} {r['per_message']:>12,.0f}")
        if args.threads:  # the busiest threads: the event loop (1), the looper, gRPC's poller
            top = sorted(r["per_thread"].items(), key=lambda kv: -kv[1])[:4]
            print("       per message by thread: " + ", ".join(f"{n}: {v / r['messages']:,.0f}" for n, v in top))
    if len(rows) == 2:
        print(f"full / bare: {rows[1]['per_message'] / rows[0]['per_message']:.2f}x the instructions per message")


if __name__ == "__main__":
    main()
