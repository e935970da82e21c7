"""An engine whose decode-attention kernel does not compile does not start (attention_backend auto used to fall back
to torch attention silently): KernelBuildError, with the compiler's message. The kernel alone:
tests/unit/test_kernel_build.py."""

from __future__ import annotations

import pytest

from tests.tiny_model import make_tiny_model
from tokenloop.engine import kernels
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine


@pytest.mark.skipif(kernels.compiler() is None, reason=f"this machine has no C compiler ({kernels.NO_COMPILER})")
def test_the_engine_does_not_start_on_a_kernel_that_does_not_compile(tmp_path, monkeypatch):
    broken = tmp_path / "src" / "paged_attention.c"
    broken.parent.mkdir()
    broken.write_text("int paged_path_supported(int path) { return path }\n")  # no ';'
    monkeypatch.setenv("TOKENLOOP_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "PAGED_SOURCE", broken)
    checkpoint = make_tiny_model(tmp_path / "model", "llama", num_layers=1)
    with pytest.raises(kernels.KernelBuildError, match="paged_attention.c.*error"):
        Engine(checkpoint, EngineConfig(kv_cache_tokens=256, attention_backend="auto"), start=False)
