"""`--weights int8` and `--weights int4` on a tiny checkpoint: on the exact route (float32 activations, forced with
TOKENLOOP_MATMUL_ROUTE) the engine computes what float32 computes on the dequantized weights, alone and in a batch of
16, with a LoRA adapter and under structured output; on the route the calibration chooses (vnni's int8 activations
where the CPU has them) a row's tokens are the same alone and in a batch and across a prefix-cache hit;
GetModelInfo and the start-up log say the mode and its routes.

The reference is the same engine in float32 on a copy of the checkpoint whose layer matrices were replaced by what the
mode serves (int8: values times scales; int4: 4-bit levels times scales plus minimums, and the lm_head's int8 values
times scales), both over a float32 KV cache (the quantized modes' default, a 16-bit cache, has its own contract:
tests/e2e/test_kv16_quality.py): the two runs differ only in float rounding, so greedy tokens must agree. (The real model's quality
contract, perplexity and agreement with fp32 on every route, is tests/e2e/test_weights_quality.py.)
"""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
import torch
from safetensors.torch import load_file

from tests.engine_helpers import (
    greedy_batch,
    greedy_request,
    quantized_and_reference,
    run_all,
    served_weights_copy,
    tokens,
)
from tests.integration.service_harness import serving
from tests.lora_helpers import write_adapter
from tests.structured_helpers import schemas_agree
from tests.tiny_model import make_tiny_model
from tokenloop.engine import kernels
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.quant import Q4Weight, QWeight
from tokenloop.engine.quant_routes import ROUTE_ENV
from tokenloop.v1 import tokenloop_pb2 as pb

CONFIG = dict(kv_cache_tokens=4096, max_num_tokens=64, max_batch_size=16, block_size=8, max_lora_rank=8)


@pytest.fixture(scope="module", params=["int8", "int4"])
def mode(request) -> str:
    return request.param


def engine(path, mode: str, route: str | None = None, **config) -> Engine:
    """An engine on `mode`, its products on `route` (None: the calibration's choice)."""
    with pytest.MonkeyPatch.context() as patch:
        if route is None:
            patch.delenv(ROUTE_ENV, raising=False)
        else:
            patch.setenv(ROUTE_ENV, route)
        return Engine.from_dir(path, EngineConfig(weights=mode, **{**CONFIG, **config}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, mode):
    """(original, dequantized copy) of an untied tiny Llama (untied: the fp32 embedding lookup stays exact)."""
    original = make_tiny_model(tmp_path_factory.mktemp(mode), "llama", tied=False, num_layers=3)
    return original, served_weights_copy(original, mode, tmp_path_factory.mktemp(f"dequantized-{mode}"))


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory, mode):
    """(quantized engine on the original on its exact route, fp32 engine on the dequantized copy), each with the same
    LoRA adapter `a`."""
    original, dequantized = checkpoints
    adapter = write_adapter(original, tmp_path_factory.mktemp("adapter") / "a", seed=1, scale=0.3)
    with quantized_and_reference(original, dequantized, mode, adapter, CONFIG) as pair:  # see the docstring
        yield pair


def prompts(num: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randint(2, 90))] for _ in range(num)]


def greedy(engine: Engine, batch: list[list[int]], num_new: int = 24, **request) -> list[list[int]]:
    return greedy_batch(engine, batch, num_new, **request)


def test_equals_float32_on_the_dequantized_weights_alone_and_batched(checkpoints, engines, mode):
    quant, ref = engines
    assert quant.dtype == mode and ref.dtype == "float32"
    assert all(isinstance(w, Q4Weight if mode == "int4" else QWeight) for w in (layer.gate_up for layer in quant.model.layers))
    batch = prompts(16)
    expected = greedy(ref, batch)
    alone = [greedy(quant, [p])[0] for p in batch[:4]]
    together = greedy(quant, batch)  # a batch of 16 with chunked prefill next to decodes
    assert alone == expected[:4]
    assert together == expected
    # and the quantization is not a no-op: the weights it serves differ from the checkpoint's
    original, dequantized = checkpoints
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(load_file(str(original / "model.safetensors"))[name],
                           load_file(str(dequantized / "model.safetensors"))[name])


def test_start_up_log_says_the_mode_and_its_routes(checkpoints, caplog, mode, monkeypatch):
    monkeypatch.delenv(ROUTE_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="tokenloop.engine"):
        e = Engine(checkpoints[0], EngineConfig(weights=mode, kv_cache_tokens=512), start=False)
    assert f"weights {mode} loaded in" in caplog.text and "matmul routes (" in caplog.text
    if kernels.load_int8() is not None:
        route, _ = e.model.matmul.route(1)
        assert f"<=1: {route.name} " in caplog.text and "torch-fp32/1t*" in caplog.text
    assert e.dtype == mode


def test_a_lora_adapter_applies_on_quantized_weights(engines):
    """The low-rank products go on top of the quantized base projection: the same tokens as on the float32 copy."""
    quant, ref = engines
    batch = prompts(4, seed=7)
    with_lora = greedy(quant, batch, lora="a")
    assert with_lora == greedy(ref, batch, lora="a")
    assert with_lora != greedy(quant, batch)  # the adapter changes the output


def test_structured_output_on_quantized_weights(checkpoints, engines):
    """Constrained greedy decoding: every output validates, and equals the float32 copy's token for token."""
    schemas_agree(list(engines), checkpoints[0], ["flat_object", "array_of_numbers", "enums"])


def test_the_calibrated_route_is_batch_invariant_and_a_prefix_cache_hit_changes_no_token(checkpoints, mode):
    auto = engine(checkpoints[0], mode)
    plain = engine(checkpoints[0], mode, enable_prefix_caching=False)
    try:
        batch = prompts(8, seed=11)
        assert [greedy(auto, [p])[0] for p in batch] == greedy(auto, batch)
        rng = random.Random(5)
        system = [rng.randrange(3, 250) for _ in range(45)]  # 5 full blocks of 8 and a partial one
        first, second = system + [11, 12, 13], system + [21, 22, 23, 24]
        greedy(auto, [first])
        _, steps = run_all(auto, [greedy_request(second, 24)])
        (hit,) = steps.values()
        assert hit[0].num_cached_prompt_tokens == 40
        _, steps = run_all(plain, [greedy_request(second, 24)])
        (without,) = steps.values()
        assert without[0].num_cached_prompt_tokens == 0
        assert tokens(hit) == tokens(without)
    finally:
        auto.shutdown()
        plain.shutdown()


def test_model_info_reports_the_weights_mode(checkpoints, mode):
    from tokenloop.service.config import ServerConfig
    from tokenloop.service.executors import default_executor_factory

    async def body(weights: str) -> str:
        config = ServerConfig(model=str(checkpoints[0]), executor_options={"weights": weights, "kv_cache_tokens": 512})
        executor = default_executor_factory(config)
        async with serving(checkpoints[0], executor=executor) as (_, stub, _):
            info = await stub.GetModelInfo(pb.GetModelInfoRequest())
            reply = [r async for r in stub.Generate(pb.GenerateRequest(
                text="hello", stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True)))]
            assert reply[-1].complete.usage.completion_tokens == 4
            return info.dtype

    assert asyncio.run(body(mode)) == mode
    assert asyncio.run(body("fp32")) == "float32"
