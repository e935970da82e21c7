"""Speculation inside the engine step: drafts before scheduling, and the verification of each draft after the
forward pass. The step itself stays the plain one (schedule, run the model, sample, postprocess); these are its
two speculative hooks (docs/engine.md, "Speculative decoding").

1. `propose_drafts`, before `schedule()`: each decoding sequence may get `seq.draft` (speculation.py decides how
   many tokens, if any). The scheduler then gives it 1 + len(draft) tokens of the step's budget (never preempting
   another sequence for them), the runner feeds its last token and its draft as one short chunk whose rows attend
   on the decode kernel as decodes would, and returns the logits of every row.
2. Row 0 of a drafting sequence is sampled with every other sequence's row, by the plain sampler: it is exactly the
   row a plain decode step would have. `verify_drafts` then goes on, position by position, while the token the
   model produced equals the drafted one: the accepted token's K/V is already in the cache (one more computed
   token), and the next row is sampled and postprocessed as a plain step would do it, on the sequence's state as it
   now is (its output, its matcher, its generator). The first token that differs, the bonus token after a whole
   draft, or the end of the sequence stops it. The rejected positions' K/V is never counted as computed (so it is
   never published as a cached block), and the blocks only they used go back to the pool.
"""

from __future__ import annotations

import torch

from tokenloop.core.executor import Step

from .postprocess import steps_for_samples
from .sampler import RowFailure, sample_batch
from .scheduler import Scheduler
from .sequence import Sequence
from .spec_sampling import num_accepted
from .speculation import SpecStats, SpeculativeConfig, drafting_allowed


def propose_drafts(running: list[Sequence], config: SpeculativeConfig, token_budget: int,
                   max_context_length: int) -> int:
    """Give each decoding sequence of `running` its draft for this step (none when the batch is too large, or the
    sequence's own rule says no); at most `token_budget` drafted tokens in all. Returns how many were drafted."""
    decoding = [s for s in running if s.spec is not None and s.num_uncomputed_tokens == 1]
    for seq in running:
        seq.draft = []
    if not decoding or not drafting_allowed(len(decoding), config):
        return 0
    total = 0
    for seq in decoding:
        # the draft and the token after it must fit the request's max_new_tokens and the context
        room = min(seq.request.stopping.max_new_tokens - seq.num_output_tokens, max_context_length - len(seq)) - 1
        limit = min(room, token_budget - total)
        if limit <= 0:
            continue
        seq.draft = seq.spec.propose(seq.token_ids, limit)
        total += len(seq.draft)
    return total


def verify_drafts(drafting: list[tuple[Sequence, torch.Tensor]], first_steps: dict[int, Step],
                  scheduler: Scheduler, eos_token_ids: tuple[int, ...], max_context_length: int,
                  stats: SpecStats) -> tuple[list[Step], list[tuple[Sequence, RowFailure]]]:
    """After row 0 of each drafting sequence was sampled and postprocessed (its token appended, `first_steps` by
    seq_id: the Step it made), verify the rest of its draft. `drafting`: (sequence, logits of its rows 1..k [k, V]).
    Returns the further Steps (one per accepted position, and one for the token that ends the run), and the rows
    that could not be sampled (their requests fail as a plain step's would)."""
    steps: list[Step] = []
    failures: list[tuple[Sequence, RowFailure]] = []
    for seq, rows in drafting:
        draft, start = seq.draft, len(seq) - 1  # token_ids[start] is row 0's token; draft[i] was fed at row i + 1
        seq.draft = []
        last = first_steps.get(seq.seq_id)
        if last is None or last.error is not None:  # row 0 failed its request: nothing to verify
            continue
        i = 0
        # row i + 1 is valid only while every drafted token so far was the model's own and the sequence goes on
        while i < len(draft) and not seq.is_finished and seq.token_ids[start + i] == draft[i]:
            seq.num_computed_tokens += 1  # draft[i]'s K/V, computed at row i + 1, is the accepted token's
            scheduler.block_manager.commit_full_blocks(seq)
            sample = sample_batch(rows[i:i + 1], [seq], eos_token_ids)[0]
            if isinstance(sample, RowFailure):
                failures.append((seq, sample))
                break
            made = steps_for_samples([seq], [sample], scheduler, eos_token_ids, max_context_length)
            steps += made
            last = made[-1]
            i += 1
        emitted = seq.token_ids[start:start + i + 1]  # row 0's token and each one sampled after it
        accepted = num_accepted(draft, emitted)
        seq.spec.record(len(draft), accepted)
        stats.observe(len(draft), accepted)
        if not seq.is_finished:  # the blocks only rejected positions used go back to the pool
            scheduler.block_manager.trim(seq, len(seq))
        last.num_draft_tokens = seq.spec.num_draft_tokens
        last.num_accepted_draft_tokens = seq.spec.num_accepted_tokens
    return steps, failures
