"""A model-free `Executor` for measuring the looper and the gRPC front.

Every running sequence emits tokens either as fast as the looper asks (`rate=None`: each
`await_responses` call returns `tokens_per_step` new tokens per sequence, without waiting) or
at `rate` tokens/s per sequence, each sequence on its own clock from the moment it was enqueued
(token k is due at enqueue + (k + 1) / rate). Token ids cycle through `token_ids`, by default
the ids of a paragraph of real text, so the detokenizer does real work.

With `record=True` the executor keeps, per request id, the CLOCK_MONOTONIC time at which each
token was emitted (its due time, or the time of the call that returned it when unlimited).
`time.monotonic()` is shared by every process on one machine, so a client in another process
can subtract these stamps from its own receipt times.
"""

from __future__ import annotations

import heapq
import threading
import time

from tokenloop.core.executor import ExecutorStats, Step
from tokenloop.core.request import FinishReason, ValidRequest

SAMPLE_TEXT = (
    "The looper turns executor steps into text: it keeps a few tokens of context, decodes only "
    "what is new, and hands every request's events to the event loop once per poll. Café, naïve, "
    "日本語のテキスト, and emoji 🚀✨ survive incremental decoding because incomplete UTF-8 is held back. "
)


def sample_token_ids(tokenizer) -> list[int]:
    """Ids of SAMPLE_TEXT in `tokenizer` (anything with `encode(text)`)."""
    return list(tokenizer.encode(SAMPLE_TEXT))


class _Seq:
    __slots__ = ("request_id", "index", "max_tokens", "pos", "start", "final_sent", "stamps", "step")

    def __init__(self, request_id: int, index: int, max_tokens: int, start: float,
                 stamps: list[float] | None = None):
        self.request_id = request_id
        self.index = index
        self.max_tokens = max_tokens
        self.pos = 0
        self.start = start
        self.final_sent = False
        self.stamps = stamps  # emission times of this sequence's tokens (recorded for sequence 0 only)
        # the Step of this sequence's common (one token, not its last) steps, refilled each poll: the executor
        # seam lets an executor hand the same Step object again once the poll that returned it is over
        self.step = Step(request_id, index, [])


