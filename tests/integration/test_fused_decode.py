"""One C call per decode step (layer_ops.c, decode_step_f32; Model.forward's fast path) against the per-operation path
(Model.forward's layer loop on the C ops, with fuse_decode off), on a tiny random-weight checkpoint: the logits and the K/V cache must be
bit-equal, for int8 and int4, one and many sequences, products on one thread and on two, and the attention split over
two threads. Steps the fused call does not cover (a prefill chunk on torch's SDPA, LoRA rows, fp32 weights, a torch
route) keep the per-operation path; prefill chunks on the decode kernel (runner's paged_prefill) are
tests/integration/test_paged_prefill.py's."""

from __future__ import annotations

import pytest
import torch

from tests.integration.fused_steps import engine, needs_kernels, step_both_ways
from tests.integration.scheduled import BLOCK, Seq
from tests.tiny_model import make_tiny_model
from tokenloop.engine import kernels, runner
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.runner import prepare


@needs_kernels
@pytest.mark.parametrize("weights,isa", [("int8", None), ("int4", None), ("int4", "x22-vnni"), ("int4", "x22-avx2")])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])  # qwen2: a qkv bias; qwen3: q/k norms;
# gemma3: q/k norms, sandwich norms, GeGLU, scaled embeddings, local layers with their own rope and a sliding window
@pytest.mark.parametrize("num_seqs", [1, 5])
@pytest.mark.parametrize("split", [False, True])
def test_fused_decode_step_gives_the_bits_of_the_per_operation_step(tmp_path, weights, isa, arch, num_seqs, split):
    """isa None: the exact C route; x22-*: int4's 22-bit-activation paths, whose fused plan reads the packed
    weights (Model.plan_for)."""
    if isa is not None and kernels.load_int4().missing(isa):
        pytest.skip(kernels.load_int4().missing(isa))
    model = engine(tmp_path, weights, arch, route=isa and f"{weights}-{isa}").model
    assert model.plan is not None
    route, _ = model.matmul.route(num_seqs)
    if isa is not None:
        assert route.int4.isa == isa and model.plan_for(route.int4) is not model.plan  # over the packing
    model.matmul.qroutes = {b: (route, split) for b in model.matmul.qroutes}
    model.split_attention = True
    gen = torch.Generator().manual_seed(num_seqs)
    prompts = [torch.randint(3, 300, (int(n),), generator=gen).tolist() for n in (9, 30, 3, 17, 24)[:num_seqs]]
    seqs = [Seq(p, 0, 1 + 12 * i) for i, p in enumerate(prompts)]
    for s in seqs:  # prefill (the per-operation path), then decodes over contexts of different lengths
        batch, _ = prepare([(s, len(s.token_ids))], BLOCK)
        model.forward(batch)
        s.num_computed_tokens = len(s.token_ids)
    for _ in range(4):
        for s in seqs:
            s.token_ids.append(int(torch.randint(3, 300, (1,), generator=gen)))
        batch, _ = prepare([(s, 1) for s in seqs], BLOCK)
        if num_seqs > 1:
            assert 0 < batch.groups[0].split < num_seqs  # the attention splits over two threads
        (logits, k, v), (want, want_k, want_v) = step_both_ways(model, batch)
        assert logits.shape == (num_seqs, 384)
        assert torch.equal(logits, want)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        assert k.abs().sum() > 0
        for s in seqs:
            s.num_computed_tokens += 1


@needs_kernels
def test_steps_the_fused_call_does_not_cover_keep_the_per_operation_path(tmp_path):
    model = engine(tmp_path, "int4").model
    s, t = Seq(list(range(3, 20)), 0, 1), Seq(list(range(5, 12)), 6, 20)
    prefill, _ = prepare([(s, 17)], BLOCK)
    assert model.fused_kernels(prefill) is None
    s.num_computed_tokens = 16
    mixed, _ = prepare([(s, 1), (t, 1), (Seq(list(range(3, 9)), 2, 40), 4)], BLOCK)  # decodes and a chunk
    assert model.fused_kernels(mixed) is None
    decode, _ = prepare([(s, 1), (t, 1)], BLOCK)
    assert model.fused_kernels(decode) is not None
    decode.lora_segments = [(0, 1, object())]
    assert model.fused_kernels(decode) is None
    decode.lora_segments = []
    model.fuse_decode = False
    assert model.fused_kernels(decode) is None
    model.fuse_decode = True
    assert engine(tmp_path / "fp32", "int4", route="torch-fp32").model.fused_kernels(decode) is None
    fp32 = Engine(make_tiny_model(tmp_path / "f", "llama", num_layers=2), EngineConfig(kv_cache_tokens=512),
                  start=False).model
    assert fp32.plan is None and fp32.fused_kernels(decode) is None


@needs_kernels
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_run_reuses_the_decode_batch_and_rows_and_gives_the_per_operation_steps_bits(tmp_path, weights):
    """runner.run over plain decodes: runner.prepare's fast batch (refilled while its shape stays) and the fused
    step's reused residual rows (Model.fused_rows) give, step after step, the logits and K/V of the per-operation
    path over the general path's fresh batch (fast=False); a sequence leaving changes the shapes; earlier logits stay as they were."""
    model = engine(tmp_path, weights).model
    gen = torch.Generator().manual_seed(3)
    seqs = [Seq(torch.randint(3, 300, (n,), generator=gen).tolist(), 0, 1 + 12 * i) for i, n in enumerate((9, 30, 6))]
    for s in seqs:
        model.forward(prepare([(s, len(s.token_ids))], BLOCK)[0])
        s.num_computed_tokens = len(s.token_ids)
    kept, batches, rows = [], [], []
    for step in range(6):  # the 30-token context crosses a block boundary at step 2; a sequence leaves at step 4
        active = seqs if step < 4 else seqs[:2]
        for s in active:
            s.token_ids.append(int(torch.randint(3, 300, (1,), generator=gen)))
        scheduled = [(s, 1) for s in active]
        k0, v0 = model.k_cache.clone(), model.v_cache.clone()
        out = runner.run(model, scheduled, BLOCK)
        logits = out.logits
        assert out.samplers == active and not out.pooled
        fused_k, fused_v = model.k_cache.clone(), model.v_cache.clone()
        batches.append(model.reused_batch.batch)
        rows.append(model.fused_rows[0])
        model.k_cache.copy_(k0), model.v_cache.copy_(v0)
        model.fuse_decode = False
        want = model.forward(runner.prepare(scheduled, BLOCK, fast=False)[0])
        model.fuse_decode = True
        assert torch.equal(logits, want), step
        assert torch.equal(model.k_cache, fused_k) and torch.equal(model.v_cache, fused_v)
        kept.append((logits, logits.clone()))
        for s in active:
            s.num_computed_tokens += 1
    assert batches[0] is batches[1] and batches[1] is not batches[2] and batches[2] is batches[3] is not batches[4]
    assert rows[0] is rows[3] and rows[3] is not rows[4] and rows[4] is rows[5]
    assert all(torch.equal(a, b) for a, b in kept)
