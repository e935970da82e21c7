"""The executor seam: what the looper needs from TensorRT-LLM or the embedded engine.

Shaped after the TensorRT-LLM C++ executor (`enqueue_request`, `await_responses`,
`cancel_request`, `get_latest_iteration_stats`) so that adapters stay thin. The looper
thread is the only caller of every method except `stats()`, which any thread may call.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .request import FinishReason, ValidRequest


class ErrorKind(enum.Enum):
    """How a request failed; the service maps each to one gRPC status code."""

    UNAVAILABLE = "unavailable"  # executor dead, server shutting down
    INTERNAL = "internal"  # the executor failed this request
    INVALID_ARGUMENT = "invalid_argument"  # the executor refused this request at enqueue
    DEADLINE_EXCEEDED = "deadline_exceeded"
    RESOURCE_EXHAUSTED = "resource_exhausted"


class EngineDeadError(RuntimeError):
    """The executor can no longer serve any request; every open stream must fail."""


@dataclass(slots=True)
class Step:
    """New output of one sequence of one request since its previous step.

    `token_ids` are deltas. `logprobs[i]` is the log probability of `token_ids[i]`;
    `top_logprobs[i]` lists `(token_id, logprob)` alternatives, best first. A step
    with `is_final` ends that sequence: `finish_reason` says why, unless `error`
    is set, in which case the whole request failed with that message (and the status `error_kind`:
    INVALID_ARGUMENT when the request's own values made it fail; None means INTERNAL).
    """

    executor_id: int  # the id enqueue() returned for the request (ValidRequest.request_id is the client's)
    seq_index: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    is_final: bool = False
    finish_reason: FinishReason | None = None
    matched_stop_token: int | None = None  # set with FinishReason.STOP_TOKEN
    error: str | None = None
    error_kind: ErrorKind | None = None
    num_cached_prompt_tokens: int | None = None  # on a sequence's first token step: prompt tokens from the prefix cache
    embedding: list[float] | None = None  # the final step of an embedding request (ValidRequest.embed): the vector
    # speculative decoding: this sequence's drafted tokens and the drafted tokens its verifications accepted, totals
    # so far (not deltas); None: unchanged since its previous step
    num_draft_tokens: int | None = None
    num_accepted_draft_tokens: int | None = None


def merge_steps(steps: list[Step]) -> list[Step]:
    """One step per sequence per poll: consecutive token steps of a sequence (an executor that returns
    one response per token, and a looper that fell behind) are joined, so each is detokenized once."""
    by_seq: dict[tuple[int, int], Step] = {}
    out: list[Step] = []
    for step in steps:
        key = (step.executor_id, step.seq_index)
        prev = by_seq.get(key)
        if prev is None or prev.is_final or step.error is not None or prev.error is not None:
            by_seq[key] = step
            out.append(step)
            continue
        prev.token_ids = prev.token_ids + step.token_ids
        if prev.logprobs is not None and step.logprobs is not None:
            prev.logprobs = prev.logprobs + step.logprobs
            if prev.top_logprobs is not None and step.top_logprobs is not None:
                prev.top_logprobs = prev.top_logprobs + step.top_logprobs
        prev.is_final, prev.finish_reason = step.is_final, step.finish_reason
        if step.num_cached_prompt_tokens is not None:
            prev.num_cached_prompt_tokens = step.num_cached_prompt_tokens
        if step.embedding is not None:
            prev.embedding = step.embedding
        if step.num_draft_tokens is not None:
            prev.num_draft_tokens, prev.num_accepted_draft_tokens = step.num_draft_tokens, step.num_accepted_draft_tokens
        prev.matched_stop_token = step.matched_stop_token
    return out if len(out) < len(steps) else steps


@dataclass(slots=True)
class ExecutorStats:
    """A snapshot for GetLoad and metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tokens_per_block: int = 0
    step_latency_s: float = 0.0  # mean of recent steps
    num_preemptions: int = 0
    num_steps: int = 0
    kv_blocks_cached: int = 0  # blocks holding a reusable prefix (in use or evictable)
    prefix_cache_hit_rate: float = 0.0  # prompt tokens served from the prefix cache / prompt tokens looked up
    num_prefix_cache_evictions: int = 0  # cached blocks whose slots were reused
    num_prefix_cache_hit_tokens: int = 0
    num_prefix_cache_query_tokens: int = 0
    # speculative decoding since start (vLLM's spec_decode counters): verifications of a draft, drafted tokens,
    # accepted drafted tokens, and accepted tokens by draft position (0 first)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted over drafted tokens since start, 0 to 1."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_tokens_per_step(self) -> float:
        """Tokens one verification of a draft yields on average (its accepted drafts and the target's own token);
        0 before any draft."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def kv_cache_utilization(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@runtime_checkable
class Executor(Protocol):
    """What the looper drives. Implementations: engine.Engine, trtllm.executor.TrtllmExecutor, trtllm.llmapi.TrtllmLlmApi.

    Optional abilities (wake, pause / resume, a death callback, LoRA, KV events) are protocols of their own in
    core/capabilities.py, read once where the executor is built.
    """

    def enqueue(self, request: ValidRequest) -> int:
        """Submit a request; returns the executor's id for it. May raise ValueError for a request it
        cannot take (the looper fails only that request)."""
        ...

    def await_responses(self, timeout: float) -> list[Step]:
        """Block up to `timeout` seconds for new steps, releasing the GIL while waiting.
        Raises EngineDeadError when the executor has died. The steps are the looper's until its next call: an
        executor may then refill and return the same `Step` objects again (one object per sequence per poll),
        and never changes a list it returned (the looper keeps `token_ids` lists)."""
        ...

    def cancel(self, executor_id: int) -> None:
        """Idempotent. The request then ends with a final step of FinishReason.CANCELLED per
        unfinished sequence; unknown or finished ids are ignored."""
        ...

    def stats(self) -> ExecutorStats:
        """Thread-safe snapshot of load."""
        ...

    def shutdown(self) -> None:
        """Stop the executor and free its resources."""
        ...