class NullExecutor:
    """Emits tokens with no model, at `rate` tokens/s per sequence or unlimited (`rate=None`)."""

    def __init__(self, token_ids: list[int], rate: float | None = None, tokens_per_step: int = 1,
                 record: bool = False):
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        if rate is not None and rate <= 0:
            raise ValueError("rate must be > 0 tokens/s (or None for unlimited)")
        if tokens_per_step < 1:
            raise ValueError("tokens_per_step must be >= 1")
        self.token_ids = list(token_ids)
        self.rate = rate
        self.tokens_per_step = tokens_per_step
        self.record = record
        self.emitted: dict[str, list[float]] = {}  # request id -> emission time of each token
        self._seqs: dict[int, list[_Seq]] = {}  # executor id -> sequences
        self._names: dict[int, str] = {}  # executor id -> request id
        self._cancelled: set[int] = set()
        self._heap: list[tuple[float, int, int]] = []  # paced: (next due time, executor id, sequence index)
        self._running: list[_Seq] = []  # unlimited: the sequences that have not sent their final step, in order
        self._next_id = 1
        self._lock = threading.Lock()  # only stats() runs on another thread
        self._wake = threading.Event()
        self.num_steps = 0
        self.num_tokens = 0

    # -- Executor protocol -----------------------------------------------------------------
    def enqueue(self, request: ValidRequest) -> int:
        """Start every sequence of `request` now."""
        now = time.monotonic()
        stamps = self.emitted.setdefault(request.request_id, []) if self.record else None
        with self._lock:
            rid, self._next_id = self._next_id, self._next_id + 1
            self._seqs[rid] = [_Seq(rid, i, request.stopping.max_new_tokens, now, stamps if i == 0 else None)
                               for i in range(request.n)]
            self._names[rid] = request.request_id
        if self.rate is None:
            self._running += self._seqs[rid]
        else:
            for i in range(request.n):
                heapq.heappush(self._heap, (now + 1.0 / self.rate, rid, i))
        return rid

    def cancel(self, request_id: int) -> None:
        """The request's open sequences end as CANCELLED on the next call."""
        if request_id in self._seqs:
            self._cancelled.add(request_id)

    def await_responses(self, timeout: float) -> list[Step]:
        """Every token due now; waits (GIL released) until the next one is due, at most `timeout`, or until
        `wake()`."""
        if not self._seqs:
            self._sleep(timeout)
            return []
        if self.rate is None:
            return self._emit(time.monotonic())
        if not self._cancelled:
            wait = min(timeout, self._heap[0][0] - time.monotonic()) if self._heap else timeout
            if wait > 0:
                self._sleep(wait)
        return self._emit_paced(time.monotonic())

    def wake(self) -> None:
        """Make a waiting (or the next) `await_responses` return now: the looper has a new command."""
        self._wake.set()

    def _sleep(self, seconds: float) -> None:
        if self._wake.wait(seconds):
            self._wake.clear()

    def stats(self) -> ExecutorStats:
        """Running sequences; no KV cache."""
        with self._lock:
            num = sum(len(s) for s in self._seqs.values())
        return ExecutorStats(num_running=num, num_steps=self.num_steps)

    def shutdown(self) -> None:
        """Forget every request."""
        with self._lock:
            self._seqs.clear()
        self._running = []

    # -- emission --------------------------------------------------------------------------
    def _emit_paced(self, now: float) -> list[Step]:
        """Only the sequences whose next token is due (a heap of due times), plus cancellations."""
        self.num_steps += 1
        steps = self._cancel_steps() if self._cancelled else []
        heap, rate = self._heap, self.rate
        while heap and heap[0][0] <= now:
            _, rid, index = heapq.heappop(heap)
            seqs = self._seqs.get(rid)
            if seqs is None or seqs[index].final_sent:
                continue
            seq = seqs[index]
            num = max(1, min(int((now - seq.start) * rate + 1e-9) - seq.pos, seq.max_tokens - seq.pos))
            steps.append(self._advance(seq, num, now))
            if not seq.final_sent:
                heapq.heappush(heap, (seq.start + (seq.pos + 1) / rate, rid, index))
            elif all(s.final_sent for s in seqs):
                self._forget(rid)
        return steps

    def _cancel_steps(self) -> list[Step]:
        steps = []
        for rid in list(self._cancelled):
            for seq in self._seqs.get(rid, ()):
                if not seq.final_sent:
                    seq.final_sent = True
                    steps.append(Step(rid, seq.index, [], is_final=True, finish_reason=FinishReason.CANCELLED))
            self._forget(rid)
        return steps

    def _forget(self, rid: int) -> None:
        with self._lock:
            self._seqs.pop(rid, None)
            self._cancelled.discard(rid)
            self._names.pop(rid, None)

    def _emit(self, now: float) -> list[Step]:
        """Every running sequence's next `tokens_per_step` tokens (one Step each), after the cancellations."""
        self.num_steps += 1
        steps = []
        if self._cancelled:
            steps = self._cancel_steps()
            self._drop_ended()
        append, per_step, ids, num_ids = steps.append, self.tokens_per_step, self.token_ids, len(self.token_ids)
        first, advanced, ended = len(steps), 0, False
        for seq in self._running:
            pos = seq.pos
            if per_step == 1 and pos + 1 < seq.max_tokens:  # the common step, inline: one token, not the last
                seq.pos = pos + 1
                if seq.stamps is not None:
                    seq.stamps.append(now)
                step = seq.step
                step.token_ids = [ids[pos % num_ids]]
                append(step)
            else:
                append(self._advance(seq, min(per_step, seq.max_tokens - pos), now))
                advanced += 1
                ended = ended or seq.final_sent
        self.num_tokens += len(steps) - first - advanced  # the inline steps' tokens (_advance counts its own)
        if ended:
            self._drop_ended()
        return steps

    def _drop_ended(self) -> None:
        """Forget the sequences that sent their final step, and the requests all of whose sequences did."""
        running, done = [], set()
        for seq in self._running:
            if seq.final_sent:
                done.add(seq.request_id)
            else:
                running.append(seq)
        self._running = running
        for rid in done:
            if all(s.final_sent for s in self._seqs.get(rid, ())):
                self._forget(rid)

    def _advance(self, seq: _Seq, num: int, now: float) -> Step:
        ids, n, pos = self.token_ids, len(self.token_ids), seq.pos
        new = [ids[pos % n]] if num == 1 else [ids[(pos + k) % n] for k in range(num)]
        stamps = seq.stamps
        if stamps is not None:
            if self.rate is None:
                stamps.append(now) if num == 1 else stamps.extend([now] * num)
            else:
                stamps += [seq.start + (pos + k + 1) / self.rate for k in range(num)]
        seq.pos = pos + num
        self.num_tokens += num
        final = seq.pos >= seq.max_tokens
        seq.final_sent = final
        return Step(seq.request_id, seq.index, new, None, None, final, FinishReason.LENGTH if final else None)
