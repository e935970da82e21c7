"""What one forward pass reads: the flat token batch and its attention groups, built by runner.prepare.

Notation: T tokens in the flat batch, S rows that sample, B sequences of a group, Q queries each, NB blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(slots=True)
class AttentionGroup:
    """Sequences whose queries are padded to one length Q for one attention call (B sequences)."""

    query_rows: torch.Tensor  # [B*Q] flat-batch row of each padded query (padding repeats a valid row)
    valid: torch.Tensor | None  # [B*Q] bool, False on padded queries; None when there is no padding
    kv_blocks: torch.Tensor  # [B, NB] block table of each sequence (0 on padding); C = NB * block_size
    mask: torch.Tensor | None  # [B, 1, Q, C] bool, True where a query may attend; None: attend to all
    out_start: int  # the group's valid queries are flat rows out_start .. out_start + num_valid - 1
    num_seqs: int
    max_q: int
    fresh: bool = False  # one sequence with nothing cached before these rows: causal over the new K/V
    lens: torch.Tensor | None = None  # [B] int64 context lengths (one-query groups: for the native kernel)
    split: int = 0  # one-query groups: sequences 0..split-1 and split..B-1 hold about half the context each

    @property
    def one_query(self) -> bool:
        """One query per sequence over its context lengths: what the native decode kernel runs (decodes, and
        prompt chunks as rows of their own, runner.PAGED_PREFILL_CONTEXT)."""
        return self.max_q == 1 and self.lens is not None


def fresh_group(row_start: int, num_tokens: int) -> AttentionGroup:
    """A prefill chunk that starts a sequence: attends causally to its own new K/V, no cache read."""
    return AttentionGroup(query_rows=torch.empty(0, dtype=torch.long), valid=None,
                          kv_blocks=torch.empty(0, dtype=torch.long), mask=None, out_start=row_start, num_seqs=1,
                          max_q=num_tokens, fresh=True)


@dataclass(slots=True)
class ForwardBatch:
    """Everything one forward pass needs; built by the runner from scheduled sequences."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] where each token's K/V is written
    groups: list[AttentionGroup]
    logits_rows: torch.Tensor  # [S] rows whose next-token logits are wanted
    # rows start..end-1 run with a LoRA adapter (lora.LoraWeights); rows in no segment run the base model
    lora_segments: list[tuple[int, int, object]] = field(default_factory=list)
    # embedding requests: rows whose final hidden states (after the final norm) `forward` puts in `hidden` [R, D]
    hidden_rows: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    embeds: list[tuple[object, int]] = field(default_factory=list)  # (sequence, its rows in `hidden`), in row order


@dataclass(slots=True)
class ReusedBatch:
    """The model's last plain-decode ForwardBatch, kept for the next step (runner.prepare's fast path): a step of
    the same `shape` (sequences, block-table width) refills `array`, which holds the values of every index tensor of
    `batch`."""

    shape: tuple[int, int] | None = None
    array: np.ndarray | None = None
    batch: ForwardBatch | None = None
