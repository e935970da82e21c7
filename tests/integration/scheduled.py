"""What runner.prepare reads of a scheduled sequence, for the tests that build an engine step by hand
(test_fused_decode, test_hugepages_model, test_runner_decode)."""

from __future__ import annotations

BLOCK = 8  # the block size those tests give their engines


class Seq:
    lora = embed = None
    draft: list[int] = []  # no speculative draft (engine/spec_step.py)

    def __init__(self, tokens: list[int], computed: int, first_block: int, num_blocks: int = 12):
        self.token_ids, self.num_computed_tokens = tokens, computed
        self.block_table = list(range(first_block, first_block + num_blocks))
