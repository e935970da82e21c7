"""Native kernels, compiled at run time with the system C compiler and loaded with ctypes: building and loading.

`paged_attention.c` holds decode attention that reads the paged KV cache in place and `layer_ops.c` the layer's small
operations and the fused step (their bindings: layer_kernels.py); `int8_linear.c` the matrix products of int8
weights (`--weights int8`) with float32 activations, `int4_linear.c` those of 4-bit weights (`--weights int4`),
both with their code path chosen at run time from the CPU's flags, and `f32_linear.c` float32 products (their
bindings: linear_kernels.py). Each is built once per source, compiler flags and CPU (`-march=native`), into a cache
directory (`$TOKENLOOP_KERNEL_CACHE`, else `$XDG_CACHE_HOME/tokenloop` or `~/.cache/tokenloop`), which takes well
under a second. No torch headers are involved, so no build step at install time.

A machine with no C compiler gets None from the `load_*` functions (logged once) and the engine uses its pure-torch
path: slower, never wrong. Where a compiler exists, a source that fails to build or load raises KernelBuildError
with the compiler's message, at every call: a broken kernel is a bug, never a silent fallback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from tokenloop.core.threads import name_this_thread  # noqa: F401 - the engine's threads name themselves with it

from .layer_kernels import DecodePlan, LayerOps, PagedAttention, StepKernels  # noqa: F401 - what load_* return
from .linear_kernels import F32Linear, Int4Linear, Int8Linear, QuantKernel  # noqa: F401 - what load_* return

log = logging.getLogger(__name__)

PAGED_SOURCE = Path(__file__).with_name("paged_attention.c")
INT8_SOURCE = Path(__file__).with_name("int8_linear.c")
INT4_SOURCE = Path(__file__).with_name("int4_linear.c")
OPS_SOURCE = Path(__file__).with_name("layer_ops.c")
F32_SOURCE = Path(__file__).with_name("f32_linear.c")
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
_loaded: dict[str, PagedAttention | Int8Linear | Int4Linear | LayerOps | F32Linear | KernelBuildError | None] = {}
NO_COMPILER = "no C compiler found (set CC, or install gcc)"


class KernelBuildError(RuntimeError):
    """A kernel source failed to compile, link or load where a C compiler exists; the message has the compiler's."""


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
    dispatched = source.name in (INT8_SOURCE.name, INT4_SOURCE.name, F32_SOURCE.name) and platform.machine() in ("x86_64", "AMD64")
    return DISPATCHED_FLAGS if dispatched else COMPILE_FLAGS


def build(source: Path = PAGED_SOURCE, compile_flags: tuple[str, ...] | None = None) -> Path:
    """Compile `source` into the cache (if not already there), with its own flags (compile_flags_for) unless others
    are given; returns the shared library's path. RuntimeError without a compiler; KernelBuildError, with the
    compiler's message, when the source does not compile or link."""
    cc = compiler()
    if cc is None:
        raise RuntimeError(NO_COMPILER)
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
    log.info("compiling the native kernel %s with %s (once per CPU and source: cached in %s)", source.name, cc,
             target.parent)  # a first start is otherwise silent for seconds
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    except OSError as exc:
        raise KernelBuildError(f"cannot write the kernel cache {target.parent} ({exc.strerror or exc}): set "
                               "TOKENLOOP_KERNEL_CACHE to a writable directory") from exc
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        for cmd in ([cc, *compile_flags, "-c", str(source), "-o", obj], [cc, *LINK_FLAGS, obj, "-o", tmp, *libs, "-lm", "-pthread"]):
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise KernelBuildError(f"{' '.join(cmd)} failed: {result.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders race harmlessly
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


def _load(source: Path, binding, what: str):
    """`binding` over `source`'s library, built once per process: None (logged once) where there is no C compiler;
    KernelBuildError, at every call, where the build or the load failed."""
    key = str(source)
    with _lock:
        if key not in _loaded:
            if compiler() is None:
                log.warning("native %s unavailable, using torch: %s", what, NO_COMPILER)
                _loaded[key] = None
            else:
                try:
                    _loaded[key] = binding(build(source))
                    log.debug("%s kernel: %s", what, _loaded[key].path)
                except Exception as exc:  # noqa: BLE001 - kept, and raised at every call
                    _loaded[key] = KernelBuildError(f"the native {what} kernel ({source.name}) failed to build or "
                                                    f"load with {compiler()}: {type(exc).__name__}: {exc}")
        loaded = _loaded[key]
    if isinstance(loaded, KernelBuildError):
        raise KernelBuildError(str(loaded))
    return loaded


def load_paged_attention() -> PagedAttention | None:
    """The compiled decode-attention kernel (paged_attention.c); None where there is no C compiler."""
    return _load(PAGED_SOURCE, PagedAttention, "paged attention")


def load_ops() -> LayerOps | None:
    """The compiled layer operations (layer_ops.c); None where there is no C compiler."""
    return _load(OPS_SOURCE, LayerOps, "layer ops")


def load_int4() -> Int4Linear | None:
    """The compiled 4-bit matrix-product kernel on the fastest path this CPU runs; None where there is no C
    compiler."""
    return _load(INT4_SOURCE, Int4Linear, "int4 linear")


def load_int8() -> Int8Linear | None:
    """The compiled int8 matrix-product kernel; None where there is no C compiler."""
    return _load(INT8_SOURCE, Int8Linear, "int8 linear")


def load_f32() -> F32Linear | None:
    """The compiled float32 GEMM kernel (f32_linear.c) on the fastest path this CPU runs; None where there is no C
    compiler."""
    return _load(F32_SOURCE, F32Linear, "f32 linear")
