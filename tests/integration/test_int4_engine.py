"""`--weights int4` on a tiny checkpoint: the engine computes what float32 computes on the dequantized weights, alone
and in a batch of 16, with a LoRA adapter, under structured output and across a prefix-cache hit; GetModelInfo and
the start-up log say int4.

The reference is the same engine in float32 on a copy of the checkpoint whose layer matrices were replaced by their
4-bit values (levels times scales plus minimums) and whose lm_head by its int8 values times scales, what
`--weights int4` serves: the two runs differ only in float rounding, so greedy tokens must agree. (The real model's
quality contract, perplexity and agreement with fp32, is tests/e2e/test_weights_quality.py.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.structured_cases import SCHEMAS
from tests.engine_helpers import final, greedy_request, run_all, tokens
from tests.integration.service_harness import serving
from tests.lora_helpers import write_adapter
from tests.structured_helpers import check_json, compiler_for, constrained
from tests.tiny_model import make_tiny_model
from tokenloop.core.request import FinishReason
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.quant import Q4Weight, qweight, qweight4
from tokenloop.v1 import tokenloop_pb2 as pb

CONFIG = dict(kv_cache_tokens=4096, max_num_tokens=64, max_batch_size=16, block_size=8, max_lora_rank=8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(original, dequantized copy) of an untied tiny Llama (untied: the fp32 embedding lookup stays exact)."""
    original = make_tiny_model(tmp_path_factory.mktemp("int4"), "llama", tied=False, num_layers=3)
    dequantized = tmp_path_factory.mktemp("dequantized4")
    for path in original.iterdir():
        shutil.copy(path, dequantized / path.name)
    weights = load_file(str(original / "model.safetensors"))
    served = {k: qweight4(w).dequantize() if k.endswith("_proj.weight") else
              qweight(w).dequantize() if k == "lm_head.weight" else w for k, w in weights.items()}
    save_file(served, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    return original, dequantized


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory):
    """(int4 engine on the original, fp32 engine on the dequantized copy), each with the same LoRA adapter `a`."""
    original, dequantized = checkpoints
    adapter = write_adapter(original, tmp_path_factory.mktemp("adapter") / "a", seed=1, scale=0.3)
    int4 = Engine.from_dir(original, EngineConfig(weights="int4", **CONFIG))
    ref = Engine.from_dir(dequantized, EngineConfig(weights="fp32", **CONFIG))
    for engine in (int4, ref):
        engine.add_lora(engine.read_lora("a", adapter))
    yield int4, ref
    int4.shutdown()
    ref.shutdown()


def prompts(num: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randint(2, 90))] for _ in range(num)]


def greedy(engine: Engine, batch: list[list[int]], num_new: int = 24, **request) -> list[list[int]]:
    ids, steps = run_all(engine, [dataclasses.replace(greedy_request(p, num_new), **request) for p in batch])
    return [tokens(steps[(i, 0)]) for i in ids]


def test_int4_equals_float32_on_the_dequantized_weights_alone_and_batched(checkpoints, engines):
    int4, ref = engines
    assert int4.dtype == "int4" and ref.dtype == "float32"
    assert all(isinstance(w, Q4Weight) for w in int4._gate_ups)
    batch = prompts(16)
    expected = greedy(ref, batch)
    alone = [greedy(int4, [p])[0] for p in batch[:4]]
    together = greedy(int4, batch)  # a batch of 16 with chunked prefill next to decodes
    assert alone == expected[:4]
    assert together == expected
    # and the quantization is not a no-op: the weights it serves differ from the checkpoint's
    original, dequantized = checkpoints
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(load_file(str(original / "model.safetensors"))[name],
                           load_file(str(dequantized / "model.safetensors"))[name])


def test_start_up_log_says_int4(checkpoints, caplog):
    with caplog.at_level(logging.INFO, logger="tokenloop.engine.engine"):
        engine = Engine(checkpoints[0], EngineConfig(weights="int4", kv_cache_tokens=512), start=False)
    assert "weights int4 loaded in" in caplog.text and "matmul int4 native kernel" in caplog.text
    assert engine.dtype == "int4"


def test_a_lora_adapter_applies_on_int4_weights(engines):
    """The low-rank products go on top of the 4-bit base projection: the same tokens as on the float32 copy."""
    int4, ref = engines
    batch = prompts(4, seed=7)
    with_lora = greedy(int4, batch, lora="a")
    assert with_lora == greedy(ref, batch, lora="a")
    assert with_lora != greedy(int4, batch)  # the adapter changes the output


def test_structured_output_on_int4_weights(checkpoints, engines):
    """Constrained greedy decoding: every output validates, and equals the float32 copy's token for token."""
    int4, ref = engines
    compiler = compiler_for(checkpoints[0])
    tok = Tokenizer.from_dir(checkpoints[0])
    for name in ("flat_object", "array_of_numbers", "enums"):
        request = constrained(compiler, "json_schema", SCHEMAS[name], [5, 17, 99, 3], temperature=0.0)
        outs = []
        for engine in (int4, ref):
            _, steps = run_all(engine, [request])
            (got,) = steps.values()
            assert final(got).error is None and final(got).finish_reason == FinishReason.STRUCTURE_COMPLETE
            outs.append(tokens(got))
        check_json(tok.decode(outs[0]), SCHEMAS[name])
        assert outs[0] == outs[1], name


def test_a_prefix_cache_hit_on_int4_changes_no_token(checkpoints, engines):
    int4, _ = engines
    rng = random.Random(5)
    system = [rng.randrange(3, 250) for _ in range(45)]  # 5 full blocks of 8 and a partial one
    first, second = system + [11, 12, 13], system + [21, 22, 23, 24]
    greedy(int4, [first])
    _, steps = run_all(int4, [greedy_request(second, 24)])
    (hit,) = steps.values()
    assert hit[0].num_cached_prompt_tokens == 40
    plain = Engine.from_dir(checkpoints[0], EngineConfig(weights="int4", enable_prefix_caching=False, **CONFIG))
    try:
        _, steps = run_all(plain, [greedy_request(second, 24)])
        (without,) = steps.values()
        assert without[0].num_cached_prompt_tokens == 0
        assert tokens(hit) == tokens(without)
    finally:
        plain.shutdown()


def test_model_info_reports_int4(checkpoints):
    from tokenloop.service.config import ServerConfig
    from tokenloop.service.executors import default_executor_factory

    async def body() -> str:
        config = ServerConfig(model=str(checkpoints[0]), executor_options={"weights": "int4", "kv_cache_tokens": 512})
        executor = default_executor_factory(config)
        async with serving(checkpoints[0], executor=executor) as (_, stub, _):
            info = await stub.GetModelInfo(pb.GetModelInfoRequest())
            reply = [r async for r in stub.Generate(pb.GenerateRequest(
                text="hello", stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True)))]
            assert reply[-1].complete.usage.completion_tokens == 4
            return info.dtype

    assert asyncio.run(body()) == "int4"
