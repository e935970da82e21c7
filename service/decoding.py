"""Undecodable requests get INVALID_ARGUMENT on every RPC of every service, with no traceback.

grpc Python turns an exception of a request deserializer into `UNKNOWN: Unexpected <class 'DecodeError'>` and logs
its traceback: random bytes, or invalid UTF-8 in a string field, from any caller (an unauthenticated one included)
wrote seven log lines a call. `DecodingInterceptor`, the outermost interceptor, wraps the deserializer of the handler
the others made so that a payload that does not parse becomes an `Undecodable` marker, and its behaviour so that a
marker ends the call with INVALID_ARGUMENT naming the message type; one rate-limited log line says so, and the
inner wrappers (tracing, the request log) never run for it. A caller without a valid API key gets UNAUTHENTICATED
whatever it sent: the API-key refusal's deserializer does not parse (`service.security._unread`).

A streaming response is written by the wrapper (`context.write`) rather than re-yielded (grpc's own loop does the
same two steps). That is why it is the outermost: an inner wrapper that iterates its handler could not iterate a
coroutine. The generation RPCs (`own_checks`: `app.GENERATE_RPCS`) are not wrapped at all: only their deserializer
is, and their handler (`FrontDoor.generate`) calls the marker's `refuse(context)` itself, so that grpc iterates it
directly with no wrapper frame to resume for every streamed message (as `service.logs.RequestLogInterceptor` leaves
them to keep their own request-log record).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable

import grpc

from .errors import client_text
from .logs import RateLimitedLog

log = logging.getLogger("tokenloop.service")


# grpc's method handler constructors by (request streaming, response streaming)
METHOD_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler,
                   (False, True): grpc.unary_stream_rpc_method_handler,
                   (True, False): grpc.stream_unary_rpc_method_handler,
                   (True, True): grpc.stream_stream_rpc_method_handler}


def handler_like(handler, behaviour, deserializer):
    """A method handler of `handler`'s kind (and response serializer) that runs `behaviour`, its requests read by
    `deserializer`."""
    make = METHOD_HANDLERS[handler.request_streaming, handler.response_streaming]
    return make(behaviour, deserializer, handler.response_serializer)


class Undecodable:
    """What the wrapped deserializer returns for a payload that is not a valid message."""

    __slots__ = ("message", "_refuse")

    def __init__(self, message: str, refuse: Callable[[Undecodable, object], Awaitable[None]] | None = None):
        self.message = message
        self._refuse = refuse  # the interceptor's refusal, for a handler that checks its request itself

    async def refuse(self, context) -> None:
        """End the call with INVALID_ARGUMENT naming the type (one rate-limited log line): the interceptor's one
        policy, called by a handler it left unwrapped (`DecodingInterceptor(own_checks=...)`)."""
        await self._refuse(self, context)


def _type_name(deserializer) -> str:
    owner = getattr(deserializer, "__self__", None)  # `SomeRequest.FromString`, a bound class method
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", "") or "request message"


def decoder(deserializer, refuse: Callable[[Undecodable, object], Awaitable[None]] | None = None):
    """`deserializer` that returns an `Undecodable` (naming the message type and the parser's reason, and holding
    `refuse`) in place of raising on bytes that are not a valid message."""
    name = _type_name(deserializer)

    def decode(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # DecodeError, or a generated parser's own error
            detail = client_text(str(exc)).rpartition("': ")[2] or type(exc).__name__  # without "Error parsing..."
            return Undecodable(f"the request is not a valid {name}: {detail}", refuse)
    return decode


class DecodingInterceptor(grpc.aio.ServerInterceptor):
    """Refuses undecodable requests with INVALID_ARGUMENT (one log line per `log_interval` seconds at most)."""

    def __init__(self, log_interval: float = 10.0, own_checks: frozenset[str] = frozenset()):
        self.refusals = RateLimitedLog(log, log_interval)
        self.num_refused = 0
        self.own_checks = own_checks  # methods whose handler calls `Undecodable.refuse` itself: left unwrapped
        self._wrapped: dict[str, tuple] = {}  # method -> (the handler, its wrapped version): built once per method

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, details.method)
        self._wrapped[details.method] = (handler, wrapped)
        return wrapped

    async def _refuse(self, request: Undecodable, method: str, context) -> None:
        self.num_refused += 1
        self.refusals.warning("refused an undecodable request to %s from %s: %s", method, context.peer(),
                              request.message)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    def _wrap(self, handler, method: str):
        fn = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        if not (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)):
            return handler  # a synchronous handler (none of ours): left as grpc runs it
        if method in self.own_checks:  # only the deserializer: grpc runs the handler itself, no frame per message
            async def refuse(request: Undecodable, context) -> None:
                await self._refuse(request, method, context)
            return handler_like(handler, fn, decoder(handler.request_deserializer, refuse))
        if handler.request_streaming:
            behaviour = self._stream_in(fn, method)
        elif handler.response_streaming:
            behaviour = self._unary_stream(fn, method)
        else:
            behaviour = self._unary(fn, method)
        return handler_like(handler, behaviour, decoder(handler.request_deserializer))

    def _unary(self, fn, method: str):
        async def behaviour(request, context):
            if type(request) is Undecodable:
                return await self._refuse(request, method, context)
            return await fn(request, context)
        return behaviour

    def _unary_stream(self, fn, method: str):
        async def behaviour(request, context):
            if type(request) is Undecodable:
                return await self._refuse(request, method, context)
            await _respond(fn, request, context)
        return behaviour

    def _stream_in(self, fn, method: str):
        async def checked(requests, context):
            async for request in requests:
                if type(request) is Undecodable:
                    await self._refuse(request, method, context)
                yield request

        async def behaviour(requests, context):
            return await _respond(fn, checked(requests, context), context)
        return behaviour


async def _respond(fn, request, context):
    """Run a handler of any shape (a coroutine, an async generator) from a coroutine: messages of a generator are
    written with `context.write`; on the way out (an abort, a cancelled write) the generator is closed at once, so
    that its cleanup (a request's cancel) runs now and not when it is collected."""
    if inspect.isasyncgenfunction(fn):
        async with contextlib.aclosing(fn(request, context)) as messages:
            async for message in messages:
                await context.write(message)
        return None
    return await fn(request, context)
