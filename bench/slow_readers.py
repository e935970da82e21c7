"""How long a new client waits beside N streams that never read (issue 28), with and without --slow-reader-grace.

    .venv/bin/tokenloop-bench slow_readers                 # table + JSON line (a few minutes with the default model)
    .venv/bin/tokenloop-bench slow_readers --streams 100   # smaller

Per run, a real `tokenloop serve` process (default flags but those named) on loopback:
1. --streams hostile Generate calls (max_new_tokens --hostile-tokens, ignore_eos) over 10 channels whose HTTP/2
   window stays at a few bytes (BDP probing off, `grpc.http2.lookahead_bytes` 1): each reads its first message
   and nothing more, so the server's writes stop at once;
2. once all of them are open or waiting (GetLoad), a well-behaved client on its own channel sends Generate
   (max_new_tokens --new-tokens) with a --deadline; its time to the first message and to the end are recorded.
Runs: `off` (--slow-reader-grace 0: the behaviour before issue 28; the stalled streams keep their slots until
--stall-timeout cuts them) and `on` (the default grace). --stall-timeout is the same for both (default 10 s here,
so that the `off` run ends in minutes; the server's default is 60 s, which makes `off` 6 times longer), and
--max-queue-wait is 0 (no bound) so that the new client's whole wait is measured rather than cut at 30 s.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc

from tokenloop.bench.harness import TokenloopServer, never_reading, parser, report
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

NEVER_READS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1)]
PROMPT = "Write a long story about a lighthouse keeper and the sea."


async def _serve(model: str, flags: list[str]) -> tuple[subprocess.Popen, int]:
    server = TokenloopServer(model, ["--shutdown-grace", "1", *flags])
    await server.start()
    return server.proc, server.port


def _request(max_new: int, rid: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(text=PROMPT, stream=True, request_id=rid,
                              sampling=pb.SamplingParams(temperature=0.0),
                              stopping=pb.StoppingCriteria(max_new_tokens=max_new, ignore_eos=True))


async def one_run(model: str, grace: float, args) -> dict:
    proc, port = await _serve(model, ["--slow-reader-grace", str(grace), "--stall-timeout", str(args.stall_timeout),
                                      "--max-queue-wait", str(args.max_queue_wait)])
    target = f"127.0.0.1:{port}"
    hostile = [_request(args.hostile_tokens, f"h{i}") for i in range(args.streams)]
    row: dict = {"slow_reader_grace_s": grace, "stall_timeout_s": args.stall_timeout, "streams": args.streams,
                 "max_queue_wait_s": args.max_queue_wait}
    try:
        async with never_reading(target, hostile, 10, NEVER_READS), grpc.aio.insecure_channel(target) as good:
            stub = pb_grpc.TextGenerationStub(good)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 120:  # every hostile call has reached the server
                load = await stub.GetLoad(pb.GetLoadRequest())
                if load.num_in_flight + load.num_waiting >= args.streams:
                    break
                await asyncio.sleep(0.2)
            row["hostile_open_after_s"] = round(time.monotonic() - t0, 2)
            start = time.monotonic()
            call = stub.Generate(_request(args.new_tokens), timeout=args.deadline)
            first = None
            try:
                async for _msg in call:
                    if first is None:
                        first = time.monotonic() - start
                row["outcome"] = "OK"
            except grpc.aio.AioRpcError as err:
                row["outcome"] = err.code().name
            row["new_client_first_message_s"] = round(first, 2) if first is not None else None
            row["new_client_total_s"] = round(time.monotonic() - start, 2)
            load = await stub.GetLoad(pb.GetLoadRequest())
            # the server's count: a stream it cut cannot tell its client (its trailers wait behind unread data)
            row["hostile_open_on_server"] = load.num_in_flight
    finally:
        proc.terminate()
        proc.wait(30)
    return row


async def measure(args) -> dict:
    runs = {}
    for name, grace in (("off", 0.0), ("on", args.grace)):
        if name in args.runs.split(","):
            runs[name] = await one_run(args.model, grace, args)
    return {"runs": runs, "new_tokens": args.new_tokens, "deadline_s": args.deadline,
            "hostile_tokens": args.hostile_tokens}


def main(argv=None) -> int:
    p = parser(__doc__, "results-slow-readers.json")
    p.add_argument("--streams", type=int, default=300, help="never-reading streams")
    p.add_argument("--hostile-tokens", type=int, default=1000, help="max_new_tokens each of them asks for")
    p.add_argument("--new-tokens", type=int, default=16, help="max_new_tokens of the new client's request")
    p.add_argument("--deadline", type=float, default=120.0, help="the new client's deadline, seconds")
    p.add_argument("--grace", type=float, default=1.0, help="--slow-reader-grace of the `on` run")
    p.add_argument("--stall-timeout", type=float, default=10.0, help="--stall-timeout of both runs")
    p.add_argument("--max-queue-wait", type=float, default=0.0,
                   help="--max-queue-wait of both runs (default 0, no bound: the wait itself is measured)")
    p.add_argument("--runs", default="off,on", help="which runs: off (--slow-reader-grace 0), on, or both")
    args = p.parse_args(argv)
    out = asyncio.run(measure(args))
    return report(args, out, lambda: "\n".join([
        f"{args.streams} never-reading streams ({args.hostile_tokens} tokens asked each); the new client asks "
        f"{args.new_tokens} tokens with a {args.deadline:g} s deadline; --stall-timeout {args.stall_timeout:g}, "
        f"--max-queue-wait {args.max_queue_wait:g}\n",
        "| --slow-reader-grace | new client | first message s | total s | never-reading streams still open |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {r['slow_reader_grace_s']:g} | {r['outcome']} | {r['new_client_first_message_s']} "
          f"| {r['new_client_total_s']} | {r['hostile_open_on_server']} / {r['streams']} |"
          for r in out["runs"].values())]))


if __name__ == "__main__":
    sys.exit(main())
