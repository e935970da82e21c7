"""A request's failure is that request's alone (issue 28): bad requests beside 16 concurrent streams, both APIs,
on the embedded engine with a tiny random model; many bad requests in a row; an idle engine's death.

The bad requests are the ones a hostile-client probe found: values that validation lets through but sampling
cannot use (a structure and stop rules that leave no token allowed), values now refused or made computable at
validation (temperature 1e-45, repetition_penalty 1e-40, stop_token_ids covering the vocabulary), and a model
forward that fails for one request's rows (TOKENLOOP_DEBUG_FAULT's `position:N`, looper/faults.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tests.conftest import run
from tests.integration.service_harness import serving
from tests.tiny_model import make_tiny_model
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.looper.faults import break_forward
from tokenloop.v1 import tokenloop_pb2 as pb

POISON_POSITION = 200  # a model forward over this position raises: only the long-prompt request reaches it
TOKEN_A = 67  # the tiny tokenizer's only token that can start the text "a"
OK, INVALID, INTERNAL = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL
NO_TOKEN = ("no token is allowed at output token 0: the `structured` constraint with `stop_token_ids` and EOS held "
            "back by `min_new_tokens` (1) forbid every token")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama-isolation"), "llama")


@asynccontextmanager
async def engine_server(checkpoint, position: int | None = POISON_POSITION, after: int | None = None):
    """(server, tokenloop.v1 stub, trtllm stub, health stub, engine) with the embedded engine on the tiny model."""
    engine = Engine.from_dir(checkpoint, EngineConfig(kv_cache_tokens=16384, max_batch_size=64, max_num_tokens=256))
    break_forward(engine, after=after, position=position)
    async with serving(checkpoint, engine) as (server, stub, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, stub, tpb_grpc.TrtllmServiceStub(channel), health_pb2_grpc.HealthStub(channel), engine


async def outcome(call) -> tuple[grpc.StatusCode, list[int] | str]:
    """(OK, the output token ids of sequence 0) or (code, details) of one tokenloop.v1 Generate."""
    ids = []
    try:
        async for msg in call:
            if msg.HasField("complete") and msg.complete.index == 0:
                ids = list(msg.complete.token_ids)
        return OK, ids
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details()


async def health(stub) -> int:
    return (await stub.Check(health_pb2.HealthCheckRequest(service=""))).status


# -- tokenloop.v1 -------------------------------------------------------------------------------------------------

def v1_good(i: int) -> pb.GenerateRequest:
    """8 greedy and 8 seeded sampled streams on different prompts."""
    sampling = pb.SamplingParams(temperature=0.0) if i < 8 else pb.SamplingParams(temperature=0.8, top_k=40, seed=i)
    return pb.GenerateRequest(text=f"Stream {i}: the quick brown fox number {i * 7}", stream=True, sampling=sampling,
                              stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True))


def v1_bad(vocab: int, eos: tuple[int, ...]) -> list[tuple[pb.GenerateRequest, grpc.StatusCode, str]]:
    """(request, the status it gets, a part of its message)."""
    stopping = pb.StoppingCriteria(max_new_tokens=8, min_new_tokens=1, stop_token_ids=[TOKEN_A])
    covering = [t for t in range(vocab) if t not in eos]
    return [
        (pb.GenerateRequest(text="Say a:", regex="a", stopping=stopping, stream=True,
                            sampling=pb.SamplingParams(temperature=0.7, seed=1)), INVALID, NO_TOKEN),
        (pb.GenerateRequest(text="Say a:", regex="a", stopping=stopping, stream=True,
                            sampling=pb.SamplingParams(temperature=0.0)), INVALID, NO_TOKEN),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(repetition_penalty=1e-40), stream=True),
         INVALID, "`sampling.repetition_penalty` must be between 0.01 and 100 (1 disables it); got 1e-40"),
        (pb.GenerateRequest(text="x", stream=True, stopping=pb.StoppingCriteria(stop_token_ids=covering,
                                                                                min_new_tokens=2)),
         INVALID, "`stopping.stop_token_ids` "),  # covers the vocabulary (or, where a count limit applies: too many)
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5 + i % 300 for i in range(POISON_POSITION + 20)]),
                            stream=True, stopping=pb.StoppingCriteria(max_new_tokens=4)),
         INTERNAL, "generation failed: the model failed on this request: RuntimeError: injected forward fault"),
    ]


def test_v1_bad_requests_fail_alone_beside_16_streams_that_get_their_tokens(checkpoint):
    async def body():
        async with engine_server(checkpoint) as (server, stub, _, health_stub, engine):
            card = server.app.card
            alone = await asyncio.gather(*(outcome(stub.Generate(v1_good(i))) for i in range(16)))
            assert all(code is OK and len(ids) == 24 for code, ids in alone)
            bad = v1_bad(card.vocab_size, card.eos_token_ids)
            # 1e-45 is greedy (as vLLM: below 1e-5), so it gets the greedy stream's tokens
            tiny = pb.GenerateRequest(text="Stream 0: the quick brown fox number 0", stream=True,
                                      sampling=pb.SamplingParams(temperature=1e-45),
                                      stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True))
            calls = [stub.Generate(v1_good(i)) for i in range(16)] + [stub.Generate(r) for r, _, _ in bad]
            together = await asyncio.gather(*(outcome(c) for c in calls), outcome(stub.Generate(tiny)))
            assert together[:16] == alone, "a stream's tokens changed beside the bad requests"
            for (code, details), (_, want_code, want) in zip(together[16:-1], bad):
                assert code is want_code and want in details, (code, details)
            assert together[-1] == alone[0]
            assert engine.num_failed_steps == 0 and engine.dead is None
            assert await health(health_stub) == health_pb2.HealthCheckResponse.SERVING

    run(body())


def test_the_server_keeps_serving_after_many_bad_requests_in_a_row(checkpoint, caplog):
    """... and the requests whose own values fail in sampling (INVALID_ARGUMENT) leave no warning each: a client
    repeats them at will, and only the request log's budgeted line may record them (docs/robustness.md)."""
    caplog.set_level(logging.DEBUG, logger="tokenloop.engine.engine")

    async def body():
        async with engine_server(checkpoint) as (server, stub, _, health_stub, engine):
            card = server.app.card
            first = await outcome(stub.Generate(v1_good(3)))
            runtime_bad = [v1_bad(card.vocab_size, card.eos_token_ids)[i] for i in (0, 1, 4)]  # reach the engine
            for k in range(30):
                request, code, want = runtime_bad[k % 3]
                got_code, details = await outcome(stub.Generate(request))
                assert got_code is code and want in details, (k, got_code, details)
            assert engine.num_failed_steps == 0 and engine.dead is None and not server.app.dead.is_set()
            assert await health(health_stub) == health_pb2.HealthCheckResponse.SERVING
            assert await outcome(stub.Generate(v1_good(3))) == first

    run(body())
    sampling = [r for r in caplog.records if "failed in sampling" in r.getMessage()]
    assert len(sampling) == 20 and all(r.levelno == logging.DEBUG for r in sampling), \
        [(r.levelname, r.getMessage()) for r in sampling[:3]]
    forward = [r for r in caplog.records if "fails alone in the model forward" in r.getMessage()]
    assert len(forward) == 10 and all(r.levelno == logging.WARNING for r in forward)  # the server's own fault


