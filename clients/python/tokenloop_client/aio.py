"""The asyncio client: `AsyncClient` and the `AsyncTextStream` its `stream()` returns."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import grpc

from . import _request
from ._channel import (
    HEALTH_CHECK,
    Connection,
    aio_channel,
    decode_health_response,
    encode_health_request,
)
from ._gen import tokenloop_pb2 as pb
from ._gen.messages import Delta, EmbedResult, Load, LoraAdapter, ModelInfo, TokenizeResult
from .errors import from_retried
from .types import GenerateResult


class AsyncTextStream(_request.StreamState):
    """Async iterator of Deltas for one Generate call; `result` holds the final GenerateResult."""

    final_hint = "await final()"

    def __aiter__(self) -> AsyncTextStream:
        return self

    async def __anext__(self) -> Delta:
        while True:
            msg = await self._next_message()
            if msg is None:
                raise StopAsyncIteration
            delta = self._builder.add(msg)
            if delta is not None:
                return delta

    async def _next_message(self) -> pb.GenerateResponse | None:
        while not self._done:
            if self._call is None:
                self._num_attempts += 1
                self._call = self._start()
            try:
                msg = await self._call.read()
            except grpc.RpcError as err:
                self._first_error = self._first_error or err
                if not self._retry.should_retry(err, self._num_attempts, self._builder.num_messages):
                    self._done = True
                    raise from_retried(self._first_error, err, self._num_attempts, self.request_id) from None
                await asyncio.sleep(self._retry.backoff_s(self._num_attempts))
                self._call = None
                continue
            if msg is grpc.aio.EOF:
                self._done = True
                break
            return msg
        return None

    async def final(self) -> GenerateResult:
        """Read the rest of the stream and return the final result."""
        async for _ in self:
            pass
        return self.result

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


class AsyncClient(Connection):
    """asyncio tokenloop client. Use `async with` or await close()."""

    connect = staticmethod(aio_channel)

    async def close(self) -> None:
        """Close the channel."""
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stream(self, prompt: str | None = None, *, messages: Iterable | None = None,
               token_ids: Sequence[int] | None = None, request_id: str | None = None,
               timeout: float | None = None, **params) -> AsyncTextStream:
        """Start a streaming Generate; `async for` over the result for Deltas."""
        return self._generate(prompt, messages, token_ids, request_id, timeout, True, params)

    async def generate(self, prompt: str | None = None, *, messages: Iterable | None = None,
                       token_ids: Sequence[int] | None = None, request_id: str | None = None,
                       timeout: float | None = None, **params) -> GenerateResult:
        """Generate without streaming and return the final result."""
        return await self._generate(prompt, messages, token_ids, request_id, timeout, False, params).final()

    def chat(self, messages: Iterable, *, stream: bool = False, **kwargs):
        """The assistant's next turn: an awaitable GenerateResult, or an AsyncTextStream when stream=True."""
        return (self.stream if stream else self.generate)(messages=messages, **kwargs)

    def _generate(self, prompt, messages, token_ids, request_id, timeout, stream, params) -> AsyncTextStream:
        req = _request.build_generate(prompt, messages=messages, token_ids=token_ids, stream=stream,
                                      request_id=request_id, params=params)
        timeout = timeout if timeout is not None else self.timeout

        def start() -> grpc.aio.UnaryStreamCall:
            return self._stub.Generate(req, timeout=timeout, metadata=self._metadata)

        return AsyncTextStream(start, req.request_id, self.retry)

    async def tokenize(self, text: str | None = None, *, messages: Iterable | None = None) -> TokenizeResult:
        """Token ids of a text, or of a chat rendered with the model's template."""
        res = await self._unary(self._stub.Tokenize, _request.build_tokenize(text, messages))
        return TokenizeResult.from_pb(res)

    async def embed(self, text: str | None = None, *, token_ids: Sequence[int] | None = None,
              pooling: str | None = None, normalize: bool | None = None,
              request_id: str | None = None) -> EmbedResult:
        """The embedding of a text or of token ids: the model's final hidden states pooled ("last" token or "mean";
        None: the server's default) and scaled to unit length or not (None: the server's default)."""
        req = _request.build_embed(text, token_ids, pooling, normalize, request_id)
        return EmbedResult.from_pb(await self._unary(self._stub.Embed, req))

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None) -> str:
        """Text of token ids."""
        req = _request.build_detokenize(token_ids, skip_special_tokens)
        return (await self._unary(self._stub.Detokenize, req)).text

    async def model_info(self) -> ModelInfo:
        """The loaded model and the server's limits."""
        return ModelInfo.from_pb(await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest()))

    async def load(self) -> Load:
        """What the server is doing now."""
        return Load.from_pb(await self._unary(self._stub.GetLoad, pb.GetLoadRequest()))

    async def load_lora_adapter(self, name: str, path: str, *, id: int | None = None) -> LoraAdapter:  # noqa: A002
        """Load the PEFT adapter in `path` (a directory on the server) as `name`; `id`: its router task id."""
        req = _request.build_load_lora(name, path, id)
        return LoraAdapter.from_pb(await self._unary(self._stub.LoadLoraAdapter, req))

    async def unload_lora_adapter(self, name: str) -> LoraAdapter:
        """Unload an adapter no request is using (FAILED_PRECONDITION while one is)."""
        res = await self._unary(self._stub.UnloadLoraAdapter, pb.UnloadLoraAdapterRequest(name=name))
        return LoraAdapter.from_pb(res.adapter)

    async def list_lora_adapters(self) -> list[LoraAdapter]:
        """The adapters the server serves."""
        res = await self._unary(self._stub.ListLoraAdapters, pb.ListLoraAdaptersRequest())
        return [LoraAdapter.from_pb(a) for a in res.adapters]

    async def abort(self, request_id: str) -> bool:
        """Cancel a request by id; True when a live request was found."""
        return (await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id))).found

    async def health(self, service: str = "") -> str:
        """grpc.health.v1 status of `service` ("" = the whole server): SERVING, NOT_SERVING, ..."""
        check = self._channel.unary_unary(HEALTH_CHECK, request_serializer=None, response_deserializer=None)
        return decode_health_response(await self._unary(check, encode_health_request(service)))

    async def _unary(self, method, request):
        num_attempts, first = 0, None
        while True:
            num_attempts += 1
            try:
                return await method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as err:
                first = first or err
                if not self.retry.should_retry(err, num_attempts, 0):
                    raise from_retried(first, err, num_attempts) from None
                await asyncio.sleep(self.retry.backoff_s(num_attempts))
