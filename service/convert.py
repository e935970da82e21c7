"""Looper events -> tokenloop.v1 protobuf messages (the only place that builds them)."""

from __future__ import annotations

from tokenloop.looper.request import ValidRequest
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
            out[-1] = Chunk(prev.index, prev.text + event.text, prev.token_ids + event.token_ids,
                            (prev.logprobs or []) + (event.logprobs or []) if prev.logprobs is not None else None)
        else:
            out.append(event)
    return out


def chunk_message(request_id: str, chunk: Chunk) -> pb.GenerateResponse:
    return pb.GenerateResponse(request_id=request_id, chunk=pb.Chunk(
        index=chunk.index, text=chunk.text, token_ids=chunk.token_ids, logprobs=_logprobs(chunk.logprobs)))


def complete_message(request_id: str, done: Complete, request: ValidRequest) -> pb.GenerateResponse:
    msg = pb.Complete(
        index=done.index, text=done.text, token_ids=done.token_ids, finish_reason=int(done.finish_reason),
        usage=pb.Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens),
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
