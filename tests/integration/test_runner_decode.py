"""runner.run leaves the decode group's attention mask out when the model reads context lengths instead (the native
decode kernel), and keeps it for torch attention, which needs it: on a tiny random-weight checkpoint, the logits of
decodes over contexts that end inside a block are the same as with the mask, on both attention backends. A step of
plain decodes takes runner.prepare's fast path, which builds what the general path builds (and reuses its batch)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.integration.scheduled import BLOCK, Seq
from tests.tiny_model import make_tiny_model
from tokenloop.engine import kernels, runner
from tokenloop.engine.batch import ReusedBatch
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine


def decodes() -> list[tuple[Seq, int]]:
    """Three decodes whose contexts (13, 22, 30 tokens) end inside a block, after their prompts are cached."""
    return [(Seq(list(range(3 + i, 3 + i + n)), n - 1, 1 + 8 * i, num_blocks=8), 1) for i, n in enumerate((13, 22, 30))]


def fill_cache(engine: Engine, scheduled: list[tuple[Seq, int]]) -> None:
    for seq, _ in scheduled:  # each prompt's K/V, so that the decodes read real context
        batch, _ = runner.prepare([(Seq(seq.token_ids[:-1], 0, seq.block_table[0], num_blocks=8), len(seq.token_ids) - 1)], BLOCK)
        engine.model.forward(batch)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_decode_logits_equal_with_and_without_the_mask_where_run_leaves_it_out(tmp_path, backend):
    if backend == "native" and kernels.load_paged_attention() is None:
        pytest.skip("no C compiler here: the torch path serves")
    checkpoint = make_tiny_model(tmp_path, "llama", tied=False, num_layers=2)
    engine = Engine(checkpoint, EngineConfig(kv_cache_tokens=512, block_size=BLOCK, attention_backend=backend),
                    start=False)
    scheduled = decodes()
    fill_cache(engine, scheduled)
    masked, _ = runner.prepare(scheduled, BLOCK)
    assert masked.groups[0].mask is not None  # the contexts end inside a block: the default builds a mask
    bare, _ = runner.prepare(scheduled, BLOCK, decode_mask=False)
    assert bare.groups[0].mask is None and torch.equal(bare.groups[0].lens, masked.groups[0].lens)
    expected = engine.model.forward(masked)
    out = runner.run(engine.model, scheduled, BLOCK)
    logits = out.logits
    assert [s for s, _ in scheduled] == out.samplers
    assert torch.equal(logits, expected)
    if backend == "torch":  # the mask matters there: without it the padding keys would be attended to
        assert not torch.equal(engine.model.forward(bare), expected)
    else:
        assert torch.equal(engine.model.forward(bare), expected)


def test_prefill_chunks_keep_their_mask_without_the_decode_mask():
    """decode_mask concerns decode groups only: a chunk over cached context keeps its causal mask."""
    chunk = Seq(list(range(3, 23)), 12, 1, num_blocks=8)
    batch, _ = runner.prepare([(chunk, 8)], BLOCK, decode_mask=False)
    assert batch.groups[0].max_q == 8 and batch.groups[0].mask is not None


def same_batch(a, b) -> bool:
    """Every field of two ForwardBatches equal (tensors: values and dtype)."""
    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype and \
                torch.equal(x, y)
        return x == y
    fields = ("input_ids", "positions", "slot_mapping", "logits_rows", "lora_segments", "hidden_rows", "embeds")
    group_fields = ("query_rows", "valid", "kv_blocks", "mask", "out_start", "num_seqs", "max_q", "fresh", "lens",
                    "split")
    return all(same(getattr(a, f), getattr(b, f)) for f in fields) and len(a.groups) == len(b.groups) and \
        all(same(getattr(g, f), getattr(h, f)) for g, h in zip(a.groups, b.groups) for f in group_fields)


def test_plain_decodes_take_the_fast_batch_equal_to_the_general_one_and_reused_while_its_shape_stays():
    """runner.prepare's fast path (every sequence decodes one token and samples, no mask) builds what its general
    path (fast=False) builds; with a ReusedBatch, a step of the same shape refills the same batch, a new shape gets a new one."""
    scheduled = decodes()  # contexts 13, 22 and 30: 2 to 4 blocks; each block table is 8 long
    reuse = ReusedBatch()
    batches = []
    for step in range(5):  # the longest context crosses a block boundary at step 3 (30 -> 33 tokens)
        batch, samplers = runner.prepare(scheduled, BLOCK, decode_mask=False, reuse=reuse)
        general, want = runner.prepare(scheduled, BLOCK, decode_mask=False, fast=False)
        assert samplers == want == [s for s, _ in scheduled]
        assert batch is reuse.batch and general is not reuse.batch
        assert same_batch(batch, general), step
        assert same_batch(runner.prepare(scheduled, BLOCK, decode_mask=False)[0], general)  # without reuse
        batches.append(batch)
        for seq, _ in scheduled:
            seq.token_ids.append(7 + step)
            seq.num_computed_tokens += 1
    assert batches[0] is batches[1] is batches[2] and batches[3] is not batches[2] and batches[4] is batches[3]
    assert reuse.shape == (3, 5)
    fewer, _ = runner.prepare(scheduled[1:], BLOCK, decode_mask=False, reuse=reuse)  # another shape
    assert fewer is not batches[4] and fewer is reuse.batch
    assert same_batch(fewer, runner.prepare(scheduled[1:], BLOCK, decode_mask=False, fast=False)[0])


def test_steps_other_than_plain_decodes_take_the_general_path():
    """A one-token chunk that does not end its prompt (it samples nothing), an adapter's or an embedding's decode,
    a decode mask, or a prefill chunk beside the decodes: runner.prepare's general path builds the batch (it leaves
    the ReusedBatch empty)."""
    chunk = Seq(list(range(3, 23)), 12, 1)  # 20 tokens, 12 computed: a one-token slice of its prompt
    adapter, embedding = decodes()[0][0], decodes()[1][0]
    adapter.lora, embedding.embed = SimpleNamespace(uid=1), SimpleNamespace(pooling="last")
    cases = [([(chunk, 1)] + decodes(), False), ([(adapter, 1)] + decodes(), False),
             ([(embedding, 1)] + decodes(), False), (decodes(), True), (decodes() + [(chunk, 4)], False)]
    for scheduled, mask in cases:
        reuse = ReusedBatch()
        batch, samplers = runner.prepare(scheduled, BLOCK, decode_mask=mask, reuse=reuse)
        general, want = runner.prepare(scheduled, BLOCK, decode_mask=mask, fast=False)
        assert samplers == want and same_batch(batch, general)
        assert chunk not in samplers and embedding not in samplers
        assert reuse.batch is None
    reuse = ReusedBatch()
    batch, _ = runner.prepare(decodes(), BLOCK, decode_mask=False, reuse=reuse)
    assert batch is reuse.batch
