"""Every engine feature holds on each family beside Llama (Qwen2, Mistral, Qwen3, Gemma 3; Llama is what the feature
modules themselves run), on tiny random checkpoints (tests/tiny_model.py), checked as those modules check it:

- paged KV, prefix caching and chunked prefill (the native kernels in float32): greedy tokens equal transformers'
  with the prompt split over several steps and its leading blocks served from the prefix cache
  (tests/integration/test_prefix_cache.py, test_paged_prefill.py);
- int8 / int4 (test_quantized_engine.py): on the exact route, the tokens of float32 on the dequantized weights,
  alone, in a batch, with a LoRA adapter and under structured output;
- LoRA (tests/e2e/test_lora_vs_peft.py): adapters made with peft on the tiny model, the engine's tokens equal
  transformers + peft's, each alone and in one batch with the base model;
- structured output (test_structured_engine.py): every sampled output validates against its schema;
- embeddings (test_embeddings_vs_hf.py): transformers' final hidden states, pooled the same way.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from tests.engine_helpers import (
    final,
    greedy_batch,
    greedy_request,
    hf_greedy,
    quantized_and_reference,
    run_all,
    served_weights_copy,
    tokens,
)
from tests.lora_helpers import make_adapter, peft_greedy, write_adapter
from tests.structured_helpers import check_json, compiler_for, constrained, schemas_agree
from tests.tiny_model import make_tiny_model
from tokenloop.bench.structured_cases import SCHEMAS
from tokenloop.core.lora import LoraError
from tokenloop.core.request import EmbedParams, FinishReason, SamplingParams, StoppingParams, ValidRequest
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.engine import kernels
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine

transformers = pytest.importorskip("transformers")

FAMILIES = ["qwen2", "mistral", "qwen3", "gemma3", "phi3"]
CONFIG = dict(kv_cache_tokens=4096, max_num_tokens=32, max_batch_size=16, block_size=8, max_lora_rank=8)
NUM_NEW = 12


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    """An untied tiny checkpoint (untied: a quantized lm_head leaves the float32 embedding lookup exact)."""
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, tied=False, num_layers=3)


def prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randint(2, 60))] for _ in range(num)]


def greedy(engine: Engine, batch: list[list[int]], num_new: int = NUM_NEW, **request) -> list[list[int]]:
    return greedy_batch(engine, batch, num_new, **request)


def test_paged_kv_prefix_cache_and_chunked_prefill_equal_transformers(checkpoint):
    """A 45-token system prompt (5 full blocks) shared by two prompts, prefilled 32 tokens a step: the second prompt
    takes 40 tokens from the cache; both, and a batch of prompts beside them, equal transformers' greedy tokens."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    engine = Engine.from_dir(checkpoint, EngineConfig(dtype="float32", **CONFIG))
    try:
        assert engine.model.paged is not None or kernels.load_paged_attention() is None
        rng = random.Random(5)
        system = [rng.randrange(3, 384) for _ in range(45)]
        first, second = system + [11, 12, 13], system + [21, 22, 23, 24]
        assert greedy(engine, [first]) == [hf_greedy(hf, first, NUM_NEW)]
        _, steps = run_all(engine, [greedy_request(second, NUM_NEW)])
        (hit,) = steps.values()
        assert hit[0].num_cached_prompt_tokens == 40
        assert tokens(hit) == hf_greedy(hf, second, NUM_NEW)
        batch = prompts(6, seed=3)
        assert greedy(engine, batch) == [hf_greedy(hf, p, NUM_NEW) for p in batch]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module", params=["int8", "int4"])
def quantized(request, checkpoint, tmp_path_factory):
    """(the engine on `mode` on its exact route, an fp32 engine on a copy of the checkpoint whose layer matrices and
    lm_head are what the mode serves), each with the same LoRA adapter `a`."""
    copy = served_weights_copy(checkpoint, request.param, tmp_path_factory.mktemp(f"dequantized-{request.param}"))
    adapter = write_adapter(checkpoint, tmp_path_factory.mktemp("adapter") / "a", seed=1, scale=0.3)
    with quantized_and_reference(checkpoint, copy, request.param, adapter, CONFIG) as pair:
        yield pair


def test_quantized_equals_float32_on_the_served_weights(quantized):
    quant, ref = quantized
    batch = prompts(8, seed=7)
    expected = greedy(ref, batch)
    assert [greedy(quant, [p])[0] for p in batch[:2]] == expected[:2]
    assert greedy(quant, batch) == expected
    with_lora = greedy(quant, batch[:3], lora="a")
    assert with_lora == greedy(ref, batch[:3], lora="a") and with_lora != expected[:3]


