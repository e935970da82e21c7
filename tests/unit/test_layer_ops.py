"""The native layer operations (engine/layer_ops.c) against the torch operations they replace. The engine's forward
pass with them against the all-torch forward pass, on a tiny checkpoint: tests/integration/test_native_forward.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloop.engine import kernels
from tokenloop.engine.torch_ops import rms_norm, rotate

ops = kernels.load_ops()
needs_kernel = pytest.mark.skipif(ops is None, reason="no C compiler here: the torch path serves")


@needs_kernel
@pytest.mark.parametrize("num_tokens, dim", [(1, 576), (7, 64), (3, 13)])
def test_add_rms_norm_matches_torch(num_tokens, dim):
    gen = torch.Generator().manual_seed(dim)
    h, delta = torch.randn(num_tokens, dim, generator=gen) * 3, torch.randn(num_tokens, dim, generator=gen)
    weight = torch.randn(dim, generator=gen)
    want_h = h + delta
    want = rms_norm(want_h, weight, 1e-5)
    out = torch.full_like(h, float("nan"))
    ops.add_rms_norm(h, delta, weight, 1e-5, out)
    assert torch.equal(h, want_h)  # the residual add is one float add, as in torch
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    again = torch.empty_like(h)
    ops.add_rms_norm(h, None, weight, 1e-5, again)  # no residual: h unchanged
    assert torch.equal(h, want_h) and torch.equal(again, out)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 8)])
def test_rope_store_matches_torch_and_writes_the_cache(heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads)
    num_tokens, slots_total = 5, 40
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.tensor([0, 1, 7, 30, 31])
    slots = torch.tensor([3, 9, 0, 39, 20])
    freqs = torch.arange(64, dtype=torch.float32)[:, None] * (10000 ** (-torch.arange(0, head_dim, 2) / head_dim))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qk = rotate(qkv[:, :q_size + kv_size].reshape(num_tokens, heads + kv_heads, head_dim),
                cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    v = qkv[:, q_size + kv_size:].reshape(num_tokens, kv_heads, head_dim).clone()
    k_cache, v_cache = torch.zeros(slots_total, kv_heads, head_dim), torch.zeros(slots_total, kv_heads, head_dim)
    q_out = torch.full((num_tokens, heads, head_dim), float("nan"))
    ops.rope_store(qkv, heads, kv_heads, head_dim, cos, sin, positions, slots, k_cache, v_cache, q_out)
    rotated = qkv[:, :q_size + kv_size].reshape(num_tokens, heads + kv_heads, head_dim)
    assert torch.equal(q_out, rotated[:, :heads])  # the rotated queries, copied to contiguous rows
    torch.testing.assert_close(rotated, qk, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_cache[slots], qk[:, heads:], rtol=1e-6, atol=1e-6)
    assert torch.equal(v_cache[slots], v)
    others = torch.ones(slots_total, dtype=torch.bool)
    others[slots] = False
    assert k_cache[others].abs().sum() == 0 and v_cache[others].abs().sum() == 0


@needs_kernel
def test_silu_mul_matches_torch():
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(6, 2 * 1536, generator=gen) * 4
    out = torch.empty(6, 1536)
    ops.silu_mul(gate_up, out)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
