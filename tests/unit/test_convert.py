"""service/convert.py: the tokenloop.v1 sequence writer (hold, merge, stream interval, the raw-bytes path)."""

from __future__ import annotations

from tokenloop.core.request import FinishReason, StoppingParams, ValidRequest
from tokenloop.looper.stream import Chunk, Complete, Timing, TokenLogprob
from tokenloop.service.convert import SequenceWriter, StreamWriter, complete_message, logprob_messages
from tokenloop.v1 import tokenloop_pb2 as pb


def request(rid="r", max_new=10, n=1, stream=True):
    return ValidRequest(request_id=rid, prompt_token_ids=(1, 2, 3), n=n, stream=stream,
                        stopping=StoppingParams(max_new_tokens=max_new))


def _done(index=0, ids=()):
    return Complete(index, "", list(ids), FinishReason.LENGTH, 3, 0, Timing())


class ProtobufWriter(SequenceWriter):
    """The reference for StreamWriter's byte paths: each message built by protobuf from its event's fields."""

    def encode_chunk(self, chunk: Chunk, done: Complete | None) -> bytes:
        return pb.GenerateResponse(request_id=self.valid.request_id, chunk=pb.Chunk(
            index=chunk.index, text=chunk.text, token_ids=chunk.token_ids,
            logprobs=logprob_messages(chunk.logprobs))).SerializeToString()

    def encode_complete(self, done: Complete) -> bytes:
        return complete_message(self.valid.request_id, done, self.valid).SerializeToString()


def sent(writer: SequenceWriter, batch) -> list[pb.GenerateResponse]:
    """What the client reads for one batch: the writer's bytes, parsed."""
    return [pb.GenerateResponse.FromString(m) for m in writer.encode(batch)]


def test_stream_writer_coalesces_a_batch_and_honours_the_interval():
    req = request("w")
    batch = [Chunk(0, "a", [1]), Chunk(0, "b", [2]), Chunk(0, "c", [3])]
    msgs = sent(StreamWriter(req), batch)
    assert [(m.chunk.text, list(m.chunk.token_ids)) for m in msgs] == [("abc", [1, 2, 3])]
    assert len(sent(StreamWriter(req, coalesce=False), batch)) == 3
    w = StreamWriter(req, interval=4)
    assert sent(w, batch) == []  # 3 < 4 tokens: held while the reader keeps up
    msgs = sent(w, [Chunk(0, "d", [4]), Chunk(0, "e", [5])])
    assert [(m.chunk.text, list(m.chunk.token_ids)) for m in msgs] == [("abcde", [1, 2, 3, 4, 5])]
    sent(w, [Chunk(0, "f", [6])])
    msgs = sent(w, [_done(ids=range(1, 7))])  # the end flushes what is held, then completes
    assert [m.WhichOneof("response") for m in msgs] == ["chunk", "complete"]
    assert msgs[0].chunk.text == "f"


def test_stream_writer_encode_refills_one_message_and_writes_what_protobuf_writes():
    """encode() serializes chunks other than the commonest from one chunk message it refills; the bytes equal
    those of messages protobuf builds from the events, batch after batch (the refilled message carries nothing
    over), for every mode and across sequences and logprobs."""
    lp = [TokenLogprob(3, -0.5, [(3, -0.5), (4, -1.0)])]
    batches = [[Chunk(0, "a", [1]), Chunk(1, "b", [2]), Chunk(0, "", [])],
               [Chunk(1, "x", [9, 10], lp), Chunk(1, "y", [11]), Chunk(1, "z", [12, 13, 14])],
               [Chunk(0, "c", [3], lp), Chunk(0, "d", [4]), _done(0, [1, 3, 4])],
               [Chunk(1, "e", [5]), _done(1, [2, 9, 10, 11, 12, 13, 14, 5])]]
    for kw in ({}, {"coalesce": False}, {"interval": 2}):
        req = request("w")
        a, b = ProtobufWriter(req, **kw), StreamWriter(req, **kw)
        for batch in batches:
            assert b.encode(batch) == a.encode(batch), kw


def test_stream_writer_refilled_message_carries_nothing_into_the_next():
    """The refilled chunk message must not carry one message's token ids or logprobs into the next one."""
    lp = [TokenLogprob(3, -0.5, [(3, -0.5)])]
    req = request("w")
    w = StreamWriter(req, coalesce=False)
    w.encode([Chunk(0, "a", [1, 2], lp)])  # two ids and logprobs
    wire = w.encode([Chunk(0, "c", [4]), Chunk(1, "d", [5])])
    assert wire == ProtobufWriter(req, coalesce=False).encode([Chunk(0, "c", [4]), Chunk(1, "d", [5])])
    w = StreamWriter(req, coalesce=False)
    w.encode([Chunk(1, "a", [1, 2], lp)])
    batch = [Chunk(1, "c", [4]), Chunk(1, "d", [5, 6])]
    assert w.encode(batch) == ProtobufWriter(req, coalesce=False).encode(batch)


def test_stream_writer_encode_writes_the_bytes_protobuf_writes(monkeypatch):
    """encode() (the servicer's path) yields each message serialized, with one-token chunks of sequence 0 built from
    a table shared by every stream: byte for byte what protobuf writes for the same events, for every mode, on a first
    pass (the table filling) and a second (hits), for a token seen again with another text (held-back UTF-8),
    ids that take several varint bytes, logprobs, sequences other than 0, and request ids empty, non-ASCII and
    longer than 127 bytes."""
    lp = [TokenLogprob(3, -0.5, [(3, -0.5), (4, -1.0)])]
    batches = [[Chunk(0, " the", [1000]), Chunk(0, "é", [1001]), Chunk(0, "", [1002]), Chunk(0, "\U0001f680", [1002])],
               [Chunk(0, " the", [1000]), Chunk(1, " the", [1000]), Chunk(0, "x", [16384]), Chunk(0, "y", [2 ** 31])],
               [Chunk(0, "a", [5], lp), Chunk(0, "bc", [6, 7]), Chunk(0, "", []), Chunk(0, " the", [1000])],
               [Chunk(0, "d", [8]), _done(0, [1000, 8]), Chunk(1, "e", [9]), _done(1, [1000, 9])]]
    for rid in ("w", "", "ré-1", "r" * 200):
        for kw in ({}, {"coalesce": False}, {"interval": 2}):
            for _ in range(2):
                a, b = ProtobufWriter(request(rid), **kw), StreamWriter(request(rid), **kw)
                for batch in batches:
                    wire = list(b.encode(batch))
                    assert all(type(m) is bytes for m in wire)
                    assert wire == a.encode(batch), (rid, kw)
    from tokenloop.service import convert
    monkeypatch.setattr(convert, "MAX_CHUNK_FIELDS", len(convert.CHUNK_FIELDS))  # the table is full
    a, b = ProtobufWriter(request("w"), coalesce=False), StreamWriter(request("w"), coalesce=False)
    batch = [Chunk(0, "new", [424242]), Chunk(0, "new", [424242])]
    assert list(b.encode(batch)) == a.encode(batch)
    assert 424242 not in convert.CHUNK_FIELDS
