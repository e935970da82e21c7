"""The engine's float32 products on f32_linear.c (Backend.C_GEMM_TWO_THREADS, chosen by the calibration where it measures fastest:
steps of a batch on this machine) give transformers' greedy tokens: a float32 batch of 16 mixed-length requests
with every product of every step forced onto the C GEMM, each request against transformers' generate() alone.
The kernel itself (every path, bits alone and batched): tests/unit/test_f32_linear.py."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine_helpers import greedy_request, hf_greedy, run_all, tokens
from tests.tiny_model import make_tiny_model
from tokenloop.engine import kernels
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.matmul import Backend, MatmulPolicy

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("arch, tied", [("llama", True), ("qwen2", False)])
def test_a_float32_batch_on_the_c_gemm_equals_transformers(arch, tied, tmp_path, monkeypatch):
    f32 = kernels.load_f32()
    if f32 is None:
        pytest.skip("no C compiler here: torch multiplies instead")
    calls = []

    class Counting(type(f32)):
        def linear2(self, x, w, out):
            calls.append(x.shape[0])
            super().linear2(x, w, out)
    counting = Counting(f32.path)
    monkeypatch.setattr(MatmulPolicy, "calibrate",
                        classmethod(lambda cls, weights, native=None: cls(dict.fromkeys((1, 4, 16, 64, 256, 1024),
                                                                                         Backend.C_GEMM_TWO_THREADS), f32=counting)))
    checkpoint = make_tiny_model(tmp_path, arch, tied=tied)
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rng = random.Random(3)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randint(2, 160))] for _ in range(16)]
    expected = [hf_greedy(hf, p, 24) for p in prompts]
    engine = Engine.from_dir(checkpoint, EngineConfig(dtype="float32", kv_cache_tokens=8192, max_num_tokens=96,
                                                      max_batch_size=16, block_size=8))
    try:
        ids, steps = run_all(engine, [greedy_request(p, 24) for p in prompts])
        got = [tokens(steps[(i, 0)]) for i in ids]
    finally:
        engine.shutdown()
    assert calls and max(calls) >= 16  # steps of the whole batch ran on the C GEMM
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"request {i} (prompt of {len(prompts[i])} tokens) differs from transformers"
