"""core/executor.py: the executor seam's helpers."""

from __future__ import annotations

from tokenloop.core.executor import Step, merge_steps
from tokenloop.core.request import FinishReason


def test_merge_steps_joins_a_sequences_steps_of_one_poll():
    steps = [Step(1, 0, [5]), Step(2, 0, [7]), Step(1, 0, [6], logprobs=None), Step(1, 1, [8]),
             Step(1, 0, [9], is_final=True, finish_reason=FinishReason.LENGTH),
             Step(2, 0, [], is_final=True, error="boom")]
    out = merge_steps(steps)
    assert [(s.executor_id, s.seq_index, s.token_ids) for s in out] == [(1, 0, [5, 6, 9]), (2, 0, [7]), (1, 1, [8]),
                                                                      (2, 0, [])]
    assert out[0].is_final and out[0].finish_reason == FinishReason.LENGTH
    assert out[3].error == "boom"  # an error step is never folded into a token step
    single = [Step(1, 0, [5]), Step(2, 0, [6])]
    assert merge_steps(single) is single
