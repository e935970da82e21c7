"""Looper events -> tokenloop.v1 protobuf messages (the only place that builds them)."""

from __future__ import annotations

from collections.abc import Iterator

from tokenloop.core.request import ValidRequest
from tokenloop.looper.stream import Chunk, Complete, Event, TokenLogprob
from tokenloop.v1 import tokenloop_pb2 as pb


def _logprobs(items: list[TokenLogprob] | None) -> list[pb.TokenLogprob]:
    if not items:
        return []
    return [pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                            top_logprobs=[pb.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])
            for lp in items]


def coalesce(batch: list[Event]) -> list[Event]:
    """Merge consecutive chunks of one sequence that arrived together (a reader that fell behind)."""
    out: list[Event] = []
    for event in batch:
        prev = out[-1] if out else None
        if isinstance(event, Chunk) and isinstance(prev, Chunk) and prev.index == event.index:
            out[-1] = _merge([prev, event])
        else:
            out.append(event)
    return out


def _merge(chunks: list[Chunk]) -> Chunk:
    first = chunks[0]
    if len(chunks) == 1:
        return first
    ids = [t for c in chunks for t in c.token_ids]
    lps = [lp for c in chunks for lp in c.logprobs or ()] if first.logprobs is not None else None
    return Chunk(first.index, "".join(c.text for c in chunks), ids, lps, chunks[-1].cached_prompt_tokens)


