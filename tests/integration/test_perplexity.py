"""engine/perplexity.py (the weights-quality tool) on a tiny random-weight checkpoint: its windows' prefill logits
through the engine's forward give transformers' perplexity of the same windows. (On the default model, per weight
mode: tests/e2e/test_weights_quality.py.)"""

from __future__ import annotations

import math

import torch

from tests.tiny_model import make_tiny_model
from tokenloop.engine.perplexity import load_engine, perplexity


def test_perplexity_equals_transformers_over_the_same_windows(tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoint = make_tiny_model(tmp_path, "llama", tied=False, num_layers=2)
    ids = torch.randint(3, 384, (45,), generator=torch.Generator().manual_seed(5)).tolist()
    got, count = perplexity(load_engine(checkpoint, "fp32", window=16), ids, window=16)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32).eval()
    nll, scored = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), 16):  # windows of 16, 16 and 13 tokens: 15 + 15 + 12 scored
            chunk = torch.tensor([ids[start:start + 16]])
            logits = hf(chunk).logits[0, :-1].double()
            nll -= float(torch.log_softmax(logits, -1).gather(1, chunk[0, 1:, None]).sum())
            scored += chunk.shape[1] - 1
    assert count == scored == 42
    assert math.isclose(got, math.exp(nll / scored), rel_tol=1e-5)
