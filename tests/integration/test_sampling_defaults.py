"""Defaults for what a request leaves unset: the model's recommended sampling settings (as `make model` writes them)
and `--default-max-new-tokens`, on both APIs.

The checkpoint here gets its generation_config.json from `convert_gguf.write_sampling_defaults`, the function
`make model` uses (temperature 0.2, top-p 0.9 from the SmolLM2-Instruct model card); requests go through a real
in-process server to a scripted executor that records what it was given.
"""

from __future__ import annotations

import json
import shutil

import grpc
import pytest
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb

from tests.conftest import run
from tests.integration.service_harness import gen, read_all, trtllm
from tokenloop.core.tokenizer import ModelCard
from tokenloop.engine.convert_gguf import SAMPLING_DEFAULTS, main, write_sampling_defaults
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc


@pytest.fixture
def recommended_dir(tokenizer_dir, tmp_path):
    """The test checkpoint with generation_config.json as `make model` leaves it."""
    target = shutil.copytree(tokenizer_dir, tmp_path / "model")
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    write_sampling_defaults(target)
    return target


def test_write_sampling_defaults_keeps_the_other_fields(recommended_dir):
    gen_config = json.loads((recommended_dir / "generation_config.json").read_text())
    assert gen_config == {"eos_token_id": 2, "bos_token_id": 1, "do_sample": True, "temperature": 0.2, "top_p": 0.9}
    card = ModelCard.from_dir(recommended_dir)
    assert (card.default_temperature, card.default_top_p) == (0.2, 0.9)


def test_make_model_adds_the_settings_to_an_older_checkpoint(tmp_path, capsys):
    out = tmp_path / "old"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (out / name).write_text("{}")
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert main(["--out", str(out)]) == 0  # no download: only generation_config.json changes
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": 2, **SAMPLING_DEFAULTS}
    assert main(["--out", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"{out} is complete; nothing to do"


def test_generate_without_temperature_or_top_p_uses_the_models_settings(recommended_dir):
    async def body():
        async with trtllm(recommended_dir) as (server, _stub, executor):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = tokenloop_pb2_grpc.TextGenerationStub(channel)
                unset = pb.GenerateRequest(text="Hello world", stopping=pb.StoppingCriteria(max_new_tokens=2))
                greedy = pb.GenerateRequest(text="Hello world", stopping=pb.StoppingCriteria(max_new_tokens=2),
                                            sampling=pb.SamplingParams(temperature=0.0, top_p=0.5))
                for request in (unset, greedy):
                    [_ async for _ in stub.Generate(request)]
            return [(r.sampling.temperature, r.sampling.top_p) for r in executor.enqueued]

    assert run(body()) == [(0.2, 0.9), (0.0, 0.5)]


def test_router_api_without_temperature_or_top_p_uses_the_models_settings(recommended_dir, tokenizer):
    async def body():
        async with trtllm(recommended_dir) as (_server, stub, executor):
            await read_all(stub.Generate(gen(tokenizer.encode("Hello world"), max_tokens=2)))
            await read_all(stub.Generate(gen(tokenizer.encode("Hello world"), max_tokens=2,
                                             sampling_config=tpb.SamplingConfig(temperature=1.0))))
            return [(r.sampling.temperature, r.sampling.top_p) for r in executor.enqueued]

    assert run(body()) == [(0.2, 0.9), (1.0, 0.9)]


def test_the_default_model_carries_the_recommended_settings(default_model_dir):
    card = ModelCard.from_dir(default_model_dir)
    assert (card.default_temperature, card.default_top_p) == (0.2, 0.9), "run `make model` to add them"


def test_unset_maximum_follows_default_max_new_tokens_on_both_apis(recommended_dir, tokenizer):
    async def body():
        async with trtllm(recommended_dir, default_max_new_tokens=5) as (server, router, executor):
            await read_all(router.Generate(gen(tokenizer.encode("Hello world"), max_tokens=0)))  # 0: unset
            await read_all(router.Generate(gen(tokenizer.encode("Hello world"), max_tokens=9)))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = tokenloop_pb2_grpc.TextGenerationStub(channel)
                [_ async for _ in stub.Generate(pb.GenerateRequest(text="Hello world"))]
            return [r.stopping.max_new_tokens for r in executor.enqueued]

    assert run(body()) == [5, 9, 5]
