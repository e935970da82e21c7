"""`--weights int8` on a tiny checkpoint: the engine computes what float32 computes on the dequantized weights,
batch invariance holds, and GetModelInfo / the start-up log say int8.

The reference is the same engine in float32 on a copy of the checkpoint whose linear and lm_head weights were
replaced by their int8 values times their scales, so the two runs differ only in float rounding: greedy tokens
must agree. (The real model's quality contract, perplexity and agreement with fp32, is tests/e2e/test_weights_quality.py.)
"""

from __future__ import annotations

import asyncio
import logging
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine_helpers import greedy_request, run_all, tokens
from tests.integration.service_harness import serving
from tests.tiny_model import make_tiny_model
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.quant import qweight
from tokenloop.v1 import tokenloop_pb2 as pb

LINEAR = ("_proj.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(original, dequantized copy) of an untied tiny Llama (untied: the fp32 embedding lookup stays exact)."""
    original = make_tiny_model(tmp_path_factory.mktemp("int8"), "llama", tied=False, num_layers=3)
    dequantized = tmp_path_factory.mktemp("dequantized")
    for path in original.iterdir():
        shutil.copy(path, dequantized / path.name)
    weights = load_file(str(original / "model.safetensors"))
    weights = {k: qweight(w).dequantize() if k.endswith(LINEAR) else w for k, w in weights.items()}
    save_file(weights, str(dequantized / "model.safetensors"), metadata={"format": "pt"})
    return original, dequantized


def prompts(num: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 384) for _ in range(rng.randint(2, 90))] for _ in range(num)]


def greedy(engine: Engine, batch: list[list[int]], num_new: int = 24) -> list[list[int]]:
    ids, steps = run_all(engine, [greedy_request(p, num_new) for p in batch])
    return [tokens(steps[(i, 0)]) for i in ids]


def test_int8_equals_float32_on_the_dequantized_weights_alone_and_batched(checkpoints, caplog):
    original, dequantized = checkpoints
    config = dict(kv_cache_tokens=4096, max_num_tokens=64, max_batch_size=16)
    with caplog.at_level(logging.INFO, logger="tokenloop.engine.engine"):
        int8 = Engine.from_dir(original, EngineConfig(weights="int8", **config))
    ref = Engine.from_dir(dequantized, EngineConfig(weights="fp32", **config))
    try:
        assert int8.dtype == "int8" and ref.dtype == "float32"
        assert "weights int8" in caplog.text and "loaded in" in caplog.text
        batch = prompts(16)
        expected = greedy(ref, batch)
        alone = [greedy(int8, [p])[0] for p in batch[:4]]
        together = greedy(int8, batch)  # a batch of 16 with chunked prefill next to decodes
        assert alone == expected[:4]
        assert together == expected
        # and the quantization is not a no-op: the weights it serves differ from the checkpoint's
        assert not torch.equal(load_file(str(original / "model.safetensors"))["lm_head.weight"],
                               load_file(str(dequantized / "model.safetensors"))["lm_head.weight"])
    finally:
        int8.shutdown()
        ref.shutdown()


def test_model_info_reports_the_weights_mode(checkpoints):
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

    assert asyncio.run(body("int8")) == "int8"
    assert asyncio.run(body("fp32")) == "float32"
