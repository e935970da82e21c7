"""LoRA serving throughput: 32 streams spread over 4 adapters against 32 streams on the base model, one server.

Makes `--num-adapters` PEFT adapters with peft (rank `--rank` on all seven projections, random non-zero B),
starts one `tokenloop serve --lora ...` on the default model, and runs `tokenloop-cli bench`'s load generator
(greedy, EOS ignored) in alternating rounds: base, adapters, base, adapters, ... Reports tok/s per round and
the ratio adapters / base of the summed figures, which is the issue's target (>= 0.75). One short untimed
round of each kind comes first.

    .venv/bin/python -m bench.lora_bench --out bench/results-lora.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import torch

from tokenloop.bench.harness import DEFAULT_MODEL, TokenloopServer, add_out_argument, write
from tokenloop_client import AsyncClient
from tokenloop_client import bench as load

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: Path, out: Path, num: int, rank: int) -> list[tuple[str, Path]]:
    import peft
    import transformers

    adapters = []
    for i in range(num):
        torch.manual_seed(i)
        base = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        m = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.02)
        m.save_pretrained(out / f"ad{i}")
        adapters.append((f"ad{i}", out / f"ad{i}"))
    return adapters


async def run_rounds(address: str, args, names: list[str]) -> list[dict]:
    rounds = []
    async with AsyncClient(address) as client:
        for loras in ((), tuple(names)):  # warm-up, untimed: first-use costs (allocations, caches) land here
            await load.run_level(client, load.BenchConfig(args.concurrency, args.concurrency, None, args.prompt_tokens,
                                                          8, 0.0, True, loras))
        for r in range(args.rounds):
            for label, loras in (("base", ()), ("lora", tuple(names))):
                cfg = load.BenchConfig(args.concurrency, args.requests, None, args.prompt_tokens, args.max_new_tokens,
                                       0.0, True, loras)
                res = await load.run_level(client, cfg)
                rounds.append({"round": r, "kind": label, "output_tokens_per_s": res["output_tokens_per_s"],
                               "ttft_p50_s": res["ttft_s"]["p50"], "num_errors": res["num_errors"],
                               "output_tokens": res["output_tokens"], "duration_s": res["duration_s"]})
                print(f"round {r} {label:>4}: {res['output_tokens_per_s']:7.1f} tok/s, TTFT p50 "
                      f"{res['ttft_s']['p50']:.2f} s, errors {res['num_errors']}", flush=True)
    return rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=32, help="requests per round")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    add_out_argument(p, "results-lora.json")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(args.model, Path(tmp), args.num_adapters, args.rank)
        flags = ["--max-loras", str(max(8, args.num_adapters))]
        for name, path in adapters:
            flags += ["--lora", f"{name}={path}"]
        with TokenloopServer(args.model, flags) as server:
            rounds = asyncio.run(run_rounds(server.address, args, [n for n, _ in adapters]))
    base = sum(r["output_tokens"] for r in rounds if r["kind"] == "base") / \
        sum(r["duration_s"] for r in rounds if r["kind"] == "base")
    lora = sum(r["output_tokens"] for r in rounds if r["kind"] == "lora") / \
        sum(r["duration_s"] for r in rounds if r["kind"] == "lora")
    print(f"\n| streams | adapters (rank) | base tok/s | adapters tok/s | ratio |\n| --- | --- | --- | --- | --- |\n"
          f"| {args.concurrency} | {args.num_adapters} ({args.rank}) | {base:.1f} | {lora:.1f} | {lora / base:.2f} |")
    write(args.out, {"config": vars(args) | {"model": str(args.model)}, "rounds": rounds,
                             "base_tokens_per_s": base, "lora_tokens_per_s": lora, "ratio": lora / base,
                             "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
