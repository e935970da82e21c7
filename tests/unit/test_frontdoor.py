"""service.frontdoor: the one admission pipeline's order and error policy, driven without a server (a scripted app:
real Admission, a fake looper whose streams replay given batches, a fake grpc context)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import types

import grpc
import pytest

from tokenloop.core.executor import ErrorKind
from tokenloop.core.request import FinishReason, ValidRequest
from tokenloop.looper.stream import Chunk, Complete, RequestFailed, Timing
from tokenloop.service import servicer
from tokenloop.service.admission import Admission
from tokenloop.service.errors import Unavailable, ValidationError
from tokenloop.service.frontdoor import FrontDoor, add_service, unary
from tokenloop.service.servicer import SERVICE
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

RPC = "/test.Api/Generate"


class Aborted(grpc.aio.AbortError):
    pass


class FakeContext:
    def __init__(self):
        self.status: tuple[grpc.StatusCode, str] | None = None

    def invocation_metadata(self):
        return ()

    def peer(self):
        return "ipv4:127.0.0.1:1"

    def time_remaining(self):
        return None

    def cancelled(self):
        return False

    def set_trailing_metadata(self, trailers):
        pass

    def code(self):
        return self.status[0] if self.status else None

    async def abort(self, code, message):
        self.status = (code, message)
        raise Aborted()


class FakeStream:
    def __init__(self, batches):
        self.batches = list(batches)
        self.finished = self.ended = self.cancelled = False

    def take(self):
        return []  # nothing waiting: every batch comes through next_batch

    async def next_batch(self):
        if not self.batches:
            self.finished = self.ended = True
            return None
        batch = self.batches.pop(0)
        if isinstance(batch, Exception):
            raise batch
        return batch

    def cancel(self):
        self.cancelled = True


class FakeLooper:
    can_pause = False

    def __init__(self, batches):
        self.batches, self.submitted, self.streams = batches, [], []

    def find(self, rid):
        return None

    def submit(self, valid, arrival):
        self.submitted.append(valid)
        self.streams.append(FakeStream(self.batches))
        return self.streams[-1]


async def _same(valid, field=None):
    return valid


def make_app(batches=()):
    app = types.SimpleNamespace(
        config=types.SimpleNamespace(max_queue_wait=0.0, stall_timeout=0.0, slow_reader_grace=0.0),
        admission=Admission(2, 4), looper=FakeLooper(batches), not_ready_reason="", errors=[], ends=[],
        grammars=types.SimpleNamespace(admit=_same), loras=types.SimpleNamespace(admit=_same))

    def require_ready():
        if app.not_ready_reason:
            raise Unavailable(app.not_ready_reason)

    app.require_ready = require_ready
    app.observe_error = app.errors.append
    app.observe_end = lambda valid, completes, code, streamed: app.ends.append((valid.request_id, len(completes), code))
    return app


async def validate(request, rid, deadline):
    if request.bad:
        raise ValidationError("max_tokens", "`max_tokens` must be >= 1; got 0")
    return ValidRequest(request_id=rid, prompt_token_ids=(1, 2))


class Writer:
    def __init__(self, valid, request, arrival_wall):
        if request.writer_bug:
            raise KeyError("writer bug")

    def encode(self, batch):
        return [f"{type(e).__name__}:{e.index}".encode() for e in batch]


def request(**kw):
    return types.SimpleNamespace(**{"request_id": "r1", "bad": False, "writer_bug": False, **kw})


def complete(index=0):
    return Complete(index, "ab", [1, 2], FinishReason.LENGTH, 2, 0, Timing())


async def drive(app, req):
    context, out = FakeContext(), []
    handler = FrontDoor(app, RPC, validate, Writer).generate
    try:
        async for msg in handler(req, context):
            out.append(msg)
    except Aborted:
        pass
    return context, out


def test_handler_streams_the_writers_messages_and_is_the_pipeline_itself():
    async def main():
        app = make_app([[Chunk(0, "a", [1])], [complete()]])
        context, out = await drive(app, request())
        assert out == [b"Chunk:0", b"Complete:0"] and context.status is None
        assert app.ends == [("r1", 1, grpc.StatusCode.OK)] and app.admission.num_active == 0
        handler = FrontDoor(app, RPC, validate, Writer).generate
        assert inspect.isasyncgenfunction(handler)  # grpc iterates it itself: no wrapping frame per message
    asyncio.run(main())


def test_add_service_registers_what_the_generated_code_does_but_raw_generate_responses():
    """add_service's method table equals the generated `add_TextGenerationServicer_to_server`'s, method for
    method, except that Generate sends the bytes it yields (no response serializer), and it is served by a generic
    handler only: no method is registered with grpc core (grpc.aio's server loop would wait on a pending call per
    registered method for every RPC it accepts)."""
    class Recorder:
        registered = None

        def add_generic_rpc_handlers(self, handlers):
            self.generic = handlers

        def add_registered_method_handlers(self, name, handlers):
            self.registered = (name, handlers)

    servicer = pb_grpc.TextGenerationServicer()
    ours, generated = Recorder(), Recorder()
    add_service(ours, servicer, SERVICE, raw_responses="Generate")
    pb_grpc.add_TextGenerationServicer_to_server(servicer, generated)
    assert ours.registered is None and generated.registered[0] == "tokenloop.v1.TextGeneration"
    (generic,) = ours.generic
    theirs = generated.registered[1]
    assert "Generate" in theirs
    for name, expected in theirs.items():
        handler = generic.service(types.SimpleNamespace(method=f"/tokenloop.v1.TextGeneration/{name}"))
        if name == "Generate":
            assert expected.response_serializer is not None
            expected = expected._replace(response_serializer=None)
        assert handler == expected, name
    assert generic.service(types.SimpleNamespace(method="/tokenloop.v1.TextGeneration/Nonesuch")) is None


def test_the_request_log_leaves_every_front_door_generate_to_its_own_record():
    """Each API's Generate path is in GENERATE_RPCS (the interceptor leaves those unwrapped: the front door's
    RequestRecord logs them), so none is logged twice nor wrapped in a generator of the interceptor."""
    from tokenloop.service import trtllm_service, vllm_service
    from tokenloop.service.app import GENERATE_RPCS
    from tokenloop.service.logs import RequestLogInterceptor
    assert GENERATE_RPCS == {servicer.GENERATE, trtllm_service.GENERATE, vllm_service.GENERATE}

    async def main():
        marker = object()
        handler = grpc.unary_stream_rpc_method_handler(marker)

        async def continuation(details):
            return handler
        interceptor = RequestLogInterceptor(own_records=GENERATE_RPCS)
        for path in GENERATE_RPCS:
            assert await interceptor.intercept_service(continuation, types.SimpleNamespace(method=path)) is handler
        other = await interceptor.intercept_service(continuation, types.SimpleNamespace(
            method="/tokenloop.v1.TextGeneration/Other", invocation_metadata=()))
        assert other is not handler and other.unary_stream is not marker  # wrapped: logged by the interceptor
    asyncio.run(main())


@pytest.mark.parametrize("case, code", [
    ("not_ready", grpc.StatusCode.UNAVAILABLE),
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT),
    ("request_failed", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("writer_bug", grpc.StatusCode.INTERNAL),
    ("stream_bug", grpc.StatusCode.INTERNAL),
])
def test_one_error_policy_every_failure_is_a_status_and_the_slot_comes_back(case, code, caplog):
    async def main():
        batches = [[Chunk(0, "a", [1])]]
        if case == "request_failed":
            batches.append(RequestFailed(ErrorKind.RESOURCE_EXHAUSTED, "out of KV blocks"))
        if case == "stream_bug":
            batches.append(ZeroDivisionError("bug"))
        app = make_app(batches)
        app.not_ready_reason = "the model is loading" if case == "not_ready" else ""
        context, _ = await drive(app, request(bad=case == "invalid", writer_bug=case == "writer_bug"))
        assert context.status[0] == code, context.status
        assert app.errors == [code]
        assert app.admission.num_active == 0  # the slot came back on every path
        if code == grpc.StatusCode.INTERNAL:  # a bug: its type only to the client, its traceback in the log
            assert context.status[1].startswith("internal error (") and "bug" not in context.status[1]
            assert [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
        else:
            assert not [r for r in caplog.records if r.exc_info]
        if case == "stream_bug":  # submitted then failed: the stream was cancelled on the way out
            assert app.looper.streams[0].cancelled
        if case == "writer_bug":  # the writer is made before submit: nothing ran
            assert app.looper.submitted == []
    asyncio.run(main())


def test_complete_collects_every_sequence_in_order_for_a_non_streaming_api():
    async def main():
        app = make_app([[Chunk(1, "a", [1]), complete(1)], [complete(0)]])
        context = FakeContext()
        got = await FrontDoor(app).complete(request(), context, rpc=RPC, validate=validate,
                                            respond=lambda valid, completes: (valid.request_id,
                                                                              [c.index for c in completes]))
        assert got == ("r1", [0, 1]) and context.status is None
        bad = FakeContext()
        with pytest.raises(Aborted):
            await FrontDoor(app).complete(request(bad=True), bad, rpc=RPC, validate=validate, respond=None)
        assert bad.status[0] == grpc.StatusCode.INVALID_ARGUMENT
    asyncio.run(main())


class Servicer:
    def __init__(self, app):
        self.app = app

    @unary()
    async def Ready(self, request, context):
        return request()

    @unary(ready=False)
    async def Always(self, request, context):
        return request()

    @unary()
    async def Many(self, request, context):
        for x in request():
            yield x


@pytest.mark.parametrize("rpc", ["Ready", "Always", "Many"])
def test_unary_and_streaming_rpcs_share_one_error_mapping(rpc, caplog):
    async def call(servicer, fn):
        context = FakeContext()
        method = getattr(servicer, rpc)
        try:
            if rpc == "Many":
                out = [x async for x in method(fn, context)]
            else:
                out = await method(fn, context)
        except Aborted:
            out = None
        return context.status, out

    def invalid():
        raise ValidationError("name", "`name` must not be empty")

    def bug():
        raise IndexError("secret detail")

    async def main():
        app = make_app()
        servicer = Servicer(app)
        assert await call(servicer, lambda: [7]) == (None, [7])
        status, _ = await call(servicer, invalid)
        assert status == (grpc.StatusCode.INVALID_ARGUMENT, "`name` must not be empty")
        status, _ = await call(servicer, bug)
        assert status == (grpc.StatusCode.INTERNAL, "internal error (IndexError)")
        assert [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
        app.not_ready_reason = "the model is loading"
        status, out = await call(servicer, lambda: [7])
        if rpc == "Always":
            assert (status, out) == (None, [7])
        else:
            assert status == (grpc.StatusCode.UNAVAILABLE, "the model is loading")
    asyncio.run(main())
