"""Which library multiplies the weights: torch (MKL / oneDNN) or numpy (OpenBLAS), chosen per step.

On some CPUs torch's float32 matrix-vector product is slower than OpenBLAS's by 2x (see
bench/RESULTS-engine.md). Both read the same memory (`Tensor.numpy()` shares it), so picking the
faster one per batch size costs no weight copy. `auto` times both once at start-up.
numpy's OpenBLAS is kept to one thread (`set_blas_threads(1)`): its worker threads spin between
calls, and next to torch's own OpenMP pool on a small machine that turns a 20 ms step into 700 ms.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

BUCKETS = (1, 4, 16, 64, 256, 1024)  # tokens per step at which the backends are compared


def _time(fn, repeats: int = 5) -> float:
    """Best of `repeats` runs: the least disturbed by whatever else the machine is doing."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class MatmulPolicy:
    """`linear(x, w, use_numpy)` = x @ w.T; `use_numpy(num_tokens)` says which backend a step uses."""

    def __init__(self, numpy_buckets: dict[int, bool]):
        self.numpy_buckets = numpy_buckets  # bucket -> True when numpy is faster there

    @classmethod
    def fixed(cls, use_numpy: bool) -> MatmulPolicy:
        return cls({b: use_numpy for b in BUCKETS})

    @classmethod
    def calibrate(cls, weight: torch.Tensor) -> MatmulPolicy:
        """Time both backends on `weight` [N, D] for every bucket; numpy only for float32/float64."""
        if weight.dtype not in (torch.float32, torch.float64):
            return cls.fixed(False)
        buckets = {}
        w_np = weight.numpy()
        with torch.inference_mode():
            for b in BUCKETS:
                x = torch.randn(b, weight.shape[1], dtype=weight.dtype)
                x_np = x.numpy()
                t_torch = _time(lambda: F.linear(x, weight))
                t_numpy = _time(lambda: np.matmul(x_np, w_np.T))
                buckets[b] = t_numpy < t_torch
        return cls(buckets)

    def use_numpy(self, num_tokens: int) -> bool:
        for b in BUCKETS:
            if num_tokens <= b:
                return self.numpy_buckets[b]
        return self.numpy_buckets[BUCKETS[-1]]

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor, use_numpy: bool) -> torch.Tensor:
        """x: [T, D_in], w: [D_out, D_in] -> [T, D_out]."""
        if use_numpy:
            return torch.from_numpy(np.matmul(x.contiguous().numpy(), w.numpy().T))
        return F.linear(x, w)

    def describe(self) -> str:
        return ", ".join(f"<={b}: {'numpy' if n else 'torch'}" for b, n in self.numpy_buckets.items())


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
