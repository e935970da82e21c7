"""Prefill attention on the native decode kernel (runner._chunk_rows_group): a prompt chunk whose context is at most
runner.PAGED_PREFILL_CONTEXT tokens runs each query row as a one-token sequence of its own over the block table, so
  - its rows get the decode arithmetic: the same bits however the prompt is chunked (one chunk, or several, or a
    prefix from the cache), which torch's SDPA over a chunk does not promise;
  - a prefill or mixed step of quantized weights runs in the one fused C call (layer_ops.c, decode_step_f32), bit-equal
    to the per-operation path;
  - the results stay those of SDPA's causal attention to float32 rounding (the fp32 reference against transformers is
    tests/integration/test_engine_vs_hf.py and tests/e2e/test_default_model_vs_hf.py, which run this path).
Tiny random-weight checkpoints; longer chunks keep SDPA."""

from __future__ import annotations

import pytest
import torch

from tests.integration.fused_steps import engine, needs_kernels, step_both_ways
from tests.integration.scheduled import BLOCK, Seq
from tests.tiny_model import make_tiny_model
from tokenloop.engine import kernels
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.runner import PAGED_PREFILL_CONTEXT, prepare

# The fp32 tests compare attention, so every chunk's products run on one backend whose rows do not depend on the
# batch: `auto` times the backends per bucket of rows (engine/matmul.py) and may give 16 rows one and 29 another
# (numpy2's BLAS, whose rows do), as the machine's load decides; a fresh-clone CI run then failed both tests.
FP32_PRODUCTS = "f32c2"


def test_a_chunk_within_the_limit_is_one_row_per_sequence_over_its_block_table():
    s = Seq(list(range(3, 43)), 16, 5)  # 16 tokens cached, a 24-token chunk
    batch, samplers = prepare([(s, 24)], BLOCK, decode_mask=False, paged_prefill=True)
    (g,) = batch.groups
    assert samplers == [s] and batch.logits_rows.tolist() == [23]
    assert (g.num_seqs, g.max_q, g.out_start, g.mask, g.fresh) == (24, 1, 0, None, False)
    assert g.lens.tolist() == list(range(17, 41))  # row i sees positions 0 .. 16 + i
    assert g.kv_blocks.shape == (24, 5) and all(row == [5, 6, 7, 8, 9] for row in g.kv_blocks.tolist())
    front = sum(range(17, 17 + g.split))  # the two threads' parts hold about half the context each
    assert abs(front - sum(range(17 + g.split, 41))) <= 16 + g.split + 1
    # decodes beside it keep their group; a second chunk has its own (chunks over a cached prefix first)
    t, u = Seq(list(range(3, 13)), 9, 40), Seq(list(range(3, 9)), 0, 60)
    batch, _ = prepare([(u, 6), (s, 24), (t, 1)], BLOCK, decode_mask=False, paged_prefill=True)
    assert [(g.out_start, g.num_seqs, g.max_q) for g in batch.groups] == [(0, 1, 1), (1, 24, 1), (25, 6, 1)]
    assert batch.groups[2].lens.tolist() == [1, 2, 3, 4, 5, 6] and batch.groups[0].lens.tolist() == [10]


def test_a_chunk_past_the_limit_and_a_model_without_the_kernel_keep_sdpa():
    long = Seq(list(range(PAGED_PREFILL_CONTEXT + 8)), PAGED_PREFILL_CONTEXT - 8, 0, num_blocks=200)
    (g,) = prepare([(long, 16)], BLOCK, decode_mask=False, paged_prefill=True)[0].groups
    assert g.max_q == 16 and g.lens is None and g.mask is not None  # gather + masked SDPA
    edge = Seq(list(range(PAGED_PREFILL_CONTEXT)), PAGED_PREFILL_CONTEXT - 16, 0, num_blocks=200)
    assert prepare([(edge, 16)], BLOCK, decode_mask=False, paged_prefill=True)[0].groups[0].max_q == 1
    fresh = Seq(list(range(3, 40)), 0, 1)
    (g,) = prepare([(fresh, 37)], BLOCK)[0].groups  # paged_prefill off (a model without the kernel)
    assert g.fresh and g.max_q == 37