# -- trtllm.TrtllmService ------------------------------------------------------------------------------------------

def trt_good(ids: list[int], i: int) -> tpb.GenerateRequest:
    sampling = tpb.SamplingConfig(temperature=0.0) if i < 4 else tpb.SamplingConfig(temperature=0.8, top_k=40,
                                                                                    seed=i)
    return tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=ids + [10 + i]), max_tokens=16,
                               streaming=True, ignore_eos=True, sampling_config=sampling)


async def trt_outcome(call) -> tuple[grpc.StatusCode, list[int] | str]:
    """(OK, the output token ids) or (code, details) of one trtllm.TrtllmService Generate."""
    ids = []
    try:
        async for msg in call:
            if msg.HasField("complete"):
                ids = list(msg.complete.output_token_ids)
        return OK, ids
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details()


def test_trtllm_bad_requests_fail_alone_beside_8_streams(checkpoint):
    async def body():
        async with engine_server(checkpoint) as (server, _, trt, health_stub, engine):
            ids = server.app.tokenizer.encode("Router stream")
            card = server.app.card
            alone = await asyncio.gather(*(trt_outcome(trt.Generate(trt_good(ids, i))) for i in range(8)))
            assert all(code is OK and len(out) == 16 for code, out in alone), alone
            guide = tpb.GuidedDecodingParams(guide_type=tpb.GuidedDecodingParams.GuideType.GUIDE_TYPE_REGEX,
                                             guide="a")
            covering = [t for t in range(card.vocab_size) if t not in card.eos_token_ids]
            bad = [
                (tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=ids), max_tokens=8, streaming=True,
                                     stop_token_ids=[TOKEN_A], guided_decoding=guide,
                                     sampling_config=tpb.SamplingConfig(temperature=0.7, seed=2, min_tokens=1)),
                 INVALID, NO_TOKEN),
                (tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=ids), max_tokens=8, streaming=True,
                                     sampling_config=tpb.SamplingConfig(repetition_penalty=1e-40)),
                 INVALID, "`sampling_config.repetition_penalty` must be between 0.01 and 100"),
                (tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=ids), max_tokens=8, streaming=True,
                                     stop_token_ids=covering, sampling_config=tpb.SamplingConfig(min_tokens=1)),
                 INVALID, "`stop_token_ids` "),  # the exact rule: tests/unit/test_validation.py
                (tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=[5] * (POISON_POSITION + 8)),
                                     max_tokens=4, streaming=True),
                 INTERNAL, "the model failed on this request"),
            ]
            calls = [trt.Generate(trt_good(ids, i)) for i in range(8)] + [trt.Generate(r) for r, _, _ in bad]
            together = await asyncio.gather(*(trt_outcome(c) for c in calls))
            assert together[:8] == alone, "a router stream's tokens changed beside the bad requests"
            for (code, details), (_, want_code, want) in zip(together[8:], bad):
                assert code is want_code and want in details, (code, details)
            assert engine.num_failed_steps == 0 and engine.dead is None
            assert await health(health_stub) == health_pb2.HealthCheckResponse.SERVING

    run(body())


