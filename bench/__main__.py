"""`tokenloop-bench`: list the benchmarks, run one, or run them all.

    .venv/bin/tokenloop-bench                      # the list: name, what it measures, its results file
    .venv/bin/tokenloop-bench NAME [ARGS...]       # one benchmark; `NAME --help` lists its arguments
    .venv/bin/tokenloop-bench all                  # every benchmark with its defaults, one after another
    .venv/bin/tokenloop-bench smoke [NAME...]      # each with a tiny setting: does it still run? (no figures)
    .venv/bin/tokenloop-bench record NAME...       # each as recorded: its recorded arguments, --out its results file
    .venv/bin/tokenloop-bench figures [--write]    # the docs' figures against the results files (--write: tables)

`python -m tokenloop.bench NAME ...` is the same. A benchmark is a module of bench/ (the package
`tokenloop.bench`) with `main(argv) -> int`, listed in BENCHMARKS below.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from dataclasses import dataclass

from tokenloop.bench import harness


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: its module in bench/, what it measures, where its recorded figures are, a tiny setting
    that runs it end to end in seconds (`smoke`), and the arguments of its recorded run besides `--out` (`record`)."""

    module: str
    what: str
    results: str = ""  # bench/results-NAME.json, when its figures are recorded
    smoke: tuple[str, ...] = ()
    record: tuple[str, ...] = ()

    def arguments(self, mode: str) -> list[str]:
        """`all`: the defaults; `smoke`: the tiny setting; `record`: the recorded run, written to its results file."""
        return {"all": [], "smoke": list(self.smoke),
                "record": [*self.record, "--out", f"bench/{self.results}"]}[mode]


TINY_ENGINE = ("--scenarios", "single", "--single-repeats", "1", "--no-bandwidth", "--new-tokens", "8")
BENCHMARKS = {
    "engine": Benchmark("engine_bench", "the engine through its gRPC server against transformers generate() and "
                        "llama.cpp's llama-server (--llama-cpp DIR), fp32 / int8 / int4", "results-engine.json",
                        TINY_ENGINE + ("--reference", "transformers", "--weights", "fp32,int4")),
    "structured": Benchmark("structured_bench", "32 streams under one JSON schema against the same streams free; "
                            "compile times; a cached schema's admission", "results-structured.json",
                            ("--rounds", "1", "--streams", "2", "--new-tokens", "8")),
    "structured_first_try": Benchmark("structured_first_try", "20 JSON schemas as a newcomer writes them, and two "
                                      "jsonObject prompts: how many complete on the default model at temperature 0 "
                                      "and 0.7 (a count, not a timing)", "results-structured-first-try.json",
                                      ("--cases", "1")),
    "shared_prefix": Benchmark("shared_prefix", "prefix caching on and off: 64 requests sharing a 448-token system "
                               "prompt", "results-shared-prefix.json",
                               ("--new-tokens", "4", "--requests", "4")),
    "bandwidth": Benchmark("bandwidth", "what two threads stream from memory, and each weights mode's bytes per "
                           "token", "", ("--mb", "16", "--rounds", "1")),
    "quant_kernels": Benchmark("quant_kernels", "the quantized products, each kernel route against torch's, on the "
                               "model's shapes", "results-quant-kernels.json",
                               ("--weights", "int8", "--tokens", "1", "--layers", "2", "--rounds", "1")),
    "decode_profile": Benchmark("decode_profile", "one process: where a decode step's time goes, engine against "
                                "transformers", "", ("--batch", "1", "--new", "4", "--skip-transformers")),
    "attention": Benchmark("attention_bench", "the paged decode-attention kernel against the one committed at "
                           "--base", "", ("--base", "HEAD", "--batch", "2", "--lens", "32", "--layers", "2", "--rounds", "1")),
    "server_ab": Benchmark("server_ab", "two servers (two checkouts or two flag sets) interleaved round by round, "
                           "one stream through gRPC", "", ("engine", "--rounds", "1", "--new-tokens", "8")),
    "service_overhead": Benchmark("service_overhead", "the Python front against a bare grpc.aio method on a null "
                                  "executor: 1, 64, 256 streams; --ab-checkout DIR for an interleaved A/B",
                                  "results-overhead.json",
                                  ("--tokens", "256", "--repeat", "1", "--paced-repeat", "1", "--streams", "1,4",
                                   "--idle-seconds", "1")),
    "front_ab": Benchmark("service_overhead", "the front's interleaved A/B at 256 streams: this checkout against "
                          "another's (--ab-checkout DIR; recorded against /tmp/tl-old, docs/performance.md) and bare "
                          "grpc.aio, medians of 24 rounds", "results-front-ab.json",
                          ("--ab-checkout", ".", "--streams", "4", "--ab-rounds", "1", "--tokens", "64"),
                          ("--ab-checkout", "/tmp/tl-old", "--streams", "256")),
    "idle_cpu": Benchmark("idle_cpu", "an idle server's CPU, and its looper thread's", "",
                          ("--executor", "null", "--seconds", "1")),
    "engine_gil": Benchmark("engine_gil", "the engine's GIL use: a unary RPC's latency beside 16 and 32 streams",
                            "results-engine-gil.json", ("--streams", "2", "--tokens", "8", "--seconds", "2", "--warmup", "1", "--no-py-spy"),
                            ("--streams", "16")),
    "prompt_stall": Benchmark("prompt_stall", "paced streams while long prompts arrive: tokenized on the event loop "
                              "or off it", "results-prompt-stall.json",
                              ("--streams", "4", "--seconds", "2", "--prompt-tokens", "512", "--repeat", "1")),
    "slow_readers": Benchmark("slow_readers", "a new client's first token beside streams that never read",
                              "results-slow-readers.json", ("--streams", "4", "--new-tokens", "8", "--deadline", "30", "--runs", "on")),
    "soak": Benchmark("soak", "chaos and soak: 400 streams of every kind, an Abort storm, an engine death (make soak)",
                      "", ("--quick", "--num", "40", "--death-streams", "4")),
    "lora": Benchmark("lora_bench", "32 streams over 4 LoRA adapters against the base model", "results-lora.json",
                      ("--num-adapters", "2", "--rank", "4", "--concurrency", "2", "--requests", "2", "--max-new-tokens", "4", "--rounds", "1")),
    "model_load": Benchmark("model_load", "load time, resident and peak memory per model and weights mode, each in a "
                            "child process", "results-model-load.json", ("--weights", "int4")),
    "spec": Benchmark("spec_bench", "speculative decoding off / ngram against llama-server plain and with its n-gram "
                      "speculation (--llama-cpp DIR): grounded tasks and free chat, 1 and 8 streams", "results-spec.json",
                      ("--scenarios", "grounded", "--streams", "1", "--new-tokens", "8", "--repeats", "1")),
    "size_table": Benchmark("size_table", "the engine against llama-server as models grow: 135M, 360M and 1.7B "
                            "shapes, Gemma 3 270M from its GGUF; 1 and 8 streams (--llama-cpp DIR)",
                            "results-size.json", ("--scenarios", "single", "--single-repeats", "1",
                                                  "--new-tokens", "8")),
    "route_retiming": Benchmark("route_retiming", "one stream's tok/s over the first minutes after a quiet start "
                                "and after starts beside a CPU hog, with and without --route-retiming",
                                "results-route-retiming.json",
                                ("--seconds", "2", "--window", "1", "--rounds", "1", "--new-tokens", "8",
                                 "--arms", "quiet,loaded+retiming")),
    "clients": Benchmark("client_bench", "`tokenloop-cli bench` (the Python client's load generator) against the "
                         "default model: throughput, TTFT, inter-token latency at 1, 4, 16, 32 streams",
                         "results-clients.json", ("--concurrency", "1,2", "--duration", "2", "--max-new-tokens", "8")),
    "grammar_libs": Benchmark("grammar_libs", "xgrammar against llguidance: compile, mask per token",
                              "results-grammar-libs.json", ("--walks", "1")),
}
SUPPORT = ("harness", "llama_server", "null_executor", "structured_cases", "spec_cases", "shape_gguf")  # not benchmarks


