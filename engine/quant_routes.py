"""The routes of a quantized mode's products (`--weights int8` / `int4`): each C kernel path this CPU runs and torch's
library kernels (QuantRoute), why a route cannot run or be chosen, and the calibration that times them per bucket
and keeps one family (matmul.MatmulPolicy.calibrate_quant)."""

from __future__ import annotations

import functools
import json
import math
import os
import warnings

import torch
import torch.nn.functional as F

from .calibration import BUCKETS, COLD_TOKENS, best_times
from .kernels import NO_COMPILER, cpu_id
from .linear_kernels import Int4Linear, Int8Linear
from .quant import Q4Weight, QWeight

ROUTE_ENV = "TOKENLOOP_MATMUL_ROUTE"  # force one route for every bucket of a quantized mode (docs/engine.md)
INT8_TIMED_TOKENS = 4  # int8 products of more rows always split over two threads; fewer are timed at start-up


class QuantRoute:
    """One way to run a quantized mode's products: `product(x, w, split)` for its weights (QWeight and, with
    --weights int4, Q4Weight; int4's lm_head is int8) on one of the engine's C kernel paths or a library kernel.
    `family`: routes of one family give the same bits, so a step may take any of them without breaking batch
    invariance; the calibration keeps to one family for every bucket. `head`: the int8 kernel (path x16-avx2) that
    multiplies the lm_head on a route named with HEAD_SUFFIX. `ineligible`: why the calibration times
    this route but never chooses it (it can still be forced with TOKENLOOP_MATMUL_ROUTE)."""

    def __init__(self, name: str, family: str, int8: Int8Linear | None = None, int4: Int4Linear | None = None,
                 ineligible: str = "", head: Int8Linear | None = None):
        self.name, self.family, self.int8, self.int4, self.ineligible = name, family, int8, int4, ineligible
        self.head = head  # multiplies the lm_head (QWeight.head) when set, on its own path (HEAD_SUFFIX); else int8
        self._copies: dict[int, tuple] = {}  # id(weight) -> (weight, what a library route multiplies by)

    def __repr__(self) -> str:
        return f"QuantRoute({self.name})"

    def _copy(self, w, make):
        entry = self._copies.get(id(w))
        if entry is None or entry[0] is not w:
            entry = self._copies[id(w)] = (w, make(w))
        return entry[1]

    def product(self, x: torch.Tensor, w: QWeight | Q4Weight, split: bool) -> torch.Tensor:
        """x [T, K] float32 @ w [N, K] -> [T, N] float32."""
        if isinstance(w, Q4Weight):
            kernel = self.int4
        else:  # the lm_head on the head's path where it takes the weight (the same for every batch: invariant)
            kernel = self.head if self.head is not None and w.head and self.head.x16_takes(w) else self.int8
        if self.family == "torch-fp32" or (kernel is None and self.family != "torch-dynq"):
            # torch on the weight widened to float32 (kept: a library route; dropped: the fallback without a kernel)
            weight = self._copy(w, lambda v: v.dequantize()) if self.family == "torch-fp32" else w.dequantize()
            return F.linear(x, weight.to(x.dtype))
        if self.family == "torch-dynq":
            return dynamic_int8(x, self._copy(w, prepack_dynamic))
        x = x.contiguous()
        out = torch.empty(x.shape[0], w.num_out, dtype=torch.float32)
        (kernel.linear2 if split else kernel.linear)(x, w, out)
        return out


def dynq_engine() -> str:
    """torch's quantized engine for the torch-dynq route ("" where torch has none)."""
    engines = torch.backends.quantized.supported_engines
    return next((e for e in ("x86", "fbgemm", "onednn") if e in engines), "")


def prepack_dynamic(w: QWeight | Q4Weight):
    """torch's dynamically quantized Linear weight (fbgemm / x86 engine) from w's values: fbgemm takes one scale per
    output channel, not per group of 32 columns, so the dequantized weight is requantized per channel."""
    torch.backends.quantized.engine = dynq_engine()
    dense = w.dequantize()
    scale = (dense.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    with warnings.catch_warnings():  # torch deprecates its quantized tensors (this route is measured, not chosen)
        warnings.simplefilter("ignore", UserWarning)
        qw = torch.quantize_per_channel(dense, scale, torch.zeros(dense.shape[0], dtype=torch.int64), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qw, None)


def dynamic_int8(x: torch.Tensor, packed) -> torch.Tensor:
    """torch.ops.quantized.linear_dynamic: x quantized to uint8 per call (one scale for the whole tensor), int8
    weights, VNNI where the CPU has it. Without VNNI fbgemm multiplies with vpmaddubsw, whose int16 pair sums
    saturate on 8-bit activations (an output off by ~17 % of the largest on AVX2-only Zen 3): there the activations
    take 7 bits (`reduce_range`, torch's own advice for such CPUs)."""
    return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, not _has_vnni())


@functools.cache
def _has_vnni() -> bool:
    """Whether this CPU has an int8 dot-product instruction (AVX512-VNNI or AVX-VNNI) that fbgemm uses."""
    return bool(set(cpu_id().split()) & {"avx512_vnni", "avx_vnni"})


