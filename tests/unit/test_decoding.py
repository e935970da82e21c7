"""service/decoding.py: a payload that does not parse becomes a marker naming the request type and what is wrong
(every RPC of every service through a server: tests/integration/test_undecodable.py)."""

from __future__ import annotations

import grpc
import pytest

from tests.conftest import run
from tokenloop.service.decoding import DecodingInterceptor, Undecodable, decoder
from tokenloop.v1 import tokenloop_pb2 as pb


@pytest.mark.parametrize("payload, detail", [
    (b"\x0a\x05abc", "Wire format was corrupt"), (b"\xff" * 8, "Wire format was corrupt"),
    (b"\x0a\x02\xff\xfe", "String field had bad UTF-8")])
def test_an_undecodable_payload_becomes_a_marker_naming_the_type(payload, detail):
    decode = decoder(pb.GenerateRequest.FromString)
    assert decode(pb.GenerateRequest(text="ok").SerializeToString()).text == "ok"
    marker = decode(payload)
    assert type(marker) is Undecodable
    assert marker.message == f"the request is not a valid tokenloop.v1.GenerateRequest: {detail}"


class _Details:
    def __init__(self, method):
        self.method = method


class _Context:
    def __init__(self):
        self.aborted = None

    def peer(self):
        return "ipv4:127.0.0.1:1"

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


def test_a_method_that_checks_its_own_request_keeps_its_handler_and_refuses_through_the_marker():
    """`own_checks` (the generation RPCs): grpc runs the servicer's own handler (no wrapper frame per streamed
    message); only the deserializer is wrapped, and the marker's `refuse` is the interceptor's one policy."""
    async def generate(request, context):
        yield b""

    handler = grpc.unary_stream_rpc_method_handler(generate, pb.GenerateRequest.FromString, None)
    interceptor = DecodingInterceptor(own_checks=frozenset({"/s/Generate"}))

    async def continuation(details):
        return handler

    async def body():
        own = await interceptor.intercept_service(continuation, _Details("/s/Generate"))
        other = await interceptor.intercept_service(continuation, _Details("/s/Other"))
        assert own.unary_stream is generate and other.unary_stream is not generate
        marker = own.request_deserializer(b"\xff" * 8)
        context = _Context()
        with pytest.raises(grpc.aio.AbortError):
            await marker.refuse(context)
        return context.aborted

    code, details = run(body())
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "the request is not a valid tokenloop.v1.GenerateRequest: Wire format was corrupt"
    assert interceptor.num_refused == 1