def varint(value: int) -> bytes:
    """Protobuf's base-128 varint of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def field_key(message, field: str, wire_type: int = 2) -> bytes:
    """A field's serialized key (2: length-delimited, 0: varint), its number from the message's descriptor."""
    return varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | wire_type)


# Serialized pieces of GenerateResponse (StreamWriter.encode)
_REQUEST_ID_TAG = field_key(pb.GenerateResponse, "request_id")
_CHUNK_TAG = field_key(pb.GenerateResponse, "chunk")
_MAX_CHUNK_FIELDS = 1 << 18  # token ids whose one-token chunk field is kept (a vocabulary is usually smaller)
_CHUNK_FIELDS: dict[int, tuple[str, bytes]] = {}  # token id -> (its text, the chunk field of that one token)


def string_field(tag: bytes, text: str) -> bytes:
    """A length-delimited field; empty when `text` is (proto3 leaves a default scalar out)."""
    data = text.encode()
    return tag + varint(len(data)) + data if data else b""


def _chunk_field(text: str, token_id: int) -> bytes:
    """The serialized `chunk` field of a GenerateResponse holding one token of sequence 0."""
    body = pb.Chunk(text=text, token_ids=(token_id,)).SerializeToString()
    return _CHUNK_TAG + varint(len(body)) + body


class StreamWriter:
    """Events -> messages for one Generate call: ready chunks of a sequence go out as one message.

    Every batch the looper handed over since the reader last asked is merged per sequence (a reader
    that fell behind gets all ready tokens at once); with `interval` N > 1 a sequence's chunks are
    held until N tokens are ready or it completes. `coalesce=False` sends one message per chunk.

    `encode(batch)` is the servicer's path: the same messages already serialized, one `bytes` each (the
    Generate method is registered without one: `servicer.add_text_generation`). The commonest
    message, one token of sequence 0 with no logprobs, is the request's id field followed by a chunk
    field that depends only on the token and its text: that field is built once per token id and kept in
    a table shared by every stream (`_CHUNK_FIELDS`), so such a message costs one bytes concatenation.
    Anything else is serialized from the refilled message of `stream()`.

    `stream(batch)` yields one message at a time and refills a single chunk message per call, so each
    yielded chunk is valid only until the next one is asked for. `messages(batch)` returns independent
    messages.
    """

    __slots__ = ("request", "interval", "coalesce", "_held", "_msg", "_msg_lps", "_prefix")

    def __init__(self, request: ValidRequest, interval: int = 1, coalesce: bool = True):
        self.request = request
        self.interval = interval
        self.coalesce = coalesce
        self._held: dict[int, list[Chunk]] = {}  # sequence index -> chunks not yet sent
        self._msg: pb.GenerateResponse | None = None  # the chunk message that stream() refills
        self._msg_lps = False  # whether that message holds logprobs (reading the field costs more than this)
        self._prefix: bytes | None = None  # the serialized request_id field that starts every message

    def messages(self, batch: list[Event]) -> list[pb.GenerateResponse]:
        """The messages to send for one batch of events, in order per sequence."""
        rid, request = self.request.request_id, self.request
        return [chunk_message(rid, e) if type(e) is Chunk else complete_message(rid, e, request)
                for e in self._plan(batch)]

    def encode(self, batch: list[Event]) -> Iterator[bytes]:
        """The messages of `stream(batch)`, serialized: byte for byte what protobuf would write."""
        prefix = self._prefix
        if prefix is None:
            prefix = self._prefix = string_field(_REQUEST_ID_TAG, self.request.request_id)
        fields = _CHUNK_FIELDS
        for event in self._plan(batch):
            if type(event) is Chunk and not event.index and not event.logprobs and len(event.token_ids) == 1:
                token_id = event.token_ids[0]
                known = fields.get(token_id)
                if known is not None and known[0] == event.text:  # the common message: no protobuf at all
                    yield prefix + known[1]
                    continue
                field = _chunk_field(event.text, token_id)
                if known is None and len(fields) < _MAX_CHUNK_FIELDS:
                    fields[token_id] = (event.text, field)
                yield prefix + field
                continue
            yield self._one(event).SerializeToString()

    def stream(self, batch: list[Event]) -> Iterator[pb.GenerateResponse]:
        """The same messages, one at a time; each chunk message is the previous one refilled."""
        for event in self._plan(batch):
            yield self._one(event)

    def _one(self, event: Event) -> pb.GenerateResponse:
        """The message of one planned event: a Complete's own, or this writer's chunk message refilled."""
        if type(event) is not Chunk:
            return complete_message(self.request.request_id, event, self.request)
        msg = self._msg
        if msg is None:
            msg = self._msg = pb.GenerateResponse(request_id=self.request.request_id)
            msg.chunk.SetInParent()
        out = msg.chunk
        if event.index != out.index:
            out.index = event.index
        out.text = event.text
        ids, new = out.token_ids, event.token_ids
        if len(new) == 1 and len(ids) == 1:  # one token after one token: set in place
            ids[0] = new[0]
        else:
            ids[:] = new
        if event.logprobs or self._msg_lps:
            del out.logprobs[:]
            out.logprobs.extend(_logprobs(event.logprobs))
            self._msg_lps = bool(event.logprobs)
        return msg

    def _plan(self, batch: list[Event]) -> list[Event]:
        """The events to send for one batch: chunks merged per sequence (when coalescing) or held."""
        if not self.coalesce:
            return batch
        held, out = self._held, []
        for event in batch:
            if type(event) is Chunk:
                held.setdefault(event.index, []).append(event)
                continue
            chunks = held.pop(event.index, None)
            if chunks:
                out.append(_merge(chunks))
            out.append(event)
        for index in [i for i, chunks in held.items() if sum(len(c.token_ids) for c in chunks) >= self.interval]:
            out.append(_merge(held.pop(index)))
        return out


def chunk_message(request_id: str, chunk: Chunk) -> pb.GenerateResponse:
    # setting fields one by one is ~3x cheaper in upb than keyword construction of nested messages
    msg = pb.GenerateResponse(request_id=request_id)
    out = msg.chunk
    if not (chunk.text or chunk.token_ids):
        out.SetInParent()
    if chunk.index:
        out.index = chunk.index
    if chunk.text:
        out.text = chunk.text
    if chunk.token_ids:
        out.token_ids.extend(chunk.token_ids)
    if chunk.logprobs:
        out.logprobs.extend(_logprobs(chunk.logprobs))
    return msg


def complete_message(request_id: str, done: Complete, request: ValidRequest) -> pb.GenerateResponse:
    msg = pb.Complete(
        index=done.index, text=done.text, token_ids=done.token_ids, finish_reason=int(done.finish_reason),
        usage=pb.Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                       cached_prompt_tokens=done.cached_prompt_tokens),
        seed=done.seed, timing=pb.Timing(queue_s=done.timing.queue_s, ttft_s=done.timing.ttft_s,
                                         total_s=done.timing.total_s),
        logprobs=_logprobs(done.logprobs))
    if done.matched_stop_str is not None:
        msg.matched_stop_str = done.matched_stop_str
    elif done.matched_stop_token is not None:
        msg.matched_stop_token_id = done.matched_stop_token
    if request.output.echo:
        msg.prompt_text = request.prompt_text
        msg.prompt_token_ids.extend(request.prompt_token_ids)
    return pb.GenerateResponse(request_id=request_id, complete=msg)


def messages(request: ValidRequest, batch: list[Event]) -> list[pb.GenerateResponse]:
    """The response messages for one batch of events."""
    rid = request.request_id
    return [chunk_message(rid, e) if isinstance(e, Chunk) else complete_message(rid, e, request)
            for e in coalesce(batch)]
