"""Which kernel multiplies the weights, chosen per step (MatmulPolicy): torch, numpy, numpy on two threads, the C
kernels on two threads; for quantized weights, a route (quant_routes.py).

On some CPUs torch's float32 matrix-vector product (MKL) is 2x slower than numpy's OpenBLAS on the
same memory (`Tensor.numpy()` shares it, so no weight is copied). `auto` times the choices once at
start-up for 1..1024 tokens per step and uses the fastest per step.

Threads: OpenBLAS worker threads spin between calls, and OpenMP barriers wait for descheduled
workers; on a small shared machine either turns a 20 ms step into 700 ms. So OpenBLAS stays
single-threaded, and `numpy2` (Backend.NUMPY_TWO_THREADS) splits a product over two plain Python threads (numpy releases the
GIL) that block, rather than spin, while they wait.

`native2` (Backend.C_GEMV_TWO_THREADS), for steps of a few tokens (one decoding stream): the float32 matrix-vector kernel of
int8_linear.c on two threads, its own worker spinning at most 200 us between the products of one
step. A step of one token reads every weight once, so it runs at memory bandwidth, which one core
cannot reach alone; handing half of each of the ~120 products of a step to a Python thread costs
~35 us each (a queue, then the GIL), more than half of what a product takes. Timed over every
layer's weights, not one: one matrix sits in the cache and hides what memory costs.

`f32c2` (Backend.C_GEMM_TWO_THREADS), for steps of a batch (16 to hundreds of rows: 32 decoding streams): f32_linear.c's float32 GEMM on two
threads (its own worker, as native2). A register tile of 12 channels by 32 rows (AVX-512; 6 by 16 on AVX2) over x
transposed once per product reads each weight once for the whole batch: ~185 GFLOP/s on the 2-vCPU Zen 4 VM at 32
rows, where MKL and OpenBLAS reach ~40 % of the FMA peak on these narrow shapes (K = 576; docs/engine.md). torch on two OpenMP threads is measured beside it in
`bench/decode_profile.py --products` and is not a candidate: it is slower there, and its barriers are what the
engine avoids (above).
"""

from __future__ import annotations

import enum
import json
import os

import numpy as np
import torch
import torch.nn.functional as F

from .calibration import BUCKETS, COLD_TOKENS, cache_key, cached_choice, fastest, provisional
from .helper_thread import HelperThread
from .kernels import cache_dir, load_f32, load_int8
from .linear_kernels import F32Linear, Int4Linear, Int8Linear
from .quant import Q4Weight, QWeight
from .quant_routes import (
    ROUTE_ENV,
    QuantRoute,
    candidate_name,
    choose_routes,
    quant_routes,
    read_route_record,
    route_missing,
    time_routes,
)

MIN_SPLIT_TOKENS = 1


class Backend(enum.Enum):
    """How one step's float matrix products run (the values are what --matmul-backend and the cache files say)."""

    TORCH = "torch"
    NUMPY = "numpy"
    NUMPY_TWO_THREADS = "numpy2"  # numpy, output features split over two threads
    C_GEMV_TWO_THREADS = "native2"  # int8_linear.c's float32 matrix-vector kernel on two threads (a few tokens)
    C_GEMM_TWO_THREADS = "f32c2"  # f32_linear.c's float32 GEMM on two threads (a batch of rows per step)


NATIVE_MAX_TOKENS = 16  # native2 is a candidate up to this bucket (past it BLAS's blocking wins)


TIMED_COPY_BYTES = 1 << 30  # the float32 copies the torch-fp32 route times over, at most (8B: 0.5 GB per gate_up)