# -- an engine fault no request explains ---------------------------------------------------------------------------

def test_an_idle_engine_death_turns_health_not_serving_at_once(checkpoint):
    """Every forward fails (TOKENLOOP_DEBUG_FAULT=forward:0): three requests, one after another, fail with INTERNAL
    and the third failed step kills the engine while no request is in flight. The looper hears of it from the
    engine (not at the next Generate): health turns NOT_SERVING and the server's `dead` event is set, which makes
    `tokenloop serve` exit (tests/e2e/test_request_isolation.py)."""
    async def body():
        async with engine_server(checkpoint, position=None, after=0) as (server, stub, _, health_stub, engine):
            for _ in range(3):
                code, details = await outcome(stub.Generate(v1_good(0)))
                assert code is INTERNAL and "injected forward fault" in details
            ended = time.monotonic()
            while await health(health_stub) == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() - ended < 5.0, "health still SERVING 5 s after the engine died idle"
                await asyncio.sleep(0.01)
            assert await health(health_stub) == health_pb2.HealthCheckResponse.NOT_SERVING
            assert server.app.dead.is_set() and engine.dead is not None and not server.app.looper.alive
            code, details = await outcome(stub.Generate(v1_good(1)))
            assert code is grpc.StatusCode.UNAVAILABLE

    run(body())
