"""The blocking client: `Client` and the `TextStream` its `stream()` returns."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

import grpc

from . import _request
from ._channel import (
    HEALTH_CHECK,
    Connection,
    decode_health_response,
    encode_health_request,
    sync_channel,
)
from ._gen import tokenloop_pb2 as pb
from ._gen.messages import Delta, EmbedResult, Load, LoraAdapter, ModelInfo, TokenizeResult
from .errors import from_retried
from .types import GenerateResult


class TextStream(_request.StreamState):
    """Iterator of Deltas for one Generate call; `result` holds the final GenerateResult."""

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> Delta:
        while True:
            delta = self._builder.add(self._next_message())
            if delta is not None:
                return delta

    def _next_message(self) -> pb.GenerateResponse:
        while True:
            if self._done:
                raise StopIteration
            if self._call is None:
                self._num_attempts += 1
                self._call = self._start()
            try:
                return next(self._call)
            except StopIteration:
                self._done = True
                raise
            except grpc.RpcError as err:
                self._first_error = self._first_error or err
                if not self._retry.should_retry(err, self._num_attempts, self._builder.num_messages):
                    self._done = True
                    raise from_retried(self._first_error, err, self._num_attempts, self.request_id) from None
                time.sleep(self._retry.backoff_s(self._num_attempts))
                self._call = None

    def final(self) -> GenerateResult:
        """Read the rest of the stream and return the final result."""
        for _ in self:
            pass
        return self.result

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Client(Connection):
    """Blocking tokenloop client. Use as a context manager or call close()."""

    connect = staticmethod(sync_channel)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, prompt: str | None = None, *, messages: Iterable | None = None,
               token_ids: Sequence[int] | None = None, request_id: str | None = None,
               timeout: float | None = None, **params) -> TextStream:
        """Start a streaming Generate; iterate the returned TextStream for Deltas."""
        return self._generate(prompt, messages, token_ids, request_id, timeout, True, params)

    def generate(self, prompt: str | None = None, *, messages: Iterable | None = None,
                 token_ids: Sequence[int] | None = None, request_id: str | None = None,
                 timeout: float | None = None, **params) -> GenerateResult:
        """Generate without streaming and return the final result."""
        return self._generate(prompt, messages, token_ids, request_id, timeout, False, params).final()

    def chat(self, messages: Iterable, *, stream: bool = False, **kwargs) -> GenerateResult | TextStream:
        """Generate the assistant's next turn of a conversation (a TextStream when stream=True)."""
        return (self.stream if stream else self.generate)(messages=messages, **kwargs)

    def _generate(self, prompt, messages, token_ids, request_id, timeout, stream, params) -> TextStream:
        req = _request.build_generate(prompt, messages=messages, token_ids=token_ids, stream=stream,
                                      request_id=request_id, params=params)
        timeout = timeout if timeout is not None else self.timeout

        def start() -> Iterator:
            return self._stub.Generate(req, timeout=timeout, metadata=self._metadata)

        return TextStream(start, req.request_id, self.retry)

    def tokenize(self, text: str | None = None, *, messages: Iterable | None = None) -> TokenizeResult:
        """Token ids of a text, or of a chat rendered with the model's template."""
        res = self._unary(self._stub.Tokenize, _request.build_tokenize(text, messages))
        return TokenizeResult.from_pb(res)

    def embed(self, text: str | None = None, *, token_ids: Sequence[int] | None = None,
              pooling: str | None = None, normalize: bool | None = None,
              request_id: str | None = None) -> EmbedResult:
        """The embedding of a text or of token ids: the model's final hidden states pooled ("last" token or "mean";
        None: the server's default) and scaled to unit length or not (None: the server's default)."""
        req = _request.build_embed(text, token_ids, pooling, normalize, request_id)
        return EmbedResult.from_pb(self._unary(self._stub.Embed, req))

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool | None = None) -> str:
        """Text of token ids."""
        req = _request.build_detokenize(token_ids, skip_special_tokens)
        return self._unary(self._stub.Detokenize, req).text

    def model_info(self) -> ModelInfo:
        """The loaded model and the server's limits."""
        return ModelInfo.from_pb(self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest()))

    def load(self) -> Load:
        """What the server is doing now."""
        return Load.from_pb(self._unary(self._stub.GetLoad, pb.GetLoadRequest()))

    def load_lora_adapter(self, name: str, path: str, *, id: int | None = None) -> LoraAdapter:  # noqa: A002
        """Load the PEFT adapter in `path` (a directory on the server) as `name`; `id`: its router task id."""
        return LoraAdapter.from_pb(self._unary(self._stub.LoadLoraAdapter, _request.build_load_lora(name, path, id)))

    def unload_lora_adapter(self, name: str) -> LoraAdapter:
        """Unload an adapter no request is using (FAILED_PRECONDITION while one is)."""
        res = self._unary(self._stub.UnloadLoraAdapter, pb.UnloadLoraAdapterRequest(name=name))
        return LoraAdapter.from_pb(res.adapter)

    def list_lora_adapters(self) -> list[LoraAdapter]:
        """The adapters the server serves."""
        res = self._unary(self._stub.ListLoraAdapters, pb.ListLoraAdaptersRequest())
        return [LoraAdapter.from_pb(a) for a in res.adapters]

    def abort(self, request_id: str) -> bool:
        """Cancel a request by id; True when a live request was found."""
        return self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id)).found

    def health(self, service: str = "") -> str:
        """grpc.health.v1 status of `service` ("" = the whole server): SERVING, NOT_SERVING, ..."""
        check = self._channel.unary_unary(HEALTH_CHECK, request_serializer=None, response_deserializer=None)
        return decode_health_response(self._unary(check, encode_health_request(service)))

    def _unary(self, method, request):
        num_attempts, first = 0, None
        while True:
            num_attempts += 1
            try:
                return method(request, timeout=self.timeout, metadata=self._metadata)
            except grpc.RpcError as err:
                first = first or err
                if not self.retry.should_retry(err, num_attempts, 0):
                    raise from_retried(first, err, num_attempts) from None
                time.sleep(self.retry.backoff_s(num_attempts))
