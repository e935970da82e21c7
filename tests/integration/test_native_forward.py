"""The engine's forward pass with the native layer operations (engine/layer_ops.c) against the all-torch forward pass,
on a tiny random-weight checkpoint, for each weight mode. (Each operation alone: tests/unit/test_layer_ops.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import exact_route
from tokenloop.engine import kernels
from tokenloop.engine.quant_routes import ROUTE_ENV

ops = kernels.load_ops()
needs_kernel = pytest.mark.skipif(ops is None, reason="no C compiler here: the torch path serves")


@needs_kernel
@pytest.mark.parametrize("weights, kv", [("fp32", "fp32"), ("int8", "fp32"), ("int4", "fp32"), ("int8", "fp16"),
                                        ("int4", "fp16")])
def test_forward_with_native_ops_matches_the_torch_forward(tmp_path, weights, kv, monkeypatch):
    """The same batches (a prompt chunk, then decodes) through both forward passes: logits agree closely and the
    greedy tokens are equal. With the 16-bit KV cache, a K or V value that the two rotations (equal to float32
    rounding) put on either side of a float16 rounding boundary is stored one float16 step apart, so the logits agree
    to that step's effect, not float32's. The products run on the mode's exact route: a +h16 route's lm_head
    quantizes the final rows to 16-bit integers, where float32 rounding differences between the two passes can
    move a value one step (its own contract: docs/engine.md), which is not what this test compares."""
    from tests.tiny_model import make_tiny_model
    from tokenloop.engine.config import EngineConfig
    from tokenloop.engine.engine import Engine
    from tokenloop.engine.runner import prepare

    if weights != "fp32":
        monkeypatch.setenv(ROUTE_ENV, exact_route(weights))
    checkpoint = make_tiny_model(tmp_path, "llama", tied=False, num_layers=2)
    engine = Engine(checkpoint, EngineConfig(weights=weights, kv_cache_tokens=512, kv_dtype=kv), start=False)
    model = engine.model
    assert model.k_cache.dtype == (torch.float16 if kv == "fp16" else torch.float32)
    assert model.ops is not None

    class Seq:  # what runner.prepare reads
        lora = embed = None
        draft: list[int] = []

        def __init__(self, tokens, computed):
            self.token_ids, self.num_computed_tokens, self.block_table = tokens, computed, list(range(1, 9))

    tokens = list(range(3, 40))
    runs = []
    for use_ops in (True, False):
        model.ops = ops if use_ops else None
        logits = []
        for computed, n in ((0, 30), (30, 1), (31, 1), (32, 5)):
            batch, _ = prepare([(Seq(tokens[:computed + n], computed), n)], engine.config.block_size)
            logits.append(model.forward(batch))
        runs.append(torch.cat(logits))
    tolerance = 1e-2 if kv == "fp16" else 1e-4
    torch.testing.assert_close(runs[0], runs[1], rtol=tolerance, atol=tolerance)
    assert torch.equal(runs[0].argmax(-1), runs[1].argmax(-1))