def chunked_prefill(model, tokens: list[int], chunks: list[int], first_block: int,
                    paged_prefill: bool = True) -> torch.Tensor:
    """The prompt's last logits row after prefilling it chunk by chunk."""
    s = Seq(tokens, 0, first_block, num_blocks=(len(tokens) + BLOCK - 1) // BLOCK)
    for n in chunks:
        batch, samplers = prepare([(s, n)], BLOCK, decode_mask=False, paged_prefill=paged_prefill)
        logits = model.forward(batch)
        s.num_computed_tokens += n
    assert s.num_computed_tokens == len(tokens) and samplers == [s]
    return logits[-1]


def cached_kv(model, first_block: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    slots = slice(first_block * BLOCK, first_block * BLOCK + n)
    return model.k_cache[:, slots].clone(), model.v_cache[:, slots].clone()


@needs_kernels
@pytest.mark.parametrize("weights", ["fp32", "int4"])
def test_a_prompt_gives_the_same_bits_however_it_is_chunked(tmp_path, weights):
    """fp32: the per-operation path; int4: the fused step on an x22 route (its products' rows do not depend on their
    batch either)."""
    if weights == "fp32":  # one products backend for every chunk size (FP32_PRODUCTS)
        model = Engine(make_tiny_model(tmp_path / "f", "llama", num_layers=3),
                       EngineConfig(kv_cache_tokens=1024, block_size=BLOCK, matmul_backend=FP32_PRODUCTS),
                       start=False).model
        assert model.paged is not None and model.plan is None
    else:
        isa = next((i for i in ("x22-vnni", "x22-avx2", "x22-portable") if not kernels.load_int4().missing(i)))
        model = engine(tmp_path, "int4", route=f"int4-{isa}").model
    tokens = torch.randint(3, 300, (45,), generator=torch.Generator().manual_seed(7)).tolist()
    first = chunked_prefill(model, tokens, [45], 1)
    want_k, want_v = cached_kv(model, 1, 45)
    chunkings = [[16, 29], [8] * 5 + [5]]
    if weights == "int4":  # one-token steps too (the last as a decode); fp32's products take another backend at one
        chunkings += [[1] * 3 + [42], [44, 1]]  # token (native2), so only its attention is compared there
    for i, chunks in enumerate(chunkings):
        block = 10 + 8 * i
        logits = chunked_prefill(model, tokens, chunks, block)
        k, v = cached_kv(model, block, 45)
        assert torch.equal(logits, first), chunks
        assert torch.equal(k, want_k) and torch.equal(v, want_v), chunks


@needs_kernels
def test_paged_prefill_matches_sdpa_to_float32_rounding(tmp_path):
    model = Engine(make_tiny_model(tmp_path / "f", "llama", num_layers=3),
                   EngineConfig(kv_cache_tokens=1024, block_size=BLOCK, matmul_backend=FP32_PRODUCTS),
                   start=False).model
    tokens = torch.randint(3, 300, (50,), generator=torch.Generator().manual_seed(9)).tolist()
    for chunks in ([50], [20, 30]):  # a fresh chunk, and one over a cached prefix (SDPA: gather + mask)
        paged_logits = chunked_prefill(model, tokens, chunks, 1)
        paged_k, paged_v = cached_kv(model, 1, 50)
        sdpa_logits = chunked_prefill(model, tokens, chunks, 20, paged_prefill=False)
        sdpa_k, sdpa_v = cached_kv(model, 20, 50)
        scale = sdpa_logits.abs().max()
        assert (paged_logits - sdpa_logits).abs().max() <= 1e-5 * scale, chunks
        assert torch.allclose(paged_k, sdpa_k, atol=1e-5) and torch.allclose(paged_v, sdpa_v, atol=1e-5)
        assert not torch.equal(paged_logits, torch.zeros_like(paged_logits))


@needs_kernels
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("split", [False, True])
def test_prefill_and_mixed_steps_run_fused_with_the_per_operation_bits(tmp_path, weights, split):
    model = engine(tmp_path, weights).model
    route, _ = model.matmul.route(1)
    model.matmul.qroutes = {b: (route, split) for b in model.matmul.qroutes}
    model.split_attention = True
    gen = torch.Generator().manual_seed(11)
    s = Seq(torch.randint(3, 300, (30,), generator=gen).tolist(), 0, 1)
    t = Seq(torch.randint(3, 300, (12,), generator=gen).tolist(), 0, 20)
    for seq, n in ((s, 30), (t, 12)):  # fresh prefills, fused
        batch, _ = prepare([(seq, n)], BLOCK, decode_mask=False, paged_prefill=True)
        (logits, k, v), (want, want_k, want_v) = step_both_ways(model, batch)
        assert torch.equal(logits, want) and torch.equal(k, want_k) and torch.equal(v, want_v)
        seq.num_computed_tokens = n
    t.token_ids.append(7)
    u = Seq(torch.randint(3, 300, (20,), generator=gen).tolist(), 8, 40)  # a chunk over 8 cached tokens
    s.token_ids.extend([5, 6, 7, 8, 9])  # and a second chunk of s
    mixed, samplers = prepare([(t, 1), (u, 12), (s, 5)], BLOCK, decode_mask=False, paged_prefill=True)
    assert samplers == [t, s, u] and len(mixed.groups) == 3
    (logits, k, v), (want, want_k, want_v) = step_both_ways(model, mixed)
    assert logits.shape == (3, 384)
    assert torch.equal(logits, want) and torch.equal(k, want_k) and torch.equal(v, want_v)
