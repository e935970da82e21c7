"""Request building and response assembly shared by the sync and asyncio clients."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import grpc

from . import _params
from ._gen import tokenloop_pb2 as pb
from ._gen.messages import ChatMessage, Delta
from .errors import ParameterError, TokenloopError
from .types import Completion, GenerateResult

_REQUEST = pb.GenerateRequest.DESCRIPTOR
# The options of each group, read from the proto (GenerationParams has a field of each name, in this order:
# tests/unit/test_client_types.py)
_SAMPLING, _STOPPING, _OUTPUT = (tuple(f.name for f in _REQUEST.fields_by_name[group].message_type.fields)
                                 for group in ("sampling", "stopping", "output"))
_REPEATED = tuple(f.name for f in _REQUEST.fields_by_name["stopping"].message_type.fields if f.is_repeated)
_STRUCTURED = tuple(f.name for f in _REQUEST.oneofs_by_name["structured"].fields)


@dataclass(frozen=True)
class GenerationParams:
    """Every generation option; None leaves the server's default. Names match the proto fields."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    skip_special_tokens: bool | None = None
    echo: bool | None = None
    n: int | None = None
    # structured output, at most one: a JSON schema (JSON text or a dict), any JSON object, a regex, a grammar
    # (GBNF or Lark), a structural tag (JSON text or a dict)
    json_schema: str | Mapping | None = None
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    structural_tag: str | Mapping | None = None
    lora: str | None = None  # a loaded LoRA adapter's name (ListLoraAdapters); None or "": the base model

    def apply(self, req: pb.GenerateRequest) -> None:
        """Copy the set options into a GenerateRequest."""
        for group, names in (("sampling", _SAMPLING), ("stopping", _STOPPING), ("output", _OUTPUT)):
            target = getattr(req, group)
            for name in names:
                value = getattr(self, name)
                if value is None:
                    continue
                if name in _REPEATED:
                    getattr(target, name).extend([value] if isinstance(value, (str, int)) else value)
                else:
                    setattr(target, name, value)
        if self.n is not None:
            if self.n < 1:  # the proto's 0 means "unset": the server would quietly run one sequence
                raise ParameterError("n", f"`n` must be >= 1 (the number of sequences); got {self.n}")
            req.n = self.n
        if self.lora:
            req.lora = self.lora
        self._apply_structured(req)

    def _apply_structured(self, req: pb.GenerateRequest) -> None:
        given = [name for name in _STRUCTURED if getattr(self, name) not in (None, False)]
        if len(given) > 1:
            raise ParameterError(given[1], f"give at most one of {', '.join(_STRUCTURED)}; got {', '.join(given)}")
        for name in given:
            setattr(req, name, getattr(self, name))


PARAM_NAMES = frozenset(f.name for f in fields(GenerationParams))


def _param_fields() -> dict:
    """Each option's proto field (for the client-side type checks in `_params`)."""
    groups = {"sampling": _SAMPLING, "stopping": _STOPPING, "output": _OUTPUT}
    top = pb.GenerateRequest.DESCRIPTOR.fields_by_name
    out = {name: top[name] for name in ("n", "lora", *_STRUCTURED)}
    for group, names in groups.items():
        message = pb.GenerateRequest.DESCRIPTOR.fields_by_name[group].message_type
        out.update({name: message.fields_by_name[name] for name in names})
    return out


PARAM_FIELDS = _param_fields()


