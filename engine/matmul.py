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
"""

from __future__ import annotations

import enum
import os
import queue
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F

from .kernels import Int4Linear, Int8Linear, name_this_thread
from .quant import Q4Weight, QWeight

BUCKETS = (1, 4, 16, 64, 256, 1024)  # tokens per step at which the backends are compared
MIN_SPLIT_TOKENS = 1
INT8_TIMED_TOKENS = 4  # int8 products of more rows always split over two threads; fewer are timed at start-up


class Backend(enum.Enum):
    """How one step's matrix products run."""

    TORCH = "torch"
    NUMPY = "numpy"
    NUMPY2 = "numpy2"  # numpy, output features split over two threads
    NATIVE2 = "native2"  # the native float32 kernel on two threads (a few tokens per step; int8_linear.c)


NATIVE_MAX_TOKENS = 16  # native2 is a candidate up to this bucket (past it BLAS's blocking wins)
COLD_TOKENS = 4  # buckets up to this many tokens are timed over every layer's weights (memory-bound)

def _fastest(candidates: dict, rounds: int = 7):
    """The key of the fastest callable. Rounds interleave the candidates (A B C A B C ...) and each keeps its
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
    return min(best, key=best.get)


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


class MatmulPolicy:
    """`linear(x, w, backend)` = x @ w.T; `backend(num_tokens)` says how a step multiplies."""

    def __init__(self, buckets: dict[int, Backend], helper: _Helper | None = None, int8: Int8Linear | None = None,
                 int8_split: dict[int, bool] | None = None, native: Int8Linear | None = None,
                 int4: Int4Linear | None = None):
        self.buckets = buckets
        self.int8 = int8  # the native int8 kernel for QWeight products; None: torch (dequantize, then F.linear)
        self.int4 = int4  # the native 4-bit kernel for Q4Weight products; None: torch (dequantize, then F.linear)
        self.native = native or int8  # the native kernels' library, for Backend.NATIVE2 (None: numpy serves)
        # bucket -> split a QWeight's (or Q4Weight's) product's output channels over two threads
        self.int8_split = int8_split or {}
        wants_helper = Backend.NUMPY2 in buckets.values() or any(self.int8_split.values())
        self._helper = helper or (_Helper() if wants_helper else None)

    def helper(self) -> _Helper:
        """The second thread (started on first use when no backend needed it)."""
        if self._helper is None:
            self._helper = _Helper()
        return self._helper

    @classmethod
    def fixed(cls, backend: Backend) -> MatmulPolicy:
        native = None
        if backend is Backend.NATIVE2:
            from .kernels import load_int8
            native = load_int8()
        return cls({b: backend for b in BUCKETS}, native=native)

    @classmethod
    def calibrate(cls, weights: torch.Tensor | list[torch.Tensor], native: Int8Linear | None = None) -> MatmulPolicy:
        """Time each backend for every bucket (numpy and native only for float32/float64; native2 only for float32
        and up to NATIVE_MAX_TOKENS). `weights`: [N, D] matrices of one shape, e.g. every layer's gate_up; buckets
        up to COLD_TOKENS are timed over all of them (a step streams them from memory), larger ones on the first."""
        weights = weights if isinstance(weights, list) else [weights]
        weight = weights[0]
        if weight.dtype not in (torch.float32, torch.float64):
            return cls.fixed(Backend.TORCH)
        split = (os.cpu_count() or 1) >= 2
        native = native if split and weight.dtype == torch.float32 else None
        probe = cls({b: Backend.NUMPY2 for b in BUCKETS}, native=native) if split else None
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
                buckets[b] = _fastest(candidates, rounds=3 if len(over) > 1 else 7)
        return cls(buckets, probe._helper if probe is not None else None, native=native)

    @classmethod
    def calibrate_int8(cls, weights: QWeight | list[QWeight], int8: Int8Linear | None) -> MatmulPolicy:
        """For int8 weights: time the native kernel on one thread against two (output channels halved) per bucket,
        each candidate running over all of `weights` (every layer's: a real step streams them from memory, where
        one matrix alone would sit in the cache and make a second thread look useless)."""
        policy = cls.fixed(Backend.TORCH)
        if int8 is None:
            return policy
        policy.int8 = int8
        if (os.cpu_count() or 1) >= 2:
            policy.int8_split = _time_split(weights, policy._qlinear)
        return policy

    @classmethod
    def calibrate_int4(cls, weights: Q4Weight | list[Q4Weight], int4: Int4Linear | None,
                       int8: Int8Linear | None = None) -> MatmulPolicy:
        """For 4-bit weights: as calibrate_int8, with engine/int4_linear.c on the fastest path this CPU runs; `int8`
        multiplies the int8 lm_head that goes with them."""
        policy = cls.fixed(Backend.TORCH)
        policy.int8 = int8
        if int4 is None:
            return policy
        policy.int4 = int4
        if (os.cpu_count() or 1) >= 2:
            policy.int8_split = _time_split(weights, policy._q4linear)
        return policy

    def _q4linear(self, x: torch.Tensor, w: Q4Weight, split: bool | None = None) -> torch.Tensor:
        """x [T, K] float32 @ 4-bit w [N, K] -> [T, N] float32; split: over two threads (None: as calibrated)."""
        if self.int4 is None:  # fallback: the same product in torch, the weight widened on the fly
            return F.linear(x, w.dequantize().to(x.dtype))
        x = x.contiguous()
        out = torch.empty(x.shape[0], w.num_out, dtype=torch.float32)
        if split is None:
            split = self.int8_split.get(self._bucket(x.shape[0]), False)
        if split:
            self.int4.linear2(x, w, out)
        else:
            self.int4.linear(x, w, out)
        return out

    def _bucket(self, num_tokens: int) -> int:
        for b in BUCKETS:
            if num_tokens <= b:
                return b
        return BUCKETS[-1]

    def backend(self, num_tokens: int) -> Backend:
        return self.buckets[self._bucket(num_tokens)]

    def _qlinear(self, x: torch.Tensor, w: QWeight, split: bool | None = None) -> torch.Tensor:
        """x [T, K] float32 @ int8 w [N, K] -> [T, N] float32; split: over two threads (None: as calibrated)."""
        if self.int8 is None:  # fallback: the same product in torch, the weight widened on the fly
            return F.linear(x, w.dequantize().to(x.dtype))
        x = x.contiguous()
        num_out = w.num_out
        out = torch.empty(x.shape[0], num_out, dtype=torch.float32)
        if split is None:
            split = self.int8_split.get(self._bucket(x.shape[0]), False)
        if split:  # the kernel's own worker thread takes half the channels (no Python hand-over)
            self.int8.linear2(x, w, out)
        else:
            self.int8.linear(x, w, out)
        return out

    def linear(self, x: torch.Tensor, w: torch.Tensor | QWeight, backend: Backend) -> torch.Tensor:
        """x: [T, D_in], w: [D_out, D_in] -> [T, D_out]."""
        if isinstance(w, QWeight):
            return self._qlinear(x, w)
        if isinstance(w, Q4Weight):
            return self._q4linear(x, w)
        if backend is Backend.NATIVE2 and self.native is not None and w.dtype == torch.float32 and w.is_contiguous():
            x = x.contiguous()
            out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
            self.native.f32_linear2(x, w, out)
            return out
        if backend is Backend.TORCH or backend is Backend.NATIVE2:  # NATIVE2 without the kernel: torch serves
            return F.linear(x, w)
        x_np = x.contiguous().numpy()
        if backend is Backend.NUMPY2 and x.shape[0] >= MIN_SPLIT_TOKENS and self._helper is not None:
            return torch.from_numpy(self._helper.matmul(x_np, w.numpy()))
        return torch.from_numpy(np.matmul(x_np, w.numpy().T))

    def describe(self) -> str:
        if self.int4 is not None:
            return f"int4 native kernel ({self.int4.isa}), " + ", ".join(
                f"<={b}: {'2 threads' if self.int8_split.get(b) else '1 thread'}" for b in BUCKETS)
        if self.int8 is not None:
            return "int8 native kernel, " + ", ".join(
                f"<={b}: {'2 threads' if self.int8_split.get(b) else '1 thread'}" for b in BUCKETS)
        return ", ".join(f"<={b}: {backend.value}" for b, backend in self.buckets.items())


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


def _time_split(weights, product) -> dict[int, bool]:
    """Per bucket: whether `product(x, w, split)` over all of `weights` is faster on two threads than on one (timed
    up to INT8_TIMED_TOKENS rows; larger products are milliseconds of arithmetic, which two threads halve)."""
    weights = weights if isinstance(weights, list) else [weights]
    split = {}
    with torch.inference_mode():
        for b in BUCKETS:
            if b > INT8_TIMED_TOKENS:
                split[b] = True
                continue
            x = torch.randn(b, weights[0].shape[1])
            split[b] = _fastest({s: lambda x=x, s=s: [product(x, w, s) for w in weights] for s in (False, True)})
    return split
