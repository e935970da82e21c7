"""Looper events -> tokenloop.v1 protobuf messages (the only place that builds them)."""

from __future__ import annotations

from tokenloop.core.request import ValidRequest
from tokenloop.looper.stream import Chunk, Complete, Event, TokenDelta, TokenLogprob, as_chunk
from tokenloop.v1 import tokenloop_pb2 as pb


def logprob_messages(items: list[TokenLogprob] | None, token_logprob=pb.TokenLogprob,
                     top_logprob=pb.TopLogprob) -> list:
    """Log probabilities -> an API's messages (`token_logprob(token_id, logprob, top_logprobs)`; both APIs name
    the fields alike: tokenloop.v1's by default, trtllm's passing its classes)."""
    if not items:
        return []
    return [token_logprob(token_id=lp.token_id, logprob=lp.logprob,
                          top_logprobs=[top_logprob(token_id=t, logprob=p) for t, p in lp.top])
            for lp in items]


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
MAX_CHUNK_FIELDS = 1 << 18  # token ids whose one-token chunk field is kept (a vocabulary is usually smaller)
CHUNK_FIELDS: dict[int, tuple[str, bytes]] = {}  # token id -> (its text, the chunk field of that one token)


def string_field(tag: bytes, text: str) -> bytes:
    """A length-delimited field; empty when `text` is (proto3 leaves a default scalar out)."""
    data = text.encode()
    return tag + varint(len(data)) + data if data else b""


def _chunk_field(text: str, token_id: int) -> bytes:
    """The serialized `chunk` field of a GenerateResponse holding one token of sequence 0."""
    body = pb.Chunk(text=text, token_ids=(token_id,)).SerializeToString()
    return _CHUNK_TAG + varint(len(body)) + body


class SequenceWriter:
    """Looper events of one generation call -> one API's serialized messages: the hold / merge / stream-interval
    logic of every API, written once. A subclass (one per API) writes only its message constructors:

        encode_chunk(chunk, done) -> bytes | None   a chunk's serialized message (None: nothing to send); `done` is
                                                    its sequence's Complete when the chunk is that sequence's last
        encode_complete(done) -> bytes              a Complete's serialized message
        encode_delta(delta) -> bytes | None         (optional) a TokenDelta's message sent on its own, the looper's
                                                    commonest event: by default its Chunk's

    Every batch the looper handed over since the reader last asked is merged per sequence (a reader that fell
    behind gets all ready tokens at once, in one message); with `interval` N > 1 a sequence's chunks are held until
    N tokens are ready or it completes (--stream-interval). `coalesce=False` sends one message per chunk.
    The front door yields what `encode(batch)` returns (the Generate method is registered without a response
    serializer: frontdoor.add_service)."""

    __slots__ = ("valid", "interval", "coalesce", "_held")

    def __init__(self, valid: ValidRequest, interval: int = 1, coalesce: bool = True):
        self.valid = valid
        self.interval = max(1, interval)
        self.coalesce = coalesce
        self._held: dict[int, list[Chunk]] = {}  # sequence index -> chunks not yet sent

    def encode(self, batch: list[Event]) -> list[bytes]:
        """The serialized messages for one batch of events, in order per sequence."""
        chunk, complete, delta = self.encode_chunk, self.encode_complete, self.encode_delta
        held = self._held
        if len(batch) == 1 and not held:  # the commonest batch: one chunk, ready to go (nothing to merge or hold)
            event = batch[0]
            if type(event) is tuple and self.interval == 1:
                msg = delta(event)
                return [msg] if msg is not None else []
            if type(event) is Chunk and len(event.token_ids) >= self.interval:
                msg = chunk(event, None)
                return [msg] if msg is not None else []
        out = []
        if not self.coalesce:
            for event in batch:
                kind = type(event)
                msg = delta(event) if kind is tuple else chunk(event, None) if kind is Chunk else complete(event)
                if msg is not None:
                    out.append(msg)
            return out
        for event in map(as_chunk, batch):
            if type(event) is Chunk:
                held.setdefault(event.index, []).append(event)
                continue
            chunks = held.pop(event.index, None)
            if chunks and (msg := chunk(_merge(chunks), event)) is not None:
                out.append(msg)
            out.append(complete(event))
        for index in [i for i, chunks in held.items() if sum(len(c.token_ids) for c in chunks) >= self.interval]:
            if (msg := chunk(_merge(held.pop(index)), None)) is not None:
                out.append(msg)
        return out

    def encode_delta(self, delta: TokenDelta) -> bytes | None:
        """A TokenDelta's message, sent on its own: its Chunk's (a subclass may make it without the Chunk)."""
        return self.encode_chunk(as_chunk(delta), None)

    def encode_chunk(self, chunk: Chunk, done: Complete | None) -> bytes | None:
        raise NotImplementedError

    def encode_complete(self, done: Complete) -> bytes:
        raise NotImplementedError