def to_chat(messages: Iterable[ChatMessage | dict | tuple[str, str]]) -> pb.Chat:
    """Build a protobuf Chat from ChatMessages, {"role", "content"} dicts or (role, content) pairs."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Iterable):
        raise ParameterError("messages", f"`messages` must be a list of chat messages; got {type(messages).__name__}")
    chat = pb.Chat()
    for i, msg in enumerate(messages):
        role, content = _params.chat_message(i, msg)
        chat.messages.add(role=role, content=content)
    return chat


def build_generate(
    prompt: str | None,
    *,
    messages: Iterable | None = None,
    token_ids: Sequence[int] | None = None,
    stream: bool,
    request_id: str | None = None,
    params: dict,
) -> pb.GenerateRequest:
    """Build a GenerateRequest from exactly one input and keyword options (TypeError on unknown ones)."""
    inputs = [x is not None for x in (prompt, messages, token_ids)]
    if sum(inputs) != 1:
        raise ParameterError("prompt", "give exactly one of prompt, messages, token_ids")
    params = {k: json.dumps(v) if k in _STRUCTURED and isinstance(v, Mapping) else v for k, v in params.items()}
    _params.check_options(params, PARAM_FIELDS)  # a dict schema or structural tag is sent as JSON text
    if request_id is not None:
        _params.check_text("request_id", request_id)
    req = pb.GenerateRequest(request_id=request_id or uuid.uuid4().hex, stream=stream)
    if prompt is not None:
        _params.check_text("prompt", prompt)
        req.text = prompt
    elif messages is not None:
        req.chat.CopyFrom(to_chat(messages))
    else:
        _params.check_token_ids("token_ids", token_ids)
        req.token_ids.ids.extend(token_ids)
    GenerationParams(**params).apply(req)
    return req


def build_tokenize(text: str | None, messages: Iterable | None) -> pb.TokenizeRequest:
    """Build a TokenizeRequest from text or chat messages."""
    if (text is None) == (messages is None):
        raise ParameterError("text", "give exactly one of text, messages")
    if text is not None:
        _params.check_text("text", text)
        return pb.TokenizeRequest(text=text)
    return pb.TokenizeRequest(chat=to_chat(messages))


POOLINGS = ("last", "mean")


def build_embed(text: str | None, token_ids: Sequence[int] | None, pooling: str | None, normalize: bool | None,
                request_id: str | None) -> pb.EmbedRequest:
    """An EmbedRequest from exactly one of text and token_ids; pooling "last" | "mean" | None (the server's)."""
    if (text is None) == (token_ids is None):
        raise ParameterError("text", "give exactly one of text, token_ids")
    req = pb.EmbedRequest(request_id=request_id or uuid.uuid4().hex)
    if request_id is not None:
        _params.check_text("request_id", request_id)
    if text is not None:
        _params.check_text("text", text)
        req.text = text
    else:
        _params.check_token_ids("token_ids", token_ids)
        req.token_ids.ids.extend(token_ids)
    if pooling is not None:
        if pooling not in POOLINGS:
            raise ParameterError("pooling", f"`pooling` must be one of {', '.join(POOLINGS)} or None; got {pooling!r}")
        req.pooling = pb.Pooling.Value(pooling.upper())
    if normalize is not None:
        if not isinstance(normalize, bool):
            raise ParameterError("normalize", f"`normalize` must be True, False or None; got {normalize!r}")
        req.normalize = normalize
    return req


class StreamState:
    """What both clients' text streams keep: how to start (or restart) the call, the retry policy, the call, the
    responses so far (`ResultBuilder`), the attempts and whether the stream ended. `final_hint` completes the error of
    reading `result` too early."""

    final_hint = "call final()"

    def __init__(self, start: Callable, request_id: str, retry) -> None:
        self._start = start
        self._retry = retry
        self._call = None
        self._builder = ResultBuilder(request_id)
        self._num_attempts = 0
        self._first_error = None  # what the first attempt got (reported if all fail)
        self._done = False

    @property
    def request_id(self) -> str:
        """The request's id (usable with the client's `abort`)."""
        return self._builder.request_id

    @property
    def result(self) -> GenerateResult:
        """The final result; only once the stream is exhausted."""
        if not self._done:
            raise RuntimeError(f"the stream is not finished yet: iterate it or {self.final_hint}")
        if not self._builder.completions:
            raise TokenloopError(grpc.StatusCode.UNKNOWN, "stream ended without a complete", self.request_id)
        return self._builder.result()

    def cancel(self) -> None:
        """Hang up: the server cancels the request."""
        if self._call is not None and not self._done:
            self._call.cancel()
        self._done = True


class ResultBuilder:
    """Collects Generate responses; turns chunks into Deltas and completes into a GenerateResult."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.completions: dict[int, Completion] = {}
        self.num_messages = 0

    def add(self, msg: pb.GenerateResponse) -> Delta | None:
        """Record one response message; return its Delta for a chunk, None for a complete."""
        self.num_messages += 1
        if msg.request_id:
            self.request_id = msg.request_id
        kind = msg.WhichOneof("response")
        if kind == "chunk":
            return Delta.from_pb(msg.chunk)
        if kind == "complete":
            done = Completion.from_pb(msg.complete)
            self.completions[done.index] = done
        return None

    def result(self) -> GenerateResult:
        """The final result, sequences ordered by index."""
        done = tuple(self.completions[i] for i in sorted(self.completions))
        return GenerateResult(self.request_id, done)


def build_detokenize(token_ids: Sequence[int], skip_special_tokens: bool | None) -> pb.DetokenizeRequest:
    """Build a DetokenizeRequest (ParameterError on ids that are not token ids)."""
    _params.check_token_ids("token_ids", token_ids)
    if skip_special_tokens is not None and not isinstance(skip_special_tokens, bool):
        raise ParameterError("skip_special_tokens", "`skip_special_tokens` must be True or False; got "
                                                    f"{skip_special_tokens!r}")
    return pb.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)


def build_load_lora(name: str, path: str, adapter_id: int | None) -> pb.LoadLoraAdapterRequest:
    """A LoadLoraAdapterRequest; the types checked here, the rules by the server."""
    fields_ = pb.LoadLoraAdapterRequest.DESCRIPTOR.fields_by_name
    _params.check_field("name", name, fields_["name"])
    _params.check_field("path", str(path), fields_["path"])
    req = pb.LoadLoraAdapterRequest(name=name, path=str(path))
    if adapter_id is not None:
        _params.check_field("id", adapter_id, fields_["id"])
        req.id = adapter_id
    return req
