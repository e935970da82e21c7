"""Native kernels, compiled at run time with the system C compiler and loaded with ctypes.

`paged_attention.c` holds decode attention that reads the paged KV cache in place; `int8_linear.c` the
matrix products of int8 weights (`--weights int8`) with float32 activations; `int4_linear.c` those of 4-bit
weights (`--weights int4`), both with their code path chosen at run time from the CPU's flags. Each is built once
per source, compiler flags and CPU (`-march=native`), into a cache directory (`$TOKENLOOP_KERNEL_CACHE`,
else `$XDG_CACHE_HOME/tokenloop` or `~/.cache/tokenloop`), which takes well under a second. No C
compiler, or a failed build, means `load()` returns None and the engine uses its pure-torch path:
slower, never wrong. No torch headers are involved, so no build step at install time.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..core.threads import name_this_thread  # noqa: F401 - the engine's threads name themselves with it

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention.c")
INT8_SOURCE = Path(__file__).with_name("int8_linear.c")
INT4_SOURCE = Path(__file__).with_name("int4_linear.c")
OPS_SOURCE = Path(__file__).with_name("layer_ops.c")
# -ffast-math lets the dot products and exp vectorise. It is given to the compile step only: linked with it,
# the library would pull in crtfastmath.o, which switches the whole process to flush-denormals-to-zero on
# load (torch's and Python's arithmetic included).
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fPIC", "-std=c11")
# int8_linear.c and int4_linear.c pick their code path at run time from the CPU's flags (each path under its own
# target attribute, kernel_common.h), so on x86-64 they are built for the baseline ISA: the portable path then runs
# on any x86-64, and the avx2 path cannot pick up AVX-512 instructions from -march=native.
DISPATCHED_FLAGS = ("-O3", "-mtune=native", "-ffast-math", "-fPIC", "-std=c11")
LINK_FLAGS = ("-shared",)
FLAGS = COMPILE_FLAGS + LINK_FLAGS
# the process's one kernel worker thread (kernel_worker.c): every library that includes kernel_worker.h links it
WORKER_SOURCE = Path(__file__).with_name("kernel_worker.c")
WORKER_FLAGS = ("-O2", "-fPIC", "-std=c11", "-pthread")
_lock = threading.Lock()
_loaded: dict[str, PagedAttention | Int8Linear | Int4Linear | LayerOps | None] = {}


def cpu_id() -> str:
    """What -march=native depends on: the CPU model and its flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines))


