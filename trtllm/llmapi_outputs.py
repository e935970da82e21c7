"""The LLM API's outputs as our steps: each sequence's new tokens of a `RequestOutput`, their log probabilities
(both layouts the releases use), the speculation counts, and the finish reason of a finished sequence.

Written against NVIDIA/TensorRT-LLM tensorrt_llm/executor/result.py @ 005bc848893f575ec14b45d6b13139360d67c790
(CompletionOutput: token_ids, logprobs, finish_reason, stop_reason, request_perf_metrics). Sequences are tracked
with the caller's own offsets (`sent`) rather than `token_ids_diff`, which is only refreshed for the sequence a
response carries (stale for the others when n > 1).
"""

from __future__ import annotations

from tokenloop.core.executor import Step
from tokenloop.core.request import FinishReason, ValidRequest

from .common import infer_finish, stop_reason, wants_logprobs
from .speculative import draft_counts

FINISH_REASONS = {"length": FinishReason.LENGTH, "cancelled": FinishReason.CANCELLED,
                  "timeout": FinishReason.CANCELLED}  # "stop" depends on stop_reason


def steps_of(request_id: int, request: ValidRequest, output, sent: list[int], aborted: bool) -> list[Step]:
    """One step per sequence of `output` with new tokens (or that finished); `sent[seq]`, the tokens already
    stepped, moves on. `aborted`: the request was cancelled (a finish with no reason is then CANCELLED)."""
    steps = []
    for seq, completion in enumerate(output.outputs[:request.n]):
        tokens = list(completion.token_ids[sent[seq]:])
        logprobs, tops = completion_logprobs(completion, sent[seq], len(tokens), request)
        sent[seq] += len(tokens)
        if not tokens and not output.finished:
            continue
        step = Step(request_id, seq, tokens, logprobs=logprobs, top_logprobs=tops, is_final=output.finished)
        counts = draft_counts(getattr(completion, "request_perf_metrics", None))  # speculation (usage)
        if counts is not None:
            step.num_draft_tokens, step.num_accepted_draft_tokens = counts
        if output.finished:
            finish_step(step, completion, request, aborted)
        steps.append(step)
    return steps


def finish_step(step: Step, completion, request: ValidRequest, aborted: bool) -> None:
    """Map `finish_reason` stop|length|timeout|cancelled (and `stop_reason`) to ours."""
    reason = completion.finish_reason
    if reason == "stop":
        token = completion.stop_reason if isinstance(completion.stop_reason, int) else None
        step.finish_reason, step.matched_stop_token = stop_reason(token, request)
    elif reason in FINISH_REASONS:
        step.finish_reason = FINISH_REASONS[reason]
    elif reason is None:  # the LLM API sets it only for the sequence in the last response
        step.finish_reason, step.matched_stop_token = infer_finish(completion.token_ids, request, aborted)
    else:
        step.error = f"TensorRT-LLM finished sequence {step.seq_index} with an unknown reason {reason!r}"


def completion_logprobs(completion, start: int, count: int, request: ValidRequest):
    """(logprobs, top alternatives) of `count` tokens from `start`. Entries are floats in older
    releases and `{token_id: Logprob(logprob, rank)}` dicts in newer ones."""
    if not wants_logprobs(request) or completion.logprobs is None:
        return None, None
    entries = list(completion.logprobs[start:start + count])
    ids = completion.token_ids[start:start + count]
    lps: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    for token, entry in zip(ids, entries):
        if isinstance(entry, dict):
            lps.append(float(entry[token].logprob) if token in entry else float("nan"))
            ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 0, -kv[1].logprob))
            tops.append([(t, float(lp.logprob)) for t, lp in ranked[:request.output.top_logprobs]])
        else:
            lps.append(float(entry))
            tops.append([])
    lps += [float("nan")] * (count - len(lps))
    tops += [[] for _ in range(count - len(tops))]
    return lps, (tops if request.output.top_logprobs else None)
