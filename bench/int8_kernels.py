"""int8-weight matrix products on this model's shapes: library kernels against the engine's own C kernel.

    .venv/bin/python bench/int8_kernels.py [--model DIR] [--tokens 1,8,32,256] [--out FILE]

For 1, 8, 32 and 256 tokens per step, times the products of all decoder layers (qkv, o, gate_up, down with
the model's shapes, a separate random weight per layer so the weights stream from memory as in a real step)
and the lm_head, each on two threads, the best of several rounds (rounds interleave the candidates):

  fp32 torch         F.linear on float32 weights (torch threads = 2): the reference class of kernel
  fp32 numpy2        the engine's float32 path from 32 tokens (OpenBLAS, output features split over two Python
                     threads)
  fp32 native2       the engine's float32 path for few tokens (int8_linear.c's f32_linear_f32 on the library's
                     own two threads; timed up to 32 tokens)
  dyn-quant ENGINE   torch.ao.nn.quantized.dynamic.Linear, per-channel int8 weights; ENGINE = fbgemm, x86,
                     onednn (activations quantized to uint8 per step: not fp32 activations)
  int8pack           torch.ops.aten._weight_int8pack_mm (int8 weights, per-channel scales, fp32 activations;
                     timed up to 8 tokens only, it takes seconds per pass beyond)
  dequant torch      w.float() * scale, then F.linear: the naive fp32-activation route
  tokenloop C        engine/int8_linear.c (the engine's layout: a scale per channel and 32 columns), output
                     channels split with the library's worker thread; "per channel": the same kernel, one scale
                     a channel
Prints ms per step and tokens/s of products alone; recorded figures: bench/results-int8-kernels.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.results import add_out_argument, write  # noqa: E402


def shapes(model_dir: Path) -> tuple[list[tuple[int, int]], tuple[int, int], int]:
    """Per-layer (N, K) of the fused products, the lm_head's, and the number of layers."""
    c = json.loads((model_dir / "config.json").read_text())
    d, i, h = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    kv, e = c.get("num_key_value_heads", h), c.get("head_dim") or c["hidden_size"] // h
    return [((h + 2 * kv) * e, d), (d, h * e), (2 * i, d), (d, i)], (c["vocab_size"], d), c["num_hidden_layers"]


