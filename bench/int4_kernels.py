"""4-bit-weight matrix products on this model's shapes: engine/int4_linear.c on each code path this CPU runs,
against the engine's int8 and float32 kernels, and the bytes of weights each reads per token.

    .venv/bin/python bench/int4_kernels.py [--model DIR] [--tokens 1,8,32,256] [--rounds 3] [--out FILE]

As bench/int8_kernels.py: for each tokens-per-step, the products of all decoder layers (qkv, o, gate_up, down,
a separate random weight per layer so they stream from memory as in a real step) and the lm_head, the best of
`--rounds` interleaved rounds:

  fp32 native2          int8_linear.c's f32_linear_f32 on two threads (the engine's fp32 path for few tokens). At
                        one token it does one FMA per 4 bytes read: memory-bound, so its bytes per second are what
                        two threads stream on this machine, the limit the others are held to
  int8 C                int8_linear.c on two threads (--weights int8: 1.125 bytes per weight)
  int4 C ISA            int4_linear.c on two threads, each code path this CPU runs (--weights int4's layers: 0.625
                        bytes per weight); "1 thread": the fastest path without the worker thread

Then, for one token: bytes of weights read per step, GB/s, and the share of fp32 native2's GB/s. Recorded
figures: bench/results-int4-kernels.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402

from bench.int8_kernels import shapes  # noqa: E402
from bench.results import add_out_argument, write  # noqa: E402

SLOW = {"fp32 native2": 32, "int4 C portable": 32}  # timed up to this many tokens only (not built for big steps)


def nbytes(w) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    parts = (w.q, w.scale) if hasattr(w, "scale") else (w.q, w.sm)
    return sum(p.numel() * p.element_size() for p in parts)


def candidates(weights: list[torch.Tensor]) -> dict[str, tuple[callable, int]]:
    """name -> (fn(x) running x through every weight, bytes of weights that reads)."""
    from tokenloop.engine import kernels
    from tokenloop.engine.matmul import BUCKETS, Backend, MatmulPolicy
    from tokenloop.engine.quant import quantize, quantize4

    out: dict[str, tuple[callable, int]] = {}
    native2 = MatmulPolicy.fixed(Backend.NATIVE2)
    if native2.native is not None:
        out["fp32 native2"] = (lambda x: [native2.linear(x[:, :w.shape[1]], w, Backend.NATIVE2) for w in weights],
                               sum(nbytes(w) for w in weights))
    split = dict.fromkeys(BUCKETS, True)
    int8 = kernels.load_int8()
    if int8 is not None:
        q8 = [quantize(w) for w in weights]
        p8 = MatmulPolicy(dict.fromkeys(BUCKETS, Backend.TORCH), int8=int8, int8_split=split)
        out["int8 C"] = (lambda x: [p8.linear(x[:, :w.shape[1]], w, Backend.TORCH) for w in q8],
                         sum(nbytes(w) for w in q8))
    int4 = kernels.load_int4()
    if int4 is not None:
        q4 = [quantize4(w) for w in weights]
        size = sum(nbytes(w) for w in q4)
        for isa in int4.supported():
            p4 = MatmulPolicy(dict.fromkeys(BUCKETS, Backend.TORCH), int4=int4.with_isa(isa), int8_split=split)
            out[f"int4 C {isa}"] = (lambda x, p4=p4: [p4.linear(x[:, :w.shape[1]], w, Backend.TORCH) for w in q4],
                                    size)
        p1 = MatmulPolicy(dict.fromkeys(BUCKETS, Backend.TORCH), int4=int4, int8_split=dict.fromkeys(BUCKETS, False))
        out[f"int4 C {int4.isa} 1 thread"] = (lambda x: [p1.linear(x[:, :w.shape[1]], w, Backend.TORCH) for w in q4],
                                              size)
    return out


def measure(weights: list[torch.Tensor], tokens: list[int], rounds: int) -> tuple[dict, dict[str, int]]:
    """({name: {tokens: best seconds for one pass}}, {name: bytes of weights read per pass})."""
    fns = candidates(weights)
    width = max(w.shape[1] for w in weights)
    best = {name: {t: float("inf") for t in tokens} for name in fns}
    with torch.inference_mode():
        for t in tokens:
            x = torch.randn(t, width)
            reps = max(1, min(5, 64 // t))
            for _ in range(rounds):
                for name, (fn, _) in fns.items():
                    if name in SLOW and t > SLOW[name]:
                        continue
                    fn(x)
                    start = time.perf_counter()
                    for _ in range(reps):
                        fn(x)
                    best[name][t] = min(best[name][t], (time.perf_counter() - start) / reps)
    return best, {name: size for name, (_, size) in fns.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--tokens", default="1,8,32,256")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers to time (default: the model's)")
    parser.add_argument("--rounds", type=int, default=3)
    add_out_argument(parser, "results-int4-kernels.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as the engine's products run: the C kernels bring their own second thread
    layer_shapes, head_shape, num_layers = shapes(Path(args.model))
    num_layers = args.layers or num_layers
    tokens = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(num_layers) for n, k in layer_shapes]
    figures, sizes = {}, {}
    figures["layers"], sizes["layers"] = measure(layers, tokens, args.rounds)
    del layers
    figures["lm_head"], sizes["lm_head"] = measure([torch.randn(*head_shape, generator=gen) * 0.02], tokens,
                                                   args.rounds)
    for part, rows in figures.items():
        what = f"{num_layers} layers" if part == "layers" else "lm_head"
        print(f"\n{what}: ms per step (tokens/s of these products alone)\n")
        print("| kernel | " + " | ".join(f"{t} tok" for t in tokens) + " |")
        print("| --- " * (len(tokens) + 1) + "|")
        for name, by_t in rows.items():
            print(f"| {name} | " + " | ".join(f"{by_t[t] * 1e3:.2f} ({t / by_t[t]:.0f})" if by_t[t] < float("inf")
                                              else "not timed" for t in tokens) + " |")
    bandwidth = {}
    if 1 in tokens:
        print("\none token: bytes of weights read per step, GB/s, share of fp32 native2's GB/s (the streaming limit)\n")
        print("| kernel | part | MB read | GB/s | share |\n| --- | --- | --- | --- | --- |")
        for part, rows in figures.items():
            limit = sizes[part].get("fp32 native2", 0) / rows.get("fp32 native2", {1: float("inf")})[1]
            for name, by_t in rows.items():
                rate = sizes[part][name] / by_t[1]
                bandwidth.setdefault(part, {})[name] = rate
                share = f"{100 * rate / limit:.0f} %" if limit else "-"
                print(f"| {name} | {part} | {sizes[part][name] / 1e6:.1f} | {rate / 1e9:.1f} | {share} |")
    write(args.out, {"num_layers": num_layers, "layer_shapes": layer_shapes, "lm_head_shape": head_shape,
                     "bytes_per_pass": sizes, "bytes_per_second_at_1_token": bandwidth,
                     "seconds": {p: {n: {str(t): s for t, s in r.items() if s < float("inf")} for n, r in rows.items()}
                                 for p, rows in figures.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
