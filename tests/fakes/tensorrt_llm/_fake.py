"""The scripted "model" behind the fake tensorrt_llm, and the knobs tests turn.

Not part of the real package. Next token of sequence `s` = (last token + 1 + s) mod VOCAB_SIZE,
so outputs are predictable: prompt [10] -> 11, 12, 13, ... (sequence 1: 12, 14, 16, ...).
A prompt containing one of the trigger ids makes the fake misbehave the way TensorRT-LLM can.
"""

from __future__ import annotations

VOCAB_SIZE = 400
ERROR_TOKEN = 397  # the request fails with an error response
UNKNOWN_REASON_TOKEN = 398  # the first step finishes with a finish reason the adapters do not know
DIE_TOKEN = 399  # the executor dies: await_responses raises / the LLM turns unhealthy
MAX_INPUT_LEN = 200  # longer prompts are refused at enqueue

LEGACY_NAMES = False  # True: bindings take 0.1x `max_new_tokens` / `random_seed` instead of 1.x names
# True: `LLM._check_health()` exists, as in releases since NVIDIA/TensorRT-LLM PR #9057 (Dec 2025: BaseLLM returns
# `not self._executor.is_shutdown()`); False (the default): the LLM API as at the commit the adapter cites
# (tensorrt_llm/llmapi/llm.py @ 00966934), which has no such method.
LLM_CHECK_HEALTH = False


def next_token(tokens: list[int], seq_index: int) -> int:
    return (tokens[-1] + 1 + seq_index) % VOCAB_SIZE


def logprob(token: int) -> float:
    return -((token % 7) + 1) / 10.0


def top_logprobs(token: int, k: int) -> dict[int, float]:
    """The sampled token first, then made-up alternatives with lower log probabilities."""
    out = {token: logprob(token)}
    for i in range(1, k):
        out[(token + 100 * i) % VOCAB_SIZE] = logprob(token) - i
    return out


def kw_init(obj, cls_name: str, args: tuple, kwargs: dict, spec: dict, required: tuple = (),
            positional: int | None = None) -> None:
    """nanobind-like construction: the first `positional` arguments of `spec` (in the binding's order; all of them
    when None) may be passed by position, the rest only by keyword (`nb::kw_only()`); more positional arguments,
    an argument given twice, or an unknown one is a TypeError, as nanobind's "incompatible function arguments"."""
    names = list(spec)[:len(spec) if positional is None else positional]
    if len(args) > len(names):
        raise TypeError(f"{cls_name}.__init__(): incompatible function arguments: at most {len(names)} positional "
                        f"(got {len(args)})")
    twice = set(names[:len(args)]) & set(kwargs)
    if twice:
        raise TypeError(f"{cls_name}.__init__(): incompatible function arguments: {sorted(twice)} given twice")
    kwargs = {**dict(zip(names, args)), **kwargs}
    unknown = set(kwargs) - set(spec)
    if unknown:
        raise TypeError(f"{cls_name}.__init__(): incompatible function arguments: unexpected {sorted(unknown)}")
    missing = [name for name in required if name not in kwargs]
    if missing:
        raise TypeError(f"{cls_name}.__init__(): missing required argument(s) {missing}")
    for name, default in spec.items():
        setattr(obj, name, kwargs.get(name, default))


class Drafting:
    """The fake's speculative decoding, per sequence: each iteration drafts `draft_len` tokens and accepts
    `accepted(iteration)` of them (a fixed, varying pattern), so the iteration emits 1 + accepted tokens of the same
    scripted sequence (speculation never changes the tokens). Totals feed `RequestPerfMetrics.speculative_decoding`;
    `take_iteration` gives and resets what this iteration adds to the engine's `specDecodingStats`."""

    PATTERN = (2, 0, 3, 1)  # accepted drafts per iteration, cycled (capped at draft_len)

    def __init__(self, draft_len: int):
        self.draft_len = draft_len
        self.iterations = 0
        self.total_draft_tokens = self.total_accepted_draft_tokens = 0

    def tokens_this_iteration(self) -> int:
        """Count one verification: its drafted and accepted tokens; the tokens it yields."""
        accepted = min(self.PATTERN[self.iterations % len(self.PATTERN)], self.draft_len)
        self.iterations += 1
        self.total_draft_tokens += self.draft_len
        self.total_accepted_draft_tokens += accepted
        return 1 + accepted


class SpecIteration:
    """One engine iteration's specDecodingStats (cpp/include/tensorrt_llm/executor/types.h's SpecDecodingStats)."""

    def __init__(self):
        self.num_draft_tokens = self.num_accepted_tokens = self.num_requests_with_draft_tokens = 0

    def count(self, drafted: int, accepted: int) -> None:
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_requests_with_draft_tokens += 1

    def to_json(self) -> dict:
        n = self.num_requests_with_draft_tokens
        return {"numDraftTokens": self.num_draft_tokens, "numAcceptedTokens": self.num_accepted_tokens,
                "numRequestsWithDraftTokens": n, "acceptanceLength": 1.0 + self.num_accepted_tokens / n if n else 0.0,
                "iterLatencyMS": 0.5, "draftOverhead": 0.2}


def draft_step(drafting: Drafting | None, iteration: SpecIteration | None, advance, finished) -> list[int]:
    """One iteration of a sequence: `advance()` (its next token, or [] at END_ID) 1 + accepted times with
    speculation, once without; stops early once `finished()` (the sequence ended)."""
    if drafting is None:
        return advance()
    drafted, accepted = drafting.total_draft_tokens, drafting.total_accepted_draft_tokens
    out: list[int] = []
    for _ in range(drafting.tokens_this_iteration()):
        out += advance()
        if finished():
            break
    if iteration is not None:
        iteration.count(drafting.total_draft_tokens - drafted, drafting.total_accepted_draft_tokens - accepted)
    return out


def perf_metrics(drafting: Drafting):
    """A RequestPerfMetrics with its speculative_decoding filled from `drafting` (request.cpp's binding names)."""
    from .bindings.executor import RequestPerfMetrics

    metrics = RequestPerfMetrics()
    spec = metrics.speculative_decoding
    spec.total_draft_tokens, spec.total_accepted_draft_tokens = (drafting.total_draft_tokens,
                                                                 drafting.total_accepted_draft_tokens)
    spec.acceptance_rate = (drafting.total_accepted_draft_tokens / drafting.total_draft_tokens
                            if drafting.total_draft_tokens else 0.0)
    return metrics
