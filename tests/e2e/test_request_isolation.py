"""A request's failure is that request's alone, on a real `tokenloop serve` with the default model (issue 28).

The values a hostile-client probe sent (temperature 1e-45, repetition_penalty 1e-40, stop_token_ids covering the
vocabulary with min_new_tokens) once failed every stream of an engine step and, three steps in a row, killed the
process; and an engine that died while idle left health SERVING until the next Generate. Here: 16 streams beside
those requests complete with the tokens they get without them, and an idle engine's death (every model forward
failing: TOKENLOOP_DEBUG_FAULT=forward:0) turns health NOT_SERVING and ends the process without another request.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e.live_server import DEFAULT_MODEL, Proc, outcome
from tokenloop.core.tokenizer import ModelCard
from tokenloop.v1 import tokenloop_pb2 as pb

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(),
                                reason="the default model is not prepared: run `make model`")
SERVING = health_pb2.HealthCheckResponse.SERVING


def good(i: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(temperature=0.0) if i % 2 == 0 else pb.SamplingParams(temperature=0.8, seed=i)
    return pb.GenerateRequest(text=f"Write a short note number {i} about the sea.", stream=True, sampling=sampling,
                              stopping=pb.StoppingCriteria(max_new_tokens=16, ignore_eos=True))


def bad() -> list[tuple[pb.GenerateRequest, grpc.StatusCode]]:
    card = ModelCard.from_dir(DEFAULT_MODEL)
    covering = [t for t in range(card.vocab_size) if t not in card.eos_token_ids]
    return [
        (pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(temperature=1e-45),
                            stopping=pb.StoppingCriteria(max_new_tokens=8)), grpc.StatusCode.OK),
        (pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(temperature=0.7, repetition_penalty=1e-40),
                            stopping=pb.StoppingCriteria(max_new_tokens=8)), grpc.StatusCode.INVALID_ARGUMENT),
        (pb.GenerateRequest(text="Hi", stopping=pb.StoppingCriteria(max_new_tokens=8, min_new_tokens=2,
                                                                    stop_token_ids=covering)),
         grpc.StatusCode.INVALID_ARGUMENT),
    ] * 3


def tokens_of(result) -> list[int] | None:
    code, msgs = result
    return list(msgs[-1].complete.token_ids) if code is grpc.StatusCode.OK else None


def test_16_streams_beside_the_probe_values_complete_with_their_own_tokens():
    server = Proc()
    try:
        with ThreadPoolExecutor(32) as pool:
            alone = list(pool.map(lambda i: tokens_of(outcome(server.stub, good(i))), range(16)))
            assert all(t is not None and len(t) == 16 for t in alone)
            bad_requests = bad()
            futures = [pool.submit(outcome, server.stub, good(i)) for i in range(16)]
            futures += [pool.submit(outcome, server.stub, r) for r, _ in bad_requests]
            results = [f.result() for f in futures]
        assert [tokens_of(r) for r in results[:16]] == alone
        assert [code for code, _ in results[16:]] == [code for _, code in bad_requests]
        health = health_pb2_grpc.HealthStub(server.channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == SERVING
    finally:
        server.kill()


def test_an_idle_engine_death_turns_health_not_serving_and_exits_1_without_another_request():
    server = Proc(env={"TOKENLOOP_DEBUG_FAULT": "forward:0"})
    try:
        health = health_pb2_grpc.HealthStub(server.channel)
        for _ in range(3):  # each fails alone and the model fails a probe too: three such steps kill the engine
            code, msgs = outcome(server.stub, good(0))
            assert code is grpc.StatusCode.INTERNAL and "injected forward fault" in msgs[-1]
        died = time.monotonic()  # the third failed step ends the engine right after its error went out
        statuses, not_serving_s = [], None
        while server.proc.poll() is None and time.monotonic() - died < 60:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
            except grpc.RpcError:
                status = None  # the server has closed its port
            statuses.append(status)
            if status != SERVING and not_serving_s is None:
                not_serving_s = time.monotonic() - died
            time.sleep(0.01)
        exit_code = server.wait(timeout=5)  # before the fix: still SERVING after 60 s, so no exit here
        exit_s = time.monotonic() - died
        assert exit_code == 1, "".join(server.lines[-20:])
        first_not = next((i for i, st in enumerate(statuses) if st != SERVING), len(statuses))
        assert SERVING not in statuses[first_not:], statuses  # never SERVING again once it was not
        print(f"idle engine death: health not SERVING after {not_serving_s} s, exit after {exit_s:.2f} s "
              f"({len(statuses)} checks)")
    finally:
        server.kill()
