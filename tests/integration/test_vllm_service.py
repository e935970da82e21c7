"""vllm.grpc.engine.VllmEngine (smg's vLLM worker protocol) through a real in-process server and the generated stub:
the tiny random-weight model on the embedded engine for what sampling does (stream and not, n, seed, structured
outputs, logprobs, abort), a scripted executor for what the executor is given (the model's defaults)."""

from __future__ import annotations

import asyncio
import io
import json
import re
import shutil
import zipfile
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from tests.conftest import run
from tests.integration.service_harness import serving
from tests.scripted_executor import ScriptedExecutor
from tests.tiny_model import make_tiny_model
from tokenloop.core.capabilities import NO_EMBED, NO_FLUSH_CACHE
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

PROMPT = "Hello world, hello gRPC streams."


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model with the sampling defaults SmolLM2-Instruct's publishers recommend (as `make model` writes)."""
    path = make_tiny_model(tmp_path_factory.mktemp("vllm-tiny"), "llama")
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "do_sample": True, "temperature": 0.2,
                                                             "top_p": 0.9}))
    return path


@pytest.fixture(scope="module")
def ids(checkpoint):
    return Tokenizer.from_dir(checkpoint).encode(PROMPT)


@asynccontextmanager
async def vllm(model_dir, executor=None, **config):
    """(server, VllmEngine stub, executor) on a running server; the embedded engine on `model_dir` by default."""
    if executor is None:
        executor = Engine.from_dir(model_dir, EngineConfig(dtype="float32", kv_cache_tokens=4096, block_size=8,
                                                           enable_prefix_caching=True))
    async with serving(model_dir, executor, **config) as (server, _stub, ex):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, vpb_grpc.VllmEngineStub(channel), ex


