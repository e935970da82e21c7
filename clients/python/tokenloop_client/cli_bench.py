"""`tokenloop-cli bench`: load levels one after another; the expected time first, progress as it goes, and on
Ctrl-C (or SIGTERM) the levels that finished (printed, and written with --out).

A shell that runs a command in the background without job control (`cmd &` in a script, `make test &`) starts it
with SIGINT ignored, and Python then installs no KeyboardInterrupt handler: Ctrl-C and `kill -INT` do nothing. So
SIGTERM (`kill PID`, never ignored that way) stops the bench the same way, and the first line says so when SIGINT
is ignored."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
import time

from . import bench, report
from .aio import AsyncClient
from .machine import cpu_record

DEFAULT_DURATION_S = 20.0  # seconds per level when neither --num-requests nor --duration is given
INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT), as shells report it
TERMINATED = 143  # after SIGTERM (128 + 15)


def add_parser(sub, parents: list) -> None:
    """The `bench` sub-command's options."""
    b = sub.add_parser("bench", parents=parents, help="load generator: throughput, TTFT and inter-token latency",
                       description="Run one load level per concurrency and print a table. Without -r/-d each level "
                                   f"runs {DEFAULT_DURATION_S:g} s (then the requests in flight finish); Ctrl-C "
                                   "stops and keeps the levels that finished.")
    b.add_argument("-c", "--concurrency", type=concurrency_list, default=[1],
                   help="concurrent streams; a comma list (1,4,16) sweeps (default 1)")
    b.add_argument("-r", "--num-requests", type=int, help="requests per level (default: as many as fit in -d)")
    b.add_argument("-d", "--duration", type=float,
                   help=f"seconds per level: stop starting requests after (default {DEFAULT_DURATION_S:g} without -r)")
    b.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens (default 64)")
    b.add_argument("--max-new-tokens", type=int, default=64, help="output length in tokens (default 64)")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--no-ignore-eos", action="store_true", help="let sequences end at EOS (shorter outputs)")
    b.add_argument("--lora", action="append", default=[], metavar="NAME",
                   help="requests name these LoRA adapters in turn (repeatable; 'base' = no adapter)")
    b.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    b.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE (no file unless asked)")
    b.add_argument("--plot", metavar="PNG", help="draw throughput and latency against concurrency")
    b.add_argument("--title", help="plot title (default: the model id)")
    b.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress on stderr: a bar on a terminal, a line every 5 s otherwise (default: on)")


def concurrency_list(text: str) -> list[int]:
    """`1,4,16` -> [1, 4, 16]."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,4,16; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrency values must be >= 1; got {text!r}")
    return values


def plan(args: argparse.Namespace) -> str:
    """The line printed first: what will run, about how long it takes, and how to stop it."""
    levels = ", ".join(map(str, args.concurrency))
    what = f"{len(args.concurrency)} level{'s' * (len(args.concurrency) > 1)} (concurrency {levels})"
    stop = "Ctrl-C stops and keeps the levels that finished"
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        stop = ("SIGINT is ignored in this process (started in the background by a script?): `kill PID` (SIGTERM) "
                "stops and keeps the levels that finished")
    if args.duration:
        total = len(args.concurrency) * args.duration
        more = f", at most {args.num_requests} requests each" if args.num_requests else ""
        return (f"bench: {what}, {args.duration:g} s each{more}, then the requests in flight finish: "
                f"about {total:.0f} s or a little more; {stop}")
    return f"bench: {what}, {args.num_requests} requests each; the time depends on the server (-d S bounds each level); {stop}"


def run(args: argparse.Namespace) -> int:
    """Run the levels; print (and write) the ones that finished, also after Ctrl-C."""
    if args.num_requests is None and args.duration is None:
        args.duration = DEFAULT_DURATION_S
    print(plan(args), file=sys.stderr, flush=True)
    state: dict = {"server": {"address": args.address}, "results": []}
    status = 0
    try:
        asyncio.run(_levels(args, state))
    except KeyboardInterrupt:
        status = INTERRUPTED
    except asyncio.CancelledError:  # SIGTERM cancelled the levels
        status = TERMINATED
    if status:
        done = ", ".join(str(level["concurrency"]) for level in state["results"]) or "none"
        how = "interrupted" if status == INTERRUPTED else "terminated (SIGTERM)"
        print(f"\nbench: {how}; levels that finished: {done} (the level cut short is left out)", file=sys.stderr)
        state["interrupted"] = True
    _output(args, state)
    return status


async def _levels(args: argparse.Namespace, state: dict) -> None:
    from .cli import client_kwargs
    mode = "off" if args.progress is False else ("bar" if sys.stderr.isatty() else "lines")
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
    async with AsyncClient(args.address, **client_kwargs(args)) as client:
        state["server"].update(dataclasses.asdict(await client.model_info()))
        for concurrency in args.concurrency:
            cfg = bench.BenchConfig(concurrency, args.num_requests, args.duration, args.prompt_tokens,
                                    args.max_new_tokens, args.temperature, not args.no_ignore_eos,
                                    tuple("" if name == "base" else name for name in args.lora))
            state["results"].append(await bench.run_level(client, cfg, mode))


def _output(args: argparse.Namespace, state: dict) -> None:
    results = state["results"]
    if args.json:
        print(json.dumps(state, indent=2), flush=True)
    elif results:
        print(report.table(results), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **cpu_record(), **state},
                               indent=2) + "\n")
        print(f"results written to {args.out}", file=sys.stderr)
    if args.plot and results:
        report.plot(results, args.plot, title=args.title or state["server"].get("model_id", ""))
        print(f"plot written to {args.plot}", file=sys.stderr)
