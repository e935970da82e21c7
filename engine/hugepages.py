"""Weights and KV cache on transparent huge pages (docs/engine.md, "Huge pages").

Where the kernel's THP mode is `madvise` (the default of many distributions), torch's allocations get 4 KiB pages,
so streaming ~100 MB of weights per decode step walks ~25 000 pages and misses the TLB on most of them. An `Arena`
is one anonymous mapping, 2 MiB-aligned and madvised MADV_HUGEPAGE before it is first touched (Python's own
`mmap.madvise`, no ctypes), whose bytes back torch tensors: `place` copies a tensor in and returns a view of the
same dtype and shape, each starting on a 4 KiB page. The bits do not change, only where they live.

TOKENLOOP_HUGE_PAGES=off keeps torch's own allocations (read at each load, so tests can switch it). Where huge pages
are unavailable (not Linux, THP `never`) the same calls return torch's tensors unchanged, with a debug log.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import mmap
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
PAGE = mmap.PAGESIZE
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ENV = "TOKENLOOP_HUGE_PAGES"


def thp_mode(path: Path | None = None) -> str | None:
    """The kernel's THP mode, the bracketed word of `always [madvise] never`; None where there is no such file."""
    try:
        text = (path or THP_ENABLED).read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def unavailable_reason() -> str | None:
    """Why tensors stay on torch's pages: TOKENLOOP_HUGE_PAGES=off, no madvise(MADV_HUGEPAGE), THP `never`; None
    where an Arena gets huge pages."""
    if os.environ.get(ENV, "on").strip().lower() in ("off", "0", "false", "no"):
        return f"{ENV}=off"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "madvise(MADV_HUGEPAGE) is unavailable on this platform"
    mode = thp_mode()
    if mode is None:
        return f"{THP_ENABLED} is missing (no transparent huge pages)"
    if mode == "never":
        return "transparent huge pages are disabled (THP mode 'never')"
    return None


def _page_round(nbytes: int) -> int:
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


