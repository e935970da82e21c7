"""A GGUF file (llama.cpp's format): its header read here, refused in one line when we cannot serve it.

The header (metadata and tensor table) is parsed here, with llama.cpp's `gguf` package for the tensor types and
their block sizes: its `GGUFReader` took 11 s for the default model's header on a loaded 2-core machine (a numpy
view per vocabulary string, ~100,000 of them; a 150,000-token vocabulary with its merges would take a minute),
this parser 0.1 s. Nothing here reads a tensor's data (engine/gguf.py reads them one at a time, dequantizing
with `gguf.quants`). Every refusal is a `GGUFError` whose message names the file,
the key or tensor, and what we accept (docs/models.md), so `tokenloop serve` can print it and exit before the port
opens.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# general.architecture -> the Hugging Face architecture it is served as (engine/loader.py's ModelConfig)
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
READ_VERSIONS = (2, 3)
T = GGMLQuantizationType
# tensor types we read, and the smallest weights mode that holds their values without losing precision (`--weights
# auto`, by the layers' element count): 2 to 4 bits -> int4 (Q4_0 / Q4_1 exactly, Q4_K's 32-column blocks nearly),
# 5 to 8 bits -> int8 (Gemma 3 270M's Q5_0 / Q6_K re-quantized to 4 bits kept fp32's 16 greedy tokens on 1 prompt of
# 16, so int4 is no longer the default for such files), 16 and 32 bits -> fp32
TENSOR_MODES = {T.F32: "fp32", T.F16: "fp32", T.BF16: "fp32", T.Q8_0: "int8", T.Q6_K: "int8",
                T.Q5_0: "int8", T.Q5_1: "int8", T.Q5_K: "int8",
                T.Q4_0: "int4", T.Q4_1: "int4", T.Q4_K: "int4", T.Q3_K: "int4", T.Q2_K: "int4"}
TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE, sentencepiece BPE


class GGUFError(ValueError):
    """A GGUF file we cannot serve; the message names the file, the key or tensor, and what we accept."""


def is_gguf(path: str | Path) -> bool:
    """A regular file named *.gguf, or one that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of the file: its name, type, shape as rows x columns (N, K; ggml lists K first), and bytes."""

    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # of its data from the start of the file
    num_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """The metadata (key -> value; arrays as lists) and tensor table of one file."""

    path: Path
    metadata: dict
    tensors: dict[str, TensorInfo]

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def require(self, key: str):
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def arch_key(self, name: str, default=None):
        """`{architecture}.{name}`, e.g. llama.block_count."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def weights_mode(self) -> str:
        """The weights mode closest to the file's own precision (`--weights auto`): that of most of the layers'
        matrix elements."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            if t.name.startswith("blk.") and len(t.shape) == 2:
                mode = TENSOR_MODES[t.kind]
                counts[mode] = counts.get(mode, 0) + t.shape[0] * t.shape[1]
        return max(counts, key=counts.get) if counts else "fp32"


def _check_header(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read ({exc.strerror})") from None
    if len(head) < 8 or head[:4] != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    version = struct.unpack("<I", head[4:])[0]
    if version not in READ_VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version} is unknown; we read versions "
                        f"{', '.join(map(str, READ_VERSIONS))}")


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads the header's little-endian values from a bytes-like buffer."""

    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: str):
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise EOFError("a string runs past the end of the file")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            fmt = _SCALARS[item]
            size = struct.calcsize(fmt)
            if self.pos + size * count > len(self.buf):
                raise EOFError("an array runs past the end of the file")
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
            self.pos += size * count
            return values
        return self.scalar(_SCALARS[kind])


def _parse(p: Path, buf, size: int) -> GGUFFile:
    """The header: metadata, then the tensor table, then (aligned) the tensors' data."""
    cur = _Cursor(buf, 8)
    num_tensors, num_keys = cur.scalar("<Q"), cur.scalar("<Q")
    metadata = {}
    for _ in range(num_keys):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        code, offset = cur.scalar("<I"), cur.scalar("<Q")
        try:
            kind = GGMLQuantizationType(code)
        except ValueError:
            raise GGUFError(f"{p}: tensor {name!r} has tensor type {code}, unknown to llama.cpp's gguf package; we "
                            f"read {', '.join(k.name for k in TENSOR_MODES)}") from None
        infos.append((name, kind, dims, offset))
    align = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // align) * align
    tensors = {}
    for name, kind, dims, offset in infos:
        block, type_size = GGML_QUANT_SIZES[kind]
        num_bytes = math.prod(dims) // block * type_size
        info = TensorInfo(name, kind, tuple(reversed(dims)), data_start + offset, num_bytes)
        if info.offset + num_bytes > size:
            raise GGUFError(f"{p}: tensor {name!r} ends at byte {info.offset + num_bytes} but the file has {size} "
                            "bytes; the file is truncated")
        tensors[name] = info
    return GGUFFile(p, metadata, tensors)


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    p = Path(path)
    _check_header(p)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse(p, buf, size)
        except (EOFError, struct.error, KeyError, ValueError, OverflowError, MemoryError) as exc:
            if isinstance(exc, GGUFError):
                raise
            raise GGUFError(f"{p}: the GGUF header cannot be read ({exc}); the file is truncated or damaged") \
                from None


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensor table (cached per path, size and modification time); raises GGUFError."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as exc:
        raise GGUFError(f"{p}: cannot read ({exc.strerror})") from None
    return _open(str(p.resolve()), st.st_mtime_ns, st.st_size)


def check_servable(path: str | Path) -> GGUFFile:
    """Open the file and refuse what the engine cannot serve: an architecture, a tensor type, a tokenizer model."""
    g = open_gguf(path)
    arch = g.architecture
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{g.path}: architecture {arch!r} (general.architecture) is not one we serve; we serve "
                        f"{', '.join(ARCHITECTURES)}")
    for t in g.tensors.values():
        if t.kind not in TENSOR_MODES:
            raise GGUFError(f"{g.path}: tensor {t.name!r} has type {t.kind.name}, which we do not read; we read "
                            f"{', '.join(k.name for k in TENSOR_MODES)}")
    model = g.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise GGUFError(f"{g.path}: tokenizer.ggml.model {model!r} is not a tokenizer we build; we build "
                        f"{', '.join(TOKENIZER_MODELS)} (byte-level BPE, sentencepiece BPE)")
    if not g.get("tokenizer.ggml.tokens"):
        raise GGUFError(f"{g.path}: metadata key 'tokenizer.ggml.tokens' is missing")
    return g
