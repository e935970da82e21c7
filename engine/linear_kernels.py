"""ctypes bindings of the matrix-product kernels: int8_linear.c and int4_linear.c (QuantKernel: products of
quantized weights with float32 activations) and f32_linear.c (F32Linear: float32 weights). Built and loaded by
kernels.py."""

from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import torch

from .kernel_lib import CodePaths, bind_function, set_spin_us
from .quant import pack_vnni

X16_MAX_GROUP = 512  # int8_linear.c's x16 path: the largest group its int32 sums hold (32767 * 127 * 512 < 2^31)


class QuantKernel(CodePaths):
    """ctypes binding of int8_linear.c or int4_linear.c on one code path (`isa`): the fastest exact one this CPU
    runs unless one is named. PATHS lists every path, `supported()` those this CPU runs, `missing(isa)` why one
    cannot run here. Exact paths (avx2, avx512) give the same bits; vnni quantizes the activations to int8 (its own
    numerics) and multiplies weights it packs on first use (`packings`, one copy per weight)."""

    PATHS = {"portable": 1, "avx2": 2, "avx512": 3, "vnni": 4}
    EXACT = ("portable", "avx2", "avx512")  # float32 activations; avx2 and avx512 give identical bits
    NEEDS = {"avx2": "avx2, fma, f16c", "avx512": "avx512f, avx512bw, avx512vl", "vnni": "avx512_vnni"}
    X22: tuple[str, ...] = ()  # int4's paths with 22-bit integer activations (the same bits on each)
    X16: tuple[str, ...] = ()  # int8's paths with 16-bit integer activations
    PREFIX = ""

    def __init__(self, path: Path, isa: str | None = None):
        self.path = path
        self.lib = lib = ctypes.CDLL(str(path))
        self._path_supported = bind_function(lib, f"{self.PREFIX}_path_supported", [ctypes.c_int])
        set_spin_us(lib)
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        exact = [c_int, ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, i64]  # path, x, M, K, q, scales, G, y, N, n0, n1
        self._linear = bind_function(lib, f"{self.PREFIX}_linear_f32", exact)
        self._linear2 = bind_function(lib, f"{self.PREFIX}_linear_f32_2t", exact + [i64])  # + the split channel
        self._bind(lib)
        isa = isa or [name for name in self.supported() if name in self.EXACT][-1]
        if isa not in self.PATHS or not self.supports(isa):
            raise ValueError(f"{self.PREFIX} kernel path {isa!r} is not available on this CPU (supported: "
                             f"{', '.join(self.supported())})")
        self.isa, self.code = isa, self.PATHS[isa]
        self.packings: dict[int, tuple] = {}  # id(weight) -> (weight, its vnni packing); may be shared (with_isa)

    def _bind(self, lib) -> None:
        """Bind the library's other entry points: `_vnni` and `_vnni2` at least."""
        raise NotImplementedError

    def missing(self, isa: str) -> str:
        """Why this CPU cannot run `isa` ("" when it can)."""
        if self.supports(isa):
            return ""
        if isa not in self.PATHS:
            return f"no {self.PREFIX} kernel path {isa!r} (paths: {', '.join(self.PATHS)})"
        return (f"this CPU ({platform.machine()}) lacks {self.NEEDS.get(isa, isa)} for the {self.PREFIX} {isa} path "
                f"(it runs {', '.join(self.supported())})")

    def with_isa(self, isa: str, packings: dict | None = None):
        """`CodePaths.with_isa`; `packings`: a dict of packed weights to share with other instances (vnni and int4's
        x22 paths read the same layout: quant_routes.quant_routes packs a weight once for all its routes); its own by
        default."""
        other = super().with_isa(isa)
        if packings is not None:
            other.packings = packings
        return other

    def packed(self, w) -> tuple:
        """w's vnni packing, made on first use and kept while w lives here."""
        entry = self.packings.get(id(w))
        if entry is None or entry[0] is not w:
            entry = self.packings[id(w)] = (w, self._pack(w))
        return entry[1]

    def pack_all(self, weights: list, arena=None) -> None:
        """Pack every weight now (not in the first request that needs it), the packed bytes placed in `arena`
        (hugepages.Arena: huge pages, as the weights themselves) when given; each copy replaces the one before. A
        4-bit weight is repacked in place instead (Q4Weight.repack_vnni: its own storage reordered, no second copy),
        so it then serves only the paths that read the vnni packing (the x22 family and vnni)."""
        for w in weights:
            if hasattr(w, "repack_vnni"):
                self.packings[id(w)] = (w, (w.repack_vnni(), w.sm))
                continue
            packing = self.packed(w)
            if arena is not None:
                self.packings[id(w)] = (w, (arena.place(packing[0]), *packing[1:]))

    def linear(self, x: torch.Tensor, w, out: torch.Tensor, begin: int = 0, end: int | None = None) -> None:
        """out[:, begin:end] = x @ w.dequantize().T[:, begin:end]; x [M, K] and out [M, N] float32, contiguous.
        Releases the GIL (ctypes does), so threads can split the N channels."""
        self._run(x, w, out, begin, None, w.num_out if end is None else end)

    def linear2(self, x: torch.Tensor, w, out: torch.Tensor, mid: int | None = None) -> None:
        """`linear` over all channels on two threads: the caller's (channels up to `mid`, default half in whole
        32-channel blocks) and the library's worker (kernel_worker.h, the rest), which spins briefly for the next
        product instead of being woken through Python."""
        self._run(x, w, out, 0, w.num_out // 2 // 32 * 32 if mid is None else mid, w.num_out)

    def _run(self, x, w, out, begin, mid, end) -> None:
        split = mid is not None
        if self.isa == "vnni":
            fn = self._vnni2 if split else self._vnni
            args = (x.data_ptr(), x.shape[0], x.shape[1], *[t.data_ptr() for t in self.packed(w)])
        else:  # the exact entry points with the path's code; an x22 or x16 path multiplies the vnni packing
            fn = self._linear2 if split else self._linear
            operands = self._packed_operands(w) if self.isa in self.X22 + self.X16 else self._operands(w)
            args = (self.code, x.data_ptr(), x.shape[0], x.shape[1], *[t.data_ptr() for t in operands])
        rc = fn(*args, w.group_size, out.data_ptr(), w.num_out, begin, *((mid,) if split else ()), end)
        if rc != 0:
            raise RuntimeError(f"{fn.__name__} failed (code {rc})")


class Int8Linear(QuantKernel):
    """int8_linear.c: products of int8 weights (quant.QWeight), and the float32 one-row product (f32_linear2). Beside
    QuantKernel's paths, x16-avx2 (int8_linear.c's header): activations quantized to 16-bit integers per row and
    group, vpmaddwd on vnni's packing."""

    X16 = ("x16-avx2",)
    PATHS = {**QuantKernel.PATHS, "x16-avx2": 8}
    NEEDS = {**QuantKernel.NEEDS, "x16-avx2": "avx2, fma, f16c"}
    PREFIX = "int8"

    def _bind(self, lib) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        vnni = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64]  # x, M, K, qv, comp, scale, G, y, N, n0, n1
        self._vnni = bind_function(lib, "int8_vnni_linear_f32", vnni)
        self._vnni2 = bind_function(lib, "int8_vnni_linear_f32_2t", vnni + [i64])
        self._f32_linear2 = bind_function(lib, "f32_linear_f32_2t", [ptr, i64, i64, ptr, ptr, i64, i64])

    @staticmethod
    def _operands(w) -> tuple:
        return w.q, w.scale

    def _packed_operands(self, w) -> tuple:
        qv, _, scale = self.packed(w)
        return qv, scale

    @staticmethod
    def x16_takes(w) -> bool:
        """Whether the x16 path multiplies w: groups of a multiple of 4 columns, at most X16_MAX_GROUP (its int32
        sums' bound, int8_linear.c)."""
        return w.group_size % 4 == 0 and w.group_size <= X16_MAX_GROUP

    @staticmethod
    def _pack(w) -> tuple:
        """(qv [N32, K/4, 32, 4] int8, comp [N32, NG, 32] int32 = -128 * each group's sum of weights, scale)."""
        qv = pack_vnni(w.q, 32, w.group_size)
        nb, k, _ = w.q.shape
        comp = w.q.view(nb, k // w.group_size, w.group_size, 32).sum(dim=2, dtype=torch.int32) * -128
        return qv, comp.contiguous(), w.scale

    def f32_linear2(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """out = x @ w.T for float32 x [M, K] (a few rows), w [N, K] and out [M, N], all contiguous, on two threads
        as `linear2` (int8_linear.c's f32_linear_f32: memory-bound one-row products)."""
        num_out = w.shape[0]
        rc = self._f32_linear2(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), out.data_ptr(), num_out,
                               num_out // 2)
        if rc != 0:
            raise RuntimeError(f"f32_linear_f32_2t failed (code {rc})")


class Int4Linear(QuantKernel):
    """int4_linear.c: products of 4-bit weights (quant.Q4Weight). Beside QuantKernel's paths, the x22 ones
    (int4_linear.c's header): activations quantized to 22-bit integers per row and group (three int8 planes),
    integer dot products on vnni's packing; portable C, AVX2 (vpmaddubsw) and AVX-512 VNNI give identical bits."""

    X22 = ("x22-portable", "x22-avx2", "x22-vnni")  # "x22": activations as 22-bit integers (three int8 planes)
    PATHS = {**QuantKernel.PATHS, "x22-portable": 5, "x22-avx2": 6, "x22-vnni": 7}
    NEEDS = {**QuantKernel.NEEDS, "x22-avx2": "avx2, fma, f16c", "x22-vnni": "avx512f, avx512bw, avx512vl, avx512_vnni"}
    PREFIX = "int4"

    def _bind(self, lib) -> None:
        code = self.PATHS["vnni"]  # the same entry points, on the vnni packing
        self._vnni = lambda *a: self._linear(code, *a)
        self._vnni2 = lambda *a: self._linear2(code, *a)
        self._vnni.__name__, self._vnni2.__name__ = "int4_linear_f32", "int4_linear_f32_2t"

    @staticmethod
    def _operands(w) -> tuple:
        return w.plain_q(), w.sm  # a copy where w was repacked for the x22 paths (pack_all): not a serving path

    def _packed_operands(self, w) -> tuple:
        return self.packed(w)

    @staticmethod
    def _pack(w) -> tuple:
        """(qv [N32, K/4, 16, 4] uint8: the nibble bytes of four columns in one lane, sm): vnni's and x22's."""
        if w.q.dim() == 4:  # repacked in place already (pack_all)
            return w.q, w.sm
        return pack_vnni(w.q, 16, w.group_size), w.sm


class F32Linear(CodePaths):
    """ctypes binding of f32_linear.c: y = x @ w.T for float32 weights w [N, K] read in place and x [M, K] of a
    batch of rows (register tiles of channels by rows, x transposed once per call), on one code path (`isa`): the
    fastest this CPU runs unless one is named. avx2 and avx512 give the same bits, and a row's result does not depend
    on its batch or on the thread split."""

    PATHS = {"portable": 1, "avx2": 2, "avx512": 3}

    def __init__(self, path: Path, isa: str | None = None):
        self.path = path
        self.lib = lib = ctypes.CDLL(str(path))
        self._path_supported = bind_function(lib, "f32_path_supported", [ctypes.c_int])
        set_spin_us(lib)
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._gemm = bind_function(lib, "f32_gemm", [c_int, ptr, i64, i64, ptr, ptr, i64, i64, i64])
        self._gemm2 = bind_function(lib, "f32_gemm_2t", [c_int, ptr, i64, i64, ptr, ptr, i64, i64])
        isa = isa or self.supported()[-1]
        if not self.supports(isa):
            raise ValueError(f"f32 kernel path {isa!r} is not available on this CPU (supported: "
                             f"{', '.join(self.supported())})")
        self.isa, self.code = isa, self.PATHS[isa]

    @staticmethod
    def _check(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        if not (x.dtype == w.dtype == out.dtype == torch.float32 and x.is_contiguous() and w.is_contiguous()
                and out.is_contiguous() and x.shape[1] == w.shape[1] and out.shape == (x.shape[0], w.shape[0])):
            raise ValueError(f"f32 product needs contiguous float32 x [M, K], w [N, K], out [M, N]; got "
                             f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(out.shape)}")

    def linear(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, begin: int = 0,
               end: int | None = None) -> None:
        """out[:, begin:end] = (x @ w.T)[:, begin:end] on this thread (releases the GIL, as ctypes does)."""
        self._check(x, w, out)
        end = w.shape[0] if end is None else end
        rc = self._gemm(self.code, x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), out.data_ptr(), w.shape[0],
                        begin, end)
        if rc != 0:
            raise RuntimeError(f"f32_gemm ({self.isa}) failed (code {rc})")

    def linear2(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """out = x @ w.T on two threads: the caller's and the library's worker (kernel_worker.h), each half of the
        output channels; x is transposed once, here."""
        self._check(x, w, out)
        rc = self._gemm2(self.code, x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), out.data_ptr(), w.shape[0],
                         w.shape[0] // 2)
        if rc != 0:
            raise RuntimeError(f"f32_gemm_2t ({self.isa}) failed (code {rc})")
