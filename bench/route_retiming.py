"""Steady speed after a loaded start (issue 40, item 7): one stream's tok/s over the first minutes of serving, for a
server started on a quiet machine and for servers started while a CPU-heavy process ran (stopped once they are
ready), with and without `--route-retiming` (on by default: the arms without it pass `--no-route-retiming`).

    .venv/bin/tokenloop-bench route_retiming [--weights int4] [--seconds 90] [--window 10] [--rounds 2]

Every server times its routes at start-up (TOKENLOOP_MATMUL_CACHE=off: no cached choice is read or written, so a
loaded start keeps what it timed under load, as an uncached or provisional-cache start does). The hog is one busy
process per CPU at normal priority, running from before the server starts until it reports SERVING. Then one
stream of greedy requests (`--new-tokens` each, EOS ignored) runs back to back for `--seconds`; tokens are counted
per `--window` seconds of wall time. Arms run interleaved, `--rounds` times; the median per window is reported.
The target: a loaded start with `--route-retiming` within 10 % of the quiet start's tok/s within 60 s of serving.
Timings are only meaningful on a quiet machine (apart from the hog this benchmark starts itself).
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from tokenloop.bench.harness import TokenloopServer, parser, report
from tokenloop.core.tokenizer import Tokenizer

SWITCH = re.compile(r"matmul: steps of <=(\d+) tokens switch from (.+?) to (.+?) \(")


def start_hog() -> list[subprocess.Popen]:
    """One busy Python process per CPU (the 'other work' a server may start beside)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]


def stop_hog(hog: list[subprocess.Popen]) -> None:
    for proc in hog:
        proc.kill()
    for proc in hog:
        proc.wait()


async def one_stream(port: int, prompt: list[int], num_new: int, seconds: float) -> list[float]:
    """Greedy requests back to back on one stream for `seconds`; the arrival time (from the start) of every token."""
    import grpc

    from tokenloop.v1 import tokenloop_pb2 as pb
    from tokenloop.v1 import tokenloop_pb2_grpc

    arrivals: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = tokenloop_pb2_grpc.TextGenerationStub(channel)
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt), stream=True, sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingCriteria(max_new_tokens=num_new, ignore_eos=True))
            async for response in stub.Generate(request):
                if response.HasField("chunk") and response.chunk.token_ids:
                    now = time.perf_counter() - start
                    arrivals += [now] * len(response.chunk.token_ids)
    return arrivals


def per_window(arrivals: list[float], window: float, seconds: float) -> list[float]:
    """tok/s in each whole window of `window` seconds up to `seconds`."""
    counts = [0] * int(seconds // window)
    for t in arrivals:
        if int(t // window) < len(counts):
            counts[int(t // window)] += 1
    return [c / window for c in counts]


def run_arm(name: str, args, prompt: list[int]) -> dict:
    loaded, flags = name.startswith("loaded"), ["--weights", args.weights]
    flags.append("--route-retiming" if name.endswith("retiming") else "--no-route-retiming")  # on by default
    hog = start_hog() if loaded else []
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as log:
        try:
            server = TokenloopServer(args.model, flags, env={"TOKENLOOP_MATMUL_CACHE": "off"}, log_level="INFO",
                                     stderr=log)
            server.__enter__()
        finally:
            stop_hog(hog)
        ready_s = time.perf_counter() - started
        try:
            arrivals = asyncio.run(one_stream(server.port, prompt, args.new_tokens, args.seconds))
        finally:
            server.stop()
        log.seek(0)
        text = log.read()
    switches = [{"bucket": int(b), "from": old, "to": new} for b, old, new in SWITCH.findall(text)]
    chosen = [line.split("matmul: ", 1)[1] for line in text.splitlines() if "matmul: routes" in line][:1]
    return {"ready_s": round(ready_s, 1), "tok_s": per_window(arrivals, args.window, args.seconds),
            "switches": switches, "calibration": chosen[0] if chosen else None}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, "results-route-retiming.json")
    p.add_argument("--weights", default="int4")
    p.add_argument("--seconds", type=float, default=90.0, help="seconds of serving measured per server")
    p.add_argument("--window", type=float, default=10.0, help="seconds per tok/s window")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="times each arm runs (interleaved); medians reported")
    p.add_argument("--arms", default="quiet,loaded,loaded+retiming")
    args = p.parse_args(argv)
    tok = Tokenizer.from_dir(args.model)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a long story about a lighthouse."}]))
    arms = args.arms.split(",")
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for _ in range(args.rounds):
        for arm in arms:
            runs[arm].append(run_arm(arm, args, prompt))
            print(f"{arm}: {runs[arm][-1]}", file=sys.stderr, flush=True)
    windows = int(args.seconds // args.window)
    rows = {arm: {"tok_s": [round(statistics.median(r["tok_s"][w] for r in results), 1) for w in range(windows)],
                  "runs": results} for arm, results in runs.items()}
    quiet = rows.get("quiet")
    if quiet:
        for row in rows.values():
            row["vs_quiet"] = [round(a / q, 3) if q else None for a, q in zip(row["tok_s"], quiet["tok_s"])]
    figures = {"weights": args.weights, "seconds": args.seconds, "window_s": args.window,
               "new_tokens": args.new_tokens, "rounds": args.rounds, "arms": rows}

    def table() -> str:
        head = "| arm | " + " | ".join(f"{int(w * args.window)}-{int((w + 1) * args.window)} s" for w in range(windows))
        lines = [head + " | switches |", "|" + " --- |" * (windows + 2)]
        for arm, row in rows.items():
            cells = [f"{v:.1f}" + (f" ({r:.2f}x)" if quiet and arm != "quiet" else "")
                     for v, r in zip(row["tok_s"], row.get("vs_quiet", row["tok_s"]))]
            switches = sum(len(r["switches"]) for r in row["runs"])
            lines.append(f"| {arm} | " + " | ".join(cells) + f" | {switches} |")
        return "\n".join(lines)

    return report(args, figures, table)


if __name__ == "__main__":
    sys.exit(main())
