"""Python client for tokenloop: sync `Client`, asyncio `AsyncClient`, typed results and errors."""

import os

# gRPC's C core (grpcio 1.85) prints INFO lines on stderr by default (`I1206 ... ssl_transport_security.cc ...
# Handshake failed`, `fork_posix.cc ... skipping fork() handlers`): keep it at ERROR unless the user set a verbosity
# or asked for traces. It is read when grpc is first imported, so this comes before any import of grpc.
if "GRPC_VERBOSITY" not in os.environ and not os.environ.get("GRPC_TRACE"):
    os.environ["GRPC_VERBOSITY"] = "ERROR"

from ._channel import RetryPolicy  # noqa: E402
from .aio import AsyncClient, AsyncTextStream
from .client import Client, TextStream
from .errors import (
    CancelledError,
    DeadlineExceededError,
    IncompleteOutputError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    ParameterError,
    PermissionDeniedError,
    ResourceExhaustedError,
    TokenloopError,
    UnauthenticatedError,
    UnavailableError,
    UnimplementedError,
)
from .types import (
    ChatMessage,
    Completion,
    Delta,
    EmbedResult,
    FinishReason,
    GenerateResult,
    Load,
    LoraAdapter,
    ModelInfo,
    Timing,
    TokenizeResult,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "AsyncTextStream", "CancelledError", "ChatMessage", "Client", "Completion",
    "DeadlineExceededError", "Delta", "EmbedResult", "FinishReason", "GenerateResult", "IncompleteOutputError", "InternalError",
    "InvalidArgumentError", "Load", "LoraAdapter", "ModelInfo", "NotFoundError", "ParameterError", "PermissionDeniedError",
    "ResourceExhaustedError", "RetryPolicy", "TextStream", "Timing", "TokenLogprob", "TokenizeResult",
    "TokenloopError", "TopLogprob", "UnauthenticatedError", "UnavailableError", "UnimplementedError",
    "Usage",
]
