"""Looper events -> trtllm.TrtllmService GenerateResponse messages (the router API's writer, on
convert.SequenceWriter: only its message constructors are here)."""

from __future__ import annotations

from smg_grpc_proto.generated import trtllm_service_pb2 as tpb

from tokenloop.core.request import FinishReason, ValidRequest
from tokenloop.looper.stream import Chunk, Complete

from .convert import SequenceWriter, field_key, logprob_messages, string_field, varint

# The finish reasons SMG maps to OpenAI's: a complete structure is a natural end, "stop" (as in TensorRT-LLM, where
# the grammar ends the sequence with its end token).
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.EOS: "stop", FinishReason.STOP_SEQUENCE: "stop",
                  FinishReason.STOP_TOKEN: "stop", FinishReason.CANCELLED: "abort",
                  FinishReason.STRUCTURE_COMPLETE: "stop"}
# Serialized pieces of GenerateResponse / GenerateStreamChunk (TrtllmWriter.encode_chunk)
_REQUEST_ID_KEY = field_key(tpb.GenerateResponse, "request_id", 2)
_CHUNK_KEY = field_key(tpb.GenerateResponse, "chunk", 2)
_TOKEN_IDS_KEY = field_key(tpb.GenerateStreamChunk, "token_ids", 2)  # packed
_SEQUENCE_INDEX_KEY = field_key(tpb.GenerateStreamChunk, "sequence_index", 0)
_PROMPT_TOKENS_KEY = field_key(tpb.GenerateStreamChunk, "prompt_tokens", 0)
_COMPLETION_TOKENS_KEY = field_key(tpb.GenerateStreamChunk, "completion_tokens", 0)
_CACHED_TOKENS_KEY = field_key(tpb.GenerateStreamChunk, "cached_tokens", 0)
MAX_TOKEN_ID_FIELDS = 1 << 18  # token ids whose packed one-id field is kept (a vocabulary is usually smaller)
TOKEN_ID_FIELDS: dict[int, bytes] = {}  # token id -> the serialized `token_ids` field holding only it


def _logprobs(items) -> list[tpb.TokenLogprob]:
    return logprob_messages(items, tpb.TokenLogprob, tpb.TopLogprob)


class TrtllmWriter(SequenceWriter):
    """trtllm GenerateResponse messages: delta token ids in `chunk`s, then one `complete` per sequence. A stop /
    EOS token that TensorRT-LLM leaves out of output ids is dropped from the last chunk and the complete
    (`keep_stop_token`: the request's include_stop_token_in_output). A chunk of one token without logprobs, the
    commonest message, is put together from bytes kept per token id and per sequence; anything else goes through
    protobuf."""

    __slots__ = ("keep_stop_token", "perf", "arrival_wall", "num_sent", "_prefix", "_middle")

    def __init__(self, valid: ValidRequest, keep_stop_token: bool, perf: bool, arrival_wall: float,
                 interval: int = 1):
        super().__init__(valid, interval)
        self.keep_stop_token, self.perf, self.arrival_wall = keep_stop_token, perf, arrival_wall
        self.num_sent: dict[int, int] = {}
        self._prefix = string_field(_REQUEST_ID_KEY, valid.request_id)  # the serialized request_id field
        self._middle: dict[int, bytes] = {}  # sequence index -> its chunks' serialized index and prompt_tokens

    def _strip(self, done: Complete) -> bool:
        """Whether the last output token is a stop / EOS token TensorRT-LLM leaves out of output ids."""
        if self.keep_stop_token or not done.token_ids:
            return False
        if done.finish_reason == FinishReason.STOP_TOKEN:
            return done.token_ids[-1] == done.matched_stop_token
        return done.finish_reason == FinishReason.EOS  # the executor's EOS rule ended it on this token

    def encode_chunk(self, chunk: Chunk, done: Complete | None) -> bytes | None:
        drop_last = done is not None and self._strip(done)  # the final token arrives with the complete
        if len(chunk.token_ids) != 1 or chunk.logprobs or drop_last:
            return self._chunk_message(chunk, drop_last)
        index = chunk.index
        sent = self.num_sent[index] = self.num_sent.get(index, 0) + 1
        middle = self._middle.get(index)
        if middle is None:  # sequence_index and prompt_tokens: fixed for the sequence (0 is left out, as proto3 does)
            prompt = len(self.valid.prompt_token_ids)
            middle = self._middle[index] = ((_SEQUENCE_INDEX_KEY + varint(index) if index else b"")
                                            + (_PROMPT_TOKENS_KEY + varint(prompt) if prompt else b""))
        token_id = chunk.token_ids[0]
        ids = TOKEN_ID_FIELDS.get(token_id)
        if ids is None:
            packed = varint(token_id)
            ids = _TOKEN_IDS_KEY + varint(len(packed)) + packed
            if len(TOKEN_ID_FIELDS) < MAX_TOKEN_ID_FIELDS:
                TOKEN_ID_FIELDS[token_id] = ids
        body = ids + middle + _COMPLETION_TOKENS_KEY + varint(sent)
        if chunk.cached_prompt_tokens:  # 0 is left out, as proto3 does
            body += _CACHED_TOKENS_KEY + varint(chunk.cached_prompt_tokens)
        return self._prefix + _CHUNK_KEY + varint(len(body)) + body

    def _chunk_message(self, chunk: Chunk, drop_last: bool) -> bytes | None:
        """A chunk through protobuf (several ids, logprobs, or the last token dropped)."""
        ids = chunk.token_ids[:-1] if drop_last else chunk.token_ids
        if not ids:
            return None
        index = chunk.index
        sent = self.num_sent[index] = self.num_sent.get(index, 0) + len(ids)
        msg = tpb.GenerateResponse(request_id=self.valid.request_id)  # set field by field: cheaper in upb
        out = msg.chunk
        out.token_ids.extend(ids)
        out.sequence_index = index
        out.prompt_tokens = len(self.valid.prompt_token_ids)
        out.completion_tokens = sent
        out.cached_tokens = chunk.cached_prompt_tokens  # like prompt_tokens, on every chunk
        if chunk.logprobs:
            out.logprobs.extend(_logprobs(chunk.logprobs[:len(ids)]))
        return msg.SerializeToString()

    def encode_complete(self, done: Complete) -> bytes:
        ids = done.token_ids[:-1] if self._strip(done) else done.token_ids
        msg = tpb.GenerateComplete(
            output_token_ids=ids, sequence_index=done.index, finish_reason=FINISH_REASONS[done.finish_reason],
            prompt_tokens=done.prompt_tokens, completion_tokens=len(ids), cached_tokens=done.cached_prompt_tokens,
            logprobs=_logprobs((done.logprobs or [])[:len(ids)]),
            spec_draft_tokens=done.draft_tokens, spec_accepted_tokens=done.accepted_draft_tokens)  # speculation
        if done.matched_stop_str is not None:
            msg.matched_stop_str = done.matched_stop_str
        elif done.matched_stop_token is not None:
            msg.matched_token_id = done.matched_stop_token
        if self.perf:
            t = done.timing
            msg.perf_metrics.CopyFrom(tpb.PerfMetrics(
                arrival_time=self.arrival_wall, first_scheduled_time=self.arrival_wall + t.queue_s,
                first_token_time=self.arrival_wall + t.ttft_s, last_token_time=self.arrival_wall + t.total_s))
        return tpb.GenerateResponse(request_id=self.valid.request_id, complete=msg).SerializeToString()