class Arena:
    """`size` bytes of anonymous memory madvised MADV_HUGEPAGE, from a 2 MiB boundary; tensors are placed in order."""

    def __init__(self, size: int):
        self.size = -(-max(size, 1) // HUGE_PAGE) * HUGE_PAGE
        # private: a shared anonymous mapping is shmem, which THP `shmem_enabled` governs (often `never`)
        self._map = mmap.mmap(-1, self.size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # keeps the mapping alive
        base = self._bytes.data_ptr()
        self._start = (-base) % HUGE_PAGE  # offset of the first 2 MiB boundary
        self._map.madvise(mmap.MADV_HUGEPAGE, self._start, self.size)
        self.buffer = self._bytes[self._start:self._start + self.size]  # the 2 MiB-aligned region
        self.used = 0

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous tensor in the arena, starting on a page boundary."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self.used + nbytes > self.size:
            raise ValueError(f"arena of {self.size} bytes is full: {self.used} used, {nbytes} more wanted")
        out = self.buffer[self.used:self.used + nbytes].view(dtype).view(shape)
        self.used += _page_round(nbytes)
        return out

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` in the arena: same dtype, shape and bits, contiguous."""
        return self.empty(t.shape, t.dtype).copy_(t)


def zeros(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros on huge pages: a fresh Arena, whose anonymous mapping reads as zeros without being written, its
    pages faulted in (huge, after the madvise) as they are first written; torch.zeros itself where huge pages are
    unavailable. Not zeroed at allocation: the KV cache, sized by default to a quarter of free memory, took 15 s of
    the 1.7B shape's start-up to pre-fault (5.2 GiB), and the blocks a server never uses now stay unbacked."""
    arena = arena_for([math.prod(shape) * torch.empty((), dtype=dtype).element_size()])
    if arena is None:
        return torch.zeros(shape, dtype=dtype)
    return arena.empty(shape, dtype)


TRIM_EVERY = 256 << 20  # move_weights hands freed heap memory back after each this many bytes moved


def release_free_memory() -> None:
    """Hand the C heap's free memory back to the kernel (glibc's malloc_trim; nothing elsewhere). A load frees many
    tensors of a few MiB (each layer's float32 or raw file bytes, the originals move_weights copies): under glibc's
    mmap threshold (which grows to 32 MiB as big blocks are freed) they come from the heap, whose freed pages stay
    resident until trimmed (RssAnon 165 MB above the weights after an int4 load of the default model), counted in the
    server's steady and peak RSS."""
    if _malloc_trim:
        _malloc_trim[0](0)


def _find_malloc_trim() -> list:
    """[glibc's malloc_trim], or [] where the C library has none (musl, macOS)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library, already loaded
    except (OSError, AttributeError):
        return []
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return [trim]


_malloc_trim = _find_malloc_trim()


def arena_for(nbytes: list[int]) -> Arena | None:
    """An Arena with room for tensors of these sizes placed one after another (each from a page boundary), or None
    where huge pages are unavailable (the tensors then stay on torch's pages)."""
    reason = unavailable_reason()
    if reason is not None:
        log.debug("huge pages: %s; tensors stay on torch's pages", reason)
        return None
    return Arena(sum(_page_round(n) for n in nbytes))


def huge_bytes(t: torch.Tensor, smaps: Path = Path("/proc/self/smaps")) -> int:
    """AnonHugePages of the mapping that holds `t`'s first byte (/proc/self/smaps): how much of it the kernel backs
    with huge pages; 0 where it is none or there is no smaps."""
    ptr, inside = t.data_ptr(), False
    try:
        lines = smaps.read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's header: start-end perms offset dev inode path
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= ptr < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return 0


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [getattr(value, f.name) for f in dataclasses.fields(value) if isinstance(getattr(value, f.name),
                                                                                      torch.Tensor)]


def move_weights(weights: dict, skip: tuple[str, ...] = ("embed",)) -> dict:
    """Every tensor of `weights` (loader.load_weights: tensors and QWeight / Q4Weight) but those named in `skip`
    copied into one Arena, in dict order (a layer's weights stay together). The entries are replaced in `weights`
    itself, one at a time, so each original can go as soon as its copy is made (a load peaks at the weights plus
    one entry, not twice the weights); returns `weights`. A tensor shared by two names (a tied lm_head is the
    embedding itself) is placed once and stays shared. Unchanged where huge pages are unavailable."""
    shared = {id(weights[name]) for name in weights if name not in skip}
    chosen = [name for name in weights if name not in skip or id(weights[name]) in shared]
    sizes = {id(t): t.numel() * t.element_size() for name in chosen for t in _tensors(weights[name])}
    arena = arena_for(list(sizes.values()))
    if arena is None:
        return weights
    moved: dict[int, torch.Tensor] = {}  # id of an original (all alive at the start: ids unique) -> its copy

    def place(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in moved:
            moved[id(t)] = arena.place(t)
        return moved[id(t)]

    trimmed = 0  # arena bytes used at the last release_free_memory
    for name in chosen:
        value = weights[name]
        weights[name] = place(value) if isinstance(value, torch.Tensor) else dataclasses.replace(
            value, **{f.name: place(getattr(value, f.name)) for f in dataclasses.fields(value)
                      if isinstance(getattr(value, f.name), torch.Tensor)})
        del value
        if arena.used - trimmed >= TRIM_EVERY:  # originals under glibc's mmap threshold were freed on the heap
            release_free_memory()
            trimmed = arena.used
    if log.isEnabledFor(logging.DEBUG):
        log.debug("huge pages: %d weight tensors, %.1f MB, in one arena, %.1f MB of it on huge pages", len(moved),
                  arena.used / 1e6, huge_bytes(arena.buffer) / 1e6)
    return weights
