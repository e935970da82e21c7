"""Which library multiplies the weights, chosen per step: torch, numpy, or numpy on two threads.

On some CPUs torch's float32 matrix-vector product (MKL) is 2x slower than numpy's OpenBLAS on the
same memory (`Tensor.numpy()` shares it, so no weight is copied). `auto` times the choices once at
start-up for 1..1024 tokens per step and uses the fastest per step.

Threads: OpenBLAS worker threads spin between calls, and OpenMP barriers wait for descheduled
workers; on a small shared machine either turns a 20 ms step into 700 ms. So OpenBLAS stays
single-threaded, and `numpy2` splits a product over two plain Python threads (numpy releases the
GIL) that block, rather than spin, while they wait.

`native2`, for steps of a few tokens (one decoding stream): the float32 matrix-vector kernel of
int8_linear.c on two threads, its own worker spinning at most 200 us between the products of one
step. A step of one token reads every weight once, so it runs at memory bandwidth, which one core
cannot reach alone; handing half of each of the ~120 products of a step to a Python thread costs
~35 us each (a queue, then the GIL), more than half of what a product takes. Timed over every
layer's weights, not one: one matrix sits in the cache and hides what memory costs.

`f32c2`, for steps of a batch (16 to hundreds of rows: 32 decoding streams): f32_linear.c's float32 GEMM on two
threads (its own worker, as native2). A register tile of 12 channels by 32 rows (AVX-512; 6 by 16 on AVX2) over x
transposed once per product reads each weight once for the whole batch: ~185 GFLOP/s on the 2-vCPU Zen 4 VM at 32
rows, where MKL and OpenBLAS reach ~40 % of the FMA peak on these narrow shapes (K = 576; docs/engine.md). torch on two OpenMP threads is measured beside it in
`bench/decode_profile.py --products` and is not a candidate: it is slower there, and its barriers are what the
engine avoids (above).
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import math
import os
import queue
import threading
import time
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from .kernels import NO_COMPILER, cache_dir, cpu_id, load_f32, load_int8, name_this_thread
from .linear_kernels import F32Linear, Int4Linear, Int8Linear
from .quant import Q4Weight, QWeight

log = logging.getLogger(__name__)

BUCKETS = (1, 4, 16, 64, 256, 1024)  # tokens per step at which the backends are compared
MIN_SPLIT_TOKENS = 1
INT8_TIMED_TOKENS = 4  # int8 products of more rows always split over two threads; fewer are timed at start-up


class Backend(enum.Enum):
    """How one step's matrix products run."""

    TORCH = "torch"
    NUMPY = "numpy"
    NUMPY2 = "numpy2"  # numpy, output features split over two threads
    NATIVE2 = "native2"  # the native float32 kernel on two threads (a few tokens per step; int8_linear.c)
    F32C2 = "f32c2"  # the native float32 GEMM on two threads (a batch of rows per step; f32_linear.c)


NATIVE_MAX_TOKENS = 16  # native2 is a candidate up to this bucket (past it BLAS's blocking wins)
COLD_TOKENS = 4  # buckets up to this many tokens are timed over every layer's weights (memory-bound)
ROUTE_ENV = "TOKENLOOP_MATMUL_ROUTE"  # force one route for every bucket of a quantized mode (docs/engine.md)
CACHE_ENV = "TOKENLOOP_MATMUL_CACHE"  # "off": time the routes at every start, never read or write the cache file
# A choice timed while other processes used more than this share of the CPUs is cached as provisional: a later start
# on a quiet machine (others within LOAD_LIMIT over QUIET_SAMPLE_S, measured then) times the routes again.
LOAD_LIMIT = 0.15
QUIET_SAMPLE_S = 0.3


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used since boot: /proc/stat's first line, all of user nice
    system idle iowait irq softirq steal but idle and iowait (bench/harness.py uses it too)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class OthersLoad:
    """The share of the machine's CPUs that other processes (and, on a VM, the hypervisor's steal) used from
    construction to `share()`: /proc/stat's busy time less this process's CPU time, over wall time x CPUs.
    None where /proc/stat cannot be read."""

    def __init__(self):
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            busy = machine_busy_s()
        except (OSError, ValueError):
            return None
        return busy, time.process_time(), time.perf_counter()

    def share(self) -> float | None:
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        busy, mine, wall = (e - s for e, s in zip(end, self._start))
        return max(0.0, busy - mine) / (wall * (os.cpu_count() or 1))


