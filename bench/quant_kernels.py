"""Quantized-weight matrix products on this model's shapes: every route the engine's calibration chooses from (the C
kernels' code paths this CPU runs and torch's kernels), for int8 and int4 weights, against float32.

    .venv/bin/tokenloop-bench quant_kernels [--weights int8,int4] [--tokens 1,8,32] [--rounds 3] [--out FILE]
    .venv/bin/tokenloop-bench quant_kernels --weights int8 --layers 1 --lm-head 262144x640   # Gemma 3's lm_head

For each tokens-per-step, the products of all decoder layers (qkv, o, gate_up, down with the model's shapes, a
separate random weight per layer so they stream from memory as in a real step) and the lm_head, the best of
`--rounds` interleaved rounds (rounds interleave the candidates, so a burst of load from elsewhere cannot land on
one candidate's runs only):

  fp32 torch 2t         F.linear on the float32 weights, torch on two threads: the reference class of kernel
  fp32 native2          int8_linear.c's f32_linear_f32 on two threads (the engine's fp32 path for few tokens; at
                        one token memory-bound, so its bytes per second are what two threads stream here)
  MODE-ISA[+h16]        the engine's C kernel (int8_linear.c / int4_linear.c) on code path ISA, split over its
                        worker thread as the engine runs it: portable, avx2, avx512 (same bits as avx2), vnni (int8
                        activations per row and group of 32, vpdpbusd); portable timed up to 8 tokens; int4 also
                        x22-portable, x22-avx2, x22-vnni (22-bit integer activations, identical bits to each other);
                        +h16: the lm_head on int8's x16 path (16-bit integer activations, vpmaddwd), the layers as
                        without the suffix
  torch-fp32            F.linear on the dequantized weights, one torch thread (as the engine runs torch)
  torch-dynq [2t]       torch.ops.quantized.linear_dynamic (x86 / fbgemm engine: activations quantized per call,
                        VNNI), the weights requantized per channel; one torch thread, and two ("2t")

int4's lm_head is int8 (--weights int4 quantizes the layers to 4 bits), so the lm_head is timed for int8 only. Then,
for one token: bytes of weights read per step and GB/s. Recorded figures: bench/results-quant-kernels.json, with the CPU
model and its ISA flags.

    .venv/bin/tokenloop-bench quant_kernels --compare main [--rows 1,32] [--rounds 5]

`--compare REF` times this checkout's C kernels against the ones at git REF (int4_linear.c, int8_linear.c and the
headers, from `git archive REF engine` unpacked in a scratch directory; or REF a folder holding such sources), on
the real default model's weights (the 30 layers' qkv, o, gate_up, down quantized by engine/quant.py, int4 and int8
as `--weights` says, and int8's lm_head), each product on two
threads (the _2t entry points: the caller and the library's worker), the layers in a decode step's order so every
weight comes from memory (cold): per weight kind and row count the milliseconds per step, GB/s of weight bytes and
GFLOP/s, the builds interleaved round by round; and in the same run what two threads stream (bench/bandwidth.py's
fp32 native2 and torch sum).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenloop.bench.bandwidth import native2, nbytes, shapes, torch_sum
from tokenloop.bench.harness import DEFAULT_MODEL, ROOT, add_out_argument, machine, write

SLOW = {"fp32 native2": 32, "int8-portable": 8, "int4-portable": 8, "int4-x22-portable": 8}  # timed up to this many tokens only


def torch_threads(n: int, fn):
    """fn with torch on n threads (the engine runs torch on one: its second core is the C kernels' worker)."""
    def run(x):
        torch.set_num_threads(n)
        try:
            return fn(x)
        finally:
            torch.set_num_threads(1)
    return run


def candidates(mode: str, weights: list[torch.Tensor], head: bool = False) -> dict[str, tuple[callable, int]]:
    """name -> (fn(x) running x through every weight, bytes of weights that reads); `head`: the weights are the
    lm_head (QWeight.head: the +h16 routes multiply it on int8's x16 path)."""
    from tokenloop.engine import kernels
    from tokenloop.engine.matmul import Backend, MatmulPolicy
    from tokenloop.engine.quant import as_head, quantize, quantize4
    from tokenloop.engine.quant_routes import quant_routes

    out: dict[str, tuple[callable, int]] = {}
    dense = sum(nbytes(w) for w in weights)
    if mode == "fp32":
        out["fp32 torch 2t"] = (torch_threads(2, lambda x: [F.linear(x[:, :w.shape[1]], w) for w in weights]), dense)
        native2 = MatmulPolicy.fixed(Backend.C_GEMV_TWO_THREADS)
        if native2.native is not None:
            out["fp32 native2"] = (lambda x: [native2.linear(x[:, :w.shape[1]], w, Backend.C_GEMV_TWO_THREADS) for w in weights],
                                   dense)
        return out
    quantized = [(quantize4 if mode == "int4" else quantize)(w) for w in weights]
    quantized = [as_head(w) for w in quantized] if head else quantized
    size = sum(nbytes(w) for w in quantized)
    for name, route in quant_routes(mode, kernels.load_int8(), kernels.load_int4()).items():
        split = route.int8 is not None or route.int4 is not None
        def fn(x, route=route, split=split):
            return [route.product(x[:, :w.shape[1]], w, split) for w in quantized]
        out[name] = (fn, dense if name == "torch-fp32" else size)
        if name == "torch-dynq":
            out["torch-dynq 2t"] = (torch_threads(2, fn), size)
    return out


def measure(fns: dict, width: int, tokens: list[int], rounds: int) -> dict[str, dict[int, float]]:
    """name -> {tokens: best seconds for one pass over the weights}."""
    best = {name: {t: float("inf") for t in tokens} for name in fns}
    with torch.inference_mode():
        for fn, _ in fns.values():  # packings and copies made once, outside the timing
            fn(torch.zeros(1, width))
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
    return best


def table(title: str, rows: dict[str, dict[int, float]], tokens: list[int]) -> None:
    print(f"\n{title}: ms per step (tokens/s of these products alone)\n")
    print("| kernel | " + " | ".join(f"{t} tok" for t in tokens) + " |")
    print("| --- " * (len(tokens) + 1) + "|")
    for name, by_t in rows.items():
        print(f"| {name} | " + " | ".join(f"{by_t[t] * 1e3:.2f} ({t / by_t[t]:.0f})" if by_t[t] < float("inf")
                                          else "not timed" for t in tokens) + " |")


KINDS = ("qkv", "o", "gate_up", "down")


def model_weights(model_dir: Path) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """The decoder layers' fused products in a step's order as (kind, float32 weight), and the lm_head."""
    from safetensors import safe_open

    c = json.loads((model_dir / "config.json").read_text())
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        def get(name):
            return f.get_tensor(name).float()
        layers = []
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            layers += [("qkv", torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"])),
                       ("o", get(p + "self_attn.o_proj.weight")),
                       ("gate_up", torch.cat([get(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])),
                       ("down", get(p + "mlp.down_proj.weight"))]
        names = set(f.keys())
        head = get("lm_head.weight" if "lm_head.weight" in names else "model.embed_tokens.weight")
    return layers, head


def build_at(ref: str, scratch: Path) -> dict[str, Path]:
    """int8_linear.c and int4_linear.c (with the headers beside them) as at git `ref`, or in the folder `ref`,
    built; mode -> library path."""
    import subprocess

    from tokenloop.engine import kernels

    if Path(ref).is_dir():  # a folder of sources: a variant being tried
        sources = Path(ref)
    else:  # git archive | tar: REF's engine/ folder, unpacked in the scratch directory
        archive = subprocess.run(["git", "archive", ref, "engine"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)
        sources = scratch / "engine"
    return {mode: kernels.build(sources / src.name)
            for mode, src in (("int8", kernels.INT8_SOURCE), ("int4", kernels.INT4_SOURCE))}


def compare(args, modes: list[str]) -> int:
    """This checkout's kernels against REF's, cold, rows by rows (see the module's docstring)."""
    import tempfile

    from tokenloop.engine import kernels
    from tokenloop.engine.quant import quantize, quantize4

    rows = [int(t) for t in args.rows.split(",")]
    layers, head = model_weights(Path(args.model))
    with tempfile.TemporaryDirectory() as tmp:
        old = build_at(args.compare, Path(tmp))
        new = {"int8": kernels.build(kernels.INT8_SOURCE), "int4": kernels.build(kernels.INT4_SOURCE)}
        libs = {(mode, which): (kernels.Int8Linear if mode == "int8" else kernels.Int4Linear)(path[mode], args.isa)
                for which, path in ((args.compare, old), ("new", new)) for mode in modes}
    weights = {mode: [(k, (quantize4 if mode == "int4" else quantize)(w)) for k, w in layers] for mode in modes}
    if "int8" in weights:
        weights["int8"].append(("lm_head", quantize(head)))
    width = max(w.shape[1] for _, w in layers)
    # best seconds per (mode, build, rows, kind): one pass over every weight of the kind, in a step's order
    best: dict[tuple, float] = collections.defaultdict(lambda: float("inf"))
    bandwidth = {"fp32 native2": 0.0, "torch sum": 0.0}
    with torch.inference_mode():
        for round_ in range(args.rounds):
            bandwidth["fp32 native2"] = max(bandwidth["fp32 native2"], native2(Path(args.model), 256, 2) or 0.0)
            bandwidth["torch sum"] = max(bandwidth["torch sum"], torch_sum(256, 2, 2))
            for m in rows:
                x = torch.randn(m, width)
                outs = {w.num_out: torch.empty(m, w.num_out) for ws in weights.values() for _, w in ws}
                order = list(libs.items())  # every other round the other build first: no fixed order
                for (mode, which), lib in (order if round_ % 2 == 0 else order[::-1]):
                    spent = collections.Counter()
                    for _ in range(2):  # the first pass warms the worker and the page tables
                        spent.clear()
                        for kind, w in weights[mode]:
                            xk, out = x[:, :w.shape[1]], outs[w.num_out]
                            start = time.perf_counter()
                            lib.linear2(xk, w, out)
                            spent[kind] += time.perf_counter() - start
                    for kind, s in spent.items():
                        best[mode, which, m, kind] = min(best[mode, which, m, kind], s)
    print(f"\nbandwidth, two threads (best of {args.rounds}): " +
          ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bandwidth.items()))
    figures = {}
    for mode, ws in weights.items():
        print(f"\n{mode} (path {args.isa or 'default'}), two threads, cold: ms per step | GB/s of weights | GFLOP/s\n")
        print("| weight | rows | " + " | ".join(f"{w}" for w in (args.compare, "new")) + " | new / old |")
        print("| --- " * 5 + "|")
        for kind in [*KINDS, "lm_head"][:5 if mode == "int8" else 4]:
            size = sum(nbytes(w) for k, w in ws if k == kind)
            flop = sum(2 * w.shape[0] * w.shape[1] for k, w in ws if k == kind)
            for m in rows:
                cells = []
                for which in (args.compare, "new"):
                    s = best[mode, which, m, kind]
                    figures.setdefault(mode, {}).setdefault(kind, {}).setdefault(str(m), {})[which] = s
                    cells.append(f"{s * 1e3:.3f} ms, {size / s / 1e9:.1f} GB/s, {m * flop / s / 1e9:.0f} GFLOP/s")
                ratio = best[mode, args.compare, m, kind] / best[mode, "new", m, kind]
                print(f"| {kind} | {m} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    write(args.out, {**machine(), "compare": args.compare, "isa": args.isa, "rounds": args.rounds,
                     "bandwidth_two_threads": bandwidth, "seconds": figures})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--weights", default="int8,int4", help="quantized modes to time, comma-separated")
    parser.add_argument("--tokens", default="1,8,32")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers to time (default: the model's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare", metavar="REF", default=None,
                        help="time this checkout's C kernels against git REF's, cold, on the model's weights")
    parser.add_argument("--rows", default="1,32", help="--compare: rows (tokens) per product")
    parser.add_argument("--isa", default=None, help="--compare: the code path (default: the fastest exact one)")
    parser.add_argument("--lm-head", default=None, metavar="NxK",
                        help="the lm_head's shape instead of the model's (Gemma 3 270M's: 262144x640)")
    add_out_argument(parser, "results-quant-kernels.json")
    args = parser.parse_args(argv)
    modes = [m for m in args.weights.split(",") if m]
    if not set(modes) <= {"int8", "int4"}:
        parser.error(f"--weights takes int8 and int4, got {args.weights!r}")
    if args.compare:
        return compare(args, modes)
    torch.set_num_threads(1)
    layer_shapes, head_shape, num_layers = shapes(Path(args.model))
    if args.lm_head:
        head_shape = tuple(int(v) for v in args.lm_head.lower().split("x"))
    num_layers = args.layers or num_layers
    tokens = [int(t) for t in args.tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(n, k, generator=gen) * 0.02 for _ in range(num_layers) for n, k in layer_shapes]
    head = [torch.randn(*head_shape, generator=gen) * 0.02]
    width = max(w.shape[1] for w in layers)
    figures, sizes = {}, {}
    for mode in ["fp32", *modes]:
        for part, weights in (("layers", layers), ("lm_head", head)):
            if part == "lm_head" and mode == "int4":
                continue
            fns = candidates(mode, weights, head=part == "lm_head")
            figures.setdefault(mode, {})[part] = measure(fns, width, tokens, args.rounds)
            sizes.setdefault(mode, {})[part] = {name: size for name, (_, size) in fns.items()}
            del fns
            table(f"{mode}, {num_layers} layers" if part == "layers" else f"{mode}, lm_head",
                  figures[mode][part], tokens)
    bandwidth = {}
    if 1 in tokens:
        print("\none token: bytes of weights read per step and GB/s\n")
        print("| weights | kernel | part | MB read | GB/s |\n| --- | --- | --- | --- | --- |")
        for mode, parts in figures.items():
            for part, rows in parts.items():
                for name, by_t in rows.items():
                    rate = sizes[mode][part][name] / by_t[1]
                    bandwidth.setdefault(mode, {}).setdefault(part, {})[name] = rate
                    print(f"| {mode} | {name} | {part} | {sizes[mode][part][name] / 1e6:.1f} | {rate / 1e9:.1f} |")
    write(args.out, {**machine(), "num_layers": num_layers, "layer_shapes": layer_shapes, "lm_head_shape": head_shape,
                     "bytes_per_pass": sizes, "bytes_per_second_at_1_token": bandwidth,
                     "seconds": {m: {p: {n: {str(t): s for t, s in r.items() if s < float("inf")}
                                         for n, r in rows.items()} for p, rows in parts.items()}
                                 for m, parts in figures.items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