def cache_dir() -> Path:
    if os.environ.get("TOKENLOOP_KERNEL_CACHE"):
        return Path(os.environ["TOKENLOOP_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tokenloop"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def compile_flags_for(source: Path) -> tuple[str, ...]:
    if source.name == WORKER_SOURCE.name:
        return WORKER_FLAGS
    dispatched = source.name in (INT8_SOURCE.name, INT4_SOURCE.name, "f32_linear.c") and platform.machine() in ("x86_64", "AMD64")
    return DISPATCHED_FLAGS if dispatched else COMPILE_FLAGS


def build(source: Path = SOURCE, compile_flags: tuple[str, ...] | None = None) -> Path:
    """Compile `source` into the cache (if not already there), with its own flags (compile_flags_for) unless others
    are given; returns the shared library's path."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    text = source.read_bytes()
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the source may #include
    compile_flags = compile_flags_for(source) if compile_flags is None else tuple(compile_flags)
    # linked by path (no soname): the library loads the worker library from where it was built, so the path is
    # part of the digest; sources without kernel_worker.c beside them (an older tree, for an A/B) carry their own
    worker = source.parent / WORKER_SOURCE.name
    needs = worker.is_file() and source.name != worker.name and b'#include "kernel_worker.h"' in text
    libs = [str(build(worker))] if needs else []
    digest = hashlib.sha256(b"\0".join([text, *headers, " ".join(compile_flags + LINK_FLAGS).encode(),
                                        cc.encode(), *(lib.encode() for lib in libs),
                                        platform.machine().encode(), cpu_id().encode()])).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{digest}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        for cmd in ([cc, *compile_flags, "-c", str(source), "-o", obj], [cc, *LINK_FLAGS, obj, "-o", tmp, *libs, "-lm", "-pthread"]):
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders race harmlessly
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


SPIN_ENV = "TOKENLOOP_SPIN_US"


def set_spin_us(lib, spin_us: int | None = None) -> None:
    """Set the kernel worker's spin (kernel_worker.c: how long the process's one worker spins for its next job
    before it sleeps), in microseconds: `spin_us`, else TOKENLOOP_SPIN_US, else 200. `lib` is any library that links
    the worker."""
    fn = lib.tl_set_spin_us
    fn.argtypes, fn.restype = [ctypes.c_int64], None
    fn(int(os.environ.get(SPIN_ENV, "200")) if spin_us is None else spin_us)


class _CodePaths:
    """What every binding of a library with code paths shares: PATHS (name -> the C code), `_path_supported(code)`
    (the library's answer, set by the binding), `supports(isa)` and `supported()` (those this CPU runs)."""

    PATHS: dict[str, int] = {}
    _path_supported = None

    def supports(self, isa: str) -> bool:
        return isa in self.PATHS and bool(self._path_supported(self.PATHS[isa]))

    def supported(self) -> list[str]:
        return [name for name in self.PATHS if self.supports(name)]

    def with_isa(self, isa: str):
        """The same library running another code path (tests, benchmarks and the calibration force each one)."""
        return type(self)(self.path, isa)


class PagedAttention(_CodePaths):
    """ctypes binding of paged_attention.c. `isa` is the code path it runs: the fastest this CPU has
    (paged_best_path) unless one is named; PATHS lists them all, `supported()` those this CPU runs."""

    PATHS = {"portable": 1, "avx2": 2, "avx512": 3}

    def __init__(self, path: Path, isa: str | None = None):
        self.path = path
        self._lib = lib = ctypes.CDLL(str(path))
        self._path_supported = _function(lib, "paged_path_supported", [ctypes.c_int])
        lib.paged_best_path.restype = ctypes.c_int
        self._decode = lib.paged_decode_heads_f32_path
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._decode.argtypes = [ctypes.c_int, ptr, ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64,
                                 ctypes.c_float, i64, i64]
        self._decode.restype = ctypes.c_int
        if isa is None:
            isa = next(name for name, code in self.PATHS.items() if code == lib.paged_best_path())
        if not self.supports(isa):
            raise ValueError(f"paged attention path {isa!r} is not available on this CPU (supported: "
                             f"{', '.join(self.supported())})")
        self.isa = isa
        self._code = self.PATHS[isa]

    def decode(self, q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               tables: torch.Tensor, lens: torch.Tensor, begin: int, end: int, block_size: int,
               scale: float, kv_heads: tuple[int, int] | None = None) -> None:
        """Attention of float32 decode queries q [B, H, E] over their cached context into out [B, H, E] (rows
        begin..end-1 only; with `kv_heads` (first, end), only those kv heads' query heads). k_cache, v_cache:
        [slots, K, E] of one layer; tables [B, NB], lens [B] int64. Releases the GIL while it runs (ctypes does), so
        two threads can split one batch."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        first, last = kv_heads or (0, k_cache.shape[1])
        rc = self._decode(self._code, q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          tables.data_ptr(), tables.shape[1], lens.data_ptr(), begin, end, num_heads,
                          k_cache.shape[1], head_dim, block_size, scale, first, last)
        if rc != 0:
            raise RuntimeError(f"paged_decode_f32 ({self.isa}) failed (code {rc})")


def _function(lib, name: str, argtypes: list):
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def _pack_vnni(q: torch.Tensor, lanes: int, group_size: int) -> torch.Tensor:
    """[N32, K, lanes] bytes (a block's channels at each column) -> [N32, K/4, lanes, 4]: four columns of a channel
    in one 32-bit lane, what vpdpbusd multiplies (int8_linear.c / int4_linear.c, path vnni)."""
    nb, k, _ = q.shape
    if group_size % 4:
        raise ValueError(f"the vnni path needs groups of a multiple of 4 columns, not {group_size}")
    return q.view(nb, k // 4, 4, lanes).permute(0, 1, 3, 2).contiguous()


class QuantKernel(_CodePaths):
    """ctypes binding of int8_linear.c or int4_linear.c on one code path (`isa`): the fastest exact one this CPU
    runs unless one is named. PATHS lists every path, `supported()` those this CPU runs, `missing(isa)` why one
    cannot run here. Exact paths (avx2, avx512) give the same bits; vnni quantizes the activations to int8 (its own
    numerics) and multiplies weights it packs on first use (`packings`, one copy per weight)."""

    PATHS = {"portable": 1, "avx2": 2, "avx512": 3, "vnni": 4}
    EXACT = ("portable", "avx2", "avx512")  # float32 activations; avx2 and avx512 give identical bits
    NEEDS = {"avx2": "avx2, fma, f16c", "avx512": "avx512f, avx512bw, avx512vl", "vnni": "avx512_vnni"}
    X22: tuple[str, ...] = ()  # int4's paths with 22-bit integer activations (the same bits on each)
    PREFIX = ""

    def __init__(self, path: Path, isa: str | None = None):
        self.path = path
        self._lib = lib = ctypes.CDLL(str(path))
        self._path_supported = _function(lib, f"{self.PREFIX}_path_supported", [ctypes.c_int])
        set_spin_us(lib)
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        exact = [c_int, ptr, i64, i64, ptr, ptr, i64, ptr, i64, i64, i64]  # path, x, M, K, q, scales, G, y, N, n0, n1
        self._linear = _function(lib, f"{self.PREFIX}_linear_f32", exact)
        self._linear2 = _function(lib, f"{self.PREFIX}_linear_f32_2t", exact + [i64])  # + the split channel
        self._bind(lib)
        isa = isa or [name for name in self.supported() if name in self.EXACT][-1]
        if isa not in self.PATHS or not self.supports(isa):
            raise ValueError(f"{self.PREFIX} kernel path {isa!r} is not available on this CPU (supported: "
                             f"{', '.join(self.supported())})")
        self.isa, self._code = isa, self.PATHS[isa]
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
        """`_CodePaths.with_isa`; `packings`: a dict of packed weights to share with other instances (vnni and int4's
        x22 paths read the same layout: matmul.quant_routes packs a weight once for all its routes); its own by
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
        (hugepages.Arena: huge pages, as the weights themselves) when given; each copy replaces the one before."""
        for w in weights:
            packing = self.packed(w)
            if arena is not None:
                self.packings[id(w)] = (w, (arena.place(packing[0]), *packing[1:]))

    def linear(self, x: torch.Tensor, w, out: torch.Tensor, begin: int = 0, end: int | None = None) -> None:
        """out[:, begin:end] = x @ w.dequantize().T[:, begin:end]; x [M, K] and out [M, N] float32, contiguous.
        Releases the GIL (ctypes does), so threads can split the N channels."""
        self._run(x, w, out, begin, None, w.num_out if end is None else end)

    def linear2(self, x: torch.Tensor, w, out: torch.Tensor) -> None:
        """`linear` over all channels on two threads: the caller's and the library's worker (kernel_worker.h),
        which spins briefly for the next product instead of being woken through Python."""
        self._run(x, w, out, 0, w.num_out // 2 // 32 * 32, w.num_out)  # keep the 32-channel blocks whole

    def _run(self, x, w, out, begin, mid, end) -> None:
        split = mid is not None
        if self.isa == "vnni":
            fn = self._vnni2 if split else self._vnni
            args = (x.data_ptr(), x.shape[0], x.shape[1], *[t.data_ptr() for t in self.packed(w)])
        else:  # the exact entry points with the path's code; an x22 path multiplies the vnni packing
            fn = self._linear2 if split else self._linear
            operands = self.packed(w) if self.isa in self.X22 else self._operands(w)
            args = (self._code, x.data_ptr(), x.shape[0], x.shape[1], *[t.data_ptr() for t in operands])
        rc = fn(*args, w.group_size, out.data_ptr(), w.num_out, begin, *((mid,) if split else ()), end)
        if rc != 0:
            raise RuntimeError(f"{fn.__name__} failed (code {rc})")


class Int8Linear(QuantKernel):
    """int8_linear.c: products of int8 weights (quant.QWeight), and the float32 one-row product (f32_linear2)."""

    PREFIX = "int8"

    def _bind(self, lib) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        vnni = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64, i64, i64]  # x, M, K, qv, comp, scale, G, y, N, n0, n1
        self._vnni = _function(lib, "int8_vnni_linear_f32", vnni)
        self._vnni2 = _function(lib, "int8_vnni_linear_f32_2t", vnni + [i64])
        self._f32_linear2 = _function(lib, "f32_linear_f32_2t", [ptr, i64, i64, ptr, ptr, i64, i64])

    @staticmethod
    def _operands(w) -> tuple:
        return w.q, w.scale

    @staticmethod
    def _pack(w) -> tuple:
        """(qv [N32, K/4, 32, 4] int8, comp [N32, NG, 32] int32 = -128 * each group's sum of weights, scale)."""
        qv = _pack_vnni(w.q, 32, w.group_size)
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

    X22 = ("x22-portable", "x22-avx2", "x22-vnni")
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
        return w.q, w.sm

    @staticmethod
    def _pack(w) -> tuple:
        """(qv [N32, K/4, 16, 4] uint8: the nibble bytes of four columns in one lane, sm): vnni's and x22's."""
        return _pack_vnni(w.q, 16, w.group_size), w.sm


class LayerOps:
    """ctypes binding of layer_ops.c: RMSNorm (+ residual), rotary embedding + K/V cache write, SiLU * up."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self._norm = lib.add_rms_norm_f32
        self._norm.argtypes = [ptr, ptr, ptr, f32, ptr, i64, i64]
        self._norm.restype = None
        self._rope = lib.rope_store_f32
        self._rope.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr]
        self._rope.restype = ctypes.c_int
        self._silu = lib.silu_mul_f32
        self._silu.argtypes = [ptr, ptr, i64, i64]
        self._silu.restype = None
        self._step = lib.decode_step_f32
        self._step.argtypes = [ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr]
        self._step.restype = ctypes.c_int
        set_spin_us(lib)

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, D] += delta (in place, when given); out [T, D] = RMSNorm(h) * weight (a new tensor when out is
        None), returned. All float32, contiguous."""
        out = torch.empty_like(h) if out is None else out
        self._norm(h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps, out.data_ptr(),
                   h.shape[0], h.shape[1])
        return out

    def rope_store(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, q_out: torch.Tensor | None = None) -> None:
        """Rotate the query and key heads of qkv [T, (H+2K)*E] (rows contiguous) in place; write K and V to the
        caches [S, K, E] at `slots` [T] int64, and the rotated queries to q_out [T, H*E] (contiguous) when given.
        cos, sin: [max_context, E] tables; positions [T] int64."""
        rc = self._rope(qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_heads, num_kv_heads, head_dim,
                        cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
                        v_cache.data_ptr(), None if q_out is None else q_out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"rope_store_f32 failed (code {rc})")

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:] (a new tensor when out is None), returned; gate_up
        [T, 2I] contiguous."""
        out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2) if out is None else out
        self._silu(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], out.shape[1])
        return out

    def decode_plan(self, layers: list, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float,
                    block_size: int, int4_operands=None) -> DecodePlan | None:
        """The plan of `decode_step` for a model's layers (model.LayerWeights), or None when a layer's weights are
        not all int8 / int4 (quant.QWeight / Q4Weight): float weights keep the per-operation path.
        `int4_operands(w)`: the (q, sm) tensors the int4 products read, when the route's path multiplies another
        layout than w.q (the x22 paths: Int4Linear.packed); w's own by default."""
        return DecodePlan.build(self, layers, k_cache, v_cache, cos, sin, num_heads, num_kv_heads, head_dim, eps,
                                scale, block_size, int4_operands)

    def decode_step(self, plan: DecodePlan, step: StepKernels, h: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, groups: list) -> None:
        """Every layer of a step in one call (layer_ops.c, decode_step_f32): h [T, D] (the embeddings) is
        updated in place to the last layer's output, the K/V of the step's tokens written to the caches. positions,
        slots [T] int64; groups: model.AttentionGroup with max_q 1 and lens (int64, contiguous tables)."""
        num_tokens = h.shape[0]
        descs = (_DGroup * len(groups))(*[
            _DGroup(g.kv_blocks.data_ptr(), g.kv_blocks.shape[1], g.lens.data_ptr(), g.out_start, g.num_seqs, g.split)
            for g in groups])
        scratch = plan.scratch(num_tokens)
        rc = self._step(ctypes.byref(plan.model), ctypes.byref(step.desc), h.data_ptr(), num_tokens,
                        positions.data_ptr(), slots.data_ptr(), descs, len(groups), scratch.data_ptr(), plan.where)
        if rc != 0:
            layer, stage = plan.where[0], plan.where[1]
            raise RuntimeError(f"decode_step_f32 failed in layer {layer} at "
                               f"{DecodePlan.STAGES.get(stage, stage)} (code {rc})")


class _DWeight(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("q", ctypes.c_void_p), ("s", ctypes.c_void_p), ("N", ctypes.c_int64),
                ("K", ctypes.c_int64), ("G", ctypes.c_int64)]


class _DLayer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv_bias", ctypes.c_void_p),
                ("qkv", _DWeight), ("o", _DWeight), ("gate_up", _DWeight), ("down", _DWeight),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _DModel(ctypes.Structure):
    _fields_ = [*((name, ctypes.c_int64) for name in ("num_layers", "D", "H", "KV", "E", "I", "block_size")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cos", ctypes.c_void_p),
                ("sin", ctypes.c_void_p), ("layers", ctypes.POINTER(_DLayer))]


class _DKernels(ctypes.Structure):
    _fields_ = [("linear", ctypes.c_void_p * 2), ("linear2", ctypes.c_void_p * 2), ("path", ctypes.c_int64 * 2),
                ("split", ctypes.c_int64), ("paged", ctypes.c_void_p), ("paged_path", ctypes.c_int64),
                ("split_attention", ctypes.c_int64)]


class _DGroup(ctypes.Structure):
    _fields_ = [("tables", ctypes.c_void_p), ("max_blocks", ctypes.c_int64), ("lens", ctypes.c_void_p),
                ("out_start", ctypes.c_int64), ("num_seqs", ctypes.c_int64), ("split", ctypes.c_int64)]


def _address(lib, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


class StepKernels:
    """What one fused decode step multiplies and attends with: the int8 / int4 libraries' product entry points (the
    C functions QuantRoute.product calls, by address) on the route's code paths, whether products split over two
    threads, and the paged-attention entry point and path. Built once per (route, split) and kept."""

    KINDS = {"QWeight": 0, "Q4Weight": 1}

    def __init__(self, int8: QuantKernel | None, int4: QuantKernel | None, split: bool, paged: PagedAttention,
                 split_attention: bool):
        self.desc = desc = _DKernels()
        for kind, kernel in enumerate((int8, int4)):
            if kernel is not None:
                prefix = kernel.PREFIX
                desc.linear[kind] = _address(kernel._lib, f"{prefix}_linear_f32")
                desc.linear2[kind] = _address(kernel._lib, f"{prefix}_linear_f32_2t")
                desc.path[kind] = kernel._code
        desc.split, desc.split_attention = int(split), int(split_attention)
        desc.paged, desc.paged_path = _address(paged._lib, "paged_decode_heads_f32_path"), paged._code
        self.plan: DecodePlan | None = None  # the plan over the weight layout these paths read (model.py sets it)


class DecodePlan:
    """The per-weight pointers of decode_step_f32, built once at model load (the tensors are kept alive here), and
    its scratch buffer, grown to the largest step seen and reused."""

    STAGES = {1: "qkv", 2: "rope_store", 3: "attention", 4: "o", 5: "gate_up", 6: "down", 7: "arguments"}

    def __init__(self, model: _DModel, layers, keep: list, kinds: set[int], per_token: int):
        self.model, self._layers, self._keep, self.kinds, self._per_token = model, layers, keep, kinds, per_token
        self.where = (ctypes.c_int64 * 2)()
        self._scratch = torch.empty(0)

    @classmethod
    def build(cls, ops: LayerOps, layers: list, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float,
              block_size: int, int4_operands=None) -> DecodePlan | None:
        keep: list = [k_cache, v_cache, cos, sin]
        kinds: set[int] = set()

        def weight(w) -> _DWeight | None:
            kind = StepKernels.KINDS.get(type(w).__name__)
            if kind is None:
                return None
            kinds.add(kind)
            q, s = (w.q, w.scale) if kind == 0 else int4_operands(w) if int4_operands else (w.q, w.sm)
            keep.extend((q, s))
            return _DWeight(kind, q.data_ptr(), s.data_ptr(), w.num_out, w.q.shape[1], w.group_size)

        tensors = [k_cache, v_cache, cos, sin] + [t for w in layers for t in (w.input_norm, w.post_norm, w.qkv_bias)
                                                  if t is not None]
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            return None
        descs = (_DLayer * len(layers))()
        for i, w in enumerate(layers):
            products = [weight(p) for p in (w.qkv, w.o, w.gate_up, w.down)]
            if any(p is None for p in products):
                return None
            bias = w.qkv_bias
            descs[i] = _DLayer(w.input_norm.data_ptr(), w.post_norm.data_ptr(),
                               bias.data_ptr() if bias is not None else None, *products, k_cache[i].data_ptr(),
                               v_cache[i].data_ptr())
            keep.extend(t for t in (w.input_norm, w.post_norm, bias) if t is not None)
        first = layers[0]
        dim, inter = first.o.num_out, first.down.q.shape[1]
        qkv_size, q_size = (num_heads + 2 * num_kv_heads) * head_dim, num_heads * head_dim
        shapes = {(qkv_size, dim), (dim, q_size), (2 * inter, dim), (dim, inter)}
        if any({tuple(p.shape) for p in (w.qkv, w.o, w.gate_up, w.down)} != shapes for w in layers):
            return None
        model = _DModel(len(layers), dim, num_heads, num_kv_heads, head_dim, inter, block_size, eps, scale,
                        cos.data_ptr(), sin.data_ptr(), descs)
        per_token = 3 * dim + qkv_size + 2 * q_size + 3 * inter
        return cls(model, descs, keep, kinds, per_token)

    def scratch(self, num_tokens: int) -> torch.Tensor:
        """At least num_tokens * per-token floats (decode_step_f32's x, qkv, q, attn, o, gate_up, act, down)."""
        need = num_tokens * self._per_token
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        return self._scratch


def _load(source: Path, binding, what: str):
    key = str(source)
    with _lock:
        if key not in _loaded:
            try:
                _loaded[key] = binding(build(source))
                log.debug("%s kernel: %s", what, _loaded[key].path)
            except Exception as exc:  # noqa: BLE001 - the torch path serves instead
                log.warning("native %s unavailable, using torch: %s", what, exc)
                _loaded[key] = None
        return _loaded[key]


def load() -> PagedAttention | None:
    """The compiled decode-attention kernel, or None (logged once) when it cannot be built here."""
    return _load(SOURCE, PagedAttention, "paged attention")


def load_ops() -> LayerOps | None:
    """The compiled layer operations (layer_ops.c), or None (logged once) when they cannot be built here."""
    return _load(OPS_SOURCE, LayerOps, "layer ops")


def load_int4() -> Int4Linear | None:
    """The compiled 4-bit matrix-product kernel on the fastest path this CPU runs, or None (logged once) when it
    cannot be built here."""
    return _load(INT4_SOURCE, Int4Linear, "int4 linear")


def load_int8() -> Int8Linear | None:
    """The compiled int8 matrix-product kernel, or None (logged once) when it cannot be built here."""
    return _load(INT8_SOURCE, Int8Linear, "int8 linear")


F32_SOURCE = Path(__file__).with_name("f32_linear.c")


class F32Linear(_CodePaths):
    """ctypes binding of f32_linear.c: y = x @ w.T for float32 weights w [N, K] read in place and x [M, K] of a
    batch of rows (register tiles of channels by rows, x transposed once per call), on one code path (`isa`): the
    fastest this CPU runs unless one is named. avx2 and avx512 give the same bits, and a row's result does not depend
    on its batch or on the thread split."""

    PATHS = {"portable": 1, "avx2": 2, "avx512": 3}

    def __init__(self, path: Path, isa: str | None = None):
        self.path = path
        self._lib = lib = ctypes.CDLL(str(path))
        self._path_supported = _function(lib, "f32_path_supported", [ctypes.c_int])
        set_spin_us(lib)
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        self._gemm = _function(lib, "f32_gemm", [c_int, ptr, i64, i64, ptr, ptr, i64, i64, i64])
        self._gemm2 = _function(lib, "f32_gemm_2t", [c_int, ptr, i64, i64, ptr, ptr, i64, i64])
        isa = isa or self.supported()[-1]
        if not self.supports(isa):
            raise ValueError(f"f32 kernel path {isa!r} is not available on this CPU (supported: "
                             f"{', '.join(self.supported())})")
        self.isa, self._code = isa, self.PATHS[isa]

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
        rc = self._gemm(self._code, x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), out.data_ptr(), w.shape[0],
                        begin, end)
        if rc != 0:
            raise RuntimeError(f"f32_gemm ({self.isa}) failed (code {rc})")

    def linear2(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """out = x @ w.T on two threads: the caller's and the library's worker (kernel_worker.h), each half of the
        output channels; x is transposed once, here."""
        self._check(x, w, out)
        rc = self._gemm2(self._code, x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), out.data_ptr(), w.shape[0],
                         w.shape[0] // 2)
        if rc != 0:
            raise RuntimeError(f"f32_gemm_2t ({self.isa}) failed (code {rc})")


def load_f32() -> F32Linear | None:
    """The compiled float32 GEMM kernel (f32_linear.c) on the fastest path this CPU runs, or None (logged once) when
    it cannot be built here."""
    return _load(F32_SOURCE, F32Linear, "f32 linear")
