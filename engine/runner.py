"""Turn scheduled sequences into a ForwardBatch of index tensors and run the model. No policy here."""

from __future__ import annotations

import numpy as np
import torch

from .model import AttentionGroup, ForwardBatch, Model, ReusedBatch, fresh_group
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
        lens, split = torch.tensor(contexts, dtype=torch.long), _split(contexts)
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


# A prefill chunk whose context (cached tokens + the chunk) is at most this many tokens runs its attention on the
# native decode kernel, each query row as a sequence of its own (`_rows_group`); longer ones take torch's SDPA, which
# is faster past it (docs/engine.md, "Prefill chunks on the decode kernel")
PAGED_PREFILL_CONTEXT = 1024


def _rows_group(seq: Sequence, n: int, row_start: int, block_size: int) -> AttentionGroup:
    """A prefill chunk of `seq` (n new tokens from flat row `row_start`) as n one-query "sequences" over its block
    table: row i attends to positions 0 .. start + i (lens), as a decode of that token would. The native kernel then
    computes every row with the decode arithmetic: a row's result depends only on its query and context, not on the
    chunk it came in."""
    start = seq.num_computed_tokens
    blocks = (start + n + block_size - 1) // block_size
    contexts = list(range(start + 1, start + n + 1))
    return AttentionGroup(query_rows=torch.empty(0, dtype=torch.long), valid=None,
                          kv_blocks=torch.tensor(seq.block_table[:blocks], dtype=torch.long).repeat(n, 1),
                          mask=None, out_start=row_start, num_seqs=n, max_q=1,
                          lens=torch.tensor(contexts, dtype=torch.long), split=_split(contexts))


def _split(contexts: list[int]) -> int:
    """Where a decode group's sequences hold about half its context before and half after (the attention's two
    threads); 0 for one sequence."""
    if len(contexts) <= 1:
        return 0
    half, total = sum(contexts) / 2, 0
    for split, n in enumerate(contexts):  # noqa: B007 - `split` is used after the loop
        if total + n / 2 >= half:
            break
        total += n
    return max(split, 1)


def prepare_decodes(seqs: list[Sequence], block_size: int, reuse: ReusedBatch | None = None) -> ForwardBatch:
    """`prepare` for a step of plain decodes (one token each, no adapter, no embedding, no decode mask), in their
    scheduled order: the same batch, its index tensors views of one numpy array. With `reuse`, a step of the same
    shape (sequences, table blocks) as the one before refills that array and returns the same batch object: a batch
    is valid until the next one is built (runner.run consumes it at once). After the kernels have streamed the
    weights through the caches, each torch operation here cost ~5-10 us of cache misses."""
    num = len(seqs)
    positions = [s.num_computed_tokens for s in seqs]
    max_blocks = (max(positions) + block_size) // block_size  # the longest context, num_computed + 1, in blocks
    flat = [s.token_ids[p] for s, p in zip(seqs, positions)]  # [T] input ids
    flat += positions  # [T]
    flat += [s.block_table[p // block_size] * block_size + p % block_size for s, p in zip(seqs, positions)]  # slots
    flat += range(num)  # [T] rows: each sequence's query row and logits row
    contexts = [p + 1 for p in positions]
    flat += contexts  # [B]
    for s in seqs:  # [B, NB] block tables, 0 on padding
        table = s.block_table[:max_blocks]
        flat += table
        flat += [0] * (max_blocks - len(table))
    if reuse is not None and reuse.shape == (num, max_blocks):
        reuse.array[:] = flat
        reuse.batch.groups[0].split = _split(contexts)
        return reuse.batch
    array = np.array(flat, dtype=np.int64)
    tensor = torch.from_numpy(array)
    ids, pos, slots, rows, lens = (tensor[i * num:(i + 1) * num] for i in range(5))
    group = AttentionGroup(query_rows=rows, valid=None, kv_blocks=tensor[5 * num:].view(num, max_blocks), mask=None,
                           out_start=0, num_seqs=num, max_q=1, lens=lens, split=_split(contexts))
    batch = ForwardBatch(input_ids=ids, positions=pos, slot_mapping=slots, groups=[group], logits_rows=rows)
    if reuse is not None:
        reuse.shape, reuse.array, reuse.batch = (num, max_blocks), array, batch
    return batch


def prepare(scheduled: list[tuple[Sequence, int]], block_size: int, decode_mask: bool = True,
            reuse: ReusedBatch | None = None, paged_prefill: bool = False) -> tuple[ForwardBatch, list[Sequence]]:
    """Flat batch for `scheduled` (sequence, number of new tokens), and the sequences that sample after it:
    `prepare_general`, or, for a step of plain decodes without a decode mask, `prepare_decodes` (the same batch,
    built faster; `reuse`'s when given)."""
    seqs = [s for s, n in scheduled if n == 1 and s.lora is None and s.embed is None and
            s.num_computed_tokens + 1 == len(s.token_ids)]
    if not decode_mask and seqs and len(seqs) == len(scheduled):  # plain decodes: each samples
        return prepare_decodes(seqs, block_size, reuse), seqs
    return prepare_general(scheduled, block_size, decode_mask, paged_prefill)


def prepare_general(scheduled: list[tuple[Sequence, int]], block_size: int, decode_mask: bool = True,
                    paged_prefill: bool = False) -> tuple[ForwardBatch, list[Sequence]]:
    """Flat batch for `scheduled` (sequence, number of new tokens); decodes first, then prefill chunks.
    `decode_mask` False leaves the decode group without an attention mask: a model with the native decode kernel
    never reads it (building it cost a few tensor operations per step). `paged_prefill` (a model with that kernel):
    prefill chunks whose context is at most PAGED_PREFILL_CONTEXT tokens become `_rows_group`s for it.

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
        if paged_prefill and seq.num_computed_tokens + n <= PAGED_PREFILL_CONTEXT:
            groups.append(_rows_group(seq, n, row, block_size))  # its rows are sequences of their own
            row += n
            i += 1
            continue
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
    batch, samplers = prepare(scheduled, block_size, decode_mask=model.paged is None, reuse=model.reused_batch,
                              paged_prefill=model.paged is not None)
    logits = model.forward(batch)
    pooled, row = [], 0
    for seq, n in batch.embeds:
        pooled.append((seq, batch.hidden[row:row + n]))
        row += n
    return logits, samplers, pooled
