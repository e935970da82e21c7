"""One error family, mapped to gRPC status codes in one place."""

from __future__ import annotations

import re

import grpc

from tokenloop.core.executor import ErrorKind
from tokenloop.looper.stream import RequestFailed


class ServiceError(Exception):
    """An error the client gets as a gRPC status with this message (never a traceback). A subclass names its status
    in its header: `class Overloaded(ServiceError, code=grpc.StatusCode.RESOURCE_EXHAUSTED)`."""

    code = grpc.StatusCode.INTERNAL

    def __init_subclass__(cls, code: grpc.StatusCode | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code

    def __init__(self, message: str, trailers: tuple[tuple[str, str], ...] = ()):
        super().__init__(message)
        self.message = message
        self.trailers = trailers


class ValidationError(ServiceError, code=grpc.StatusCode.INVALID_ARGUMENT):
    """Bad input: the message names the field and the rule. `rule` is a stable identifier."""

    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


class Overloaded(ServiceError, code=grpc.StatusCode.RESOURCE_EXHAUSTED):
    """Admission is full: the client should retry later (hint in `grpc-retry-pushback-ms`)."""


class QueueTimeout(Overloaded):
    """Waited longer than --max-queue-wait for a slot: retry later, here or elsewhere (same pushback hint)."""


class Cancelled(ServiceError, code=grpc.StatusCode.CANCELLED):
    """Aborted (the Abort RPC) before it ran."""


class Unavailable(ServiceError, code=grpc.StatusCode.UNAVAILABLE):
    """Loading, draining, or the executor died."""


class AlreadyExists(ServiceError, code=grpc.StatusCode.ALREADY_EXISTS):
    """A request with this id is already in flight."""


class NotFound(ServiceError, code=grpc.StatusCode.NOT_FOUND):
    """A LoRA adapter name or task id that is not loaded."""


class InUse(ServiceError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """Unloading a LoRA adapter that requests are using."""


class RuntimeLoadingOff(ServiceError, code=grpc.StatusCode.FAILED_PRECONDITION):
    """LoadLoraAdapter on a server with no --lora-root."""


class Unimplemented(ServiceError, code=grpc.StatusCode.UNIMPLEMENTED):
    """An RPC or ability this server or its executor does not provide (e.g. LoRA adapters, KV-cache events)."""


class OutOfRange(ServiceError, code=grpc.StatusCode.OUT_OF_RANGE):
    """SubscribeKvEvents: a start_sequence_number outside the kept history."""


class DataLoss(ServiceError, code=grpc.StatusCode.DATA_LOSS):
    """SubscribeKvEvents: the subscriber fell too far behind and was cut off."""


_KIND_TO_CODE = {
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


_PATH = re.compile(r"(?<![\w.])(?:[A-Za-z]:\\|/)[\w.+~-]+(?:[/\\][\w.+~-]+)+")
MAX_MESSAGE_CHARS = 500


def client_text(message: str) -> str:
    """What a client may see of a message: its first line, file paths elided, bounded in length.

    Engine and TensorRT-LLM errors can carry C++ stack frames and source paths; those stay in the log.
    """
    first = message.strip().splitlines()[0] if message.strip() else ""
    first = _PATH.sub("<path>", first)
    return first if len(first) <= MAX_MESSAGE_CHARS else first[:MAX_MESSAGE_CHARS] + "..."


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, tuple]:
    """The (code, message, trailing metadata) a client sees for an exception."""
    if isinstance(exc, ServiceError):
        return exc.code, client_text(exc.message), exc.trailers
    if isinstance(exc, RequestFailed):
        return _KIND_TO_CODE[exc.kind], client_text(exc.message), ()
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__})", ()


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the RPC with the status for `exc`."""
    code, message, trailers = status_of(exc)
    if context.cancelled():  # the client is gone: nobody to tell
        return
    if trailers:
        context.set_trailing_metadata(trailers)
    await context.abort(code, message)
