"""Sliding-window layers attend to the last `sliding_window` positions only: Gemma 3's local layers (its global ones to
all), every Mistral and Phi-3 layer, and Qwen2's layers from `max_window_layers` on (`use_sliding_window`). A tiny checkpoint of
each with a window of 6 serves prompts and outputs well past it, token for token equal to transformers in float32,
on the native kernels (paged decode and prefill rows with the window: engine/paged_attention.c) and on the torch path
(SDPA under a windowed mask: fresh prompt chunks split over two threads, chunks over a cached prefix), alone and in a
batch with chunked prefill and prefix-cache hits. The kernel's window alone: tests/unit/test_paged_attention.py"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine_helpers import engine_on, greedy_batch, hf_greedy, quantized_and_reference, served_weights_copy
from tests.lora_helpers import write_adapter
from tests.tiny_model import make_tiny_model
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.model import layer_windows

transformers = pytest.importorskip("transformers")

WINDOW = 6
NUM_NEW = 24


# each family's windowed layers: Gemma 3's local ones (0, 2), every Mistral layer, Qwen2's upper half (max_window_layers)
WINDOWS = {"gemma3": [WINDOW, 0, WINDOW, 0], "mistral": [WINDOW] * 4, "qwen2": [0, 0, WINDOW, WINDOW],
           "phi3": [WINDOW] * 4}


@pytest.fixture(scope="module", params=list(WINDOWS))
def checkpoint(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(f"{request.param}-window"), request.param, tied=False,
                           num_layers=4, max_positions=512, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hf(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = [[rng.randrange(3, 384) for _ in range(rng.randint(2, 90))] for _ in range(num)]
    out[0] += out[2]  # at least 40 tokens
    out[1] = out[0][:40] + out[1][:9]  # a shared prefix, for the prefix cache
    return out


def test_the_window_changes_the_output_and_the_context_is_the_models(checkpoint, hf):
    """The reference itself depends on the window (else the test below proves nothing), and the engine serves the
    position limit, not the window."""
    prompt = list(range(10, 50))
    wide = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                             sliding_window=512).eval()
    assert hf_greedy(wide, prompt, NUM_NEW) != hf_greedy(hf, prompt, NUM_NEW)
    engine = Engine(checkpoint, EngineConfig(kv_cache_tokens=1024), start=False)
    assert engine.max_context_length == 512
    assert layer_windows(engine.model_config) == WINDOWS[engine.model_config.architecture[:-len("ForCausalLM")].lower()]


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_equals_transformers_past_the_window_alone_and_batched(checkpoint, hf, backend):
    batch = prompts(8, seed=3)
    expected = [hf_greedy(hf, p, NUM_NEW) for p in batch]
    for max_num_tokens in (256, 16):  # each prompt in one chunk; then over several steps beside decodes
        with engine_on(checkpoint, backend, kv_cache_tokens=4096, max_num_tokens=max_num_tokens, max_batch_size=8,
                       block_size=4) as engine:
            assert [greedy_batch(engine, [p], NUM_NEW)[0] for p in batch[:3]] == expected[:3]
            assert greedy_batch(engine, batch, NUM_NEW) == expected, max_num_tokens
            assert engine.block_manager.num_hit_tokens > 0


def test_the_fused_int8_step_takes_each_layers_window(checkpoint, tmp_path):
    """The one-call fused decode step (int8 on its exact route) runs each family's windows: its greedy tokens past
    the window, alone and batched, are those of float32 on the weights it serves (which differ from the window's
    absence: the first test)."""
    copy = tmp_path / "served"
    copy.mkdir()
    served_weights_copy(checkpoint, "int8", copy)
    adapter = write_adapter(checkpoint, tmp_path / "adapter", seed=1, scale=0.3)
    config = dict(kv_cache_tokens=4096, max_num_tokens=32, max_batch_size=8, block_size=4, max_lora_rank=8)
    batch = prompts(6, seed=5)
    with quantized_and_reference(checkpoint, copy, "int8", adapter, config) as (quant, ref):
        if quant.model.plan is None:
            pytest.skip("no fused step on this machine (no C compiler or native attention)")
        expected = greedy_batch(ref, batch, NUM_NEW)
        assert greedy_batch(quant, batch[:1], NUM_NEW) == expected[:1]
        assert greedy_batch(quant, batch, NUM_NEW) == expected
