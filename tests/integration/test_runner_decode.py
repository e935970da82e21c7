"""runner.run leaves the decode group's attention mask out when the model reads context lengths instead (the native
decode kernel), and keeps it for torch attention, which needs it: on a tiny random-weight checkpoint, the logits of
decodes over contexts that end inside a block are the same as with the mask, on both attention backends."""

from __future__ import annotations

import pytest
import torch

from tests.integration.scheduled import BLOCK, Seq
from tests.tiny_model import make_tiny_model
from tokenloop.engine import kernels, runner
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
    if backend == "native" and kernels.load() is None:
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
    logits, samplers, _ = runner.run(engine.model, scheduled, BLOCK)
    assert [s for s, _ in scheduled] == samplers
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
