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


@needs_kernel
def test_gelu_mul_matches_torch_gelu_tanh():
    """GeGLU (Gemma 3): gelu's tanh approximation times up, the contract silu_mul keeps (rounding-level differences),
    identical for a row alone and in a batch; large |gate| saturates (tanh -> +-1) without NaN."""
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(6, 2 * 1000, generator=gen) * 4
    gate_up[0, :4] = torch.tensor([40.0, -40.0, 0.0, -1e-30])
    out = ops.gelu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    # atol: where torch's tanh rounds to -1 (gelu exactly 0) the C one may leave ~1e-6
    torch.testing.assert_close(out, F.gelu(gate, approximate="tanh") * up, rtol=1e-5, atol=1e-5)
    assert torch.equal(ops.gelu_mul(gate_up[3:4].clone()), out[3:4])


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 256), (2, 1, 6)])
def test_rms_norm_heads_normalizes_the_query_and_key_heads_in_place(heads, kv_heads, head_dim):
    """Qwen3's / Gemma 3's q/k norms: each query head with the query weight, each key head with the key weight, the
    value heads untouched; rows `stride` apart (a view of wider rows)."""
    gen = torch.Generator().manual_seed(head_dim)
    width = (heads + 2 * kv_heads) * head_dim
    rows = torch.randn(3, width + 5, generator=gen) * 2
    qkv = rows[:, :width]
    q_weight, k_weight = torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)
    before = rows.clone()
    heads_of = before[:, :width].view(3, -1, head_dim)
    want_q = rms_norm(heads_of[:, :heads], q_weight, 1e-6)
    want_k = rms_norm(heads_of[:, heads:heads + kv_heads], k_weight, 1e-6)
    ops.rms_norm_heads(qkv, heads, kv_heads, head_dim, q_weight, k_weight, 1e-6)
    got = qkv.reshape(3, -1, head_dim)
    torch.testing.assert_close(got[:, :heads], want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[:, heads:heads + kv_heads], want_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[:, heads + kv_heads:], heads_of[:, heads + kv_heads:])  # the values
    assert torch.equal(rows[:, width:], before[:, width:])  # past the row's qkv


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 6)])
def test_rope_store_into_a_16_bit_cache_rounds_as_torch_half_does(heads, kv_heads, head_dim):
    """The 16-bit KV cache: each K/V value the nearest float16, ties to even (the bits of torch's .half()); the row
    tail past the last 8 values (head_dim 6 x 4 heads) takes the scalar conversion."""
    gen = torch.Generator().manual_seed(heads + 100)
    num_tokens = 4
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    positions, slots = torch.tensor([0, 3, 5, 2]), torch.tensor([7, 1, 4, 0])
    emb = torch.randn(8, head_dim, generator=gen)
    cos, sin = emb.cos(), emb.sin()
    caches = [torch.zeros(8, kv_heads, head_dim, dtype=dtype) for dtype in (torch.float32, torch.float16) for _ in "kv"]
    wide = qkv.clone()
    ops.rope_store(wide, heads, kv_heads, head_dim, cos, sin, positions, slots, caches[0], caches[1])
    ops.rope_store(qkv, heads, kv_heads, head_dim, cos, sin, positions, slots, caches[2], caches[3])
    assert torch.equal(qkv, wide)  # the rotation itself is the same in both
    assert torch.equal(caches[2], caches[0].half()) and torch.equal(caches[3], caches[1].half())


EDGES = [0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e6, float("inf"), float("-inf"), 6.1035156e-05, 6.0e-05,
         5.9604645e-08, 2.9802322e-08, 2.9802326e-08, 8.940697e-08, 1e-12, -3.1e-06, 1.00048828125, 1.00146484375,
         1.000732421875, 2049.0, 2051.0, -2050.5]


@pytest.mark.parametrize("f16c", [True, False], ids=["f16c", "bit-arithmetic"])
def test_float16_rounding_equals_torch_with_and_without_f16c(f16c):
    """layer_ops.c's float16 conversion, built with F16C and without it (the bit arithmetic of CPUs without F16C),
    against torch's .half() on random values and the edges: float16's overflow (65520 rounds to inf), subnormals,
    the smallest values, ties to even. V is stored as it comes (K is rotated first: inf * sin 0 is NaN); -0.0 is left
    out: -ffast-math need not keep a zero's sign, which attention reads alike."""
    if ops is None:
        pytest.skip("no C compiler here: the torch path serves")
    if f16c:
        lib = ops
    else:
        flags = kernels.compile_flags_for(kernels.OPS_SOURCE) + ("-mno-f16c",)
        lib = kernels.LayerOps(kernels.build(kernels.OPS_SOURCE, flags))
    gen = torch.Generator().manual_seed(7)
    values = torch.cat((torch.tensor(EDGES), torch.randn(4000, generator=gen) * 10.0 ** torch.randint(-9, 6, (4000,),
                                                                                                  generator=gen)))
    n = values.numel() // 2 * 2
    kv = values[:n].view(n // 2, 1, 2)  # one kv head of head_dim 2 per token: K = V = the values
    qkv = torch.cat((torch.zeros(n // 2, 2), kv.view(-1, 2), kv.view(-1, 2)), dim=1)
    k_cache, v_cache = (torch.zeros(n // 2, 1, 2, dtype=torch.float16) for _ in "kv")
    zeros = torch.zeros(1, 2)
    cos, sin = torch.ones(1, 2), zeros
    lib.rope_store(qkv, 1, 1, 2, cos, sin, torch.zeros(n // 2, dtype=torch.long), torch.arange(n // 2), k_cache,
                   v_cache)
    want = kv.half()
    assert torch.equal(v_cache.view(torch.int16), want.view(torch.int16))
