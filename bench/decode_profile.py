"""Where a many-stream fp32 decode step spends its time: the engine against transformers' static batch, one run.

Both systems decode the same `--batch` sequences of `--prompt`-token prompts for `--new` tokens (the *uniform*
scenario of engine_bench.py: 32 x 64 + 128), greedy, in this process, one after the other:

- the engine: `Engine(start=False)` driven step by step on this thread (no gRPC; the same `step()` the engine thread
  runs). Its decode steps are timed whole and by section: the layers' matrix products (per weight: qkv, o, gate_up,
  down), the lm_head, decode attention, the C layer operations (RMSNorm, rope + cache write, SiLU or GeLU * up, q/k norms), building
  the batch (runner.prepare), sampling, and the rest (Python per step: scheduler, postprocess, glue).
- transformers: generate()'s greedy loop by hand (the model's forward over its DynamicCache, argmax, append),
  the threads engine_bench.py gives it; its decode steps are timed whole, and 8 in the middle go through
  torch.profiler: operators grouped the same way (aten::mm / addmm: the lm_head by its output width, the rest as
  the layers' products; SDPA; aten::cat, which the DynamicCache and rope use; other aten operators as layer ops),
  scaled to the unprofiled steps' time; "python/rest" is the wall time the operators do not explain.

    .venv/bin/tokenloop-bench decode_profile                   # ~2 min on a 2-vCPU VM
    .venv/bin/tokenloop-bench decode_profile --skip-transformers --repeat 3
    .venv/bin/tokenloop-bench decode_profile --products        # the fp32 product routes at 32 rows, wall ms

Prints a table per system (ms per decode step, share of the step) and the tokens/s of the decode steps.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import time

import torch

from tokenloop.bench.harness import DEFAULT_MODEL
from tokenloop.core.request import SamplingParams, StoppingParams, ValidRequest
from tokenloop.engine import engine as engine_module
from tokenloop.engine import runner
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine

SECTIONS = ("qkv", "o", "gate_up", "down", "lm_head", "attention", "layer ops", "fused layers", "prepare", "sampling",
            "python/rest")


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


class Timer:
    """Accumulates perf_counter seconds per section while `active`."""

    def __init__(self):
        self.total = collections.Counter()
        self.active = False

    def wrap(self, fn, section):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[section(*args) if callable(section) else section] += time.perf_counter() - start
        return timed


def profile_engine(model_dir: str, batch: int, prompt: int, new: int, config: EngineConfig,
                   fuse: bool | None = True) -> dict:
    """fuse: decode steps in one C call (True), layer by layer as before it (False), or alternating step by step
    (None: both timed on the same steps' load, each step's wall time to its mode)."""
    engine = Engine(model_dir, config, start=False)
    model, timer = engine.model, Timer()
    model.fuse_decode = fuse is not False
    names = {}
    for w in model.layers:
        names.update({id(w.qkv): "qkv", id(w.o): "o", id(w.gate_up): "gate_up", id(w.down): "down"})
    names[id(model.lm_head)] = "lm_head"
    matmul = model.matmul
    matmul.linear = timer.wrap(matmul.linear, lambda x, w, *rest: names.get(id(w), "other linear"))
    model.attention = timer.wrap(model.attention, "attention")
    if model.ops is not None:
        for op in ("add_rms_norm", "rope_store", "silu_mul", "gelu_mul", "rms_norm_heads"):
            setattr(model.ops, op, timer.wrap(getattr(model.ops, op), "layer ops"))
        model.ops.decode_step = timer.wrap(model.ops.decode_step, "fused layers")  # every layer in one C call
    prepare, sample = runner.prepare, engine_module.sample_batch
    runner.prepare = timer.wrap(prepare, "prepare")
    engine_module.sample_batch = timer.wrap(sample, "sampling")
    try:
        vocab = engine.model_config.vocab_size
        for p in prompts(batch, prompt, vocab):
            engine.enqueue(ValidRequest(request_id="p", prompt_token_ids=tuple(p),
                                        sampling=SamplingParams(temperature=0.0),
                                        stopping=StoppingParams(max_new_tokens=new, ignore_eos=True)))
        engine.apply()
        running = engine.scheduler.running
        # the prefill steps: until every sequence is admitted (max_num_tokens admits a few per step) and prefilled
        while engine.scheduler.waiting or not running or any(s.num_computed_tokens < prompt for s in running):
            engine.step()
        steps, wall, by_mode = 0, 0.0, collections.defaultdict(list)
        timer.active = True
        while engine.scheduler.has_work():
            if fuse is None:
                model.fuse_decode = steps % 2 == 0
            start = time.perf_counter()
            engine.step()
            took = time.perf_counter() - start
            wall += took
            by_mode["fused" if model.fuse_decode else "layer by layer"].append(took)
            steps += 1
        timer.active = False
        engine.await_responses(0)  # the steps, not looked at
    finally:
        runner.prepare, engine_module.sample_batch = prepare, sample
        engine.shutdown()
        if model.ops is not None:
            for op in ("add_rms_norm", "rope_store", "silu_mul", "gelu_mul", "rms_norm_heads", "decode_step"):
                delattr(model.ops, op)  # the kernel objects are shared by every engine of the process
    per_step = {k: v / steps for k, v in timer.total.items()}
    per_step["python/rest"] = wall / steps - sum(per_step.values())
    mode = {True: "", False: " (fused decode off)", None: " (fused and layer-by-layer decode steps alternating)"}
    result = {"system": f"tokenloop {config.weights}{mode[fuse]}",
              "ms": {k: 1e3 * v for k, v in per_step.items()}, "step_ms": 1e3 * wall / steps,
              "tok_s": batch * steps / wall, "matmul": engine.model.matmul.describe()}
    if fuse is None:  # the steps of a finishing batch are smaller: both modes get every other one of them
        result["modes"] = {name: (1e3 * sum(t) / len(t), batch * len(t) / sum(t)) for name, t in by_mode.items()}
    return result


def _op_section(name: str, shapes: list, vocab: int) -> str:
    """transformers' operators by what they serve (q and o have the same shape here: one row for the layers)."""
    if name in ("aten::mm", "aten::addmm"):
        weight = shapes[1] if name == "aten::mm" else shapes[2]
        return "lm_head" if weight and weight[-1] == vocab else "layer products"
    if "scaled_dot_product" in name:
        return "attention"
    if name == "aten::cat":
        return "kv cache / rope cat"
    if name.startswith("aten::"):
        return "layer ops"
    return ""


