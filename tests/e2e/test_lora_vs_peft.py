"""LoRA on the real default model (fp32): the engine's greedy tokens equal transformers + peft, per adapter.

Three adapters made here with peft (different ranks, targets, rslora; random non-zero B). Each alone equals
peft token for token; a batch mixing the base model and all three gives every request what it gets alone;
the prefix cache never hands one adapter's KV blocks to another; an adapter in use is not unloaded; and the same
tokens come back through the gRPC server with the adapters loaded by LoadLoraAdapter.
"""

from __future__ import annotations

import pytest

from tests.engine_helpers import greedy_request, run_all, tokens
from tests.lora_helpers import ADAPTERS, make_adapter, peft_greedy
from tokenloop.core.lora import LoraError, LoraInUseError
from tokenloop.core.request import ValidRequest
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine

pytest.importorskip("peft")
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NUM_NEW = 24
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


def lora_request(prompt: list[int], lora: str, num_new: int = NUM_NEW) -> ValidRequest:
    r = greedy_request(prompt, num_new)
    return ValidRequest(r.request_id, r.prompt_token_ids, r.sampling, r.stopping, lora=lora)


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> list[list[int]]:
    tok = Tokenizer.from_dir(default_model_dir)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def adapters(default_model_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("loras")
    return {name: make_adapter(default_model_dir, out, name, seed) for seed, name in enumerate(ADAPTERS)}


@pytest.fixture(scope="module")
def reference(default_model_dir, adapters, prompts) -> dict:
    ref = {"": peft_greedy(default_model_dir, None, prompts, NUM_NEW)}
    for name, path in adapters.items():
        ref[name] = peft_greedy(default_model_dir, path, prompts, NUM_NEW)
    return ref


@pytest.fixture(scope="module")
def engine(default_model_dir, adapters):
    eng = Engine.from_dir(default_model_dir, EngineConfig(dtype="float32", max_num_tokens=128, max_batch_size=16,
                                                          kv_cache_tokens=8192))
    for name, path in adapters.items():
        eng.add_lora(eng.read_lora(name, path))
    yield eng
    eng.shutdown()


def test_adapters_change_the_output(reference):
    for name in ADAPTERS:
        assert reference[name] != reference[""], f"adapter {name} changes nothing: the test would prove nothing"


def test_each_adapter_alone_equals_peft_and_the_prefix_cache_keeps_adapters_apart(engine, prompts, reference):
    for name in [""] + list(ADAPTERS):  # the base first: its prompt blocks are cached when the adapters run
        for i, (prompt, expected) in enumerate(zip(prompts, reference[name])):
            hits = engine.block_manager.num_hit_tokens
            _, steps = run_all(engine, [lora_request(prompt, name)])
            (got,) = steps.values()
            assert tokens(got) == expected, f"adapter {name or 'base'!r} differs from transformers + peft"
            if i == 0:  # the prompts share a system prompt: the second one reuses the first's blocks
                assert engine.block_manager.num_hit_tokens == hits, "a prompt reused another adapter's KV blocks"
    _, steps = run_all(engine, [lora_request(prompts[0], "attn")])  # the same adapter again: its own blocks
    assert tokens(next(iter(steps.values()))) == reference["attn"][0]
    assert engine.block_manager.num_hit_tokens > hits


def test_a_batch_mixing_base_and_three_adapters(engine, prompts, reference):
    names = [""] + list(ADAPTERS)
    requests = [lora_request(p, name) for p in prompts for name in names] * 2  # 16 at once
    ids, steps = run_all(engine, requests)
    for rid, req in zip(ids, requests):
        expected = reference[req.lora][prompts.index(list(req.prompt_token_ids))]
        assert tokens(steps[(rid, 0)]) == expected, f"adapter {req.lora or 'base'!r} in a mixed batch"


def test_unknown_adapter_and_unload_while_in_use(engine, prompts, adapters):
    with pytest.raises(LoraError, match="LoRA adapter `nope` is not loaded"):
        engine.enqueue(lora_request(prompts[0], "nope"))
    rid = engine.enqueue(lora_request(prompts[0], "mlp", num_new=200))
    with pytest.raises(LoraInUseError, match="LoRA adapter `mlp` has 1 requests in flight"):
        engine.unload_lora("mlp")
    engine.cancel(rid)
    run_all(engine, [])
    for _ in range(200):
        if engine.loras.num_in_use("mlp") == 0:
            break
        engine.await_responses(0.05)
    removed = engine.unload_lora("mlp")
    assert removed.name == "mlp" and "mlp" not in engine.loras.names()
    engine.add_lora(engine.read_lora("mlp", adapters["mlp"]))  # back, for any test after this one


def test_through_the_grpc_server_loaded_by_rpc(default_model_dir, engine, adapters, prompts, reference):
    """Last in this file: stopping the server shuts the shared engine down."""
    import grpc

    from tests.conftest import run
    from tests.integration.service_harness import serving
    from tokenloop.v1 import tokenloop_pb2 as pb

    async def body():
        root = str(next(iter(adapters.values())).parent)  # LoadLoraAdapter reads under --lora-root only
        async with serving(default_model_dir, engine, lora_roots=(root,)) as (_, stub, _e):
            for name in ADAPTERS:
                await stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name=f"rpc-{name}", path=str(adapters[name])))
            for name in [""] + list(ADAPTERS):
                for prompt, expected in zip(prompts, reference[name]):
                    msgs = [m async for m in stub.Generate(pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=prompt), lora=f"rpc-{name}" if name else "",
                        sampling=pb.SamplingParams(temperature=0.0),
                        stopping=pb.StoppingCriteria(max_new_tokens=NUM_NEW, ignore_eos=True)))]
                    assert list(msgs[-1].complete.token_ids) == expected, f"adapter {name or 'base'!r} via gRPC"
            with pytest.raises(grpc.aio.AioRpcError) as info:
                [m async for m in stub.Generate(pb.GenerateRequest(text="hi", lora="attn"))]  # engine-only name
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    run(body())
