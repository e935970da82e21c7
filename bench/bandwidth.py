"""What two threads stream from memory on this machine, and the bytes of weights one decode step reads per weights
mode: the limit a one-stream decode is held to (issue 32: int4 one stream within 60 % of it).

    .venv/bin/tokenloop-bench bandwidth [--model DIR] [--mb 512] [--rounds 10] [--threads 2] [--out FILE]

Two ways of reading memory, each the best of `--rounds` passes over a buffer far larger than the caches; the
limit is the faster of the two:

  torch sum       `torch.sum` of one float32 tensor of `--mb` MB on `--threads` threads (its vectorised reduction:
                  one add per 4 bytes read, far below what a core computes)
  fp32 native2    the engine's float32 kernel (engine/int8_linear.c's f32_linear_f32, two threads) at one token
                  over the model's layer shapes, a separate random matrix each, `--mb` MB in all: one FMA per 4
                  bytes read, how docs/engine.md measured int8's bandwidth

Bytes of weights per token: every weight of the decoder layers and the lm_head is read once per decode step;
each mode's bytes come from the engine's own quantizers (engine/quant.py) on one matrix of each shape: fp32 4
bytes per weight, int8 1 byte plus a float32 scale per 32, int4 half a byte plus a float16 scale and minimum per
32 in the layers with the int8 lm_head (engine/loader.py). Embedding rows, norms and the KV cache are left out (a
few hundred KB per token at these lengths). bench/engine_bench.py runs `measure` when its scenarios include
`single`, and records each mode's share of the limit in its result file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tokenloop.bench.harness import DEFAULT_MODEL, add_out_argument, describe, machine, write

MODES = ("fp32", "int8", "int4")


def shapes(model_dir: Path) -> tuple[list[tuple[int, int]], tuple[int, int], int]:
    """Per-layer (N, K) of the fused products, the lm_head's, and the number of layers."""
    c = json.loads((model_dir / "config.json").read_text())
    d, i, h = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    kv, e = c.get("num_key_value_heads", h), c.get("head_dim") or c["hidden_size"] // h
    return [((h + 2 * kv) * e, d), (d, h * e), (2 * i, d), (d, i)], (c["vocab_size"], d), c["num_hidden_layers"]


def nbytes(w) -> int:
    """Bytes of a weight: a tensor, or a quantized one's codes and scales."""
    import torch

    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return sum(p.numel() * p.element_size() for p in ((w.q, w.scale) if hasattr(w, "scale") else (w.q, w.sm)))


def _best(fn, rounds: int) -> float:
    fn()  # first touch, page faults
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def torch_sum(mb: int, rounds: int, threads: int) -> float:
    """Bytes per second `torch.sum` reads over one float32 tensor of `mb` MB on `threads` threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = torch.ones(mb * 1_000_000 // 4)
        return t.numel() * 4 / _best(lambda: t.sum(), rounds)
    finally:
        torch.set_num_threads(before)


def native2(model_dir: Path, mb: int, rounds: int) -> float | None:
    """Bytes per second the engine's two-thread float32 kernel reads at one token over the model's layer shapes
    (None where the C kernels do not build)."""
    import torch

    from tokenloop.engine.matmul import Backend, MatmulPolicy

    policy = MatmulPolicy.fixed(Backend.C_GEMV_TWO_THREADS)
    if policy.native is None:
        return None
    layer_shapes, _, _ = shapes(model_dir)
    per_layer = sum(n * k for n, k in layer_shapes) * 4
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for _ in range(max(1, mb * 1_000_000 // per_layer))
               for n, k in layer_shapes]
    x = torch.randn(1, max(k for _, k in layer_shapes))
    with torch.inference_mode():
        seconds = _best(lambda: [policy.linear(x[:, :w.shape[1]], w, Backend.C_GEMV_TWO_THREADS) for w in weights], rounds)
    return sum(w.numel() * 4 for w in weights) / seconds


def weight_bytes_per_token(model_dir: Path) -> dict[str, int]:
    """Bytes of weights one decode step reads, per weights mode (the layers' products and the lm_head)."""
    import torch

    from tokenloop.engine.quant import quantize, quantize4

    layer_shapes, (vocab, hidden), num_layers = shapes(model_dir)
    gen = torch.Generator().manual_seed(0)

    def size(n: int, k: int, quantizer) -> int:
        return nbytes(quantizer(torch.randn(n, k, generator=gen) * 0.02)) if quantizer else n * k * 4

    head8 = size(vocab, hidden, quantize)
    return {"fp32": num_layers * sum(size(n, k, None) for n, k in layer_shapes) + vocab * hidden * 4,
            "int8": num_layers * sum(size(n, k, quantize) for n, k in layer_shapes) + head8,
            "int4": num_layers * sum(size(n, k, quantize4) for n, k in layer_shapes) + head8}


def measure(model_dir: Path, mb: int = 512, rounds: int = 10, threads: int = 2) -> dict:
    """{"methods": {name: bytes/s}, "limit_bytes_per_s", "threads", "weight_bytes_per_token": {mode: bytes},
    "max_tokens_per_s": {mode: the limit / bytes per token}}."""
    methods = {"torch sum": torch_sum(mb, rounds, threads)}
    if threads == 2:  # the engine's kernel is two threads by construction
        rate = native2(model_dir, mb, rounds)
        if rate is not None:
            methods["fp32 native2"] = rate
    limit = max(methods.values())
    per_token = weight_bytes_per_token(model_dir)
    return {"methods": methods, "limit_bytes_per_s": limit, "threads": threads, "mb": mb, "rounds": rounds,
            "weight_bytes_per_token": per_token, "max_tokens_per_s": {m: limit / b for m, b in per_token.items()}}


def share(figures: dict, mode: str, tokens_per_s: float) -> float:
    """A mode's tokens/s as a share of the bandwidth limit: bytes of weights read per second / the limit."""
    return figures["weight_bytes_per_token"][mode] * tokens_per_s / figures["limit_bytes_per_s"]


def report(figures: dict) -> str:
    lines = [f"memory read by {figures['threads']} threads, best of {figures['rounds']} passes over "
             f"{figures['mb']} MB:"]
    lines += [f"  {name}: {rate / 1e9:.1f} GB/s" for name, rate in figures["methods"].items()]
    lines += [f"  limit: {figures['limit_bytes_per_s'] / 1e9:.1f} GB/s", "weights read per decode step:"]
    lines += [f"  {mode}: {b / 1e6:.1f} MB, at most {figures['max_tokens_per_s'][mode]:.0f} tokens/s for one stream"
              for mode, b in figures["weight_bytes_per_token"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--mb", type=int, default=512, help="MB read per pass (default 512)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    add_out_argument(parser, "results-engine.json (bench/engine_bench.py records it with its single scenario)")
    args = parser.parse_args(argv)
    figures = measure(Path(args.model), args.mb, args.rounds, args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {describe(machine())}\n{report(figures)}")
    write(args.out, {"bandwidth": figures})
    return 0


if __name__ == "__main__":
    sys.exit(main())
