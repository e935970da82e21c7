"""Turning executor steps into client events: one `RequestState` per in-flight request.

Runs on the looper thread. Each sequence keeps its detokenizer, stop matcher and the
output so far; `apply(step)` returns the events the step produced (a `Chunk` when
streaming, a `Complete` when the sequence ends). The commonest step, tokens of a plain
request (no stop strings, no logprobs: `RequestState.decoding`), the looper decodes in line
as it goes through a poll's steps (`Looper._pull_steps`); `apply` takes every other, and
any step at all.
"""

from __future__ import annotations

from tokenloop.core.executor import Step
from tokenloop.core.request import FinishReason, ValidRequest

from .detokenizer import Decoder, IncrementalDetokenizer, StopMatcher
from .stream import Chunk, Complete, Event, RequestFailed, RequestStream, Timing, TokenLogprob


class Outbox:
    """What one hand-off to the event loop pushes (`Looper._fan_out`, then `deliver` on the event loop): each
    stream's new events, in order, and the streams that end for the client, with the error that ended one (None:
    it finished)."""

    __slots__ = ("events", "ends")

    def __init__(self) -> None:
        self.events: dict[RequestStream, list[Event]] = {}
        self.ends: dict[RequestStream, RequestFailed | None] = {}

    def __bool__(self) -> bool:
        return bool(self.events or self.ends)

    def add(self, stream: RequestStream, events: list[Event], end: bool = False,
            error: RequestFailed | None = None) -> None:
        """Queue `events` (the list is the outbox's from now on) and, with `end`, the stream's end."""
        if events:
            queued = self.events.get(stream)
            if queued is None:
                self.events[stream] = events
            else:
                queued += events
        if end and self.ends.get(stream) is None:
            self.ends[stream] = error

    def merge(self, later: Outbox) -> None:
        """Add a later poll's outbox (the event loop has not taken this one yet): events appended, a first error
        kept."""
        for stream, events in later.events.items():
            self.add(stream, events)
        for stream, error in later.ends.items():
            self.add(stream, [], True, error)

    def deliver(self) -> int:
        """On the event loop: push every stream's events, then the ends. Returns how many of the streams given
        events had readers still behind (the events pushed before not yet read)."""
        behind = 0
        for stream, events in self.events.items():
            behind += stream.push(events)
        for stream, error in self.ends.items():
            stream.end(error)
        return behind


class SequenceState:
    """Output of one of the `n` sequences of a request."""

    __slots__ = ("index", "detok", "stops", "token_ids", "text_parts", "logprobs", "finished", "per_token",
                 "cached_prompt_tokens", "draft_tokens", "accepted_draft_tokens")

    def __init__(self, index: int, request: ValidRequest, tokenizer: Decoder):
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, request.output.skip_special_tokens)
        self.stops = StopMatcher(request.stopping.stop, request.stopping.include_stop_str_in_output)
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.logprobs: list[TokenLogprob] | None = [] if request.output.logprobs else None
        self.finished = False
        self.cached_prompt_tokens = 0  # prompt tokens the executor served from its prefix cache
        self.draft_tokens = self.accepted_draft_tokens = 0  # speculative decoding's totals (usage)
        # with stop strings, feed tokens one at a time so the match ends at the right token
        self.per_token = bool(request.stopping.stop)

    def feed(self, token_ids: list[int]) -> tuple[str, int, str | None]:
        """Detokenize and stop-check new ids; returns (text, ids consumed, matched stop)."""
        if not self.per_token:
            text, matched = self.stops.push(self.detok.push(token_ids))
            return text, len(token_ids), matched
        parts = []
        for i, tid in enumerate(token_ids):
            text, matched = self.stops.push(self.detok.push((tid,)))
            parts.append(text)
            if matched is not None:
                return "".join(parts), i + 1, matched
        return "".join(parts), len(token_ids), None

    def flush(self) -> str:
        return self.stops.push(self.detok.flush())[0] + self.stops.flush()


