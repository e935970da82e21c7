"""The native decode-attention kernel (engine/paged_attention.c) against SDPA on the gathered context."""

from __future__ import annotations

import logging
import os
import platform

import pytest
import torch
import torch.nn.functional as F

from tokenloop.engine import kernels
from tokenloop.engine.batch import AttentionGroup
from tokenloop.engine.matmul import Backend, MatmulPolicy
from tokenloop.engine.model import Model

paged = kernels.load_paged_attention()
needs_kernel = pytest.mark.skipif(paged is None, reason="no C compiler here: the torch path serves")


def reference(q, k_cache, v_cache, tables, lens, block_size):
    """Gather each sequence's slots in block-table order and run SDPA: what the torch path computes."""
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = (tables[b][:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        k, v = (c[slots].transpose(0, 1).unsqueeze(0) for c in (k_cache, v_cache))  # [1, K, n, E]
        out[b] = F.scaled_dot_product_attention(q[b][None, :, None, :], k, v, enable_gqa=True)[0, :, 0]
    return out


def kernel_path(isa: str):
    """The kernel forced onto code path `isa`; skipped, with the reason, where this CPU cannot run it."""
    if paged is None:
        pytest.skip("no C compiler here: the torch path serves")
    if not paged.supports(isa):
        pytest.skip(f"this CPU lacks the {isa} path of paged_attention.c (it runs: {', '.join(paged.supported())})")
    return paged.with_isa(isa)


# head_dim 64, 32, 80, 128 take the x86 paths whole; 72 (8k, not 16k) runs AVX-512's request on AVX2, 20 (not 8k)
# runs every path's request on the portable loops
@pytest.mark.parametrize("isa", list(kernels.PagedAttention.PATHS))
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim",
                         [(9, 3, 64), (4, 4, 32), (8, 1, 80), (12, 4, 128), (10, 2, 72), (6, 3, 20), (9, 1, 48)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_kernel_matches_sdpa_over_the_gathered_context(isa, num_heads, num_kv_heads, head_dim, block_size):
    kernel = kernel_path(isa)
    gen = torch.Generator().manual_seed(num_heads * 1000 + head_dim + block_size)
    lens = torch.tensor([1, 2, block_size, block_size + 1, 37, 300, 511], dtype=torch.long)
    num_seqs, num_blocks = 7, sum((n + block_size - 1) // block_size for n in lens.tolist()) + 16
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    max_blocks = int((lens.max() + block_size - 1) // block_size)
    # each sequence gets distinct blocks in a shuffled order; unused table entries stay 0 (padding)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.long)
    used = 0
    for b, n in enumerate(lens.tolist()):
        nb = (n + block_size - 1) // block_size
        tables[b, :nb] = perm[used:used + nb]
        used += nb
    q = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    kernel.decode(q, out, k_cache, v_cache, tables, lens, 0, num_seqs, block_size, head_dim ** -0.5)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, lens, block_size), rtol=1e-4, atol=1e-5)


@needs_kernel
def test_the_fastest_path_this_cpu_runs_is_the_default_and_a_missing_one_is_refused():
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    expected = "avx512" if " avx512f" in flags else "avx2" if " avx2" in flags and " fma" in flags else "portable"
    if platform.machine() not in ("x86_64", "AMD64"):
        expected = "portable"
    assert paged.isa == expected and paged.supported()[-1] == expected
    assert "portable" in paged.supported()
    for isa in set(kernels.PagedAttention.PATHS) - set(paged.supported()):
        with pytest.raises(ValueError, match=f"{isa}.*not available"):
            paged.with_isa(isa)
    with pytest.raises(ValueError, match="not available"):
        paged.with_isa("neon")


@needs_kernel
def test_a_kv_head_range_outside_the_heads_or_empty_is_refused():
    gen = torch.Generator().manual_seed(1)
    k, v, q = torch.randn(16, 2, 16, generator=gen), torch.randn(16, 2, 16, generator=gen), torch.randn(1, 4, 16)
    one = (k, v, torch.arange(4).view(1, 4), torch.tensor([5]), 0, 1, 4, 0.25)
    for bad in ((1, 1), (0, 3), (-1, 1), (2, 1)):
        with pytest.raises(RuntimeError, match="code -1"):
            paged.decode(q, torch.zeros_like(q), *one, kv_heads=bad)
    paged.decode(q, torch.zeros_like(q), *one, kv_heads=(1, 2))


@needs_kernel
def test_a_range_writes_only_its_rows_so_two_threads_can_split_a_batch():
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(64, 2, 16, generator=gen), torch.randn(64, 2, 16, generator=gen)
    tables, lens = torch.arange(16).view(4, 4), torch.tensor([5, 16, 9, 1])
    q = torch.randn(4, 4, 16, generator=gen)
    out = torch.zeros_like(q)
    paged.decode(q, out, k_cache, v_cache, tables, lens, 1, 3, 4, 0.25)
    assert out[0].abs().sum() == 0 and out[3].abs().sum() == 0
    whole = torch.zeros_like(q)
    paged.decode(q, whole, k_cache, v_cache, tables, lens, 0, 4, 4, 0.25)
    torch.testing.assert_close(out[1:3], whole[1:3])


@needs_kernel
def test_model_splits_a_decode_batch_over_two_threads_with_the_same_result():
    gen = torch.Generator().manual_seed(1)
    model = Model.__new__(Model)  # only what paged_decode reads: the cache, the kernel, the helper thread
    model.k_cache = torch.randn(1, 32 * 8, 2, 16, generator=gen)
    model.v_cache = torch.randn(1, 32 * 8, 2, 16, generator=gen)
    model.block_size, model.scale, model.paged, model.windows = 8, 0.25, paged, [0]
    model.matmul = MatmulPolicy.fixed(Backend.TORCH)
    lens = torch.tensor([3, 40, 17, 64, 8])
    tables = torch.arange(40).view(5, 8) % 32
    q = torch.randn(5, 4, 16, generator=gen)
    results = []
    for split in (0, 2):
        model.split_attention = split > 0
        group = AttentionGroup(query_rows=torch.arange(5), valid=None, kv_blocks=tables, mask=None, out_start=0,
                               num_seqs=5, max_q=1, lens=lens, split=split)
        out = torch.zeros(5, 64)
        model.paged_decode(0, q, out, group)
        results.append(out)
    torch.testing.assert_close(results[0], results[1])
    expected = reference(q, model.k_cache[0], model.v_cache[0], tables, lens, 8)
    torch.testing.assert_close(results[0].view(5, 4, 16), expected, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("TOKENLOOP_KERNEL_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger=kernels.__name__):
        first = kernels.build()
        assert first.parent == tmp_path and first.suffix == ".so"
        assert kernels.build() == first  # not rebuilt
    # a first start says why it is quiet for seconds (issue 44); a cached build says nothing
    compiling = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiling the native kernel")]
    assert len(compiling) == len({m.split()[4] for m in compiling}) >= 1
    assert f"compiling the native kernel {kernels.PAGED_SOURCE.name} with" in compiling[-1]
    other = tmp_path / "other.c"
    other.write_text(kernels.PAGED_SOURCE.read_text() + "\n/* changed */\n")
    assert kernels.build(other) != first


@needs_kernel
def test_loading_the_kernels_leaves_denormals_alone():
    """Linked with -ffast-math, a shared library turns on flush-to-zero for the whole process when it loads: with
    every kernel library loaded in this process, subnormals survive."""
    import sys

    libraries = [kernels.load_paged_attention(), kernels.load_ops(), kernels.load_int8(), kernels.load_int4(),
                 kernels.load_f32()]
    assert all(lib.path.is_file() for lib in libraries)
    tiny = sys.float_info.min
    assert tiny / 4 != 0.0  # Python floats
    assert (torch.tensor([1e-40], dtype=torch.float32) * 1.0).item() != 0.0  # torch float32 subnormals


def scattered_cache(gen, lens, num_kv_heads, head_dim, block_size, spare=8):
    """A cache with each sequence's blocks in a shuffled order; unused table entries 0 (padding)."""
    nbs = [(n + block_size - 1) // block_size for n in lens.tolist()]
    num_blocks = sum(nbs) + spare
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(nbs), max(nbs), dtype=torch.long)
    used = 0
    for b, nb in enumerate(nbs):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
    return k_cache, v_cache, tables


# the engine's batch invariance: a sequence's bits do not depend on the rest of the batch or on where the batch is
# split over threads; lengths on and off the chunk widths (8, 16) and block boundaries, read-ahead across sequences
@pytest.mark.parametrize("isa", list(kernels.PagedAttention.PATHS))
@pytest.mark.parametrize("block_size", [16, 5])
def test_a_sequence_gets_the_same_bits_alone_in_any_batch_and_any_split(isa, block_size):
    kernel = kernel_path(isa)
    gen = torch.Generator().manual_seed(block_size)
    lens = torch.tensor([1, 7, 8, 15, 16, 17, 33, 64, 100, 129, 192, 3])
    k_cache, v_cache, tables = scattered_cache(gen, lens, 3, 64, block_size)
    q = torch.randn(len(lens), 9, 64, generator=gen)
    whole = torch.full_like(q, float("nan"))
    kernel.decode(q, whole, k_cache, v_cache, tables, lens, 0, len(lens), block_size, 0.125)
    for split in (1, 5, 11):
        parts = torch.full_like(q, float("nan"))
        kernel.decode(q, parts, k_cache, v_cache, tables, lens, 0, split, block_size, 0.125)
        kernel.decode(q, parts, k_cache, v_cache, tables, lens, split, len(lens), block_size, 0.125)
        assert torch.equal(parts, whole), f"split at {split}"
    for split in (1, 2):  # one sequence's heads over two threads (layer_ops.c): kv heads [0, split) and [split, 3)
        for b in (0, 8, 11):
            parts = torch.full_like(q[b:b + 1], float("nan"))
            args = (k_cache, v_cache, tables[b:b + 1], lens[b:b + 1], 0, 1, block_size, 0.125)
            kernel.decode(q[b:b + 1], parts, *args, kv_heads=(0, split))
            assert parts[0, 3 * split:].isnan().all(), "a head range writes only its query heads"
            kernel.decode(q[b:b + 1], parts, *args, kv_heads=(split, 3))
            assert torch.equal(parts[0], whole[b]), f"sequence {b} split at kv head {split}"
    order = torch.randperm(len(lens), generator=gen)  # the same sequences, another batch order
    shuffled = torch.full_like(q, float("nan"))
    kernel.decode(q[order].contiguous(), shuffled, k_cache, v_cache, tables[order].contiguous(), lens[order], 0,
                  len(lens), block_size, 0.125)
    assert torch.equal(shuffled, whole[order])
    for b in range(len(lens)):
        alone = torch.full_like(q[:1], float("nan"))
        kernel.decode(q[b:b + 1], alone, k_cache, v_cache, tables[b:b + 1], lens[b:b + 1], 0, 1, block_size, 0.125)
        assert torch.equal(alone[0], whole[b]), f"sequence {b} (length {int(lens[b])})"
    torch.testing.assert_close(whole, reference(q, k_cache, v_cache, tables, lens, block_size), rtol=1e-4, atol=1e-5)


# scores far apart: exp(s - max) runs from 1 down past float's range (the x86 paths' polynomial exp gives 0 below
# ln(FLT_MIN)), and near-ties; the softmax must still match SDPA's
@pytest.mark.parametrize("isa", list(kernels.PagedAttention.PATHS))
@pytest.mark.parametrize("spread", [0.01, 1.0, 30.0, 300.0])
def test_softmax_over_scores_near_and_far_apart(isa, spread):
    kernel = kernel_path(isa)
    gen = torch.Generator().manual_seed(int(spread * 100))
    lens = torch.tensor([40, 200, 1])
    k_cache, v_cache, tables = scattered_cache(gen, lens, 2, 32, 16)
    q = torch.randn(3, 6, 32, generator=gen) * spread
    out = torch.full_like(q, float("nan"))
    kernel.decode(q, out, k_cache, v_cache, tables, lens, 0, 3, 16, 32 ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, lens, 16), rtol=1e-4, atol=1e-5)


@needs_kernel
def test_a_context_longer_than_any_before_grows_the_work_area():
    """The kernel keeps its scores in a per-thread area that grows with the longest context seen."""
    gen = torch.Generator().manual_seed(3)
    for n in (10, 3000, 20):
        lens = torch.tensor([n])
        k_cache, v_cache, tables = scattered_cache(gen, lens, 1, 16, 16)
        q = torch.randn(1, 2, 16, generator=gen)
        out = torch.full_like(q, float("nan"))
        paged.decode(q, out, k_cache, v_cache, tables, lens, 0, 1, 16, 0.25)
        torch.testing.assert_close(out, reference(q, k_cache, v_cache, tables, lens, 16), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", list(kernels.PagedAttention.PATHS))
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (8, 1, 80), (10, 2, 72), (6, 3, 20)])
def test_kernel_over_a_16_bit_cache_matches_sdpa_over_its_widened_values(isa, num_heads, num_kv_heads, head_dim):
    """The 16-bit KV cache (float16): each path widens the rows as it loads them (exactly), so its result is SDPA's
    over the cache's values in float32, to float32 rounding (on the vector paths, the float32 kernel's bits over the
    widened cache); the same bits in a batch and alone."""
    kernel = kernel_path(isa)
    gen = torch.Generator().manual_seed(num_heads * 100 + head_dim)
    block_size, lens = 16, torch.tensor([1, 17, 300, 64], dtype=torch.long)
    tables = torch.randperm(80, generator=gen)[:4 * 19].view(4, 19)  # distinct blocks, shuffled
    k_cache, v_cache = (torch.randn(80 * block_size, num_kv_heads, head_dim, generator=gen).half() for _ in "kv")
    q = torch.randn(4, num_heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    kernel.decode(q, out, k_cache, v_cache, tables, lens, 0, 4, block_size, head_dim ** -0.5)
    want = reference(q, k_cache.float(), v_cache.float(), tables, lens, block_size)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    wide = torch.full_like(q, float("nan"))  # the float32 kernel over the widened cache
    kernel.decode(q, wide, k_cache.float(), v_cache.float(), tables, lens, 0, 4, block_size, head_dim ** -0.5)
    if isa != "portable" and head_dim % 8 == 0:  # the vector paths: the same sums in the same order
        assert torch.equal(out, wide)
    else:  # the portable loops, as the compiler vectorises each
        torch.testing.assert_close(out, wide, rtol=1e-5, atol=1e-6)
    alone = torch.full_like(q, float("nan"))
    kernel.decode(q, alone, k_cache, v_cache, tables, lens, 2, 3, block_size, head_dim ** -0.5)
    assert torch.equal(alone[2], out[2])


@pytest.mark.parametrize("isa", list(kernels.PagedAttention.PATHS))
@pytest.mark.parametrize("block_size, window", [(1, 5), (4, 6), (16, 16), (16, 40), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_sliding_window_attends_to_the_last_window_keys_only(isa, block_size, window, dtype):
    """Keys lens-window .. lens-1 (a window inside one block, across several, longer than the context, of one key),
    over a float32 or a 16-bit cache: SDPA over those keys alone."""
    kernel = kernel_path(isa)
    gen = torch.Generator().manual_seed(block_size * 100 + window)
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    lens = torch.tensor([1, window, window + 1, 37, 130], dtype=torch.long)
    max_blocks = int((lens.max() + block_size - 1) // block_size)
    tables = torch.randperm(len(lens) * max_blocks, generator=gen).view(len(lens), max_blocks)
    k_cache, v_cache = (torch.randn(len(lens) * max_blocks * block_size, num_kv_heads, head_dim,
                                    generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen)
    out = torch.full_like(q, float("nan"))
    kernel.decode(q, out, k_cache, v_cache, tables, lens, 0, len(lens), block_size, head_dim ** -0.5, window=window)
    want = torch.empty_like(q)
    for b, n in enumerate(lens.tolist()):
        slots = (tables[b][:, None] * block_size + torch.arange(block_size)).flatten()[max(0, n - window):n]
        k, v = (c[slots].float().transpose(0, 1).unsqueeze(0) for c in (k_cache, v_cache))  # [1, K, window, E]
        want[b] = F.scaled_dot_product_attention(q[b][None, :, None, :], k, v, enable_gqa=True)[0, :, 0]
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    whole = torch.empty_like(q)
    kernel.decode(q, whole, k_cache, v_cache, tables, lens, 0, len(lens), block_size, head_dim ** -0.5)
    assert not torch.allclose(whole[3:], out[3:])  # the window changed what it reads
    with pytest.raises(RuntimeError, match="code -1"):
        kernel.decode(q, out, k_cache, v_cache, tables, lens, 0, len(lens), block_size, 0.1, window=-1)