def quiet_now() -> bool:
    """The machine is idle now: other processes used at most LOAD_LIMIT of the CPUs over the next QUIET_SAMPLE_S.
    (Not the load average: it trails by a minute, so a start right after other work, as in a benchmark that runs
    one server after another, would still read as busy.)"""
    load = OthersLoad()
    time.sleep(QUIET_SAMPLE_S)
    share = load.share()
    return share is not None and share <= LOAD_LIMIT


def _fastest(candidates: dict, rounds: int = 7):
    """The key of the fastest callable (_timings)."""
    best = _timings(candidates, rounds)
    return min(best, key=best.get)


def _timings(candidates: dict, rounds: int = 7) -> dict:
    """Each callable's best time in seconds. Rounds interleave the candidates (A B C A B C ...) and each keeps its
    best time, so a burst of load from elsewhere cannot land on one candidate's runs only. Each timed call
    follows an untimed one of the same candidate: a helper thread that just slept through the others' turns
    is awake, as it is in a running engine, where every product uses it."""
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(rounds):
        for key, fn in candidates.items():
            fn()
            start = time.perf_counter()
            fn()
            best[key] = min(best[key], time.perf_counter() - start)
    return best


class _Helper:
    """A second thread that runs one half of a job while the caller runs the other (both release the GIL)."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="tokenloop-matmul", daemon=True).start()

    def _run(self) -> None:
        name_this_thread("tokenloop-mm")
        while True:
            job = self._jobs.get()
            try:
                job()
                self._done.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                self._done.put(exc)

    def split(self, mine, theirs) -> None:
        """Run `theirs` on the helper thread and `mine` here; returns when both are done."""
        self._jobs.put(theirs)
        try:
            mine()
        finally:
            error = self._done.get()
        if error is not None:
            raise error

    def matmul(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x @ w.T with the rows of w (the output features) halved: each thread reads half the weight."""
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.result_type(x, w))
        half = w.shape[0] // 2
        # each half writes a column block of `out` in place
        self.split(lambda: np.matmul(x, w[:half].T, out=out[:, :half]),
                   lambda: np.matmul(x, w[half:].T, out=out[:, half:]))
        return out



class QuantRoute:
    """One way to run a quantized mode's products: `product(x, w, split)` for its weights (QWeight and, with
    --weights int4, Q4Weight; int4's lm_head is int8) on one of the engine's C kernel paths or a library kernel.
    `family`: routes of one family give the same bits, so a step may take any of them without breaking batch
    invariance; the calibration keeps to one family for every bucket. `ineligible`: why the calibration times
    this route but never chooses it (it can still be forced with TOKENLOOP_MATMUL_ROUTE)."""

    def __init__(self, name: str, family: str, int8: Int8Linear | None = None, int4: Int4Linear | None = None,
                 ineligible: str = ""):
        self.name, self.family, self.int8, self.int4, self.ineligible = name, family, int8, int4, ineligible
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
        kernel = self.int4 if isinstance(w, Q4Weight) else self.int8
        if self.family == "torch-fp32" or (kernel is None and self.family != "torch-dynq"):
            # torch on the weight widened to float32 (kept: a library route; dropped: the fallback without a kernel)
            weight = self._copy(w, lambda v: v.dequantize()) if self.family == "torch-fp32" else w.dequantize()
            return F.linear(x, weight.to(x.dtype))
        if self.family == "torch-dynq":
            return _dynamic_int8(x, self._copy(w, _prepack_dynamic))
        x = x.contiguous()
        out = torch.empty(x.shape[0], w.num_out, dtype=torch.float32)
        (kernel.linear2 if split else kernel.linear)(x, w, out)
        return out


def _dynq_engine() -> str:
    engines = torch.backends.quantized.supported_engines
    return next((e for e in ("x86", "fbgemm", "onednn") if e in engines), "")