class RequestState:
    """Everything the looper tracks for one submitted request."""

    __slots__ = ("stream", "request", "executor_id", "seqs", "arrival", "t_enqueued", "t_first",
                 "num_open", "num_exec_open", "closed", "streaming", "plain", "decoding")

    def __init__(self, stream: RequestStream, tokenizer: Decoder, arrival: float):
        self.stream = stream
        self.request = stream.request
        self.executor_id: int | None = None
        self.seqs = [SequenceState(i, self.request, tokenizer) for i in range(self.request.n)]
        self.arrival = arrival
        self.t_enqueued = 0.0
        self.t_first = 0.0
        self.num_open = self.request.n  # sequences not yet completed for the client
        self.num_exec_open = self.request.n  # sequences the executor has not yet ended
        self.closed = False  # every Complete (or an error) was sent; waiting only for the executor
        self.streaming = self.request.stream
        # no stop strings, no logprobs: its token steps need only the detokenizer (and a Chunk when streaming)
        self.plain = not self.request.stopping.stop and not self.request.output.logprobs
        self.decoding = False  # plain, its first token seen, not closed: Looper._pull_steps decodes its steps in line

    def close(self) -> None:
        """Every Complete (or an error) was sent: later steps are the executor's, for nobody."""
        self.closed = True
        self.decoding = False

    def timing(self, now: float) -> Timing:
        first = self.t_first or now
        return Timing(queue_s=max(0.0, self.t_enqueued - self.arrival), ttft_s=first - self.arrival,
                      total_s=now - self.arrival)

    def apply(self, step: Step, now: float) -> list[Event]:
        """One step of one sequence -> the client's events: a Chunk of its new text and ids (when the request
        streams), and a Complete when the sequence ends (the executor's end, or a stop string)."""
        seq = self.seqs[step.seq_index]
        if seq.finished:
            return []  # e.g. tokens after a stop string, or the executor's CANCELLED echo
        if step.num_cached_prompt_tokens is not None:  # the executor's counts, each only when it changed
            seq.cached_prompt_tokens = step.num_cached_prompt_tokens
        if step.num_draft_tokens is not None:
            seq.draft_tokens, seq.accepted_draft_tokens = step.num_draft_tokens, step.num_accepted_draft_tokens
        ids = step.token_ids
        if ids and not self.t_first:
            self.t_first = now
            self.decoding = self.plain and not self.closed  # the looper takes its next token steps in line
        # stop strings token by token, logprobs, the sequence's end
        text, used, matched = seq.feed(ids) if ids else ("", 0, None)
        new_ids = ids[:used]
        new_lps = self._logprobs(step, used)
        finish, stop_token = step.finish_reason, step.matched_stop_token
        if matched is not None:
            finish, stop_token = FinishReason.STOP_SEQUENCE, None
        elif step.is_final:
            text += seq.flush()
        events = self._emit(seq, text, new_ids, new_lps, finish if (matched or step.is_final) else None,
                            matched, stop_token, now)
        if step.embedding is not None:  # an embedding request's one final step: its Complete carries the vector
            events[-1].embedding = step.embedding
        return events

    def cancel_all(self, now: float) -> list[Event]:
        """End every open sequence as CANCELLED (a request dropped before or after submission)."""
        events: list[Event] = []
        for seq in self.seqs:
            if not seq.finished:
                events += self._emit(seq, seq.flush(), [], None, FinishReason.CANCELLED, None, None, now)
        return events

    @staticmethod
    def _logprobs(step: Step, used: int) -> list[TokenLogprob] | None:
        if step.logprobs is None:
            return None
        tops = step.top_logprobs or [[] for _ in step.logprobs]
        return [TokenLogprob(t, lp, list(top)) for t, lp, top in
                zip(step.token_ids[:used], step.logprobs[:used], tops[:used])]

    def _emit(self, seq: SequenceState, text: str, ids: list[int], lps, finish, matched_str,
              stop_token, now: float) -> list[Event]:
        events: list[Event] = []
        seq.token_ids += ids
        if text:
            seq.text_parts.append(text)
        if seq.logprobs is not None and lps:
            seq.logprobs += lps
        if self.request.stream and (ids or text):
            events.append(Chunk(seq.index, text, ids, lps if seq.logprobs is not None else None,
                                seq.cached_prompt_tokens))
        if finish is not None:
            seq.finished = True
            self.num_open -= 1
            if self.num_open == 0:  # its last Complete: the request ends for the client
                self.close()
            events.append(Complete(
                index=seq.index, text="".join(seq.text_parts), token_ids=seq.token_ids,
                finish_reason=finish, prompt_tokens=len(self.request.prompt_token_ids),
                seed=self.request.sampling.seed, timing=self.timing(now), matched_stop_str=matched_str,
                matched_stop_token=stop_token, cached_prompt_tokens=seq.cached_prompt_tokens,
                draft_tokens=seq.draft_tokens, accepted_draft_tokens=seq.accepted_draft_tokens,
                logprobs=seq.logprobs if not self.request.stream else None))
        return events