def listing() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"{name:{width}}  {b.what}" + (f" [bench/{b.results}]" if b.results else "")
             for name, b in BENCHMARKS.items()]
    return "\n".join(["tokenloop-bench NAME [ARGS...] runs one (NAME --help: its arguments); `all` runs every one, "
                      "`smoke` each with a tiny setting, `record NAME...` each as recorded into its results file; "
                      "`figures [--write]` checks (rewrites) the docs' figures.",
                      "", *lines])


def run(name: str, argv: list[str]) -> int:
    """Benchmark `name`'s main(argv), with the command line recorded for its results file."""
    harness.COMMAND[:] = ["tokenloop-bench", name, *argv]
    module = importlib.import_module(f"tokenloop.bench.{BENCHMARKS[name].module}")
    return module.main(argv) or 0


def run_each(names: list[str], mode: str) -> int:
    """Each benchmark in its own process (a benchmark may start servers and pin threads), with the arguments of
    `mode` (Benchmark.arguments): the failures' names."""
    failed = []
    for name in names:
        args = BENCHMARKS[name].arguments(mode)
        print(f"\n== tokenloop-bench {name} {' '.join(args)}", flush=True)
        start = time.monotonic()
        code = subprocess.call([sys.executable, "-m", "tokenloop.bench", name, *args], cwd=harness.ROOT)
        print(f"== {name}: exit {code} in {time.monotonic() - start:.0f} s", flush=True)
        failed += [name] if code else []
    print("\nfailed: " + (", ".join(failed) if failed else "none"))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "figures":  # not a benchmark: the docs' figures against the results files
        from tokenloop.bench import figures
        return figures.main(rest)
    if name in ("all", "smoke", "record"):
        unknown = [n for n in rest if n not in BENCHMARKS]
        if unknown:
            print(f"unknown benchmark(s): {', '.join(unknown)}\n\n{listing()}", file=sys.stderr)
            return 2
        unrecorded = [n for n in rest if not BENCHMARKS[n].results]
        if name == "record" and (unrecorded or not rest):
            print("record NAME...: name the benchmarks to record (each writes its results file); "
                  + (f"{', '.join(unrecorded)} record(s) none" if unrecorded else "none named"), file=sys.stderr)
            return 2
        print(listing())
        return run_each(rest or list(BENCHMARKS), name)
    if name not in BENCHMARKS:
        print(f"unknown benchmark {name!r}\n\n{listing()}", file=sys.stderr)
        return 2
    return run(name, rest)


if __name__ == "__main__":
    sys.exit(main())
