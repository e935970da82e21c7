"""The front door: ONE admission pipeline that every generation API runs, and one error mapping for every unary RPC.

A generation API (tokenloop.v1 `servicer.py`, trtllm `trtllm_service.py`, vLLM `vllm_service.py`) only maps its
messages:

    validate(request, request_id, deadline) -> Awaitable[ValidRequest]   its request -> the shared ValidRequest
                                                                          (raises ValidationError naming ITS fields)
    make_writer(valid, request, arrival_wall) -> writer   its SequenceWriter (service.convert): `encode(batch)`
                                             yields the serialized messages of one batch of looper events
                                             (`arrival_wall`: time.time() when the call arrived)

and its Generate is the front door's `generate`, with that mapping:

    self.Generate = FrontDoor(app, PATH, validate, make_writer, grammar_field="guided_decoding.guide").generate
    add_service(server, servicer, SERVICE_DESCRIPTOR, raw_responses="Generate")  # Generate yields bytes

For every call the front door runs, in this order: the refusal of a payload that did not parse (`Undecodable`:
service.decoding wraps only Generate's deserializer, so that grpc iterates this handler with no wrapper frame per
message), request log record (`RequestRecord`), request id (the request's
`request_id`, else `x-request-id`, else a new one), ready check, admission slot (in line, --max-queue-wait),
`validate` (the API's mapping), grammar (`app.grammars.admit`; `grammar_field` names the field in its errors), LoRA
(`app.loras.admit`), duplicate id, Abort-while-waiting check, the writer, submit, then delivery: per batch of events
the writer's messages are yielded while the stall watchdog watches (it counts them), a reader that stalls past
--slow-reader-grace gives its slot back and takes it again when it reads (service.delivery). ONE error policy:
`ServiceError` and the executor's `RequestFailed` end the call with their status (`errors.status_of`); anything
else is a bug: logged once with its traceback, the client gets INTERNAL naming only the exception's type, and the
server keeps serving. A cancellation (client gone,
deadline, stalled reader) cancels the request on the way out. A non-streaming (unary) generation API calls
`complete()` from its unary handler: same pipeline, the `Complete`s collected, one response built by `respond`.

`generate` is the RPC's handler itself, not a wrapper: a wrapping async generator would be one more frame to resume
for every message. For the same reason it keeps its own request-log record (`RequestRecord`), and the request-log
interceptor leaves the generation RPCs (`app.GENERATE_RPCS`) unwrapped.

Unary RPCs (and server-streaming ones other than Generate) use `@unary()`: ready check where the RPC needs it,
`ServiceError` -> its status, anything else -> logged, INTERNAL.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import grpc
from google.protobuf.message_factory import GetMessageClass

from tokenloop.core.request import ValidRequest
from tokenloop.looper.stream import Complete, RequestFailed

from .decoding import METHOD_HANDLERS, Undecodable
from .delivery import Delivery
from .errors import AlreadyExists, ServiceError, abort_with, status_of
from .logs import RequestRecord

log = logging.getLogger("tokenloop.service")

Validate = Callable[[Any, str, "float | None"], Awaitable[ValidRequest]]


class Writer(Protocol):
    """What the front door needs of an API's sequence writer (service.convert.SequenceWriter is the base)."""

    def encode(self, batch: list) -> Iterable[bytes]: ...


MakeWriter = Callable[[ValidRequest, Any, float], Writer]