def profile_transformers(model_dir: str, batch: int, prompt: int, new: int, num_threads: int,
                         profiled: int = 8) -> dict:
    """generate()'s greedy loop by hand (forward with the DynamicCache, argmax, append): the decode steps are timed
    whole; `profiled` of them, in the middle of the run, go through torch.profiler for the breakdown (profiling all
    of them holds every event in memory: gigabytes)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, DynamicCache
    torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts(batch, prompt, model.config.vocab_size))
    mask = torch.ones_like(ids)
    cache = DynamicCache()
    totals, wall, profiled_wall = collections.Counter(), 0.0, 0.0
    middle = range((new - profiled) // 2, (new - profiled) // 2 + profiled)
    prof, profiled_start = None, 0.0
    with torch.inference_mode():
        logits = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
        for step in range(new - 1):
            start = time.perf_counter()
            if step == middle.start:
                prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
                prof.__enter__()
                profiled_start = start
            token = logits.argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            logits = model(token, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1]
            if step == middle.stop - 1:
                profiled_wall = time.perf_counter() - profiled_start
                prof.__exit__(None, None, None)
                for event in prof.key_averages(group_by_input_shape=True):
                    section = _op_section(event.key, event.input_shapes or [], model.config.vocab_size)
                    if section:
                        totals[section] += event.self_cpu_time_total / 1e6
            elif step not in middle:
                wall += time.perf_counter() - start
    steps = new - 1 - profiled
    per_step = {k: v / profiled for k, v in totals.items()}
    per_step["python/rest"] = profiled_wall / profiled - sum(per_step.values())
    scale = (wall / steps) / (profiled_wall / profiled)  # the breakdown is of profiled steps: scaled to the rest
    return {"system": "transformers", "ms": {k: 1e3 * v * scale for k, v in per_step.items()},
            "step_ms": 1e3 * wall / steps, "tok_s": batch * steps / wall}


def product_routes(model_dir: str, rows: int, rounds: int = 7) -> tuple[dict[str, float], int]:
    """(ms, flops): ms for the 30 layers' products (qkv, o, gate_up, down) of `rows` tokens on each fp32 route,
    interleaved rounds, best of each: the engine's torch (one thread, its torch thread count), transformers' torch (two OpenMP threads),
    numpy2 (OpenBLAS halves on two threads), torch halves on two threads (MKL per half, the helper thread), and the
    engine's float32 C kernel (f32_linear.c, Backend.C_GEMM_TWO_THREADS: halves on its own worker thread; and on one thread)."""
    import torch.nn.functional as F

    from tokenloop.engine.calibration import best_times
    from tokenloop.engine.helper_thread import HelperThread
    from tokenloop.engine.kernels import load_f32
    from tokenloop.engine.loader import ModelConfig, load_weights
    from tokenloop.engine.matmul import Backend, MatmulPolicy, set_blas_threads

    set_blas_threads(1)
    config = ModelConfig.from_dir(model_dir)
    weights = load_weights(model_dir, config, torch.float32, "fp32")
    mats = [weights[f"layers.{i}.{n}"] for i in range(config.num_layers) for n in ("qkv", "o", "gate_up", "down")]
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in mats}
    helper = HelperThread()
    f32 = load_f32()
    policy = MatmulPolicy({1: Backend.NUMPY_TWO_THREADS}, helper)

    def torch_threads(n):
        def run():
            torch.set_num_threads(n)
            for w in mats:
                F.linear(xs[w.shape[1]], w)
            torch.set_num_threads(1)
        return run

    def numpy2():
        for w in mats:
            policy.linear(xs[w.shape[1]], w, Backend.NUMPY_TWO_THREADS)

    def torch_halves():
        for w in mats:
            x, half = xs[w.shape[1]], w.shape[0] // 2
            out = torch.empty(rows, w.shape[0])

            def part(lo, hi, x=x, w=w, out=out):
                def run():
                    with torch.inference_mode():
                        torch.mm(x, w[lo:hi].t(), out=out[:, lo:hi])
                return run
            helper.split(part(0, half), part(half, w.shape[0]))

    def f32c(threads):
        def run():
            for w in mats:
                out = torch.empty(rows, w.shape[0])
                (f32.linear2 if threads == 2 else f32.linear)(xs[w.shape[1]], w, out)
        return run

    routes = {"torch, 1 thread": torch_threads(1), "torch, 2 OpenMP threads": torch_threads(2),
              "numpy2": numpy2, "torch halves, 2 threads": torch_halves}
    if f32 is not None:
        routes[f"f32c2 ({f32.isa}), 2 threads"] = f32c(2)
        routes[f"f32c ({f32.isa}), 1 thread"] = f32c(1)
    torch.set_num_threads(1)
    with torch.inference_mode():
        best = best_times(routes, rounds)  # the calibration's interleaved best-of rounds
    return {name: 1e3 * t for name, t in best.items()}, 2 * rows * sum(w.numel() for w in mats)


