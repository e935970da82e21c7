"""Python client for tokenloop: sync `Client`, asyncio `AsyncClient`, typed results and errors."""

from . import _grpc_log  # noqa: F401  (first: sets gRPC's log level before grpc is imported)
from ._channel import RetryPolicy
from ._gen.messages import (
    ChatMessage,
    Delta,
    EmbedResult,
    FinishReason,
    Load,
    LoraAdapter,
    ModelInfo,
    Timing,
    TokenizeResult,
    TokenLogprob,
    TopLogprob,
    Usage,
)
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
from .types import Completion, GenerateResult

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "AsyncTextStream", "CancelledError", "ChatMessage", "Client", "Completion",
    "DeadlineExceededError", "Delta", "EmbedResult", "FinishReason", "GenerateResult", "IncompleteOutputError", "InternalError",
    "InvalidArgumentError", "Load", "LoraAdapter", "ModelInfo", "NotFoundError", "ParameterError", "PermissionDeniedError",
    "ResourceExhaustedError", "RetryPolicy", "TextStream", "Timing", "TokenLogprob", "TokenizeResult",
    "TokenloopError", "TopLogprob", "UnauthenticatedError", "UnavailableError", "UnimplementedError",
    "Usage",
]
