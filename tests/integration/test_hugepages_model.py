"""The weights and the KV cache on huge pages (engine/hugepages.py) give the same bits: a tiny random-weight model's
logits over a prefill and decode steps (the fused C step for int4, the per-operation path for fp32) are equal with
TOKENLOOP_HUGE_PAGES=off and on, and with it on every streamed weight, the fused step's plan included, is in one
arena and the caches are on huge pages."""

from __future__ import annotations

import pytest
import torch

from tests.integration.scheduled import BLOCK, Seq
from tests.tiny_model import make_tiny_model
from tokenloop.engine import hugepages, kernels
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.quant_routes import ROUTE_ENV
from tokenloop.engine.runner import prepare


def x22_isa() -> str | None:
    """An x22 path of int4 this CPU runs (22-bit activations on the packed copy of the weights), or None."""
    kernel = kernels.load_int4()
    return next((isa for isa in ("x22-vnni", "x22-avx2") if kernel is not None and kernel.supports(isa)), None)


def load(checkpoint, weights: str, huge: str, backend: str = "torch", isa: str | None = None):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(hugepages.ENV, huge)
        if weights == "int4":  # an exact C route where there is one, without timing the routes (both engines alike)
            kernel = kernels.load_int4()
            patch.setenv(ROUTE_ENV, f"int4-{isa or kernel.isa}" if kernel is not None else "torch-fp32")
        return Engine(checkpoint, EngineConfig(weights=weights, kv_cache_tokens=1024, block_size=BLOCK,
                                               matmul_backend=backend), start=False).model


def run(model) -> list[torch.Tensor]:
    """Logits of a prefill of three sequences, then four decode steps of all three."""
    gen = torch.Generator().manual_seed(0)
    seqs = [Seq(torch.randint(3, 300, (n,), generator=gen).tolist(), 0, 1 + 12 * i) for i, n in enumerate((9, 30, 5))]
    out = []
    for s in seqs:
        batch, _ = prepare([(s, len(s.token_ids))], BLOCK)
        out.append(model.forward(batch))
        s.num_computed_tokens = len(s.token_ids)
    for _ in range(4):
        for s in seqs:
            s.token_ids.append(int(torch.randint(3, 300, (1,), generator=gen)))
        batch, _ = prepare([(s, 1) for s in seqs], BLOCK)
        out.append(model.forward(batch))
        for s in seqs:
            s.num_computed_tokens += 1
    return out


@pytest.mark.parametrize("weights, backend", [("fp32", "torch"), ("fp32", "numpy2"), ("int4", "auto")])
def test_logits_are_equal_with_huge_pages_off_and_on(tmp_path, weights, backend):
    """fp32: a fixed backend (auto times them, and two backends may differ in the last bits)."""
    checkpoint = make_tiny_model(tmp_path / "llama", "llama", tied=weights == "fp32", num_layers=3)
    off, on = load(checkpoint, weights, "off", backend), load(checkpoint, weights, "on", backend)
    for a, b in zip(run(off), run(on), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(off.k_cache, on.k_cache) and torch.equal(off.v_cache, on.v_cache)
    reason = hugepages.unavailable_reason()
    if reason is not None:
        pytest.skip(f"bits checked; no huge pages here: {reason}")
    arena = on.norm.untyped_storage().data_ptr()
    streamed = [on.norm, *(getattr(on.lm_head, "q", on.lm_head),)]
    for w in on.layers:
        streamed += [w.input_norm, w.post_norm]
        for p in (w.qkv, w.o, w.gate_up, w.down):
            streamed += [p] if isinstance(p, torch.Tensor) else [p.q, getattr(p, "sm", None)]
    assert all(t.untyped_storage().data_ptr() == arena for t in streamed)  # one arena
    assert off.norm.untyped_storage().data_ptr() != off.layers[0].input_norm.untyped_storage().data_ptr()
    if weights == "fp32":
        assert on.embed is on.lm_head  # tied: still one tensor
    if on.plan is not None:  # the fused step's pointers are the arena's
        kept = {t.data_ptr() for t in on.plan.kept}
        assert on.layers[0].gate_up.q.data_ptr() in kept and on.k_cache.data_ptr() in kept
    assert hugepages.huge_bytes(on.k_cache) > 0 and hugepages.huge_bytes(on.v_cache) > 0
    # off: no arena (checked on the weights above); the caches are torch.zeros, whose pages the kernel may still back
    # with huge pages (a CI run found 10 MiB of one such mapping huge-backed), so their backing is not asserted


def test_the_x22_paths_packed_weights_are_on_huge_pages_too(tmp_path):
    """int4's x22 paths multiply the weights repacked in place (Int4Linear.pack_all, Q4Weight.repack_vnni) for the
    fused plan: the same bits with huge pages off and on, and with them on the packed weights are the weights' own
    arena, huge-backed: no second copy."""
    isa = x22_isa()
    if isa is None:
        pytest.skip(kernels.load_int4().missing("x22-avx2") if kernels.load_int4() else "no int4 kernel here")
    checkpoint = make_tiny_model(tmp_path / "llama", "llama", tied=False, num_layers=3)
    off, on = load(checkpoint, "int4", "off", isa=isa), load(checkpoint, "int4", "on", isa=isa)
    for a, b in zip(run(off), run(on), strict=True):
        assert torch.equal(a, b)
    route, _ = on.matmul.route(1)
    assert route.int4.isa == isa
    packed = [route.int4.packed(p)[0] for w in on.layers for p in (w.qkv, w.o, w.gate_up, w.down)]
    assert {t.data_ptr() for t in packed} <= {t.data_ptr() for t in on.plan_for(route.int4).kept}
    # another x22 path on the same packings (two buckets' routes of one calibration): the same plan, packed once
    other = route.int4.with_isa("x22-portable", route.int4.packings)
    assert on.plan_for(other) is on.plan_for(route.int4)
    assert [route.int4.packed(p)[0].data_ptr() for w in on.layers for p in (w.qkv, w.o, w.gate_up, w.down)] == \
        [t.data_ptr() for t in packed]
    reason = hugepages.unavailable_reason()
    if reason is not None:
        pytest.skip(f"bits checked; no huge pages here: {reason}")
    arenas = {t.untyped_storage().data_ptr() for t in packed}
    assert arenas == {on.layers[0].qkv.q.untyped_storage().data_ptr()}
    assert all(p.q is route.int4.packed(p)[0] for w in on.layers for p in (w.qkv, w.o, w.gate_up, w.down))
    assert hugepages.huge_bytes(packed[0]) > 0