def timed_weights(weights: list) -> list:
    """The first of `weights` (at least one) whose float32 copies take at most TIMED_COPY_BYTES: what a quantized
    mode's routes are timed over. The library routes multiply copies of the weights (torch-fp32 in float32, 8x
    int4's bytes), kept for the timing: over every layer's gate_up of an 8B model that was 15 GB, and the start-up
    was killed for memory. A 1.7B model keeps 8 of its 24 layers, still far more bytes than any cache. The lm_head
    (QWeight.head, last) is kept whatever the count: the torch routes skip it (quant_routes.time_routes)."""
    head = [w for w in weights if getattr(w, "head", False)]  # the lm_head stays (quant_routes.HEAD_SUFFIX)
    layers = [w for w in weights if not getattr(w, "head", False)]
    if not layers:
        return head
    per = layers[0].shape[0] * layers[0].shape[1] * 4
    return layers[:max(1, min(len(layers), TIMED_COPY_BYTES // per))] + head


class MatmulPolicy:
    """`linear(x, w, backend)` = x @ w.T; `backend(num_tokens)` says how a step multiplies float weights, `qroutes`
    how it multiplies quantized ones (a QuantRoute and whether it splits over two threads, per bucket)."""

    def __init__(self, buckets: dict[int, Backend], helper: HelperThread | None = None, int8: Int8Linear | None = None,
                 int8_split: dict[int, bool] | None = None, native: Int8Linear | None = None,
                 int4: Int4Linear | None = None, qroutes: dict[int, tuple[QuantRoute, bool]] | None = None,
                 timings: dict[int, dict[str, float]] | None = None, chosen: str = "", f32: F32Linear | None = None):
        self.buckets = buckets
        self.f32 = f32  # the native float32 GEMM, for Backend.C_GEMM_TWO_THREADS (None: torch serves)
        self.int8 = int8  # the native int8 kernel for QWeight products; None: torch (dequantize, then F.linear)
        self.int4 = int4  # the native 4-bit kernel for Q4Weight products; None: torch (dequantize, then F.linear)
        self.native = native or int8  # the native kernels' library, for Backend.C_GEMV_TWO_THREADS (None: numpy serves)
        # bucket -> split a quantized product's output channels over two threads (the default route's)
        self.int8_split = int8_split or {}
        mode, kernel = ("int4", int4) if int4 is not None else ("int8", int8)
        default = QuantRoute(f"{mode}-{kernel.isa}" if kernel is not None else "torch", "exact", int8=int8, int4=int4)
        self.qroutes = qroutes or {b: (default, self.int8_split.get(b, False)) for b in BUCKETS}
        self.timings = timings or {}  # bucket -> {candidate: best seconds} from the calibration
        self.chosen = chosen  # how the routes were chosen (timed now, read from the cache, forced)
        self.timed_under_load = False  # the timings are a provisional record's (calibration.provisional)
        wants_helper = Backend.NUMPY_TWO_THREADS in buckets.values()
        self._helper = helper or (HelperThread() if wants_helper else None)

    def helper(self) -> HelperThread:
        """The second thread (started on first use when no backend needed it)."""
        if self._helper is None:
            self._helper = HelperThread()
        return self._helper

    @classmethod
    def fixed(cls, backend: Backend) -> MatmulPolicy:
        native = f32 = None
        if backend is Backend.C_GEMV_TWO_THREADS:
            native = load_int8()
        if backend is Backend.C_GEMM_TWO_THREADS:
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
        probe = cls({b: Backend.NUMPY_TWO_THREADS for b in BUCKETS}, native=native, f32=f32) if split else None

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
                        candidates[Backend.NUMPY_TWO_THREADS] = each(lambda w, x=x: probe.linear(x, w, Backend.NUMPY_TWO_THREADS))
                    if native is not None and b <= NATIVE_MAX_TOKENS:
                        candidates[Backend.C_GEMV_TWO_THREADS] = each(lambda w, x=x: probe.linear(x, w, Backend.C_GEMV_TWO_THREADS))
                    if f32 is not None:
                        candidates[Backend.C_GEMM_TWO_THREADS] = each(lambda w, x=x: probe.linear(x, w, Backend.C_GEMM_TWO_THREADS))
                    # 7 rounds over every layer's weights too: at one token the backends stream at 10-30 % of each
                    # other, and best-of-3 on this shared VM cached f32c2 over native2 once (one fp32 stream 0.73x)
                    buckets[b] = fastest(candidates, rounds=7).value
            return {"buckets": buckets}

        key = ["float", str(weight.dtype), np.__version__, native.path.name if native else "-",
               f32.path.name if f32 else "-", "cold rounds 7"]  # the timing rule too: a choice it made is retimed
        path = cache_dir() / f"matmul-{str(weight.dtype).split('.')[-1]}-{cache_key(key, weights)}.json"
        record, chosen = cached_choice(path, _read_float_record, time_backends, use_cache)
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
        per bucket, each over `timed_weights(weights)` (every layer's gate_up, as many as TIMED_COPY_BYTES allows:
        a real step streams them from memory) up to COLD_TOKENS rows and over the first beyond; the C routes on one thread and on two up to INT8_TIMED_TOKENS
        rows, on two beyond. Then one family is kept for every bucket (so a row gets the same bits alone and in any
        batch): the eligible family whose per-bucket best is closest to the overall best (the sum over buckets of
        log(family best / overall best)), and in each bucket its fastest route. The choice and the times are cached
        per CPU (model and flags), kernel build, mode and weight shapes in the kernels' cache directory, so later
        starts skip the timing (TOKENLOOP_MATMUL_CACHE=off: time at every start). A choice timed while other processes
        used more than LOAD_LIMIT of the CPUs (OthersLoad) is cached as provisional: two threads time slower on a
        busy machine, and such a choice once made a quiet benchmark run one stream on one thread; a later start on a
        quiet machine (quiet_now) times the routes again."""
        weights = timed_weights(weights if isinstance(weights, list) else [weights])
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
        path = cache_dir() / f"matmul-{mode}-{cache_key([mode, kernel.path.name], weights)}.json"
        record, chosen = cached_choice(path, lambda p: read_route_record(p, routes),
                                        lambda: choose_routes(time_routes(routes, weights), routes), use_cache)
        qroutes = {b: (routes[name], split) for b, (name, split) in record["buckets"].items()}
        policy = cls(dict.fromkeys(BUCKETS, Backend.TORCH), int8=int8, int4=int4, qroutes=qroutes,
                     timings=record["times"], chosen=chosen)
        policy.timed_under_load = bool(provisional(record))
        return policy

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
        if backend is Backend.C_GEMV_TWO_THREADS and self.native is not None and w.dtype == torch.float32 and w.is_contiguous():
            x = x.contiguous()
            out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
            self.native.f32_linear2(x, w, out)
            return out
        if backend is Backend.C_GEMM_TWO_THREADS and self.f32 is not None and w.dtype == torch.float32 and w.is_contiguous():
            x = x.contiguous()
            if x.dtype is torch.float32:
                out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
                self.f32.linear2(x, w, out)
                return out
        if backend in (Backend.TORCH, Backend.C_GEMV_TWO_THREADS, Backend.C_GEMM_TWO_THREADS):  # a native backend without its kernel
            return F.linear(x, w)
        x_np = x.contiguous().numpy()
        if backend is Backend.NUMPY_TWO_THREADS and x.shape[0] >= MIN_SPLIT_TOKENS and self._helper is not None:
            return torch.from_numpy(self._helper.matmul(x_np, w.numpy()))
        return torch.from_numpy(np.matmul(x_np, w.numpy().T))

    def row_timing(self, rows: int = COLD_TOKENS) -> tuple[float, float, int, str] | None:
        """The quantized products' calibration times for one row and for `rows` rows (a bucket) on the routes chosen
        for them (seconds over every layer's gate_up), `rows` and the routes' names; None where nothing was timed
        (float weights, a forced route, no C kernel) or the times were taken on a busy machine (a provisional record:
        there one row and four time at the mercy of the other processes, 0.1 or 0.9 of a step a row):
        speculation's row cost (speculation.row_cost_from_times)."""
        if self.timed_under_load:
            return None
        one, several = self.timings.get(1, {}), self.timings.get(rows, {})
        (route1, split1), (route_n, split_n) = self.route(1), self.route(rows)
        name1, name_n = candidate_name(route1.name, split1), candidate_name(route_n.name, split_n)
        if name1 not in one or name_n not in several:
            return None
        what = name1 if name1 == name_n else f"{name1} / {name_n}"
        return one[name1], several[name_n], rows, what

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


def _read_float_record(path) -> dict | None:
    """calibrate's cached record: {"buckets": {bucket: Backend value}, "others_load": share}, or None."""
    try:
        raw = json.loads(path.read_text())
        record = {"buckets": {int(b): Backend(v).value for b, v in raw["buckets"].items()},
                  "others_load": raw.get("others_load")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return record if set(record["buckets"]) == set(BUCKETS) else None


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
