"""`tokenloop-cli embed` as a real process against a real `tokenloop serve` with the default model: the vectors
equal transformers' final hidden states of SmolLM2-135M-Instruct pooled the same way (within 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.e2e.live_server import live_address
from tests.e2e.tools import cli
from tokenloop.core.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.e2e

TEXT = "The capital of France is Paris, and the capital of Japan is Tokyo."


def test_embed_equals_transformers_on_the_default_model(default_model_dir):
    address = live_address()
    runs = {pooling: cli("--address", address, "embed", TEXT, "--pooling", pooling, "--json")
            for pooling in ("last", "mean")}
    raw = cli("--address", address, "embed", TEXT, "--no-normalize")
    for run in (*runs.values(), raw):
        assert run.returncode == 0, run.stderr
    ids = Tokenizer.from_dir(default_model_dir).encode(TEXT)
    model = transformers.AutoModel.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        states = model(torch.tensor([ids])).last_hidden_state[0]
    for pooling, run in runs.items():
        got = json.loads(run.stdout)
        assert (got["pooling"], got["normalized"], got["prompt_tokens"]) == (pooling, True, len(ids))
        vec = states[-1] if pooling == "last" else states.mean(0)
        expected = torch.nn.functional.normalize(vec, dim=0)
        assert torch.tensor(got["embedding"]).sub(expected).abs().max().item() < 1e-4
    numbers = [float(x) for x in raw.stdout.split()]  # one line: the vector, last token, not normalized
    assert torch.tensor(numbers).sub(states[-1]).abs().max().item() < 1e-3 * states[-1].abs().max().item()
    assert "last pooling" in raw.stderr and "normalized" not in raw.stderr