def gen(ids, stream=False, request_id="", **sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(request_id=request_id, tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream,
                               sampling_params=vpb.SamplingParams(**sampling))


async def read_all(call) -> list:
    out = []
    while (msg := await call.read()) is not grpc.aio.EOF:
        out.append(msg)
    return out


async def completes(stub, request) -> list[vpb.GenerateComplete]:
    msgs = await read_all(stub.Generate(request))
    return [m.complete for m in msgs if m.HasField("complete")]


def test_streaming_sends_deltas_and_unary_one_complete_with_the_same_tokens(checkpoint, ids):
    async def body():
        async with vllm(checkpoint) as (server, stub, _):
            msgs = await read_all(stub.Generate(gen(ids, stream=True, temperature=0, max_tokens=12, ignore_eos=True)))
            chunks = [m.chunk for m in msgs if m.HasField("chunk")]
            # how many chunks depends on how far the reader fell behind (ready tokens go out together)
            assert chunks and msgs[-1].HasField("complete") and len(msgs) == len(chunks) + 1
            streamed = [t for c in chunks for t in c.token_ids]
            assert [c.completion_tokens for c in chunks] == [len(c.token_ids) for c in chunks]  # deltas
            assert {c.prompt_tokens for c in chunks} == {len(ids)} and len(streamed) == 12
            done = msgs[-1].complete
            assert list(done.output_ids) == list(chunks[-1].token_ids)  # the last delta, as vLLM sends it
            assert done.finish_reason == "length" and done.prompt_tokens == len(ids)
            (unary,) = await completes(stub, gen(ids, temperature=0, max_tokens=12, ignore_eos=True))
            assert list(unary.output_ids) == streamed and unary.completion_tokens == 12  # greedy: the same tokens
            assert unary.cached_tokens > 0  # the prompt's blocks, cached by the first request
    run(body())


def test_unset_max_tokens_is_the_servers_default_max_new_tokens(checkpoint, ids):
    async def body():
        async with vllm(checkpoint, default_max_new_tokens=7) as (server, stub, _):
            (done,) = await completes(stub, gen(ids, ignore_eos=True))
            assert done.completion_tokens == 7 and done.finish_reason == "length"
    run(body())


def test_n_and_seed_reproduce_and_differ(checkpoint, ids):
    async def body():
        async with vllm(checkpoint) as (server, stub, _):
            async def texts(seed, n=2):
                out = await completes(stub, gen(ids, temperature=1.0, top_p=1.0, max_tokens=16, ignore_eos=True,
                                                seed=seed, n=n))
                assert sorted(c.index for c in out) == list(range(n))
                return {c.index: list(c.output_ids) for c in out}
            first, again, other = await texts(7), await texts(7), await texts(8)
            assert first == again and first != other and first[0] != first[1]
            streamed = await read_all(stub.Generate(gen(ids, stream=True, temperature=1.0, top_p=1.0, max_tokens=16,
                                                        ignore_eos=True, seed=7, n=2)))
            by_index: dict[int, list[int]] = {}
            for m in streamed:
                if m.HasField("chunk"):
                    by_index.setdefault(m.chunk.index, []).extend(m.chunk.token_ids)
            assert by_index == first  # streamed or not, the seed gives the same tokens
    run(body())


def test_structured_outputs_constrain_the_tokens(checkpoint, ids):
    tok = Tokenizer.from_dir(checkpoint)

    async def body():
        async with vllm(checkpoint) as (server, stub, _):
            async def text(**constraint):
                (done,) = await completes(stub, gen(ids, temperature=1.0, seed=3, max_tokens=60, **constraint))
                return tok.decode(list(done.output_ids), skip_special_tokens=True), done
            out, done = await text(regex="[ab]{3}-[0-9]{2}")
            assert re.fullmatch("[ab]{3}-[0-9]{2}", out) and done.finish_reason == "stop", out
            out, _ = await text(choice=vpb.ChoiceConstraint(choices=["yes", "no", "maybe"]))
            assert out in ("yes", "no", "maybe"), out
            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                      "additionalProperties": False}
            out, _ = await text(json_schema=json.dumps(schema))
            assert isinstance(json.loads(out)["ok"], bool), out
            out, _ = await text(grammar='start: "x" ("y" | "z")')
            assert out in ("xy", "xz"), out
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await completes(stub, gen(ids, regex="[unclosed"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "`sampling_params.regex`" in err.value.details()
    run(body())


def test_logprobs_and_top_logprobs(checkpoint, ids):
    async def body():
        async with vllm(checkpoint) as (server, stub, _):
            (done,) = await completes(stub, gen(ids, temperature=0, max_tokens=5, ignore_eos=True, logprobs=3))
            lps = done.output_logprobs
            assert list(lps.token_ids) == list(done.output_ids) and len(lps.token_logprobs) == 5
            assert all(len(t.token_ids) == len(t.values) == 3 for t in lps.top_logprobs)
            assert all(t.token_ids[0] == chosen for t, chosen in zip(lps.top_logprobs, done.output_ids))  # greedy
            assert all(v <= 0 for v in lps.token_logprobs)
            (plain,) = await completes(stub, gen(ids, temperature=0, max_tokens=5, ignore_eos=True))
            assert not plain.HasField("output_logprobs")
    run(body())


def test_abort_ends_a_streaming_request_with_abort(checkpoint, ids):
    async def body():
        async with vllm(checkpoint) as (server, stub, _):
            call = stub.Generate(gen(ids, stream=True, request_id="long", max_tokens=900, ignore_eos=True))
            first = await call.read()
            assert first.HasField("chunk")
            await stub.Abort(vpb.AbortRequest(request_ids=["long", "unknown"]))
            rest = await read_all(call)
            assert rest[-1].HasField("complete") and rest[-1].complete.finish_reason == "abort"
            assert sum(len(m.chunk.token_ids) for m in rest if m.HasField("chunk")) < 800
            assert server.app.looper.num_open == 0
    run(body())


def test_unset_fields_reach_the_executor_as_the_models_defaults(checkpoint, ids):
    executor = ScriptedExecutor()

    async def body():
        async with vllm(checkpoint, executor) as (server, stub, ex):
            await completes(stub, gen(ids, max_tokens=2))
            await completes(stub, gen(ids, max_tokens=2, temperature=0.7, top_p=0.5, seed=11))
            return [(r.sampling.temperature, r.sampling.top_p) for r in ex.enqueued], ex.enqueued[1].sampling.seed

    got, seed = run(body())
    assert got == [(pytest.approx(0.2), pytest.approx(0.9)), (pytest.approx(0.7), pytest.approx(0.5))]
    assert seed == 11


def test_model_info_server_info_loads_health_and_tokenizer(checkpoint):
    async def body():
        async with vllm(checkpoint, model_id="tiny") as (server, stub, _):
            info = await stub.GetModelInfo(vpb.GetModelInfoRequest())
            assert json.loads(info.default_sampling_params_json) == {"temperature": 0.2, "top_p": 0.9}
            assert info.served_model_name == "tiny" and info.is_generation and not info.supports_vision
            assert info.vocab_size == 384 and list(info.eos_token_ids) == [2] and info.max_context_length == 1024
            assert list(info.architectures) == ["LlamaForCausalLM"] and info.max_req_input_len == 1023
            health = await stub.HealthCheck(vpb.HealthCheckRequest())
            assert health.healthy
            server_info = await stub.GetServerInfo(vpb.GetServerInfoRequest())
            assert server_info.data_parallel_size == 1 and server_info.block_size == 8
            loads = await stub.GetLoads(vpb.GetLoadsRequest())
            (load,) = loads.loads
            assert loads.dp_rank_count == 1 and load.max_running_requests == 64
            assert load.max_total_num_tokens >= 4096 and load.num_running_reqs == 0
            chunks = [c async for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
            names = zipfile.ZipFile(io.BytesIO(b"".join(c.data for c in chunks))).namelist()
            assert "tokenizer.json" in names and chunks[-1].sha256
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await completes(stub, gen([5, 6], logit_bias={5: 2.0}))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "`sampling_params.logit_bias` cannot be honoured" in err.value.details()
            kv = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
            batch = await asyncio.wait_for(kv.read(), 10)
            assert batch.HasField("load")  # the same hub as trtllm.TrtllmService
            kv.cancel()
    run(body())


def test_router_protocol_chooses_the_services(checkpoint, tmp_path):
    model = shutil.copytree(checkpoint, tmp_path / "m")

    async def body(protocol):
        async with vllm(model, ScriptedExecutor(), router_protocol=protocol) as (server, stub, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                trt = tpb_grpc.TrtllmServiceStub(channel)
                health = health_pb2_grpc.HealthStub(channel)
                served = {}
                for name, call in (("vllm", stub.HealthCheck(vpb.HealthCheckRequest())),
                                   ("trtllm", trt.HealthCheck(tpb.HealthCheckRequest()))):
                    try:
                        await call
                        served[name] = True
                    except grpc.aio.AioRpcError as err:
                        assert err.code() == grpc.StatusCode.UNIMPLEMENTED
                        served[name] = False
                status = {}
                for name in ("vllm.grpc.engine.VllmEngine", "trtllm.TrtllmService"):
                    try:
                        status[name] = (await health.Check(health_pb2.HealthCheckRequest(service=name))).status
                    except grpc.aio.AioRpcError as err:
                        status[name] = err.code().name
                return served, status

    serving_ = health_pb2.HealthCheckResponse.SERVING
    assert run(body("both")) == ({"vllm": True, "trtllm": True},
                                 {"vllm.grpc.engine.VllmEngine": serving_, "trtllm.TrtllmService": serving_})
    assert run(body("trtllm")) == ({"vllm": False, "trtllm": True},
                                   {"vllm.grpc.engine.VllmEngine": "NOT_FOUND", "trtllm.TrtllmService": serving_})
    assert run(body("vllm")) == ({"vllm": True, "trtllm": False},
                                 {"vllm.grpc.engine.VllmEngine": serving_, "trtllm.TrtllmService": "NOT_FOUND"})


def test_embed_is_tokenloop_v1_embed_and_flush_cache_drops_the_unused_blocks(checkpoint, ids):
    async def body():
        async with vllm(checkpoint) as (server, stub, engine):
            got = await stub.Embed(vpb.EmbedRequest(request_id="e1", tokenized=vpb.TokenizedInput(input_ids=ids)))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                v1 = await pb_grpc.TextGenerationStub(channel).Embed(pb.EmbedRequest(token_ids=pb.TokenIds(ids=ids)))
            assert got.embedding_dim == len(got.embedding) == 64 and got.prompt_tokens == len(ids)
            assert list(got.embedding) == pytest.approx(list(v1.embedding), abs=1e-5)  # the same helper, defaults
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[])))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "`tokenized.input_ids` must not be empty" in err.value.details()
            await completes(stub, gen(ids, max_tokens=4))
            cached = engine.stats().kv_blocks_cached
            assert cached > 0
            flushed = await stub.FlushCache(common_pb2.FlushCacheRequest())
            assert flushed.success and flushed.message == f"dropped {cached} unused prefix-cache blocks"
            assert engine.stats().kv_blocks_cached == 0
            again = await stub.FlushCache(common_pb2.FlushCacheRequest())
            assert again.message == "dropped 0 unused prefix-cache blocks"
    run(body())


def test_embed_and_flush_cache_without_the_capability_are_unimplemented(checkpoint):
    async def body():
        async with vllm(checkpoint, ScriptedExecutor()) as (server, stub, _):
            for call, message in ((stub.Embed(vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=[5, 6]))),
                                   NO_EMBED), (stub.FlushCache(common_pb2.FlushCacheRequest()), NO_FLUSH_CACHE)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNIMPLEMENTED, message)
    run(body())
