"""Fuzzed GenerateRequests through a real in-process server: every answer is OK or INVALID_ARGUMENT, none leaks a
traceback, and no request is left running (the validator alone: tests/unit/test_validation_fuzz.py)."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import run
from tests.integration.service_harness import serving
from tests.request_strategies import generate_requests
from tokenloop.v1 import tokenloop_pb2 as pb


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                               HealthCheck.too_slow])
@given(requests=st.lists(generate_requests(), min_size=40, max_size=40))
def test_a_real_server_answers_ok_or_invalid_argument(tokenizer_dir, requests):
    async def body():
        codes = []
        async with serving(tokenizer_dir, max_new_tokens=64, default_max_new_tokens=16, max_n=4,
                           max_prompt_tokens=100, max_stop_strings=3, max_stop_string_length=8) as (_, stub, _):
            for i, request in enumerate(requests):
                request.request_id = f"fuzz-{i}" if request.request_id == "" else request.request_id
                try:
                    msgs = [m async for m in stub.Generate(request, timeout=30)]
                    assert msgs and msgs[-1].HasField("complete")
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code())
                    assert "Traceback" not in err.details() and "File \"" not in err.details()
            assert (await stub.GetLoad(pb.GetLoadRequest())).num_running == 0
        return codes

    codes = run(body())
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, codes