DYNQ_INELIGIBLE = ("quantizes the activations with one scale per call (the whole batch): a row's result depends on "
                   "its batch, and the default model's perplexity rises ~70 % (tests/e2e/test_weights_quality.py)")
VNNI_INELIGIBLE = ("its int8 activations fail the quality contract on the default model: greedy output equals fp32's "
                   "on 9 of 16 prompts with int8 weights and 7 with int4 (the rule: 12), and 3-4 of 16 prompts change "
                   "between alone and batched (rounding x to 8 bits turns last-bit differences upstream into whole "
                   "steps); tests/e2e/test_weights_quality.py")
FP32_INELIGIBLE = "needs a float32 copy of every weight (4 bytes a weight against the mode's 1 or 0.5)"

# a route named with this suffix multiplies the lm_head on int8's x16 path (16-bit integer activations, vpmaddwd:
# int8_linear.c), its layers as the route without it: on AVX2 alone the float path's FMAs make the int8 lm_head
# compute-bound (Gemma 3's is 262,144 x 640)
HEAD_SUFFIX = "+h16"
HEAD_PATH = "x16-avx2"


# int4's x22 paths (22-bit integer activations) have no int8 counterpart: the int8 lm_head takes the exact float path
# of the same hardware (its rows are batch invariant on any path)
_X22_LM_HEAD = {"x22-vnni": ("avx512", "avx2"), "x22-avx2": ("avx2",), "x22-portable": ("portable",)}


def quant_routes(mode: str, int8: Int8Linear | None, int4: Int4Linear | None = None) -> dict[str, QuantRoute]:
    """Every route of `mode` ("int8" / "int4") this machine can run: the C kernel's paths this CPU has (with int4,
    each int4 path takes int8's path of the same name for the int8 lm_head, an x22 path the exact one: _X22_LM_HEAD;
    the x22 paths are one family, `x22`), each of those again with HEAD_SUFFIX where the CPU runs HEAD_PATH (the
    lm_head on it; families `exact+h16`, `x22+h16`), and torch's kernels."""
    routes: dict[str, QuantRoute] = {}
    kernel = int4 if mode == "int4" else int8
    packings: dict = {}  # the vnni layout's copies, shared by the routes that read it (vnni, x22), dropped with them
    if kernel is not None:
        for isa in (i for i in kernel.supported() if i not in kernel.X16):  # x16: the lm_head's alone (HEAD_SUFFIX)
            family = "exact" if isa in ("avx2", "avx512") else "x22" if isa.startswith("x22-") else isa
            ineligible = VNNI_INELIGIBLE if isa == "vnni" else ""
            # the int8 lm_head's path: the same name, or for x22 the exact one of the same hardware
            lm_head = next((i for i in _X22_LM_HEAD.get(isa, (isa,)) if int8 is not None and int8.supports(i)), None)
            partner = int8.with_isa(lm_head) if mode == "int4" and lm_head else None
            routes[f"{mode}-{isa}"] = QuantRoute(f"{mode}-{isa}", family, **(
                {"int4": kernel.with_isa(isa, packings), "int8": partner} if mode == "int4"
                else {"int8": kernel.with_isa(isa, packings)}),
                ineligible=ineligible)
    head = int8.with_isa(HEAD_PATH, packings) if int8 is not None and int8.supports(HEAD_PATH) else None
    for name, route in list(routes.items()):
        if head is not None and route.family in ("exact", "x22"):
            routes[name + HEAD_SUFFIX] = QuantRoute(name + HEAD_SUFFIX, route.family + HEAD_SUFFIX, route.int8,
                                                    route.int4, route.ineligible, head)
    routes["torch-fp32"] = QuantRoute("torch-fp32", "torch-fp32", ineligible=FP32_INELIGIBLE)
    if dynq_engine():
        routes["torch-dynq"] = QuantRoute("torch-dynq", "torch-dynq", ineligible=DYNQ_INELIGIBLE)
    return routes


def route_missing(mode: str, name: str, int8: Int8Linear | None, int4: Int4Linear | None = None) -> str:
    """Why route `name` of `mode` cannot run here ("" when it can)."""
    if name in quant_routes(mode, int8, int4):
        return ""
    kernel = int4 if mode == "int4" else int8
    prefix, _, isa = name.removesuffix(HEAD_SUFFIX).partition("-")
    paths = (Int4Linear if mode == "int4" else Int8Linear).PATHS
    if name.endswith(HEAD_SUFFIX) and isa in paths and (kernel is None or kernel.supports(isa)):
        return (f"{ROUTE_ENV}={name!r}: the lm_head's path {HEAD_PATH} needs "
                f"{Int8Linear.NEEDS[HEAD_PATH]} (and a C compiler); its route runs on {isa} alone")
    if prefix != mode or not isa or isa in Int8Linear.X16:
        return (f"{ROUTE_ENV}={name!r} is not a route of --weights {mode} (routes: "
                f"{', '.join([*(f'{mode}-{i}' for i in paths if i not in Int8Linear.X16), 'torch-fp32', 'torch-dynq'])}; "
                f"each C path also with "
                f"{HEAD_SUFFIX})")
    if kernel is None:
        return f"the {mode} C kernel cannot be built here ({NO_COMPILER})"
    return kernel.missing(isa)


