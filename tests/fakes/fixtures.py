"""Helpers for tests of the TensorRT-LLM adapters: the fake package on sys.path, and model dirs."""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from pathlib import Path

FAKES = str(Path(__file__).resolve().parent)


def _forget_trtllm() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@contextlib.contextmanager
def fake_trtllm():
    """Make `import tensorrt_llm` find the fake for the duration; yields the fake module.
    Each use imports it afresh, so knobs a test turns (e.g. `_fake.LEGACY_NAMES`) do not leak."""
    _forget_trtllm()
    sys.path.insert(0, FAKES)
    try:
        import tensorrt_llm
        yield tensorrt_llm
    finally:
        sys.path.remove(FAKES)
        _forget_trtllm()


def make_engine_dir(path: Path, tokenizer_dir: Path, world_size: int = 1) -> Path:
    """A TensorRT engine directory as trtllm-build writes it (config.json + rank*.engine), plus
    the checkpoint's tokenizer and generation_config.json copied next to it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "version": "1.2.0", "pretrained_config": {"architecture": "LlamaForCausalLM",
                                                  "mapping": {"world_size": world_size, "tp_size": world_size}},
        "build_config": {"max_batch_size": 8, "max_seq_len": 256}}))
    for rank in range(world_size):
        (path / f"rank{rank}.engine").write_bytes(b"\0")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path
