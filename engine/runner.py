"""Turn scheduled sequences into a ForwardBatch of index tensors and run the model. No policy here."""

from __future__ import annotations

import torch

from .model import AttentionGroup, ForwardBatch, Model, fresh_group
from .sequence import Sequence


def _group(seqs: list[Sequence], num_new: list[int], row_start: int, block_size: int,
           decode_mask: bool = True) -> AttentionGroup:
    """Pad the queries of `seqs` (their new tokens start at flat row `row_start`) to one length. `decode_mask`
    False: a group of decodes gets no mask (the native decode kernel reads `lens` instead, model._attention)."""
    max_q = max(num_new)
    contexts = [s.num_computed_tokens + n for s, n in zip(seqs, num_new)]
    max_blocks = (max(contexts) + block_size - 1) // block_size
    tables = torch.tensor([s.block_table[:max_blocks] + [0] * (max_blocks - len(s.block_table[:max_blocks]))
                           for s in seqs], dtype=torch.long)  # [B, NB]
    starts, rows, valid = [], [], []
    row = row_start
    for n in num_new:
        starts.append(row)
        rows.extend(range(row, row + n))
        rows.extend([row] * (max_q - n))  # padding repeats a valid row; its output is dropped
        valid.extend([True] * n + [False] * (max_q - n))
        row += n
    lens, split = None, 0
    if max_q == 1:  # decodes: context lengths for the native kernel, and where half the context is reached
        lens = torch.tensor(contexts, dtype=torch.long)
        half, total = sum(contexts) / 2, 0
        for split, n in enumerate(contexts):  # noqa: B007 - `split` is used after the loop
            if total + n / 2 >= half:
                break
            total += n
        split = max(split, 1) if len(contexts) > 1 else 0
    mask = None
    if max_q > 1 or (decode_mask and min(contexts) != max_blocks * block_size):
        pos = torch.arange(max_blocks * block_size)  # [C]
        computed = torch.tensor([s.num_computed_tokens for s in seqs])
        q_pos = computed[:, None] + torch.arange(max_q)[None, :]  # [B, Q] absolute position of each query
        mask = (pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)  # [B, 1, Q, C] causal + padding
    return AttentionGroup(
        query_rows=torch.tensor(rows, dtype=torch.long),
        valid=None if all(valid) else torch.tensor(valid),
        kv_blocks=tables, mask=mask, out_start=row_start, num_seqs=len(seqs), max_q=max_q, lens=lens, split=split)


def prepare(scheduled: list[tuple[Sequence, int]], block_size: int,
            decode_mask: bool = True) -> tuple[ForwardBatch, list[Sequence]]:
    """Flat batch for `scheduled` (sequence, number of new tokens); decodes first, then prefill chunks.
    `decode_mask` False leaves the decode group without an attention mask: a model with the native decode kernel
    never reads it (building it cost a few tensor operations per step).

    Returns the batch and the sequences that sample after it (those whose last token is computed). Embedding
    sequences sample nothing: their rows go to `batch.hidden_rows` (every new row for mean pooling, the last prompt
    row for last) and `batch.embeds`.
    """
    by_adapter = lambda item: item[0].lora.uid if item[0].lora is not None else 0  # noqa: E731 - rows of one adapter side by side
    decodes = sorted(((s, n) for s, n in scheduled if n == 1), key=by_adapter)
    # within an adapter, chunks of the same length over the same cached context (a shared prefix's tails) side by
    # side, so that they form one attention group
    prefills = sorted(((s, n) for s, n in scheduled if n > 1),
                      key=lambda p: (by_adapter(p), p[0].num_computed_tokens == 0, p[1], p[0].num_computed_tokens))
    ids, positions, slots = [], [], []
    samplers, logits_rows = [], []
    hidden_rows, embeds = [], []
    segments: list[tuple[int, int, object]] = []  # (first row, end row, adapter): consecutive rows of one adapter
    for seq, n in decodes + prefills:
        start = seq.num_computed_tokens
        if seq.lora is not None:
            if segments and segments[-1][2] is seq.lora and segments[-1][1] == len(ids):
                segments[-1] = (segments[-1][0], len(ids) + n, seq.lora)
            else:
                segments.append((len(ids), len(ids) + n, seq.lora))
        ids.extend(seq.token_ids[start:start + n])
        positions.extend(range(start, start + n))
        slots.extend(seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        if seq.embed is not None:
            rows = range(len(ids) - n, len(ids)) if seq.embed.pooling == "mean" else \
                range(len(ids) - 1, len(ids)) if start + n == len(seq.token_ids) else range(0)
            if rows:
                hidden_rows.extend(rows)
                embeds.append((seq, len(rows)))
        elif start + n == len(seq.token_ids):
            samplers.append(seq)
            logits_rows.append(len(ids) - 1)
    groups = []
    if decodes:
        groups.append(_group([s for s, _ in decodes], [1] * len(decodes), 0, block_size, decode_mask))
    row = len(decodes)
    i = 0
    while i < len(prefills):  # one group per chunk, or per run of equal chunks: padding unequal ones wastes work
        seq, n = prefills[i]
        j = i + 1
        while seq.num_computed_tokens and j < len(prefills) and prefills[j][1] == n and \
                prefills[j][0].num_computed_tokens == seq.num_computed_tokens:
            j += 1
        if seq.num_computed_tokens == 0:
            groups.append(fresh_group(row, n))
        else:
            groups.append(_group([s for s, _ in prefills[i:j]], [n] * (j - i), row, block_size))
        row += n * (j - i)
        i = j
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long), positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long), groups=groups,
        logits_rows=torch.tensor(logits_rows, dtype=torch.long), lora_segments=segments,
        hidden_rows=torch.tensor(hidden_rows, dtype=torch.long) if hidden_rows else None, embeds=embeds)
    return batch, samplers


def run(model: Model, scheduled: list[tuple[Sequence, int]],
        block_size: int) -> tuple[torch.Tensor, list[Sequence], list[tuple[Sequence, torch.Tensor]]]:
    """Forward `scheduled`; returns logits [S, V] for the sequences that sample, those sequences, and each embedding
    sequence with its new rows' final hidden states [n, D] (to pool)."""
    batch, samplers = prepare(scheduled, block_size, decode_mask=model.paged is None)
    logits = model.forward(batch)
    pooled, row = [], 0
    for seq, n in batch.embeds:
        pooled.append((seq, batch.hidden[row:row + n]))
        row += n
    return logits, samplers, pooled