def per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], scale [N]): one scale per output channel, the layout the library kernels take."""
    from tokenloop.engine.quant import quantize
    q, scale = quantize(w, group_size=w.shape[1]).unpacked()
    return q.contiguous(), scale[:, 0].contiguous()


def one_torch_thread(fn):
    """Run fn with torch on one thread, as the engine runs (its second thread is the matmul helper): torch's
    OpenMP workers would otherwise spin on the core the helper needs."""
    def run(x):
        torch.set_num_threads(1)
        try:
            return fn(x)
        finally:
            torch.set_num_threads(2)
    return run


def candidates(weights: list[torch.Tensor]) -> dict[str, callable]:
    """name -> fn(x) running x through every weight (each its own product)."""
    from tokenloop.engine import kernels
    from tokenloop.engine.matmul import BUCKETS, Backend, MatmulPolicy
    from tokenloop.engine.quant import quantize

    out: dict[str, callable] = {}
    out["fp32 torch"] = lambda x: [F.linear(x[:, :w.shape[1]], w) for w in weights]
    np2 = MatmulPolicy.fixed(Backend.NUMPY2)
    out["fp32 numpy2"] = one_torch_thread(
        lambda x: [np2.linear(x[:, :w.shape[1]].contiguous(), w, Backend.NUMPY2) for w in weights])
    native2 = MatmulPolicy.fixed(Backend.NATIVE2)
    if native2.native is not None:
        out["fp32 native2"] = lambda x: [native2.linear(x[:, :w.shape[1]], w, Backend.NATIVE2) for w in weights]
    q = [per_channel(w) for w in weights]
    for engine in ("fbgemm", "x86", "onednn"):
        if engine not in torch.backends.quantized.supported_engines:
            continue
        torch.backends.quantized.engine = engine
        mods = []
        for w in weights:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data.copy_(w)
            mods.append(torch.ao.quantization.quantize_dynamic(
                torch.nn.Sequential(lin), {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig},
                dtype=torch.qint8))

        def run(x, mods=mods, engine=engine):
            torch.backends.quantized.engine = engine
            return [m(x[:, :m[0].in_features]) for m in mods]
        out[f"dyn-quant {engine}"] = run
    out["int8pack"] = lambda x: [torch.ops.aten._weight_int8pack_mm(x[:, :wq.shape[1]].contiguous(), wq, s)
                                 for wq, s in q]
    out["dequant torch"] = lambda x: [F.linear(x[:, :wq.shape[1]], wq.float() * s[:, None]) for wq, s in q]
    native = kernels.load_int8()
    if native is not None:
        both = MatmulPolicy(dict.fromkeys(BUCKETS, Backend.TORCH), int8=native, int8_split=dict.fromkeys(BUCKETS, True))
        grouped = [quantize(w) for w in weights]  # the engine's layout: a scale per 32 columns
        out["tokenloop C"] = one_torch_thread(
            lambda x: [both.linear(x[:, :w.shape[1]], w, Backend.TORCH) for w in grouped])
        channel = [quantize(w, group_size=w.shape[1]) for w in weights]
        out["tokenloop C per channel"] = one_torch_thread(
            lambda x: [both.linear(x[:, :w.shape[1]], w, Backend.TORCH) for w in channel])
    return out


# timed up to this many tokens only: int8pack takes 30 s a pass at 256 tokens, 80x the others; native2 is the engine's
# path for steps of a few tokens (matmul.NATIVE_MAX_TOKENS), not built for big ones
SLOW = {"int8pack": 8, "fp32 native2": 32}


def measure(weights: list[torch.Tensor], tokens: list[int], rounds: int) -> dict[str, dict[int, float]]:
    """name -> {tokens: best seconds for one pass over `weights`}."""
    fns = candidates(weights)
    width = max(w.shape[1] for w in weights)
    best = {name: {t: float("inf") for t in tokens} for name in fns}
    with torch.inference_mode():
        for t in tokens:
            x = torch.randn(t, width)
            reps = max(1, min(5, 64 // t))
            for _ in range(rounds):
                for name, fn in fns.items():
                    if name in SLOW and t > SLOW[name]:
                        continue
                    fn(x)
                    start = time.perf_counter()
                    for _ in range(reps):
                        fn(x)
                    best[name][t] = min(best[name][t], (time.perf_counter() - start) / reps)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--tokens", default="1,8,32,256")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers to time (default: the model's)")
    parser.add_argument("--rounds", type=int, default=3)
    add_out_argument(parser, "results-int8-kernels.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    layer_shapes, head_shape, num_layers = shapes(Path(args.model))
    num_layers = args.layers or num_layers
    tokens = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(num_layers) for n, k in layer_shapes]
    figures = {"layers": measure(layers, tokens, args.rounds)}
    del layers
    figures["lm_head"] = measure([torch.randn(*head_shape, generator=gen) * 0.02], tokens, args.rounds)
    for part, rows in figures.items():
        what = f"{num_layers} layers" if part == "layers" else "lm_head"
        print(f"\n{what}: ms per step (tokens/s of these products alone)\n")
        print("| kernel | " + " | ".join(f"{t} tok" for t in tokens) + " |")
        print("| --- " * (len(tokens) + 1) + "|")
        for name, by_t in rows.items():
            print(f"| {name} | " + " | ".join(f"{by_t[t] * 1e3:.2f} ({t / by_t[t]:.0f})" if by_t[t] < float("inf")
                                              else "not timed" for t in tokens) + " |")
    write(args.out, {"num_layers": num_layers, "layer_shapes": layer_shapes, "lm_head_shape": head_shape,
                     "seconds": {p: {n: {str(t): s for t, s in r.items() if s < float("inf")} for n, r in rows.items()}
                                 for p, rows in figures.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