def test_quantized_structured_output_equals_float32(checkpoint, quantized):
    schemas_agree(list(quantized), checkpoint, ["flat_object", "enums"])


def test_lora_adapters_equal_peft(checkpoint, tmp_path_factory):
    """Two peft adapters (q/v at rank 8; every projection at rank 4), each alone and all in one batch with the base
    model, equal transformers + peft token for token; each changes the output."""
    pytest.importorskip("peft")
    if json.loads((checkpoint / "config.json").read_text())["model_type"] == "phi3":
        pytest.skip("Phi-3's adapters target its fused qkv_proj / gate_up_proj, which the engine's LoRA refuses by name "
                    "(test_a_phi3_adapter_on_fused_projections_is_refused)")
    out = tmp_path_factory.mktemp("peft")
    adapters = {name: make_adapter(checkpoint, out, name, seed, scale=0.3) for seed, name in enumerate(("attn", "all"))}
    batch = prompts(2, seed=13)
    reference = {"": peft_greedy(checkpoint, None, batch, NUM_NEW)}
    reference |= {name: peft_greedy(checkpoint, path, batch, NUM_NEW) for name, path in adapters.items()}
    engine = Engine.from_dir(checkpoint, EngineConfig(dtype="float32", **CONFIG))
    try:
        for name, path in adapters.items():
            engine.add_lora(engine.read_lora(name, path))
        for name in adapters:
            assert reference[name] != reference[""], f"adapter {name} changes nothing"
            assert greedy(engine, batch, lora=name) == reference[name], name
        mixed = [(p, name) for name in reference for p in batch]
        ids, steps = run_all(engine, [dataclasses.replace(greedy_request(p, NUM_NEW), lora=name)
                                      for p, name in mixed])
        assert [tokens(steps[(i, 0)]) for i in ids] == [t for name in reference for t in reference[name]]
    finally:
        engine.shutdown()


def test_every_sampled_structured_output_validates(checkpoint):
    compiler, tok = compiler_for(checkpoint), Tokenizer.from_dir(checkpoint)
    engine = Engine.from_dir(checkpoint, EngineConfig(dtype="float32", **CONFIG))
    try:
        for name in ("nested_object", "array_of_numbers"):
            requests = [constrained(compiler, "json_schema", SCHEMAS[name], [5, 17, 99, 3], seed=s) for s in range(6)]
            ids, steps = run_all(engine, requests, timeout=300)
            for i in ids:
                got = steps[(i, 0)]
                assert final(got).error is None and final(got).finish_reason == FinishReason.STRUCTURE_COMPLETE
                check_json(tok.decode(tokens(got)), SCHEMAS[name])
    finally:
        engine.shutdown()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers(checkpoint, pooling):
    """A prompt over several steps (chunked) and a short one, normalized or not, against transformers' final hidden
    states (after the final norm) pooled the same way."""
    hf = transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()
    engine = Engine.from_dir(checkpoint, EngineConfig(dtype="float32", **CONFIG))
    try:
        for prompt in ([5, 17, 99, 3, 250, 7], list(range(10, 80))):
            with torch.inference_mode():
                states = hf(torch.tensor([prompt])).last_hidden_state[0].double()
            want = states[-1] if pooling == "last" else states.mean(0)
            for normalize in (False, True):
                request = ValidRequest(request_id="e", prompt_token_ids=tuple(prompt),
                                       sampling=SamplingParams(temperature=0.0),
                                       stopping=StoppingParams(max_new_tokens=0),
                                       embed=EmbedParams(pooling, normalize))
                _, steps = run_all(engine, [request])
                (got,) = steps.values()
                vec = torch.tensor(final(got).embedding, dtype=torch.float64)
                expected = torch.nn.functional.normalize(want, dim=0) if normalize else want
                torch.testing.assert_close(vec, expected, rtol=0, atol=1e-4 * max(1.0, expected.abs().max().item()))
    finally:
        engine.shutdown()


def test_a_phi3_adapter_on_fused_projections_is_refused(tmp_path):
    """peft adapts Phi-3's fused qkv_proj / gate_up_proj as one matrix each; the engine's LoRA adapts q/k/v and
    gate/up apart, so such an adapter is refused by module name at load."""
    checkpoint = make_tiny_model(tmp_path / "phi3", "phi3", tied=False)
    adapter = write_adapter(checkpoint, tmp_path / "fused", targets=("down_proj",),
                            target_modules=["qkv_proj", "down_proj"])
    engine = Engine.from_dir(checkpoint, EngineConfig(dtype="float32", **CONFIG))
    try:
        with pytest.raises(LoraError, match="targets modules the model lacks .*: qkv_proj"):
            engine.read_lora("fused", adapter)
    finally:
        engine.shutdown()