def _prepack_dynamic(w: QWeight | Q4Weight):
    """torch's dynamically quantized Linear weight (fbgemm / x86 engine) from w's values: fbgemm takes one scale per
    output channel, not per group of 32 columns, so the dequantized weight is requantized per channel."""
    torch.backends.quantized.engine = _dynq_engine()
    dense = w.dequantize()
    scale = (dense.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    with warnings.catch_warnings():  # torch deprecates its quantized tensors (this route is measured, not chosen)
        warnings.simplefilter("ignore", UserWarning)
        qw = torch.quantize_per_channel(dense, scale, torch.zeros(dense.shape[0], dtype=torch.int64), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(qw, None)


def _dynamic_int8(x: torch.Tensor, packed) -> torch.Tensor:
    """torch.ops.quantized.linear_dynamic: x quantized to uint8 per call (one scale for the whole tensor), int8
    weights, VNNI where the CPU has it."""
    return torch.ops.quantized.linear_dynamic(x.contiguous(), packed, False)


DYNQ_INELIGIBLE = ("quantizes the activations with one scale per call (the whole batch): a row's result depends on "
                   "its batch, and the default model's perplexity rises ~70 % (tests/e2e/test_weights_quality.py)")
VNNI_INELIGIBLE = ("its int8 activations fail the quality contract on the default model: greedy output equals fp32's "
                   "on 9 of 16 prompts with int8 weights and 7 with int4 (the rule: 12), and 3-4 of 16 prompts change "
                   "between alone and batched (rounding x to 8 bits turns last-bit differences upstream into whole "
                   "steps); tests/e2e/test_weights_quality.py")
FP32_INELIGIBLE = "needs a float32 copy of every weight (4 bytes a weight against the mode's 1 or 0.5)"


# int4's x22 paths (22-bit integer activations) have no int8 counterpart: the int8 lm_head takes the exact float path
# of the same hardware (its rows are batch invariant on any path)
_X22_LM_HEAD = {"x22-vnni": ("avx512", "avx2"), "x22-avx2": ("avx2",), "x22-portable": ("portable",)}


def quant_routes(mode: str, int8: Int8Linear | None, int4: Int4Linear | None = None) -> dict[str, QuantRoute]:
    """Every route of `mode` ("int8" / "int4") this machine can run: the C kernel's paths this CPU has (with int4,
    each int4 path takes int8's path of the same name for the int8 lm_head, an x22 path the exact one: _X22_LM_HEAD;
    the x22 paths are one family, `x22`), and torch's kernels."""
    routes: dict[str, QuantRoute] = {}
    kernel = int4 if mode == "int4" else int8
    packings: dict = {}  # the vnni layout's copies, shared by the routes that read it (vnni, x22), dropped with them
    if kernel is not None:
        for isa in kernel.supported():
            family = "exact" if isa in ("avx2", "avx512") else "x22" if isa.startswith("x22-") else isa
            ineligible = VNNI_INELIGIBLE if isa == "vnni" else ""
            # the int8 lm_head's path: the same name, or for x22 the exact one of the same hardware
            lm_head = next((i for i in _X22_LM_HEAD.get(isa, (isa,)) if int8 is not None and int8.supports(i)), None)
            partner = int8.with_isa(lm_head) if mode == "int4" and lm_head else None
            routes[f"{mode}-{isa}"] = QuantRoute(f"{mode}-{isa}", family, **(
                {"int4": kernel.with_isa(isa, packings), "int8": partner} if mode == "int4"
                else {"int8": kernel.with_isa(isa, packings)}),
                ineligible=ineligible)
    routes["torch-fp32"] = QuantRoute("torch-fp32", "torch-fp32", ineligible=FP32_INELIGIBLE)
    if _dynq_engine():
        routes["torch-dynq"] = QuantRoute("torch-dynq", "torch-dynq", ineligible=DYNQ_INELIGIBLE)
    return routes


def route_missing(mode: str, name: str, int8: Int8Linear | None, int4: Int4Linear | None = None) -> str:
    """Why route `name` of `mode` cannot run here ("" when it can)."""
    if name in quant_routes(mode, int8, int4):
        return ""
    kernel = int4 if mode == "int4" else int8
    prefix, _, isa = name.partition("-")
    paths = (Int4Linear if mode == "int4" else Int8Linear).PATHS
    if prefix != mode or not isa:
        return (f"{ROUTE_ENV}={name!r} is not a route of --weights {mode} (routes: "
                f"{', '.join([*(f'{mode}-{i}' for i in paths), 'torch-fp32', 'torch-dynq'])})")
    if kernel is None:
        return f"the {mode} C kernel cannot be built here ({NO_COMPILER})"
    return kernel.missing(isa)

class MatmulPolicy:
    """`linear(x, w, backend)` = x @ w.T; `backend(num_tokens)` says how a step multiplies float weights, `qroutes`
    how it multiplies quantized ones (a QuantRoute and whether it splits over two threads, per bucket)."""

    def __init__(self, buckets: dict[int, Backend], helper: _Helper | None = None, int8: Int8Linear | None = None,
                 int8_split: dict[int, bool] | None = None, native: Int8Linear | None = None,
                 int4: Int4Linear | None = None, qroutes: dict[int, tuple[QuantRoute, bool]] | None = None,
                 timings: dict[int, dict[str, float]] | None = None, chosen: str = "", f32: F32Linear | None = None):
        self.buckets = buckets
        self.f32 = f32  # the native float32 GEMM, for Backend.F32C2 (None: torch serves)
        self.int8 = int8  # the native int8 kernel for QWeight products; None: torch (dequantize, then F.linear)
        self.int4 = int4  # the native 4-bit kernel for Q4Weight products; None: torch (dequantize, then F.linear)
        self.native = native or int8  # the native kernels' library, for Backend.NATIVE2 (None: numpy serves)
        # bucket -> split a quantized product's output channels over two threads (the default route's)
        self.int8_split = int8_split or {}
        mode, kernel = ("int4", int4) if int4 is not None else ("int8", int8)
        default = QuantRoute(f"{mode}-{kernel.isa}" if kernel is not None else "torch", "exact", int8=int8, int4=int4)
        self.qroutes = qroutes or {b: (default, self.int8_split.get(b, False)) for b in BUCKETS}
        self.timings = timings or {}  # bucket -> {candidate: best seconds} from the calibration
        self.chosen = chosen  # how the routes were chosen (timed now, read from the cache, forced)
        wants_helper = Backend.NUMPY2 in buckets.values()
        self._helper = helper or (_Helper() if wants_helper else None)

    def helper(self) -> _Helper:
        """The second thread (started on first use when no backend needed it)."""
        if self._helper is None:
            self._helper = _Helper()
        return self._helper

    @classmethod
    def fixed(cls, backend: Backend) -> MatmulPolicy:
        native = f32 = None
        if backend is Backend.NATIVE2:
            native = load_int8()
        if backend is Backend.F32C2:
            f32 = load_f32()
        return cls({b: backend for b in BUCKETS}, native=native, f32=f32)

    @classmethod
    def calibrate(cls, weights: torch.Tensor | list[torch.Tensor], native: Int8Linear | None = None,
                  f32: F32Linear | None = None, use_cache: bool | None = None) -> MatmulPolicy:
        """Time each backend for every bucket (numpy and native only for float32/float64; native2 only for float32
        and up to NATIVE_MAX_TOKENS; f32c2 for float32: `f32`, else the kernel load_f32 builds).
        `weights`: [N, D] matrices of one shape, e.g. every layer's gate_up; buckets up to COLD_TOKENS are timed
        over all of them (a step streams them from memory), larger ones on the first. Each backend wins only the
        buckets where it measures fastest. The choice is cached as calibrate_quant's is (per CPU, kernel builds,
        library versions, dtype and weight shapes; provisional when timed on a busy machine): a restart chooses the
        same backends, so the same bits, and skips the ~4 s of timing."""
        weights = weights if isinstance(weights, list) else [weights]
        weight = weights[0]
        if weight.dtype not in (torch.float32, torch.float64):
            return cls.fixed(Backend.TORCH)
        split = (os.cpu_count() or 1) >= 2
        native = native if split and weight.dtype == torch.float32 else None
        f32 = (f32 or load_f32()) if split and weight.dtype == torch.float32 else None
        probe = cls({b: Backend.NUMPY2 for b in BUCKETS}, native=native, f32=f32) if split else None

        def time_backends() -> dict:
            buckets = {}
            with torch.inference_mode():
                for b in BUCKETS:
                    x = torch.randn(b, weight.shape[1], dtype=weight.dtype)
                    over = weights if b <= COLD_TOKENS else [weight]

                    def each(fn, over=over):
                        return lambda: [fn(w) for w in over]
                    candidates = {Backend.TORCH: each(lambda w, x=x: F.linear(x, w)),
                                  Backend.NUMPY: each(lambda w, x=x: np.matmul(x.numpy(), w.numpy().T))}
                    if probe is not None and b >= MIN_SPLIT_TOKENS:
                        candidates[Backend.NUMPY2] = each(lambda w, x=x: probe.linear(x, w, Backend.NUMPY2))
                    if native is not None and b <= NATIVE_MAX_TOKENS:
                        candidates[Backend.NATIVE2] = each(lambda w, x=x: probe.linear(x, w, Backend.NATIVE2))
                    if f32 is not None:
                        candidates[Backend.F32C2] = each(lambda w, x=x: probe.linear(x, w, Backend.F32C2))
                    # 7 rounds over every layer's weights too: at one token the backends stream at 10-30 % of each
                    # other, and best-of-3 on this shared VM cached f32c2 over native2 once (one fp32 stream 0.73x)
                    buckets[b] = _fastest(candidates, rounds=7).value
            return {"buckets": buckets}

        key = ["float", str(weight.dtype), np.__version__, native.path.name if native else "-",
               f32.path.name if f32 else "-", "cold rounds 7"]  # the timing rule too: a choice it made is retimed
        path = cache_dir() / f"matmul-{str(weight.dtype).split('.')[-1]}-{_cache_key(key, weights)}.json"
        record, chosen = _cached_choice(path, _read_float_record, time_backends, use_cache)
        buckets = {b: Backend(v) for b, v in record["buckets"].items()}
        return cls(buckets, probe._helper if probe is not None else None, native=native, f32=f32, chosen=chosen)

    @classmethod
    def calibrate_int8(cls, weights: QWeight | list[QWeight], int8: Int8Linear | None) -> MatmulPolicy:
        """For int8 weights: calibrate_quant over int8's routes."""
        return cls.calibrate_quant("int8", weights, int8)

    @classmethod
    def calibrate_int4(cls, weights: Q4Weight | list[Q4Weight], int4: Int4Linear | None,
                       int8: Int8Linear | None = None) -> MatmulPolicy:
        """For 4-bit weights: calibrate_quant over int4's routes; `int8` multiplies the int8 lm_head that goes with
        them (on the int8 path of the int4 route's name)."""
        return cls.calibrate_quant("int4", weights, int8, int4)

    @classmethod
    def calibrate_quant(cls, mode: str, weights, int8: Int8Linear | None, int4: Int4Linear | None = None,
                        use_cache: bool | None = None) -> MatmulPolicy:
        """The routes of a quantized mode, per bucket. TOKENLOOP_MATMUL_ROUTE forces one for every bucket (an
        error names why when it cannot run here). Otherwise every route this machine runs (quant_routes) is timed
        per bucket, each over all of `weights` (every layer's gate_up: a real step streams them from memory) up to
        COLD_TOKENS rows and over the first beyond; the C routes on one thread and on two up to INT8_TIMED_TOKENS
        rows, on two beyond. Then one family is kept for every bucket (so a row gets the same bits alone and in any
        batch): the eligible family whose per-bucket best is closest to the overall best (the sum over buckets of
        log(family best / overall best)), and in each bucket its fastest route. The choice and the times are cached
        per CPU (model and flags), kernel build, mode and weight shapes in the kernels' cache directory, so later
        starts skip the timing (TOKENLOOP_MATMUL_CACHE=off: time at every start). A choice timed while other processes
        used more than LOAD_LIMIT of the CPUs (OthersLoad) is cached as provisional: two threads time slower on a
        busy machine, and such a choice once made a quiet benchmark run one stream on one thread; a later start on a
        quiet machine (quiet_now) times the routes again."""
        weights = weights if isinstance(weights, list) else [weights]
        kernel = int4 if mode == "int4" else int8
        routes = quant_routes(mode, int8, int4)
        forced = os.environ.get(ROUTE_ENV, "").strip()
        if forced:
            missing = route_missing(mode, forced, int8, int4)
            if missing:
                raise RuntimeError(missing)
            split = (os.cpu_count() or 1) >= 2
            return cls(dict.fromkeys(BUCKETS, Backend.TORCH), int8=int8, int4=int4,
                       qroutes={b: (routes[forced], split) for b in BUCKETS}, chosen=f"forced by {ROUTE_ENV}")
        if kernel is None:  # without the C kernel: torch multiplies by the weight widened on the fly
            return cls(dict.fromkeys(BUCKETS, Backend.TORCH), int8=int8, int4=int4)
        path = cache_dir() / f"matmul-{mode}-{_cache_key([mode, kernel.path.name], weights)}.json"
        record, chosen = _cached_choice(path, lambda p: _read_record(p, routes),
                                        lambda: _choose(_time_routes(routes, weights), routes), use_cache)
        qroutes = {b: (routes[name], split) for b, (name, split) in record["buckets"].items()}
        return cls(dict.fromkeys(BUCKETS, Backend.TORCH), int8=int8, int4=int4, qroutes=qroutes,
                   timings=record["times"], chosen=chosen)

    def _bucket(self, num_tokens: int) -> int:
        for b in BUCKETS:
            if num_tokens <= b:
                return b
        return BUCKETS[-1]

    def backend(self, num_tokens: int) -> Backend:
        return self.buckets[self._bucket(num_tokens)]

    def route(self, num_tokens: int) -> tuple[QuantRoute, bool]:
        """The quantized products' route for a step of `num_tokens` rows, and whether it splits over two threads."""
        return self.qroutes[self._bucket(num_tokens)]

    def linear(self, x: torch.Tensor, w: torch.Tensor | QWeight | Q4Weight, backend: Backend) -> torch.Tensor:
        """x: [T, D_in], w: [D_out, D_in] -> [T, D_out]."""
        if isinstance(w, (QWeight, Q4Weight)):
            route, split = self.route(x.shape[0])
            return route.product(x, w, split)
        if backend is Backend.NATIVE2 and self.native is not None and w.dtype == torch.float32 and w.is_contiguous():
            x = x.contiguous()
            out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
            self.native.f32_linear2(x, w, out)
            return out
        if backend is Backend.F32C2 and self.f32 is not None and w.dtype == torch.float32 and w.is_contiguous():
            x = x.contiguous()
            if x.dtype is torch.float32:
                out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
                self.f32.linear2(x, w, out)
                return out
        if backend in (Backend.TORCH, Backend.NATIVE2, Backend.F32C2):  # a native backend without its kernel
            return F.linear(x, w)
        x_np = x.contiguous().numpy()
        if backend is Backend.NUMPY2 and x.shape[0] >= MIN_SPLIT_TOKENS and self._helper is not None:
            return torch.from_numpy(self._helper.matmul(x_np, w.numpy()))
        return torch.from_numpy(np.matmul(x_np, w.numpy().T))

    def describe(self) -> str:
        """The float backends per bucket; with quantized weights, each bucket's route, threads and the times of
        every candidate (ms, * = not eligible), and how the routes were chosen."""
        if self.int8 is None and self.int4 is None and not self.timings:
            return ", ".join(f"<={b}: {backend.value}" for b, backend in self.buckets.items()) + (
                f" ({self.chosen})" if self.chosen else "")
        parts = []
        for b in BUCKETS:
            route, split = self.qroutes[b]
            times = self.timings.get(b, {})
            timed = "; ".join(f"{name} {t * 1e3:.2f}" for name, t in sorted(times.items(), key=lambda kv: kv[1]))
            parts.append(f"<={b}: {route.name} {'2 threads' if split else '1 thread'}" + (f" ({timed})" if timed else ""))
        return f"routes ({self.chosen or 'default'}; ms per pass over the timed weights, * not eligible): " + \
            ", ".join(parts)


def _candidate(name: str, split: bool) -> str:
    return f"{name}/{'2t' if split else '1t'}"


def _time_routes(routes: dict[str, QuantRoute], weights: list) -> dict[int, dict[str, float]]:
    """bucket -> {candidate ("route/2t"): best seconds over the bucket's weights}. The portable C path is timed only
    where it is the only C path (it is the fallback, minutes behind the SIMD paths on big steps)."""
    two = (os.cpu_count() or 1) >= 2
    c_routes = [r for r in routes.values() if r.int8 is not None or r.int4 is not None]
    if len(c_routes) > 1:
        c_routes = [r for r in c_routes if not r.name.endswith("-portable")]
    times = {}
    with torch.inference_mode():
        for b in BUCKETS:
            over = weights if b <= COLD_TOKENS else weights[:1]
            x = torch.randn(b, weights[0].shape[1])
            candidates = {}
            for route in c_routes:
                for split in ((False, True) if two and b <= INT8_TIMED_TOKENS else (two,)):
                    candidates[_candidate(route.name, split) + ("*" if route.ineligible else "")] = \
                        lambda r=route, s=split, x=x, over=over: [r.product(x, w, s) for w in over]
            for route in routes.values():
                if route not in c_routes and route.family.startswith("torch"):
                    candidates[_candidate(route.name, False) + ("*" if route.ineligible else "")] = \
                        lambda r=route, x=x, over=over: [r.product(x, w, False) for w in over]
            eligible = {c: fn for c, fn in candidates.items() if not c.endswith("*")}
            times[b] = _timings(eligible, rounds=3 if len(over) > 1 or b < 256 else 1)
            # the routes it cannot choose are timed once, for the log: start-up time goes to the choice
            times[b].update(_timings({c: fn for c, fn in candidates.items() if c not in eligible}, rounds=1))
    for route in routes.values():
        route._copies.clear()  # the library routes' copies of the weights were for the timing only
    return times


def _choose(times: dict[int, dict[str, float]], routes: dict[str, QuantRoute]) -> dict:
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


def _cache_key(what: list[str], weights: list) -> str:
    """What a cached choice depends on: `what` (the mode, the kernel builds) and this CPU (model and flags), its
    count, torch's version and the weights' number and shape."""
    shape = [f"{tuple(w.shape)}/{getattr(w, 'group_size', '-')}" for w in weights[:1]]
    what = [what[0], cpu_id(), str(os.cpu_count()), torch.__version__, *what[1:], str(len(weights)), *shape]
    return hashlib.sha256("\0".join(what).encode()).hexdigest()[:16]


def _cached_choice(path, read, time_choice, use_cache: bool | None) -> tuple[dict, str]:
    """A calibration's record: read from `path` (read(path) -> record or None), or timed now (time_choice() -> a
    JSON-able record) and written there; and how it was chosen. A record timed while other processes used more than
    LOAD_LIMIT of the CPUs is provisional: it serves until a start finds the machine quiet, which times again.
    use_cache None: TOKENLOOP_MATMUL_CACHE (off: time at every start, never read or write)."""
    use_cache = os.environ.get(CACHE_ENV, "").lower() != "off" if use_cache is None else use_cache
    record = read(path) if use_cache else None
    chosen = f"cached in {path}"
    under_load = _provisional(record) if record is not None else 0.0
    retime = bool(under_load) and quiet_now()
    if under_load and not retime:
        chosen += f" (timed while other processes used {under_load:.0%} of the CPUs; timed again " \
                  "at a start on a quiet machine)"
    if record is None or retime:
        started, load = time.perf_counter(), OthersLoad()
        record = time_choice()
        record["others_load"] = load.share()
        chosen = f"timed in {time.perf_counter() - started:.1f} s" + (" (the cached choice was timed under load)"
                                                                    if retime else "")
        if _provisional(record):
            chosen += f" while other processes used {record['others_load']:.0%} of the CPUs: cached as provisional"
            log.warning("matmul: routes %s", chosen)
        if use_cache:
            _write_record(path, record)
    return record, chosen


def _read_float_record(path) -> dict | None:
    """calibrate's cached record: {"buckets": {bucket: Backend value}, "others_load": share}, or None."""
    try:
        raw = json.loads(path.read_text())
        record = {"buckets": {int(b): Backend(v).value for b, v in raw["buckets"].items()},
                  "others_load": raw.get("others_load")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return record if set(record["buckets"]) == set(BUCKETS) else None


def _provisional(record: dict) -> float:
    """The other processes' share of the CPUs while `record` was timed, when over LOAD_LIMIT (else 0.0)."""
    share = record.get("others_load")
    return share if isinstance(share, (int, float)) and share > LOAD_LIMIT else 0.0


def _read_record(path, routes: dict[str, QuantRoute]) -> dict | None:
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


def _write_record(path, record: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache directory: time again next start
        log.warning("matmul: cannot write the route cache %s: %s", path, exc)


def set_blas_threads(num_threads: int) -> bool:
    """Best effort: set numpy's OpenBLAS thread count (torch's is torch.set_num_threads). True if set."""
    import ctypes
    import glob
    import os

    libs_dir = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in glob.glob(os.path.join(libs_dir, "*openblas*.so*")):
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(num_threads))
                return True
    return False