def candidate_name(name: str, split: bool) -> str:
    """A timed candidate's name: the route and its threads (\"int8-avx2/2t\")."""
    return f"{name}/{'2t' if split else '1t'}"


def time_routes(routes: dict[str, QuantRoute], weights: list) -> dict[int, dict[str, float]]:
    """bucket -> {candidate ("route/2t"): best seconds over the bucket's weights (the lm_head among them where
    model_setup passes it: the HEAD_SUFFIX routes differ there alone, and where it is not timed they take their base
    route's times; torch's routes are timed without it)}. The portable C path is timed only where it is the only C path (it is the fallback, minutes behind the SIMD paths on
    big steps)."""
    two = (os.cpu_count() or 1) >= 2
    c_routes = [r for r in routes.values() if r.int8 is not None or r.int4 is not None]
    if len(c_routes) > 1:
        c_routes = [r for r in c_routes if not r.name.removesuffix(HEAD_SUFFIX).endswith("-portable")]
    times = {}
    with torch.inference_mode():
        for b in BUCKETS:
            over = weights if b <= COLD_TOKENS else weights[:1]
            x = torch.randn(b, weights[0].shape[1])
            candidates = {}
            with_head = any(getattr(w, "head", False) for w in over)
            for route in c_routes:
                if route.head is not None and not with_head:
                    continue  # the same products as the route without the suffix: its times, below
                for split in ((False, True) if two and b <= INT8_TIMED_TOKENS else (two,)):
                    candidates[candidate_name(route.name, split) + ("*" if route.ineligible else "")] = \
                        lambda r=route, s=split, x=x, over=over: [r.product(x, w, s) for w in over]
            # torch's routes (never eligible) skip the lm_head: their copies of it would be 4 bytes a weight
            layers = [w for w in over if not getattr(w, "head", False)]
            for route in routes.values():
                if route not in c_routes and route.family.startswith("torch"):
                    candidates[candidate_name(route.name, False) + ("*" if route.ineligible else "")] = \
                        lambda r=route, x=x, over=layers: [r.product(x, w, False) for w in over]
            eligible = {c: fn for c, fn in candidates.items() if not c.endswith("*")}
            times[b] = best_times(eligible, rounds=3 if len(over) > 1 or b < 256 else 1)
            # the routes it cannot choose are timed once, for the log: start-up time goes to the choice
            times[b].update(best_times({c: fn for c, fn in candidates.items() if c not in eligible}, rounds=1))
            if not with_head:  # a HEAD_SUFFIX route times as its base where the lm_head is not timed (not noise)
                for route in c_routes:
                    base = route.name.removesuffix(HEAD_SUFFIX)
                    if route.head is not None:
                        times[b].update({c.replace(base, route.name, 1): t for c, t in list(times[b].items())
                                         if c.partition("/")[0] == base})
    for route in routes.values():
        route._copies.clear()  # the library routes' copies of the weights were for the timing only
        for kernel in (route.int8, route.int4):
            if kernel is not None:  # and so were the packings (x22 serving repacks the weights in place)
                kernel.packings.clear()
    return times


def choose_routes(times: dict[int, dict[str, float]], routes: dict[str, QuantRoute]) -> dict:
    """One family for every bucket (the eligible family closest to the overall best, see calibrate_quant), then
    each bucket's fastest candidate of it."""
    def parse(candidate):
        name, _, threads = candidate.rstrip("*").partition("/")
        return routes[name], threads == "2t"
    eligible = {b: {c: t for c, t in ts.items() if not c.endswith("*")} for b, ts in times.items()}
    families = {parse(c)[0].family for ts in eligible.values() for c in ts}

    def cost(family):
        return sum(math.log(min(t for c, t in ts.items() if parse(c)[0].family == family) / min(ts.values()))
                   for ts in eligible.values())
    family = min(sorted(families, key=lambda f: f != "exact"), key=cost)
    buckets = {}
    for b, ts in eligible.items():
        best = min((c for c in ts if parse(c)[0].family == family), key=ts.get)
        route, split = parse(best)
        buckets[b] = (route.name, split)
    return {"family": family, "buckets": buckets, "times": times}


def read_route_record(path, routes: dict[str, QuantRoute]) -> dict | None:
    """calibrate_quant's cached record, or None where it is missing, malformed or names a route not runnable here."""
    try:
        raw = json.loads(path.read_text())
        record = {"family": raw["family"], "times": {int(b): ts for b, ts in raw["times"].items()},
                  "buckets": {int(b): (name, bool(split)) for b, (name, split) in raw["buckets"].items()},
                  "others_load": raw.get("others_load")}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if set(record["buckets"]) != set(BUCKETS) or any(n not in routes or routes[n].ineligible
                                                     for n, _ in record["buckets"].values()):
        return None
    return record
