"""After a forward pass: append sampled tokens, decide which sequences end, and build Steps."""

from __future__ import annotations

from tokenloop.core.executor import ErrorKind, Step
from tokenloop.core.request import FinishReason

from . import guided
from .sampler import Sample
from .scheduler import Scheduler
from .sequence import Sequence


def finish_reason(seq: Sequence, token_id: int, eos_token_ids: tuple[int, ...],
                  max_context_length: int) -> FinishReason | None:
    """Why `seq` ends after appending `token_id`, or None. Stop tokens and EOS wait for min_new_tokens."""
    stopping = seq.request.stopping
    if seq.num_output_tokens >= stopping.min_new_tokens:
        if token_id in stopping.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if not stopping.ignore_eos and token_id in eos_token_ids:
            return FinishReason.EOS
    if seq.num_output_tokens >= stopping.max_new_tokens or len(seq) >= max_context_length:
        return FinishReason.LENGTH
    return None


def structured_finish(seq: Sequence, token_id: int, reason: FinishReason | None) -> FinishReason | None:
    """Advance `seq`'s matcher with `token_id`: a complete structure ends the sequence (STRUCTURE_COMPLETE, also
    when the same token reached max_new_tokens: the output is whole). Raises ValueError when the matcher refused it."""
    error = guided.advance(seq, token_id)
    if error is not None:
        raise ValueError(f"the structured-output matcher failed: {error}")
    if reason in (None, FinishReason.LENGTH) and guided.structure_complete(seq):
        return FinishReason.STRUCTURE_COMPLETE
    return reason


def steps_for_samples(seqs: list[Sequence], samples: list[Sample], scheduler: Scheduler,
                      eos_token_ids: tuple[int, ...], max_context_length: int) -> list[Step]:
    """Append each sample to its sequence; finished sequences leave the scheduler. A sequence whose structure
    matcher failed ends with an error step (its request fails; the looper cancels its other sequences)."""
    steps = []
    for seq, sample in zip(seqs, samples):
        seq.token_ids.append(sample.token_id)
        reason = finish_reason(seq, sample.token_id, eos_token_ids, max_context_length)
        if seq.matcher is not None:
            try:
                reason = structured_finish(seq, sample.token_id, reason)
            except ValueError as exc:
                scheduler.finish(seq)
                steps.append(Step(seq.executor_id, seq.seq_index, [], is_final=True, error=str(exc)))
                continue
        step = Step(seq.executor_id, seq.seq_index, [sample.token_id])
        if seq.num_output_tokens == 1:
            step.num_cached_prompt_tokens = seq.num_cached_prompt_tokens or 0
        if sample.logprob is not None:
            step.logprobs = [sample.logprob]
        if sample.top_logprobs is not None:
            step.top_logprobs = [sample.top_logprobs]
        if reason is not None:
            step.is_final, step.finish_reason = True, reason
            if reason is FinishReason.STOP_TOKEN:
                step.matched_stop_token = sample.token_id
            seq.finish_reason = reason
            scheduler.finish(seq)
        steps.append(step)
    return steps


def cancelled_steps(seqs: list[Sequence], scheduler: Scheduler) -> list[Step]:
    """End every unfinished sequence with CANCELLED and free its blocks."""
    steps = []
    for seq in seqs:
        if not seq.is_finished:
            scheduler.finish(seq)
            seq.finish_reason = FinishReason.CANCELLED
            steps.append(Step(seq.executor_id, seq.seq_index, [], is_final=True,
                              finish_reason=FinishReason.CANCELLED))
    return steps


def error_steps(request_id: int, seqs: list[Sequence], scheduler: Scheduler, message: str,
                kind: ErrorKind = ErrorKind.INTERNAL) -> list[Step]:
    """Fail a whole request: free its sequences and emit one final error Step (`kind`: the status it gets)."""
    for seq in seqs:
        if not seq.is_finished:
            scheduler.finish(seq)
    return [Step(request_id, 0, [], is_final=True, error=message, error_kind=kind)]
