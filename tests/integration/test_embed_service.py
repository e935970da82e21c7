"""tokenloop.v1 Embed through the in-process server on the embedded engine (tiny random model): vectors equal
transformers', beside concurrent Generate calls that stay unchanged; every bad input refused naming its field; the
Python client and the `tokenloop-client embed` CLI; the service.embedding helpers both APIs call (FlushCache); the
TensorRT-LLM adapters (against the fake) answer UNIMPLEMENTED."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch

from tests.conftest import run
from tests.fakes.fixtures import fake_trtllm
from tests.integration.service_harness import serving
from tests.tiny_model import make_tiny_model
from tokenloop.core.capabilities import NO_EMBED, Capabilities
from tokenloop.core.request import EmbedParams
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.service import embedding
from tokenloop.service.errors import Unimplemented
from tokenloop.v1 import tokenloop_pb2 as pb

transformers = pytest.importorskip("transformers")
TEXT = "The capital of France is Paris. The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama-embed"), "llama")


@pytest.fixture(scope="module")
def hf(checkpoint):
    return transformers.AutoModel.from_pretrained(checkpoint, dtype=torch.float32).eval()


def expected(hf, ids, pooling: str, normalize: bool) -> list[float]:
    with torch.inference_mode():
        states = hf(torch.tensor([list(ids)])).last_hidden_state[0]
    vec = states[-1] if pooling == "last" else states.mean(0)
    return (torch.nn.functional.normalize(vec, dim=0) if normalize else vec).tolist()


def engine_for(checkpoint, **config) -> Engine:
    return Engine.from_dir(checkpoint, EngineConfig(kv_cache_tokens=4096, max_num_tokens=64, block_size=8, **config))


async def refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details()


def test_embed_equals_transformers_beside_generation(checkpoint, hf):
    async def body():
        async with serving(checkpoint, engine_for(checkpoint)) as (server, stub, engine):
            ids = server.app.tokenizer.encode(TEXT)
            greedy = pb.GenerateRequest(text=TEXT, sampling=pb.SamplingParams(temperature=0.0),
                                        stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True))
            alone = [m async for m in stub.Generate(greedy)][-1].complete.token_ids

            async def generate():
                return [m async for m in stub.Generate(greedy)][-1].complete.token_ids

            calls = [stub.Embed(pb.EmbedRequest(text=TEXT)),  # the defaults: last token, normalized
                     stub.Embed(pb.EmbedRequest(token_ids=pb.TokenIds(ids=ids), pooling=pb.MEAN, normalize=False)),
                     stub.Embed(pb.EmbedRequest(text=TEXT, pooling=pb.LAST, normalize=False, request_id="mine"))]
            results = await asyncio.gather(generate(), *calls, generate())
            assert results[0] == alone and results[-1] == alone  # generation beside embeddings: unchanged
            first, mean, last = results[1:4]
            assert (first.pooling, first.normalized, first.prompt_tokens) == (pb.LAST, True, len(ids))
            assert (mean.pooling, mean.normalized, last.request_id) == (pb.MEAN, False, "mine")
            for got, pooling, normalize in ((first, "last", True), (mean, "mean", False), (last, "last", False)):
                assert len(got.embedding) == hf.config.hidden_size
                assert list(got.embedding) == pytest.approx(expected(hf, ids, pooling, normalize), abs=1e-4)
            assert engine.stats().kv_blocks_used == 0  # every embedding's blocks were freed
            load = await stub.GetLoad(pb.GetLoadRequest())
            assert load.num_in_flight == 0
    run(body())


@pytest.mark.parametrize("request_kw, message", [
    ({}, "`input` must be set: one of `text`, `token_ids`"),
    ({"text": ""}, "`text` must not be empty"),
    ({"token_ids": pb.TokenIds(ids=[])}, "`token_ids.ids` must not be empty"),
    ({"token_ids": pb.TokenIds(ids=[5, 100000])}, "`token_ids.ids` must be < the vocabulary size 384; got 100000"),
    ({"text": TEXT, "pooling": 7}, "`pooling` must be one of LAST, MEAN or unset; got 7"),
    ({"token_ids": pb.TokenIds(ids=[5] * 1024)}, "the prompt (`token_ids.ids`) has 1024 tokens; the limit is 1023 (--max-prompt-tokens)"),
    ({"text": TEXT, "request_id": "bad\nid"}, "`request_id` must be printable and at most 256 characters"),
])
def test_bad_input_is_refused_naming_the_field_and_nothing_else_breaks(checkpoint, hf, request_kw, message):
    async def body():
        async with serving(checkpoint, engine_for(checkpoint)) as (server, stub, _):
            code, details = await refused(stub.Embed(pb.EmbedRequest(**request_kw)))
            assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, message)
            ok = await stub.Embed(pb.EmbedRequest(token_ids=pb.TokenIds(ids=[5, 6, 7])))
            assert list(ok.embedding) == pytest.approx(expected(hf, [5, 6, 7], "last", True), abs=1e-4)
    run(body())


def test_server_defaults_and_the_helpers_both_apis_call(checkpoint, hf):
    """--embed-pooling mean / --no-embed-normalize are the defaults of a request that names none (a request that names
    them gets them); the helper's prompt errors name the caller's field; flush_cache drops the unused cached
    blocks."""
    async def body():
        engine = engine_for(checkpoint, embed_pooling="mean", embed_normalize=False)
        async with serving(checkpoint, engine) as (server, stub, _):
            app = server.app
            assert app.capabilities.embed and app.capabilities.embed_defaults == EmbedParams("mean", False)
            got = await stub.Embed(pb.EmbedRequest(text=TEXT))
            ids = app.tokenizer.encode(TEXT)
            assert (got.pooling, got.normalized) == (pb.MEAN, False)
            assert list(got.embedding) == pytest.approx(expected(hf, ids, "mean", False), abs=1e-4)
            named = await stub.Embed(pb.EmbedRequest(text=TEXT, pooling=pb.LAST, normalize=True))
            assert list(named.embedding) == pytest.approx(expected(hf, ids, "last", True), abs=1e-4)
            with pytest.raises(embedding.ValidationError, match=r"`tokenized.input_ids` must not be empty"):
                app.validator.prompt_ids([], "tokenized.input_ids")  # the caller's field in the message
            cached = engine.stats().kv_blocks_cached
            assert cached > 0  # the last-pooled one filled the prefix cache (a mean-pooled one too)
            assert await embedding.flush_cache(app) == cached
            assert engine.stats().kv_blocks_cached == 0 and await embedding.flush_cache(app) == 0
    run(body())


@pytest.mark.parametrize("api", ["llm", "executor"])
def test_tensorrt_llm_answers_unimplemented(tokenizer_dir, tmp_path, api):
    """Neither TensorRT-LLM adapter has Embeds nor FlushesCache: Embed is UNIMPLEMENTED with a message that says
    why, and the helpers refuse the same way."""
    from tests.fakes.fixtures import make_engine_dir
    from tokenloop.trtllm import create_trtllm_executor

    async def body():
        with fake_trtllm():
            model = make_engine_dir(tmp_path / "engine", tokenizer_dir) if api == "executor" else tokenizer_dir
            executor = create_trtllm_executor(str(model), trtllm_api=api)
            caps = Capabilities.of(executor)
            assert not caps.embed and caps.flush_cache is None
            async with serving(model, executor) as (server, stub, _):
                code, details = await refused(stub.Embed(pb.EmbedRequest(text=TEXT)))
                assert (code, details) == (grpc.StatusCode.UNIMPLEMENTED, NO_EMBED)
                with pytest.raises(Unimplemented):
                    await embedding.flush_cache(server.app)
    run(body())


def test_python_client_and_cli(checkpoint, hf, capsys):
    from tokenloop_client import AsyncClient
    from tokenloop_client.cli import main as client_main

    async def body():
        async with serving(checkpoint, engine_for(checkpoint)) as (server, _stub, _):
            ids = server.app.tokenizer.encode(TEXT)
            async with AsyncClient(f"127.0.0.1:{server.port}") as client:
                got = await client.embed(TEXT, pooling="mean")
                assert (got.pooling, got.normalized, got.prompt_tokens) == ("mean", True, len(ids))
                assert got.embedding == pytest.approx(expected(hf, ids, "mean", True), abs=1e-4)
                by_ids = await client.embed(token_ids=ids, normalize=False)
                assert by_ids.embedding == pytest.approx(expected(hf, ids, "last", False), abs=1e-4)
            code = await asyncio.to_thread(client_main, ["--address", f"127.0.0.1:{server.port}", "embed", TEXT,
                                                         "--pooling", "mean", "--json"])
            assert code == 0
            out = json.loads(capsys.readouterr().out)
            assert out["embedding"] == pytest.approx(expected(hf, ids, "mean", True), abs=1e-4)
            assert (out["pooling"], out["prompt_tokens"]) == ("mean", len(ids))
    run(body())


def test_embed_waits_for_a_slot_and_abort_cancels_it(checkpoint):
    """Embed takes an admission slot like Generate: with one slot held by a generation it waits in line, and Abort
    by its request_id ends it CANCELLED; once the slot is free the next Embed runs."""
    async def body():
        async with serving(checkpoint, engine_for(checkpoint), max_concurrent_requests=1) as (server, stub, _):
            long = stub.Generate(pb.GenerateRequest(text=TEXT, stream=True, sampling=pb.SamplingParams(temperature=0.0),
                                                    stopping=pb.StoppingCriteria(max_new_tokens=900, ignore_eos=True)))
            await long.read()  # it holds the one slot
            waiting = asyncio.ensure_future(stub.Embed(pb.EmbedRequest(text=TEXT, request_id="queued")))
            while server.app.admission.num_waiting == 0:
                await asyncio.sleep(0.01)
            assert (await stub.Abort(pb.AbortRequest(request_id="queued"))).found
            code, details = await refused(waiting)
            assert code == grpc.StatusCode.CANCELLED and "'queued' was aborted" in details
            long.cancel()
            got = await stub.Embed(pb.EmbedRequest(text=TEXT))
            assert len(got.embedding) == 64
    run(body())


def test_flush_cache_on_a_dead_engine_is_unavailable(checkpoint):
    async def body():
        engine = engine_for(checkpoint)
        async with serving(checkpoint, engine) as (server, _stub, _):
            engine.shutdown()
            with pytest.raises(embedding.Unavailable, match="the engine is shutting down"):
                await embedding.flush_cache(server.app)
    run(body())
