"""Typed exceptions: every failed call raises a TokenloopError that keeps the gRPC status."""

from __future__ import annotations

import grpc


class TokenloopError(Exception):
    """A failed tokenloop call; `code` is the grpc.StatusCode and `message` the server's text."""

    def __init__(self, code: grpc.StatusCode, message: str, request_id: str = "") -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id


class InvalidArgumentError(TokenloopError):
    """INVALID_ARGUMENT: the request broke a validation rule (the message names it)."""


class ResourceExhaustedError(TokenloopError):
    """RESOURCE_EXHAUSTED: the server is overloaded (queue full); back off and retry."""


class UnavailableError(TokenloopError):
    """UNAVAILABLE: the server is unreachable, shutting down, or its engine died."""


class DeadlineExceededError(TokenloopError):
    """DEADLINE_EXCEEDED: the call's timeout expired."""


class CancelledError(TokenloopError):
    """CANCELLED: the call was cancelled (by the client or the server)."""


class UnauthenticatedError(TokenloopError):
    """UNAUTHENTICATED: missing or wrong API key."""


class PermissionDeniedError(TokenloopError):
    """PERMISSION_DENIED: the credentials are not allowed to do this."""


class NotFoundError(TokenloopError):
    """NOT_FOUND: the named thing does not exist."""


class UnimplementedError(TokenloopError):
    """UNIMPLEMENTED: the server does not offer this RPC."""


class InternalError(TokenloopError):
    """INTERNAL or UNKNOWN: a server-side bug; the message says no more than the server allowed."""


class ParameterError(TypeError, ValueError):
    """A call's argument was refused on the client, before anything was sent: `parameter` names it and the message
    says the rule. Both a TypeError and a ValueError, so code that caught either keeps working."""

    def __init__(self, parameter: str, message: str) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.message = message


class IncompleteOutputError(ValueError):
    """A sequence's text is not the whole structure it was asked for: it ended at LENGTH (`max_new_tokens` or the
    context) before the JSON value, regex or grammar was complete. `completion` is the sequence, text and all."""

    def __init__(self, completion) -> None:
        c = completion
        super().__init__(f"sequence {c.index} ended at LENGTH after {c.usage.completion_tokens} tokens, before its "
                         "structure was complete: raise max_new_tokens, or bound the schema (maxLength, maximum, "
                         "maxItems) so that every valid value fits")
        self.completion = completion


_BY_CODE: dict[grpc.StatusCode, type[TokenloopError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.INTERNAL: InternalError,
    grpc.StatusCode.UNKNOWN: InternalError,
}


def _status(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    return code or grpc.StatusCode.UNKNOWN, details or ""


def from_rpc_error(err: grpc.RpcError, request_id: str = "") -> TokenloopError:
    """Turn a grpc.RpcError (sync or aio) into the matching TokenloopError subclass."""
    code, details = _status(err)
    return _BY_CODE.get(code, TokenloopError)(code, details, request_id)


def from_retried(first: grpc.RpcError, last: grpc.RpcError, num_attempts: int, request_id: str = "") -> TokenloopError:
    """The error of a call that failed `num_attempts` times: the first attempt's status, which says why (e.g. the
    server's "the executor is not available: ..." before it exited), and the last one's when it differs (a retry
    that found the server gone reads "Connection refused")."""
    err = from_rpc_error(first, request_id)
    last_code, last_details = _status(last)
    if last is first or (last_code, last_details) == (err.code, err.message):
        return err
    message = f"{err.message} (retried {num_attempts - 1} times; last: {last_code.name}: {last_details})"
    return type(err)(err.code, message, request_id)
