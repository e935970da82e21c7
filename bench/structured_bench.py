"""Structured output's costs: decode speed under a JSON schema, compile time, and the admission of a cached schema.

    .venv/bin/tokenloop-bench structured [--rounds 3] [--out bench/results-structured.json] [SERVE FLAGS...]

1. Throughput: 32 concurrent streams (64-token prompts, 128 new tokens, greedy) through the real gRPC server, all
   free (EOS ignored), then all constrained by one JSON schema (bench/structured_cases.BENCH_SCHEMA, which cannot
   complete within 128 tokens, so both runs decode the same number of tokens); alternated `--rounds` times, in one
   server process. The figure is constrained tok/s over free tok/s.
2. Compile: every schema, regex and grammar of bench/structured_cases.py compiled cold (no cache), in process.
3. Admission of a cached schema: `GrammarGate.admit` (the request path's compile step) on a cache hit, in process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from tokenloop.bench.harness import (
    DEFAULT_MODEL,
    TEXT,
    TokenloopServer,
    add_out_argument,
    machine,
    stream_generate,
    write,
)
from tokenloop.bench.structured_cases import ARITHMETIC_GRAMMAR, BENCH_SCHEMA, REGEXES, SCHEMAS

NUM_STREAMS, PROMPT_TOKENS, NEW_TOKENS = 32, 64, 128


async def run_streams(port: int, prompts: list[list[int]], schema: str | None,
                      new_tokens: int) -> tuple[float, int, list[str]]:
    """(tokens/s, tokens, finish reasons) of one batch of concurrent streams."""
    run = await stream_generate(port, prompts, [new_tokens] * len(prompts), len(prompts), json_schema=schema)
    return sum(run.num_tokens) / run.wall_s, sum(run.num_tokens), sorted(set(run.finish_reasons))


def throughput(model: str, engine_flags: list[str], rounds: int, streams: int = NUM_STREAMS,
               new_tokens: int = NEW_TOKENS) -> dict:
    from tokenloop.core.tokenizer import Tokenizer

    corpus = Tokenizer.from_dir(model).encode(TEXT)
    prompts = [corpus[i * 97:i * 97 + PROMPT_TOKENS] for i in range(streams)]
    schema = json.dumps(BENCH_SCHEMA)
    runs: dict[str, list[float]] = {"free": [], "json_schema": []}
    reasons: dict[str, list[str]] = {}
    with TokenloopServer(model, engine_flags) as server:
        asyncio.run(run_streams(server.port, prompts[:2], schema, new_tokens))  # warm-up; the schema compiled once
        for _ in range(rounds):
            for name, spec in (("free", None), ("json_schema", schema)):
                tok_s, tokens, finish = asyncio.run(run_streams(server.port, prompts, spec, new_tokens))
                if tokens != streams * new_tokens:
                    raise RuntimeError(f"{name}: {tokens} tokens, expected {streams * new_tokens}")
                runs[name].append(tok_s)
                reasons[name] = finish
                print(f"{name}: {tok_s:.1f} tok/s ({', '.join(finish)})", file=sys.stderr, flush=True)
    free, constrained = statistics.fmean(runs["free"]), statistics.fmean(runs["json_schema"])
    return {"runs_tok_s": runs, "finish_reasons": reasons, "free_tok_s": free, "constrained_tok_s": constrained,
            "ratio": constrained / free}


def compile_times(model: str) -> dict:
    from tokenloop.core.structured import GrammarCompiler
    from tokenloop.core.tokenizer import ModelCard, Tokenizer

    card, tokenizer = ModelCard.from_dir(model), Tokenizer.from_dir(model)
    start = time.perf_counter()
    compiler = GrammarCompiler(tokenizer.to_json(), max(card.vocab_size, tokenizer.vocab_size), card.eos_token_ids,
                               cache_size=0)
    setup_s = time.perf_counter() - start
    cases = [("json_schema", name, json.dumps(s)) for name, s in SCHEMAS.items()]
    cases += [("regex", name, r) for name, r in REGEXES.items()] + [("grammar", "arithmetic", ARITHMETIC_GRAMMAR)]
    times = {}
    for kind, name, spec in cases:
        start = time.perf_counter()
        compiler.compile(kind, spec)
        times[f"{kind}:{name}"] = time.perf_counter() - start
    schema_times = [t for k, t in times.items() if k.startswith("json_schema:")]
    return {"tokenizer_setup_s": setup_s, "compile_s": times, "schema_p50_s": statistics.median(schema_times),
            "schema_max_s": max(schema_times), "all_p50_s": statistics.median(times.values()),
            "all_max_s": max(times.values())}


def cached_admission(model: str, num: int = 2000) -> dict:
    """Seconds `GrammarGate.admit` takes on a cache hit (and on a request with no constraint, for scale)."""
    from tokenloop.core.request import StructuredOutput, ValidRequest
    from tokenloop.core.structured import GrammarCompiler
    from tokenloop.core.tokenizer import ModelCard, Tokenizer
    from tokenloop.service.structured import GrammarGate

    card, tokenizer = ModelCard.from_dir(model), Tokenizer.from_dir(model)
    gate = GrammarGate(GrammarCompiler(tokenizer.to_json(), card.vocab_size, card.eos_token_ids), lambda: None, 10.0)
    spec = json.dumps(SCHEMAS["tool_call"])
    gate.compiler.compile("json_schema", spec)
    request = ValidRequest("b", (1, 2, 3), structured=StructuredOutput("json_schema", spec))

    async def measure() -> list[float]:
        out = []
        for _ in range(num):
            start = time.perf_counter()
            admitted = await gate.admit(request)
            out.append(time.perf_counter() - start)
            assert admitted.structured.grammar is not None
        return out

    times = sorted(asyncio.run(measure()))
    return {"p50_s": times[len(times) // 2], "p99_s": times[int(len(times) * 0.99)], "max_s": times[-1],
            "schema_bytes": len(spec)}


def report(result: dict) -> str:
    t, c, a = result["throughput"], result["compile"], result["admission"]
    lines = ["| measure | figure |", "| --- | --- |",
             f"| 32 streams free, tok/s (each round) | {t['free_tok_s']:.1f} "
             f"({', '.join(f'{x:.1f}' for x in t['runs_tok_s']['free'])}) |",
             f"| 32 streams under one JSON schema, tok/s | {t['constrained_tok_s']:.1f} "
             f"({', '.join(f'{x:.1f}' for x in t['runs_tok_s']['json_schema'])}) |",
             f"| constrained / free | {t['ratio']:.3f} ({(1 - t['ratio']) * 100:+.1f} % lost) |",
             f"| compile, {len(SCHEMAS)} test schemas: p50 / max | {c['schema_p50_s'] * 1e3:.2f} / "
             f"{c['schema_max_s'] * 1e3:.2f} ms |",
             f"| compile, every case (schemas, regexes, grammar): p50 / max | {c['all_p50_s'] * 1e3:.2f} / "
             f"{c['all_max_s'] * 1e3:.2f} ms |",
             f"| llguidance tokenizer set-up (once, at start-up) | {c['tokenizer_setup_s']:.2f} s |",
             f"| admit a cached schema: p50 / p99 / max | {a['p50_s'] * 1e6:.1f} / {a['p99_s'] * 1e6:.1f} / "
             f"{a['max_s'] * 1e6:.1f} µs |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--rounds", type=int, default=3, help="free / constrained rounds, alternated")
    parser.add_argument("--streams", type=int, default=NUM_STREAMS, help="concurrent streams (a quick check: fewer)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="new tokens per stream")
    add_out_argument(parser, "results-structured.json")
    args, engine_flags = parser.parse_known_args(argv)  # the rest goes to `tokenloop serve`
    model = args.model
    result = {"engine_flags": engine_flags, "compile": compile_times(model), "admission": cached_admission(model),
              "throughput": throughput(model, engine_flags, args.rounds, args.streams, args.new_tokens)}
    where = machine()
    print(f"\n{where['date']}, {where['cpu']}, {where['cpus']} CPUs, engine flags: "
          f"{' '.join(engine_flags) or '(defaults)'}\n\n{report(result)}")
    write(args.out, result)
    return 0
