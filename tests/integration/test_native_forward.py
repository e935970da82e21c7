"""The engine's forward pass with the native layer operations (engine/layer_ops.c) against the all-torch forward pass,
on a tiny random-weight checkpoint, for each weight mode. (Each operation alone: tests/unit/test_layer_ops.py.)"""

from __future__ import annotations

import pytest
import torch

from tokenloop.engine import kernels

ops = kernels.load_ops()
needs_kernel = pytest.mark.skipif(ops is None, reason="no C compiler here: the torch path serves")


@needs_kernel
@pytest.mark.parametrize("weights", ["fp32", "int8", "int4"])
def test_forward_with_native_ops_matches_the_torch_forward(tmp_path, weights):
    """The same batches (a prompt chunk, then decodes) through both forward passes: logits agree closely and the
    greedy tokens are equal."""
    from tests.tiny_model import make_tiny_model
    from tokenloop.engine.config import EngineConfig
    from tokenloop.engine.engine import Engine
    from tokenloop.engine.runner import prepare

    checkpoint = make_tiny_model(tmp_path, "llama", tied=False, num_layers=2)
    engine = Engine(checkpoint, EngineConfig(weights=weights, kv_cache_tokens=512), start=False)
    model = engine.model
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
    torch.testing.assert_close(runs[0], runs[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(runs[0].argmax(-1), runs[1].argmax(-1))
