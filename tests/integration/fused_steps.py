"""The tiny engines and the fused-versus-per-operation step of tests/integration/test_fused_decode.py and
test_paged_prefill.py."""

from __future__ import annotations

import pytest
import torch

from tests.integration.scheduled import BLOCK
from tests.tiny_model import make_tiny_model
from tokenloop.engine import kernels
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.quant_routes import ROUTE_ENV

ops, paged = kernels.load_ops(), kernels.load_paged_attention()
needs_kernels = pytest.mark.skipif(ops is None or paged is None or kernels.load_int8() is None
                                   or kernels.load_int4() is None, reason="no C compiler here: the torch path serves")


def engine(tmp_path, weights: str, arch: str = "llama", route: str | None = None) -> Engine:
    """gemma3's local layers attend to the last 8 positions: less than the tests' contexts, over several blocks."""
    checkpoint = make_tiny_model(tmp_path / arch, arch, tied=False, num_layers=3,
                                 sliding_window=8 if arch == "gemma3" else None)
    kernel = kernels.load_int4() if weights == "int4" else kernels.load_int8()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ROUTE_ENV, route or f"{weights}-{kernel.isa}")  # an exact C route, without timing the routes
        return Engine(checkpoint, EngineConfig(weights=weights, kv_cache_tokens=1024, block_size=BLOCK), start=False)


def step_both_ways(model, batch) -> tuple[torch.Tensor, ...]:
    """The fused step's logits and caches, then the per-operation step's from the same cache state."""
    k0, v0 = model.k_cache.clone(), model.v_cache.clone()
    calls = []
    real = model.ops.decode_step

    def counted(*args):
        calls.append(1)
        return real(*args)
    model.ops.decode_step = counted
    try:
        model.fuse_decode = True
        fused = (model.forward(batch), model.k_cache.clone(), model.v_cache.clone())
        assert calls, "the decode step did not take the fused call"
        model.k_cache.copy_(k0), model.v_cache.copy_(v0)
        model.fuse_decode = False
        unfused = (model.forward(batch), model.k_cache.clone(), model.v_cache.clone())
        assert len(calls) == 1
    finally:
        model.fuse_decode = True
        del model.ops.decode_step
    return fused, unfused