def table(result: dict) -> str:
    lines = [f"{result['system']}: {result['step_ms']:.1f} ms per decode step, {result['tok_s']:.1f} tok/s"
             + (f" (matmul {result['matmul']})" if "matmul" in result else "")]
    for section, ms in sorted(result["ms"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {section:<20} {ms:8.2f} ms  {100 * ms / result['step_ms']:5.1f} %")
    for name, (ms, tok_s) in result.get("modes", {}).items():
        lines.append(f"  {name + ' steps':<20} {ms:8.2f} ms per step, {tok_s:.1f} tok/s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--num-threads", type=int, default=os.cpu_count() or 1, help="transformers' torch threads")
    parser.add_argument("--repeat", type=int, default=1, help="engine runs (interleaved with transformers)")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--matmul-backend", default="auto")
    parser.add_argument("--weights", default="fp32", choices=("fp32", "int8", "int4"))
    parser.add_argument("--fuse", default="on", choices=("on", "off", "both", "alternate"),
                        help="decode steps in one C call (on), layer by layer (off), both in turn per repeat, or "
                             "alternating step by step in one run (the A/B least exposed to load from elsewhere)")
    parser.add_argument("--products", action="store_true", help="only time the fp32 product routes at --batch rows")
    args = parser.parse_args(argv)
    print(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), os.getloadavg())
    if args.products:
        times, flops = product_routes(args.model, args.batch)
        for name, ms in times.items():
            print(f"  {name:<26} {ms:8.1f} ms for the 30 layers' products at {args.batch} rows (best of 7), "
                  f"{flops / ms / 1e6:.1f} GFLOP/s")
        return 0
    for _ in range(args.repeat):
        config = EngineConfig(matmul_backend=args.matmul_backend, weights=args.weights)
        for fuse in {"on": (True,), "off": (False,), "both": (True, False), "alternate": (None,)}[args.fuse]:
            print(table(profile_engine(args.model, args.batch, args.prompt, args.new, config, fuse)), flush=True)
        if not args.skip_transformers:
            print(table(profile_transformers(args.model, args.batch, args.prompt, args.new, args.num_threads)),
                  flush=True)
    print(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), os.getloadavg())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
