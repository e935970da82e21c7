"""Prefix caching measured: requests that share a long system prompt, with and without the cache, in one run.

    .venv/bin/tokenloop-bench shared_prefix [--new-tokens 10,64] [--out bench/results-shared-prefix.json] [SERVE FLAGS]

64 requests whose prompts are one 448-token system prompt followed by a different 64-token tail, 16 in flight,
greedy, EOS ignored, through the real gRPC server: with `--enable-prefix-caching` and with
`--no-enable-prefix-caching`, same prompts, same machine, one after the other, for each output length in
`--new-tokens` (10: the default `--output-len` of vLLM's benchmarks/benchmark_prefix_caching.py, where prefill
dominates; 64: where decoding does). Reports TTFT p50 / p90, generated tok/s, total tok/s (prompt + generated,
vLLM's "total token throughput") and the prompt tokens served from the cache (`usage.cached_prompt_tokens`).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from tokenloop.bench.harness import DEFAULT_MODEL, TEXT, TokenloopServer, add_out_argument, stream_generate, write

NUM_REQUESTS, SYSTEM_TOKENS, TAIL_TOKENS, IN_FLIGHT = 64, 448, 64, 16


def prompts(corpus: list[int], num: int = NUM_REQUESTS) -> list[list[int]]:
    system = corpus[:SYSTEM_TOKENS]
    tails = [corpus[SYSTEM_TOKENS + 1000 + i * 131:][:TAIL_TOKENS] for i in range(num)]
    if any(len(t) < TAIL_TOKENS for t in tails):
        raise ValueError("the corpus is too short for the shared-prefix prompts")
    return [system + t for t in tails]


async def run(port: int, batch: list[list[int]], num_new: int) -> dict:
    done = await stream_generate(port, batch, [num_new] * len(batch), IN_FLIGHT)
    wall, ttfts, counts, cached = done.wall_s, done.ttft_s, done.num_tokens, done.cached_prompt_tokens
    if sum(counts) != num_new * len(batch):
        raise RuntimeError(f"the server returned {sum(counts)} tokens, expected {num_new * len(batch)}")
    prompt_tokens = sum(len(p) for p in batch)
    return {"new_tokens": num_new, "num_tokens": sum(counts), "wall_s": wall, "tokens_per_s": sum(counts) / wall,
            "total_tokens_per_s": (sum(counts) + prompt_tokens) / wall,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1],
            "cached_prompt_tokens": sum(cached), "prompt_tokens": prompt_tokens}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--new-tokens", default="10,64", help="output lengths to run, comma-separated")
    parser.add_argument("--requests", type=int, default=NUM_REQUESTS, help="requests per run (a quick check: fewer)")
    add_out_argument(parser, "results-shared-prefix.json")
    args, engine_flags = parser.parse_known_args(argv)  # the rest goes to `tokenloop serve`
    from tokenloop.core.tokenizer import Tokenizer

    model_dir, new_tokens, out = args.model, args.new_tokens, args.out
    batch = prompts(Tokenizer.from_dir(model_dir).encode(TEXT), args.requests)
    warm = [[5, 6, 7, 8] * 8, [9, 10, 11] * 8]  # unrelated to the prompts: loads the kernels, caches nothing they share
    lengths = [int(n) for n in new_tokens.split(",")]
    runs = []
    for num_new in lengths:
        results = {}
        for mode in ("enable", "no-enable"):  # a fresh server each: nothing cached from the previous run
            with TokenloopServer(model_dir, [f"--{mode}-prefix-caching", *engine_flags]) as server:
                asyncio.run(run(server.port, warm, 4))
                results[mode] = asyncio.run(run(server.port, batch, num_new))
            r = results[mode]
            print(f"{num_new} new tokens, prefix caching {'on' if mode == 'enable' else 'off'}: "
                  f"{r['tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.2f} s, {r['cached_prompt_tokens']} of "
                  f"{r['prompt_tokens']} prompt tokens from the cache", flush=True)
        on, off = results["enable"], results["no-enable"]
        runs.append({"new_tokens": num_new, "caching_on": on, "caching_off": off,
                     "tokens_per_s_speedup": on["tokens_per_s"] / off["tokens_per_s"],
                     "ttft_p50_reduction": off["ttft_p50_s"] / on["ttft_p50_s"]})
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {NUM_REQUESTS} requests, {SYSTEM_TOKENS}-token "
          f"shared prefix + {TAIL_TOKENS}-token tails, {IN_FLIGHT} in flight\n\n"
          "| new tokens | prefix caching | generated tok/s | total tok/s | TTFT p50 s | TTFT p90 s | prompt tokens from "
          "cache | tok/s ratio | TTFT p50 ratio |\n" + "| --- " * 9 + "|")
    for r in runs:
        for name, key in (("on", "caching_on"), ("off", "caching_off")):
            x = r[key]
            ratios = (f"{r['tokens_per_s_speedup']:.2f}x | {r['ttft_p50_reduction']:.2f}x lower" if name == "on"
                      else " | ")
            print(f"| {r['new_tokens']} | {name} | {x['tokens_per_s']:.1f} | {x['total_tokens_per_s']:.1f} | "
                  f"{x['ttft_p50_s']:.2f} | {x['ttft_p90_s']:.2f} | {x['cached_prompt_tokens']} / {x['prompt_tokens']} | "
                  f"{ratios} |")
    write(out, {"engine_flags": engine_flags, "num_requests": len(batch), "shared_prefix_tokens": SYSTEM_TOKENS,
                "tail_tokens": TAIL_TOKENS, "in_flight": IN_FLIGHT, "runs": runs})
    return 0