def metadata_value(context: grpc.aio.ServicerContext, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v
    return ""


def deadline_of(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return time.monotonic() + remaining if remaining is not None else None


def add_service(server, servicer, service, raw_responses: str | None = None) -> None:
    """Register every method of `service` (a ServiceDescriptor) on `server`, as the generated `add_..._to_server`
    does, with two differences. The method named `raw_responses` has no response serializer: its handler yields
    messages already serialized (a SequenceWriter's `encode`), which grpc sends as they are. And the methods are
    served by a generic handler only, not also registered with grpc core (`add_registered_method_handlers`):
    grpc.aio's server loop keeps one pending request-call per registered method and `asyncio.wait`s on all of them
    again for every call it accepts, work per RPC that grows with the methods served (this server's three
    generation APIs, health and reflection: tens of them); with none registered it waits on one
    (docs/performance.md: ~190,000 instructions less per request)."""
    handlers = {}
    for method in service.methods:
        make = METHOD_HANDLERS[method.client_streaming, method.server_streaming]
        response = None if method.name == raw_responses else GetMessageClass(method.output_type).SerializeToString
        handlers[method.name] = make(getattr(servicer, method.name),
                                     request_deserializer=GetMessageClass(method.input_type).FromString,
                                     response_serializer=response)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


class FrontDoor:
    """The admission pipeline of every generation API on one `App` (service.app.App). A streaming API's front door
    holds its mapping (`rpc`: the method's path, `validate`, `make_writer`, `grammar_field`); its `generate` is that
    API's Generate handler."""

    __slots__ = ("app", "rpc", "validate", "make_writer", "grammar_field")

    def __init__(self, app, rpc: str = "", validate: Validate | None = None, make_writer: MakeWriter | None = None, *,
                 grammar_field: str | None = None):
        self.app, self.rpc, self.validate, self.make_writer, self.grammar_field = (app, rpc, validate, make_writer,
                                                                                   grammar_field)

    async def generate(self, request, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """One streaming generation call, start to end: yields the serialized messages the writer makes."""
        if type(request) is Undecodable:  # the payload did not parse (service.decoding leaves Generate to us)
            await request.refuse(context)
            return
        rpc = self.rpc
        async with RequestRecord(rpc, request, context):
            rid = request_id_of(request, context)
            try:
                async with self._admitted(request, context, rid, self.validate, self.grammar_field,
                                          self.make_writer) as (writer, stream, delivery):
                    watchdog = delivery.watchdog
                    # what is there, else wait for it (a reader behind the looper finds its next batch waiting)
                    while (batch := stream.take() or await stream.next_batch()) is not None:
                        watchdog.writing = True  # watched while a batch is written: waiting for tokens is no stall
                        for msg in writer.encode(batch):
                            yield msg  # returns once grpc took the message: a stalled reader blocks here
                            watchdog.sent += 1
                        watchdog.writing = False
                        delivery.delivered(batch)
                        if delivery.paused:  # it stalled past --slow-reader-grace and now reads again
                            await delivery.resume()
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await self._fail(context, exc, rpc, rid)

    async def complete(self, request, context: grpc.aio.ServicerContext, *, rpc: str, validate: Validate,
                       respond: Callable[[ValidRequest, list[Complete]], Any], grammar_field: str | None = None):
        """One non-streaming generation call (from a unary handler): the same pipeline, every sequence's `Complete`
        collected (in sequence order), the response `respond(valid, completes)`."""
        rid = request_id_of(request, context)
        try:
            async with self._admitted(request, context, rid, validate, grammar_field, None) as (valid, stream,
                                                                                                 delivery):
                while (batch := await stream.next_batch()) is not None:
                    delivery.delivered(batch)
                return respond(valid, sorted(delivery.completes, key=lambda c: c.index))
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await self._fail(context, exc, rpc, rid)

    @asynccontextmanager
    async def _admitted(self, request, context, rid: str, validate: Validate, grammar_field: str | None,
                        make_writer: MakeWriter | None):
        """Ready check -> slot -> validate -> grammar -> LoRA -> duplicate id -> abort check -> writer -> submit;
        yields (writer, or the ValidRequest without one; the stream; its Delivery)."""
        app, arrival, arrival_wall = self.app, time.monotonic(), time.time()
        app.require_ready()
        async with app.admission.slot(rid, getattr(app.config, "max_queue_wait", 0.0), context.peer()) as slot:
            valid = await validate(request, rid, deadline_of(context))
            valid = await app.grammars.admit(valid, grammar_field)  # a grammar: compiled, or cached
            valid = await app.loras.admit(valid)  # a LoRA adapter: resident (read again if swapped out)
            if app.looper.find(rid) is not None:
                raise AlreadyExists(f"`request_id` {rid!r} is already in flight")
            slot.check_aborted()  # Abort while it waited: it never runs
            writer = make_writer(valid, request, arrival_wall) if make_writer is not None else valid
            stream = app.looper.submit(valid, arrival)
            app.admission.submitted(slot)
            with Delivery(app, valid, stream, slot) as delivery:  # on the way out: cancel what did not finish
                yield writer, stream, delivery

    async def _fail(self, context, exc: Exception, rpc: str, rid: str) -> None:
        """The one error policy: a ServiceError or RequestFailed is the client's status; anything else a bug."""
        if not isinstance(exc, (ServiceError, RequestFailed)):
            log.error("%s %s failed", rpc, rid, exc_info=exc)
        self.app.observe_error(status_of(exc)[0])
        await abort_with(context, exc)


def request_id_of(request, context: grpc.aio.ServicerContext) -> str:
    """The client's request id: the request's `request_id`, else the `x-request-id` header, else a new one."""
    return getattr(request, "request_id", "") or metadata_value(context, "x-request-id") or uuid.uuid4().hex


class _Mapped:
    """The error mapping of one unary or server-streaming RPC, around its body: the ready check (given the app), then a
    ServiceError is the client's status; anything else is logged with its traceback, INTERNAL."""

    __slots__ = ("context", "rpc", "app")

    def __init__(self, context: grpc.aio.ServicerContext, rpc: str, app=None):
        self.context, self.rpc, self.app = context, rpc, app

    async def __aenter__(self) -> None:
        if self.app is not None:
            try:
                self.app.require_ready()
            except ServiceError as exc:  # __aexit__ does not see what __aenter__ raises
                await abort_with(self.context, exc)
                raise

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        if isinstance(exc, Exception) and not isinstance(exc, grpc.aio.AbortError):
            if not isinstance(exc, ServiceError):
                log.error("%s failed", self.rpc, exc_info=exc)
            await abort_with(self.context, exc)  # raises AbortError (returns when the client is gone)
            return True
        return False


def unary(ready: bool = True):
    """Decorates a unary handler `async def RPC(self, request, context)` of a servicer with `self.app` (or a
    server-streaming one, an async generator, other than Generate): the ready check (`ready=True`), then the one
    error mapping (`_Mapped`). grpc sees a coroutine (or async generator) function, as before."""
    def wrap(fn):
        if inspect.isasyncgenfunction(fn):
            @functools.wraps(fn)
            async def stream(self, request, context):
                async with _Mapped(context, fn.__name__, self.app if ready else None):
                    async for msg in fn(self, request, context):
                        yield msg
            return stream

        @functools.wraps(fn)
        async def call(self, request, context):
            async with _Mapped(context, fn.__name__, self.app if ready else None):
                return await fn(self, request, context)
        return call
    return wrap