class StreamWriter(SequenceWriter):
    """tokenloop.v1's messages. The commonest message, one token of sequence 0 with no logprobs, is the request's id
    field followed by a chunk field that depends only on the token and its text: that field is built once per token
    id and kept in a table shared by every stream (`CHUNK_FIELDS`), so such a message costs one bytes
    concatenation. Any other chunk is serialized from one chunk message this writer refills."""

    __slots__ = ("_msg", "_msg_lps", "_prefix")

    def __init__(self, request: ValidRequest, interval: int = 1, coalesce: bool = True):
        super().__init__(request, interval, coalesce)
        self._msg: pb.GenerateResponse | None = None  # the chunk message encode_chunk refills
        self._msg_lps = False  # whether that message holds logprobs (reading the field costs more than this)
        self._prefix = string_field(_REQUEST_ID_TAG, request.request_id)  # starts every message

    @property
    def request(self) -> ValidRequest:
        return self.valid

    def encode_delta(self, delta: TokenDelta) -> bytes:
        """The commonest message of all, from the looper's TokenDelta with no Chunk made."""
        index, text, ids, _ = delta
        if not index and len(ids) == 1:
            return self._one_token(ids[0], text)
        return self.encode_chunk(as_chunk(delta), None)

    def encode_chunk(self, event: Chunk, done: Complete | None) -> bytes:
        if not event.index and not event.logprobs and len(event.token_ids) == 1:
            return self._one_token(event.token_ids[0], event.text)
        return self._refilled(event).SerializeToString()

    def _one_token(self, token_id: int, text: str) -> bytes:
        """One token of sequence 0 with no logprobs: the request's id field and the token's chunk field, from
        `CHUNK_FIELDS` (made and kept there the first time the token is seen)."""
        known = CHUNK_FIELDS.get(token_id)
        if known is not None and known[0] == text:  # the common message: no protobuf at all
            return self._prefix + known[1]
        field = _chunk_field(text, token_id)
        if known is None and len(CHUNK_FIELDS) < MAX_CHUNK_FIELDS:
            CHUNK_FIELDS[token_id] = (text, field)
        return self._prefix + field

    def encode_complete(self, done: Complete) -> bytes:
        return complete_message(self.valid.request_id, done, self.valid).SerializeToString()

    def _refilled(self, event: Chunk) -> pb.GenerateResponse:
        """This writer's chunk message refilled with `event` (cheaper than a new message in upb)."""
        msg = self._msg
        if msg is None:
            msg = self._msg = pb.GenerateResponse(request_id=self.valid.request_id)
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
            out.logprobs.extend(logprob_messages(event.logprobs))
            self._msg_lps = bool(event.logprobs)
        return msg


def complete_message(request_id: str, done: Complete, request: ValidRequest) -> pb.GenerateResponse:
    msg = pb.Complete(
        index=done.index, text=done.text, token_ids=done.token_ids, finish_reason=int(done.finish_reason),
        usage=pb.Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                       cached_prompt_tokens=done.cached_prompt_tokens, draft_tokens=done.draft_tokens,
                       accepted_draft_tokens=done.accepted_draft_tokens),
        seed=done.seed, timing=pb.Timing(queue_s=done.timing.queue_s, ttft_s=done.timing.ttft_s,
                                         total_s=done.timing.total_s),
        logprobs=logprob_messages(done.logprobs))
    if done.matched_stop_str is not None:
        msg.matched_stop_str = done.matched_stop_str
    elif done.matched_stop_token is not None:
        msg.matched_stop_token_id = done.matched_stop_token
    if request.output.echo:
        msg.prompt_text = request.prompt_text
        msg.prompt_token_ids.extend(request.prompt_token_ids)
    return pb.GenerateResponse(request_id=request_id, complete=msg)
