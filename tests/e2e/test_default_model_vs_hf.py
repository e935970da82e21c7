"""On the real default model (fp32): the engine's greedy tokens equal transformers' generate().

Needs `make model` (models/SmolLM2-135M-Instruct); skips with that reason otherwise. The reference
runs each prompt alone in transformers; the engine runs them alone and inside a batch of 16
mixed-length requests (chunked prefill next to running decodes).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine_helpers import greedy_request, run_all, tokens
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_NEW = 64
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash table is.",
    "List three prime numbers greater than 100, then say which is largest, and why that matters for "
    "someone who is learning arithmetic for the first time at school.",
]
FILLERS = ["Tell me a story about a robot. " * k for k in (1, 3, 8, 20, 2, 5, 12, 1, 30, 4, 6, 9)]


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    tok = Tokenizer.from_dir(default_model_dir)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(default_model_dir, prompts) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])  # explicit mask: the prompt holds <|im_end|>, which is also the pad id
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NUM_NEW,
                                 min_new_tokens=NUM_NEW, do_sample=False, eos_token_id=None, pad_token_id=2)
            outs.append(out[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def engine(default_model_dir):
    eng = Engine.from_dir(default_model_dir, EngineConfig(dtype="float32", max_num_tokens=128, max_batch_size=16,
                                                          kv_cache_tokens=16384))
    yield eng
    eng.shutdown()


def test_alone_equals_transformers(engine, prompts, reference):
    for prompt, expected in zip(prompts, reference):
        _, steps = run_all(engine, [greedy_request(prompt, NUM_NEW)])
        (got,) = steps.values()
        assert tokens(got) == expected


def test_inside_a_batch_of_16_equals_transformers(engine, prompts, reference, default_model_dir):
    tok = Tokenizer.from_dir(default_model_dir)
    fillers = [tok.encode(tok.apply_chat_template([{"role": "user", "content": f}])) for f in FILLERS]
    requests = [greedy_request(p, NUM_NEW) for p in fillers[:6] + prompts + fillers[6:]]
    ids, steps = run_all(engine, requests, timeout=600)
    got = [tokens(steps[(i, 0)]) for i in ids[6:6 + len(prompts)]]
    for i, (g, expected) in enumerate(zip(got, reference)):
        assert g == expected, f"prompt {i} differs from transformers inside the batch"
