"""Turn scheduled sequences into a ForwardBatch of index tensors (`prepare`) and run the model (`run`). No policy
here."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .batch import AttentionGroup, ForwardBatch, ReusedBatch, fresh_group
from .model import Model
from .sequence import Sequence


def _group(seqs: list[Sequence], num_new: list[int], row_start: int, block_size: int,
           decode_mask: bool = True) -> AttentionGroup:
    """Pad the queries of `seqs` (their new tokens start at flat row `row_start`) to one length. `decode_mask`
    False: a group of decodes gets no mask (the native decode kernel reads `lens` instead, model.attention)."""
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
# native decode kernel, each query row as a sequence of its own (`_chunk_rows_group`); longer ones take torch's SDPA, which
# is faster past it (docs/engine.md, "Prefill chunks on the decode kernel")
PAGED_PREFILL_CONTEXT = 1024


def _chunk_rows_group(seq: Sequence, n: int, row_start: int, block_size: int) -> AttentionGroup:
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


def prepare(scheduled: list[tuple[Sequence, int]], block_size: int, decode_mask: bool = True,
            reuse: ReusedBatch | None = None, paged_prefill: bool = False,
            fast: bool = True) -> tuple[ForwardBatch, list[Sequence]]:
    """Flat batch for `scheduled` (sequence, number of new tokens), and the sequences that sample after it (those
    whose last token is computed by it); decodes first, then prefill chunks.

    `decode_mask` False leaves the decode group without an attention mask: a model with the native decode kernel
    never reads it (building it cost a few tensor operations per step). `paged_prefill` (a model with that kernel):
    prefill chunks whose context is at most PAGED_PREFILL_CONTEXT tokens become one-query groups for it
    (`_chunk_rows_group`). Embedding sequences sample nothing: their rows go to `batch.hidden_rows` (every new row
    for mean pooling, the last prompt row for last) and `batch.embeds`.

    Fast path (`fast`; False: the general path for every step, which tests compare it with): a step of plain
    decodes (one token each that samples, no adapter, no embedding) without a decode mask gets the same batch
    built as views of one numpy array, refilled in place while the step's shape stays when `reuse` is given
    (`_plain_decode_batch`)."""
    if fast and not decode_mask:
        seqs = [s for s, n in scheduled if n == 1 and s.lora is None and s.embed is None and
                s.num_computed_tokens + 1 == len(s.token_ids)]
        if seqs and len(seqs) == len(scheduled):  # fast path: plain decodes, each samples
            return _plain_decode_batch(seqs, block_size, reuse), seqs
    by_adapter = lambda item: item[0].lora.uid if item[0].lora is not None else 0  # noqa: E731 - rows of one adapter side by side
    decodes = sorted(((s, n) for s, n in scheduled if n == 1), key=by_adapter)
    # within an adapter, chunks of the same length over the same cached context (a shared prefix's tails) side by
    # side, so that they form one attention group
    prefills = sorted(((s, n) for s, n in scheduled if n > 1),
                      key=lambda p: (by_adapter(p), p[0].num_computed_tokens == 0, p[1], p[0].num_computed_tokens))
    batch, samplers = _flat_rows(decodes + prefills, block_size)
    if decodes:
        batch.groups.append(_group([s for s, _ in decodes], [1] * len(decodes), 0, block_size, decode_mask))
    batch.groups += _prefill_groups(prefills, len(decodes), block_size, paged_prefill)
    return batch, samplers


def _flat_rows(scheduled: list[tuple[Sequence, int]], block_size: int) -> tuple[ForwardBatch, list[Sequence]]:
    """The batch's rows in `scheduled`'s order (its groups still to add), and the sequences that sample."""
    ids, positions, slots = [], [], []
    samplers, logits_rows = [], []
    hidden_rows, embeds = [], []
    segments: list[tuple[int, int, object]] = []  # (first row, end row, adapter): consecutive rows of one adapter
    for seq, n in scheduled:
        start = seq.num_computed_tokens
        if seq.lora is not None:
            if segments and segments[-1][2] is seq.lora and segments[-1][1] == len(ids):
                segments[-1] = (segments[-1][0], len(ids) + n, seq.lora)
            else:
                segments.append((len(ids), len(ids) + n, seq.lora))
        tokens = seq.token_ids + seq.draft if seq.draft else seq.token_ids  # a verification feeds its draft too
        ids.extend(tokens[start:start + n])
        positions.extend(range(start, start + n))
        slots.extend(seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        if seq.embed is not None:
            rows = range(len(ids) - n, len(ids)) if seq.embed.pooling == "mean" else \
                range(len(ids) - 1, len(ids)) if start + n == len(seq.token_ids) else range(0)
            if rows:
                hidden_rows.extend(rows)
                embeds.append((seq, len(rows)))
        elif start + n == len(tokens):
            samplers.append(seq)
            # one row; a verification (spec_step.py) all its rows, in order (rows stay in flat order: model.forward
            # takes logits rows that are all the batch's rows as the batch itself)
            logits_rows.extend(range(len(ids) - 1 - len(seq.draft), len(ids)))
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long), positions=torch.tensor(positions, dtype=torch.long),
        slot_mapping=torch.tensor(slots, dtype=torch.long), groups=[],
        logits_rows=torch.tensor(logits_rows, dtype=torch.long), lora_segments=segments,
        hidden_rows=torch.tensor(hidden_rows, dtype=torch.long) if hidden_rows else None, embeds=embeds)
    return batch, samplers


def _prefill_groups(prefills: list[tuple[Sequence, int]], row: int, block_size: int,
                    paged_prefill: bool) -> list[AttentionGroup]:
    """One group per chunk (from flat row `row`), or per run of equal chunks over the same cached context: padding
    unequal ones wastes work."""
    groups, i = [], 0
    while i < len(prefills):
        seq, n = prefills[i]
        if paged_prefill and (seq.num_computed_tokens + n <= PAGED_PREFILL_CONTEXT or seq.draft):
            # its rows are sequences of their own (a verification's at any context: each row then gets a decode's
            # arithmetic, so that accepted tokens are the tokens plain decodes would give)
            groups.append(_chunk_rows_group(seq, n, row, block_size))
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
    return groups


def _plain_decode_batch(seqs: list[Sequence], block_size: int, reuse: ReusedBatch | None) -> ForwardBatch:
    """`prepare`'s fast path, for plain decodes in their scheduled order: the general path's batch, its index
    tensors views of one numpy array. With `reuse`, a step of the same shape (sequences, table blocks) as the one
    before refills that array and returns the same batch object: a batch is valid until the next one is built (`run`
    consumes it at once). After the kernels have streamed the weights through the caches, each torch operation here
    cost ~5-10 us of cache misses."""
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


@dataclass(slots=True)
class ModelOutput:
    """What one forward pass gives the engine: next-token logits [S, V] of the sequences that sample (`samplers`, in
    row order; a verifying sequence's row 0), each embedding sequence with its new rows' final hidden states [n, D]
    (to pool), and each verifying sequence with the logits of its rows 1..k [k, V] (spec_step.verify_drafts)."""

    logits: torch.Tensor
    samplers: list[Sequence]
    pooled: list[tuple[Sequence, torch.Tensor]]
    drafts: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)

    @classmethod
    def concat(cls, parts: list[ModelOutput]) -> ModelOutput:
        """The outputs of sequences run apart, as one."""
        return cls(torch.cat([p.logits for p in parts]), [s for p in parts for s in p.samplers],
                   [e for p in parts for e in p.pooled], [d for p in parts for d in p.drafts])


def run(model: Model, scheduled: list[tuple[Sequence, int]], block_size: int) -> ModelOutput:
    """Prepare `scheduled`'s batch for `model` (no decode mask and prompt chunks on the decode kernel when it has
    that kernel; its reused plain-decode batch) and run it."""
    batch, samplers = prepare(scheduled, block_size, decode_mask=model.paged is None, reuse=model.reused_batch,
                              paged_prefill=model.paged is not None)
    logits = model.forward(batch)
    pooled, row = [], 0
    for seq, n in batch.embeds:
        pooled.append((seq, batch.hidden[row:row + n]))
        row += n
    drafts = []
    if any(seq.draft for seq in samplers):  # verifications: row 0 samples with the others, rows 1..k apart
        first, row = [], 0
        for seq in samplers:
            first.append(row)
            if seq.draft:
                drafts.append((seq, logits[row + 1:row + 1 + len(seq.draft)]))
            row += 1 + len(seq.draft)
        logits = logits[first]
    return ModelOutput(logits, samplers, pooled, drafts)
