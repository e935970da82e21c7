"""Prefix caching measured: requests that share a long system prompt, with and without the cache, in one run.

    .venv/bin/python bench/engine_bench.py --shared-prefix [--out bench/results-shared-prefix.json]

64 requests whose prompts are one 448-token system prompt followed by a different 64-token tail, 16 in flight,
64 new tokens each (greedy, EOS ignored), through the real gRPC server: once with `--enable-prefix-caching`
and once with `--no-enable-prefix-caching`, same prompts, same machine, one after the other. Reports TTFT
p50, generated tok/s and the prompt tokens served from the cache (`usage.cached_prompt_tokens`).
"""

from __future__ import annotations

import asyncio
import statistics
import time

NUM_REQUESTS, SYSTEM_TOKENS, TAIL_TOKENS, IN_FLIGHT, NUM_NEW = 64, 448, 64, 16, 64


def prompts(corpus: list[int]) -> list[list[int]]:
    system = corpus[:SYSTEM_TOKENS]
    tails = [corpus[SYSTEM_TOKENS + 1000 + i * 131:][:TAIL_TOKENS] for i in range(NUM_REQUESTS)]
    if any(len(t) < TAIL_TOKENS for t in tails):
        raise ValueError("the corpus is too short for the shared-prefix prompts")
    return [system + t for t in tails]


async def run(port: int, batch: list[list[int]]) -> dict:
    import grpc

    from tokenloop.v1 import tokenloop_pb2 as pb
    from tokenloop.v1 import tokenloop_pb2_grpc

    gate = asyncio.Semaphore(IN_FLIGHT)
    ttfts, counts, cached = [], [], []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = tokenloop_pb2_grpc.TextGenerationStub(channel)

        async def one(prompt: list[int]) -> None:
            async with gate:
                sent, first, count = time.perf_counter(), None, 0
                request = pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=prompt), stream=True, sampling=pb.SamplingParams(temperature=0.0),
                    stopping=pb.StoppingCriteria(max_new_tokens=NUM_NEW, ignore_eos=True))
                async for response in stub.Generate(request):
                    if response.HasField("chunk") and response.chunk.token_ids:
                        first = first or time.perf_counter()
                        count += len(response.chunk.token_ids)
                    elif response.HasField("complete"):
                        cached.append(response.complete.usage.cached_prompt_tokens)
                ttfts.append(first - sent)
                counts.append(count)

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in batch))
        wall = time.perf_counter() - start
    if sum(counts) != NUM_NEW * len(batch):
        raise RuntimeError(f"the server returned {sum(counts)} tokens, expected {NUM_NEW * len(batch)}")
    return {"num_tokens": sum(counts), "wall_s": wall, "tokens_per_s": sum(counts) / wall,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": statistics.quantiles(ttfts, n=10)[-1],
            "cached_prompt_tokens": sum(cached), "prompt_tokens": sum(len(p) for p in batch)}


def main(model_dir: str, engine_flags: list[str], out: str | None) -> int:
    from bench.engine_bench import TEXT, free_port, start_server, wait_ready
    from bench.results import write
    from tokenloop.looper.tokenizer import Tokenizer
    batch = prompts(Tokenizer.from_dir(model_dir).encode(TEXT))
    warm = [[5, 6, 7, 8] * 8, [9, 10, 11] * 8]  # unrelated to the prompts: loads the kernels, caches nothing they share
    results = {}
    for mode in ("enable", "no-enable"):
        port = free_port()
        server = start_server(model_dir, port, [f"--{mode}-prefix-caching", *engine_flags])
        try:
            asyncio.run(wait_ready(port))
            asyncio.run(run(port, warm))
            results[mode] = asyncio.run(run(port, batch))
        finally:
            server.terminate()
            server.wait(timeout=60)
        r = results[mode]
        print(f"prefix caching {'on' if mode == 'enable' else 'off'}: {r['tokens_per_s']:.1f} tok/s, "
              f"TTFT p50 {r['ttft_p50_s']:.2f} s, {r['cached_prompt_tokens']} of {r['prompt_tokens']} prompt tokens "
              "from the cache", flush=True)
    on, off = results["enable"], results["no-enable"]
    speedup, ttft_ratio = on["tokens_per_s"] / off["tokens_per_s"], off["ttft_p50_s"] / on["ttft_p50_s"]
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {NUM_REQUESTS} requests, {SYSTEM_TOKENS}-token "
          f"shared prefix + {TAIL_TOKENS}-token tails, {IN_FLIGHT} in flight, {NUM_NEW} new tokens\n\n"
          "| prefix caching | tok/s | TTFT p50 s | TTFT p90 s | prompt tokens from cache |\n| --- | --- | --- | --- | --- |")
    for name, r in (("on", on), ("off", off)):
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s']:.2f} | {r['ttft_p90_s']:.2f} | "
              f"{r['cached_prompt_tokens']} / {r['prompt_tokens']} |")
    print(f"\ntok/s {speedup:.2f}x higher, TTFT p50 {ttft_ratio:.2f}x lower with prefix caching")
    write(out, {"engine_flags": engine_flags, "num_requests": NUM_REQUESTS, "shared_prefix_tokens": SYSTEM_TOKENS,
                "tail_tokens": TAIL_TOKENS, "in_flight": IN_FLIGHT, "new_tokens": NUM_NEW, "caching_on": on,
                "caching_off": off, "tokens_per_s_speedup": speedup, "ttft_p50_reduction": ttft_ratio})
    return 0
