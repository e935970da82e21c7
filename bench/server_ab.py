"""One stream (or --streams) through real servers and through the engine alone, interleaved: which is slower, and by how much.

Each arm is a `tokenloop serve` (its own executable: a checkout's .venv/bin/tokenloop, so two branches compare) or
`engine`: an `Engine` on its own thread in this process, driven through enqueue / await_responses (no looper, no
gRPC). Every round sends one greedy 64-token-prompt request to each arm in turn (the order reversed every other
round), so load from elsewhere lands on every arm alike; it prints each round, then per arm the median tokens/s
(as engine_bench's `single`: prefill and first token included), the median ms per token after the first, the
ratio to the first arm, and the CPU milliseconds per token of each thread (the arm's server, or this process for
`engine`; `client`: this process's gRPC client).

    flock /tmp/bench.lock .venv/bin/tokenloop-bench server_ab engine server=.venv/bin/tokenloop
    flock /tmp/bench.lock .venv/bin/tokenloop-bench server_ab main=../../main/.venv/bin/tokenloop \\
        branch=.venv/bin/tokenloop --rounds 8
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

from tokenloop.bench.harness import DEFAULT_MODEL, cpu_by_thread_name, free_port, stream_generate, wait_ready


class ServerArm:
    """A `tokenloop serve` started from `exe` (a checkout's entry point)."""

    def __init__(self, label: str, exe: str, model: str, flags: list[str]):
        self.label, self.port = label, free_port()
        self.process = subprocess.Popen([exe, "serve", "--model", model, "--port", str(self.port), "--metrics-port", "0",
                                         "--log-level", "WARNING", *flags], stdout=subprocess.DEVNULL)
        self.pid = self.process.pid

    def ready(self) -> None:
        asyncio.run(wait_ready(self.port, proc=self.process))

    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        run = asyncio.run(stream_generate(self.port, prompts, [n] * len(prompts), len(prompts)))
        if run.num_tokens != [n] * len(prompts):
            raise RuntimeError(f"{self.label}: {run.num_tokens} tokens, expected {n} each")
        return run.wall_s, max(run.ttft_s)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


class EngineArm:
    """An `Engine` on its own thread in this process, driven through enqueue / await_responses."""

    def __init__(self, label: str, model: str, weights: str):
        from tokenloop.engine.config import EngineConfig
        from tokenloop.engine.engine import Engine

        self.label, self.pid = label, os.getpid()
        self.engine = Engine(model, EngineConfig(weights=weights))

    def ready(self) -> None:
        pass

    def generate(self, prompts: list[list[int]], n: int) -> tuple[float, float]:
        from tokenloop.core.request import SamplingParams, StoppingParams, ValidRequest

        start, firsts, count, open_ = time.perf_counter(), {}, 0, set()
        for i, prompt in enumerate(prompts):
            open_.add(self.engine.enqueue(ValidRequest(
                request_id=f"ab{i}", prompt_token_ids=tuple(prompt), sampling=SamplingParams(temperature=0.0),
                stopping=StoppingParams(max_new_tokens=n, ignore_eos=True))))
        while open_:
            for step in self.engine.await_responses(0.02):
                firsts.setdefault(step.executor_id, time.perf_counter())
                count += len(step.token_ids)
                if step.is_final:
                    open_.discard(step.executor_id)
        if count != n * len(prompts):
            raise RuntimeError(f"{self.label}: {count} tokens, expected {n * len(prompts)}")
        return time.perf_counter() - start, max(firsts.values()) - start

    def close(self) -> None:
        self.engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arms", nargs="+", help="`engine`, or LABEL=EXECUTABLE (a tokenloop entry point)")
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=1, help="concurrent requests per round (8: engine_bench's "
                        "`eight`, 32: `uniform`); ms per token after the first is then per step, after the last "
                        "request's first token")
    args = parser.parse_args(argv)
    arms = []
    try:
        for spec in args.arms:
            label, _, exe = spec.partition("=")
            arms.append(EngineArm(label, args.model, args.weights) if not exe else
                        ServerArm(label, exe, args.model, ["--weights", args.weights]))
            arms[-1].ready()  # one start at a time: a start beside another times its matmul routes under load
            arms[-1].generate([list(range(100, 116))], 4)  # warm-up, as engine_bench's
        n, per_round, cpu = args.new_tokens, {a.label: [] for a in arms}, {a.label: {} for a in arms}
        for r in range(args.rounds):
            prompts = [[1000 + (r * 97 + k * 31 + i * 13) % 15000 for i in range(64)] for k in range(args.streams)]
            for arm in arms if r % 2 == 0 else arms[::-1]:
                before, client = cpu_by_thread_name(arm.pid), time.process_time()
                wall, ttft = arm.generate(prompts, n)
                after, client = cpu_by_thread_name(arm.pid), time.process_time() - client
                used = cpu[arm.label]
                for thread, seconds in after.items():
                    used[thread] = used.get(thread, 0.0) + seconds - before.get(thread, 0.0)
                if isinstance(arm, ServerArm):
                    used["client"] = used.get("client", 0.0) + client
                per_round[arm.label].append((n * args.streams / wall, (wall - ttft) / (n - 1) * 1e3))
            print(f"round {r}: " + "  ".join(f"{a.label} {per_round[a.label][-1][0]:.1f} tok/s "
                                             f"({per_round[a.label][-1][1]:.2f} ms/token)" for a in arms), flush=True)
        base = statistics.median(x[0] for x in per_round[arms[0].label])
        for arm in arms:
            rates = per_round[arm.label]
            tok_s, ms = statistics.median(x[0] for x in rates), statistics.median(x[1] for x in rates)
            threads = sorted(cpu[arm.label].items(), key=lambda kv: -kv[1])
            print(f"{arm.label}: median {tok_s:.1f} tok/s, {ms:.2f} ms per token after the first, "
                  f"{tok_s / base:.3f} x {arms[0].label}; CPU ms per token: "
                  + ", ".join(f"{t} {s / (n * args.streams * args.rounds) * 1e3:.2f}" for t, s in threads if s > 0.002))
        print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.2f}")
    finally:
        for arm in arms:
            arm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
