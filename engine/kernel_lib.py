"""What the ctypes bindings of the native kernels share (linear_kernels.py, layer_kernels.py): the code-path
choice, typed entry points, entry-point addresses and the kernel worker's spin."""

from __future__ import annotations

import ctypes
import os

SPIN_ENV = "TOKENLOOP_SPIN_US"


def set_spin_us(lib, spin_us: int | None = None) -> None:
    """Set the kernel worker's spin (kernel_worker.c: how long the process's one worker spins for its next job
    before it sleeps), in microseconds: `spin_us`, else TOKENLOOP_SPIN_US, else 200. `lib` is any library that links
    the worker."""
    fn = lib.tl_set_spin_us
    fn.argtypes, fn.restype = [ctypes.c_int64], None
    fn(int(os.environ.get(SPIN_ENV, "200")) if spin_us is None else spin_us)


class CodePaths:
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


def bind_function(lib, name: str, argtypes: list):
    """Entry point `name` of `lib`, typed: `argtypes`, returning a C int (0: success)."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def address(lib, name: str) -> int:
    """The address of entry point `name` of `lib` (what the fused step calls through a function pointer)."""
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
