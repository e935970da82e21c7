"""Embed and FlushCache for every API: tokenloop.v1 and smg's vLLM protocol call these, not copies of them.

`embed` takes a tokenized prompt through the front door of Generate (service.frontdoor: readiness, an admission slot
in line within --max-queue-wait, the request id unique in flight, Abort while it waits, the call's deadline,
cancellation when the client goes away) and returns the pooled final hidden state the executor computed
(core.request.EmbedParams).
`flush_cache` drops the executor's unused prefix-cache blocks.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from tokenloop.core.capabilities import NO_EMBED, NO_FLUSH_CACHE
from tokenloop.core.executor import EngineDeadError, ErrorKind
from tokenloop.core.request import POOLINGS, EmbedParams, FinishReason, SamplingParams, StoppingParams, ValidRequest
from tokenloop.looper.stream import Complete, RequestFailed

from .errors import Cancelled, Unavailable, Unimplemented, ValidationError
from .frontdoor import FrontDoor


@dataclass(frozen=True, slots=True)
class Embedding:
    """One prompt's embedding: `vector` (the model's hidden size), the prompt's token count, how it was pooled."""

    vector: list[float]
    prompt_tokens: int
    pooling: str
    normalized: bool


def embed_params(app, pooling: str | None, normalize: bool | None) -> EmbedParams:
    """The request's pooling and normalization over the executor's defaults; ValidationError naming `pooling`, and
    Unimplemented when the executor cannot embed."""
    caps = app.capabilities
    if not caps.embed:
        raise Unimplemented(NO_EMBED)
    defaults = caps.embed_defaults or EmbedParams()
    if pooling is not None and pooling not in POOLINGS:
        raise ValidationError("pooling", f"`pooling` must be one of {', '.join(POOLINGS)} (or unset: the model's "
                                         f"default, {defaults.pooling}); got {pooling!r}")
    return EmbedParams(pooling or defaults.pooling, defaults.normalize if normalize is None else normalize)


def pooling_of(value: int, enum) -> str | None:
    """A protobuf `Pooling` enum value (tokenloop.v1's `pooling` field) as EmbedParams.pooling; None when unset;
    ValidationError naming `pooling` for a number the enum does not define."""
    if value == 0:
        return None
    names = {enum.Value(p.upper()): p for p in POOLINGS}
    if value not in names:
        raise ValidationError("pooling", f"`pooling` must be one of {', '.join(p.upper() for p in POOLINGS)} or "
                                         f"unset; got {value}")
    return names[value]


@dataclass(frozen=True, slots=True)
class EmbedCall:
    """What the front door's `validate` and `respond` get for one embedding (its `request` argument)."""

    request_id: str
    prompt_ids: Sequence[int]
    params: EmbedParams
    field: str


async def embed(app, context: grpc.aio.ServicerContext, request_id: str, prompt_ids: Sequence[int],
                pooling: str | None = None, normalize: bool | None = None, *,
                field: str = "token_ids") -> Embedding | None:
    """Embed one tokenized prompt on `app` (service.app.App) for the call `context`, through the front door
    (service.frontdoor: ready, slot, the prompt checked, duplicate id, Abort, submit, delivery, cancel on the way out).

    `pooling` ("last" | "mean") and `normalize` None take the executor's defaults (`Capabilities.embed_defaults`).
    `field` names the prompt in error messages (e.g. "tokenized.input_ids"). Before admission it raises ServiceError
    (Unavailable; ValidationError naming `pooling`; Unimplemented when the executor cannot embed: the caller maps
    it, e.g. with frontdoor.unary); from admission on, an error ends the call with its status as the front door does
    for Generate (grpc.aio.AbortError propagates; None when the client is already gone)."""
    app.require_ready()
    params = embed_params(app, pooling, normalize)
    call = EmbedCall(request_id, prompt_ids, params, field)
    return await FrontDoor(app).complete(call, context, rpc="Embed", validate=functools.partial(_validate, app),
                                         respond=_respond)


async def _validate(app, call: EmbedCall, request_id: str, deadline: float | None) -> ValidRequest:
    """The front door's mapping of an embedding (in its admission slot): the prompt's rules, then the request."""
    ids = app.validator.prompt_ids(call.prompt_ids, call.field)  # Generate's rules for a token-id prompt
    return ValidRequest(request_id=app.validator.request_id(request_id), prompt_token_ids=ids,
                        sampling=SamplingParams(temperature=0.0), stopping=StoppingParams(max_new_tokens=0),
                        deadline=deadline, embed=call.params)


def _respond(valid: ValidRequest, completes: list[Complete]) -> Embedding:
    done = completes[0] if completes else None
    if done is None or done.embedding is None:
        if done is not None and done.finish_reason is FinishReason.CANCELLED:
            raise Cancelled(f"request {valid.request_id!r} was aborted")
        raise RequestFailed(ErrorKind.INTERNAL, "the embedding request ended without a vector")
    return Embedding(done.embedding, len(valid.prompt_token_ids), valid.embed.pooling, valid.embed.normalize)


async def flush_cache(app) -> int:
    """Drop the executor's unused prefix-cache blocks (their KV "removed" events go to subscribers); how many.
    Unimplemented when the executor cannot, Unavailable when it died."""
    app.require_ready()
    flush = app.capabilities.flush_cache
    if flush is None:
        raise Unimplemented(NO_FLUSH_CACHE)
    try:
        return await asyncio.to_thread(flush)
    except EngineDeadError as exc:
        raise Unavailable(f"the executor is not available: {exc}") from None
