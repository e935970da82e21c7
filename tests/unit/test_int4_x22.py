"""int4 products with 22-bit integer activations (Int4Linear.X22: x22-portable, x22-avx2, x22-vnni; int4_linear.c's
header defines the arithmetic): against a float64 reference of that arithmetic, against the dequantized float product
(the error is at float32's level, unlike vnni's int8 activations), identical bits on every path, thread split and
batch, odd shapes, and the groups the kernels refuse."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenloop.engine import kernels
from tokenloop.engine.quant import quantize4

X22 = kernels.Int4Linear.X22
KERNEL = kernels.load_int4()
X22_MAX = 2097151


def kernel_for(isa: str):
    """int4's kernel on path `isa`; skipped, with the reason, where there is no compiler or this CPU lacks the path."""
    if KERNEL is None:
        pytest.skip("no C compiler here: the torch path is what runs")
    if not KERNEL.supports(isa):
        pytest.skip(KERNEL.missing(isa))
    return KERNEL.with_isa(isa)


def x22_reference(x: torch.Tensor, w) -> np.ndarray:
    """The x22 arithmetic in float64: x quantized per row and group exactly as the kernels do (float32 steps), the
    integer dot products exact (int64), then the epilogue sum over groups of isum * d * sx + xs * m."""
    g = w.group_size
    q, d, mn = (t.numpy() for t in w.unpacked())
    xg = x.numpy().astype(np.float32).reshape(x.shape[0], -1, g)
    amax = np.abs(xg).max(axis=2, keepdims=True)
    sx = (amax / np.float32(X22_MAX)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(X22_MAX) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xi = np.clip(np.rint((xg * inv).astype(np.float32)), -X22_MAX, X22_MAX).astype(np.int64)  # [M, NG, G]
    qg = q.astype(np.int64).reshape(q.shape[0], -1, g)  # [N, NG, G]
    isum = np.einsum("mgk,ngk->mng", xi, qg)  # exact
    xs = sx[:, :, 0].astype(np.float64) * xi.sum(axis=2)  # [M, NG]
    sxd = sx[:, :, 0].astype(np.float64)
    return (isum * d.astype(np.float64)[None] * sxd[:, None, :]).sum(axis=2) + xs @ mn.astype(np.float64).T


def product(isa: str, x: torch.Tensor, w, two_threads: bool = False) -> torch.Tensor:
    out = torch.full((x.shape[0], w.num_out), float("nan"))
    kernel = kernel_for(isa)
    (kernel.linear2 if two_threads else kernel.linear)(x, w, out)
    return out


@pytest.mark.parametrize("isa", X22)
@pytest.mark.parametrize("num_tokens", [1, 5, 6, 13])
@pytest.mark.parametrize("shape, group", [((960, 576), 32), ((577, 1536), 32), ((200, 1536), 64), ((45, 576), 64),
                                          ((19, 64), 32)])
def test_x22_matches_the_float64_reference_of_its_arithmetic(isa, num_tokens, shape, group):
    gen = torch.Generator().manual_seed(num_tokens * 7 + group)
    w = quantize4(torch.randn(*shape, generator=gen), group)
    x = torch.randn(num_tokens, shape[1], generator=gen)
    x[0, :group] = 0.0  # an all-zero group: sx = 0, inv = 0
    out = product(isa, x, w).double().numpy()
    ref = x22_reference(x, w)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("isa", X22)
def test_x22_is_at_float32_level_against_the_dequantized_product(isa):
    """22-bit activations: the products are as close to the exact float64 product of x and the dequantized weight as
    the float32 path's (rel. error < 1e-5 of the output's scale), where vnni's int8 activations are ~1e-2 away."""
    gen = torch.Generator().manual_seed(3)
    w = quantize4(torch.randn(577, 1536, generator=gen), 32)
    x = torch.randn(9, 1536, generator=gen) * torch.logspace(-3, 2, 1536)  # groups of very different scales
    exact = x.double() @ w.dequantize().double().T
    scale = exact.abs().max().item()
    err = (product(isa, x, w).double() - exact).abs().max().item() / scale
    assert err < 1e-5, err
    if KERNEL.supports("avx512"):  # the float32 path, for scale: the same order of magnitude
        assert err < 10 * (product("avx512", x, w).double() - exact).abs().max().item() / scale + 1e-7
    if KERNEL.supports("vnni"):
        assert (product("vnni", x, w).double() - exact).abs().max().item() / scale > 100 * err


def test_the_three_x22_paths_give_identical_bits():
    """One family: a step may run any of them and a row keeps its bits (each path this CPU lacks is skipped, never
    passed: the test needs at least two to compare)."""
    runnable = [isa for isa in X22 if KERNEL is not None and KERNEL.supports(isa)]
    if len(runnable) < 2:
        pytest.skip("; ".join(KERNEL.missing(isa) for isa in X22 if isa not in runnable) if KERNEL else "no compiler")
    gen = torch.Generator().manual_seed(11)
    for shape, group in (((300, 576), 32), ((577, 1536), 64), ((97, 576), 64)):
        w = quantize4(torch.randn(*shape, generator=gen), group)
        for rows in (1, 2, 5, 6, 7, 13, 32):
            x = torch.randn(rows, shape[1], generator=gen)
            outs = [product(isa, x, w, two_threads=rows % 2 == 0) for isa in runnable]
            for isa, out in zip(runnable[1:], outs[1:]):
                assert torch.equal(out, outs[0]), (isa, runnable[0], shape, rows)


def test_rounding_ties_clamps_and_zero_groups_quantize_alike_on_every_path():
    """x chosen so that x * inv lands on halves (amax = 2^21 - 1: inv = 1), on the clamp, in an all-zero group and far
    from 1 in scale: every path (x22-vnni quantizes on 16 lanes, the others in C) gives the reference's bits."""
    if KERNEL is None:
        pytest.skip("no C compiler here")
    runnable = [isa for isa in X22 if KERNEL.supports(isa)]
    x = torch.zeros(4, 576)
    x[0, :32] = torch.arange(32) - 15.5  # ties to even: -15.5 .. 15.5
    x[0, 0] = float(X22_MAX)
    x[0, 32:64] = torch.arange(32) * 2.5 + 0.5
    x[0, 63] = float(X22_MAX)
    x[1] = torch.randn(576) * 1e-30
    x[2] = torch.randn(576) * 1e30
    x[3, ::7] = -3.0  # a group with one value, others of zeros
    w = quantize4(torch.randn(70, 576, generator=torch.Generator().manual_seed(2)), 32)
    outs = {isa: product(isa, x, w) for isa in runnable}
    ref = x22_reference(x, w)
    for isa, out in outs.items():
        assert torch.equal(out, outs[runnable[0]]), isa
        for row, want in zip(out.double().numpy(), ref):  # rows of scales 1e-30 .. 1e30
            np.testing.assert_allclose(row, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("isa", X22)
def test_a_row_gets_the_same_bits_alone_in_any_batch_and_on_two_threads(isa):
    """Batches of 1 .. 40 rows (tiles of six, the rows left over, the one-row step on 1 to 4 blocks) on one thread and
    two: every row identical to itself alone."""
    kernel_for(isa)
    gen = torch.Generator().manual_seed(5)
    w = quantize4(torch.randn(300, 576, generator=gen), 32)  # 10 blocks: 4 + 4 + 2, and 5 | 5 on two threads
    x = torch.randn(40, 576, generator=gen)
    alone = torch.cat([product(isa, x[i:i + 1].contiguous(), w) for i in range(40)])
    assert torch.equal(product(isa, x[:1], w, two_threads=True), alone[:1])
    for rows in (*range(1, 15), 19, 32, 40):
        batch = x[:rows].contiguous()
        assert torch.equal(product(isa, batch, w), alone[:rows]), rows
        assert torch.equal(product(isa, batch, w, two_threads=True), alone[:rows]), rows


@pytest.mark.parametrize("isa", X22)
def test_x22_writes_only_its_channels(isa):
    kernel = kernel_for(isa)
    gen = torch.Generator().manual_seed(8)
    w, x = quantize4(torch.randn(100, 576, generator=gen), 32), torch.randn(7, 576, generator=gen)
    whole, part = torch.empty(7, 100), torch.full((7, 100), -7.0)
    kernel.linear(x, w, whole)
    kernel.linear(x, w, part, 32, 97)
    assert torch.equal(part[:, 32:97], whole[:, 32:97])
    assert (part[:, :32] == -7.0).all() and (part[:, 97:] == -7.0).all()


@pytest.mark.parametrize("isa", X22)
def test_groups_past_64_columns_or_not_a_multiple_of_4_are_refused(isa):
    """G = 128 could overflow the int32 dot products (int4_linear.c's bound), G = 42 does not fit four-column lanes:
    the kernel refuses (code -1) or the packing does, never a wrong product."""
    kernel = kernel_for(isa)
    w = quantize4(torch.randn(64, 1536), 128)
    assert w.group_size == 128
    with pytest.raises(RuntimeError, match=r"code -1"):
        kernel.linear(torch.randn(2, 1536), w, torch.empty(2, 64))
    with pytest.raises(ValueError, match="multiple of 4 columns"):
        kernel.linear(torch.randn(2, 84), quantize4(torch.randn(64, 84), 42), torch.empty(2, 64))


def test_x22_paths_are_int4s_own_and_named_when_missing():
    assert set(X22) <= set(kernels.Int4Linear.PATHS) and not set(X22) & set(kernels.Int8Linear.PATHS)
    assert not set(X22) & set(kernels.Int4Linear.EXACT)
    if KERNEL is None:
        pytest.skip("no C compiler here")
    assert "x22-portable" in KERNEL.supported()
    for isa in X22:
        assert (KERNEL.missing(isa) == "") == KERNEL.supports(isa)
        if not KERNEL.supports(isa):
            assert kernels.Int4Linear.NEEDS[isa] in KERNEL.missing(isa)


@pytest.mark.parametrize("isa", X22)
def test_x22_serving_repacks_the_weights_in_place_and_keeps_their_values_and_products(isa):
    """pack_all (the fused plan of an x22 route) reorders a 4-bit weight's own storage into the vnni packing instead
    of keeping a second copy: same storage, same values (dequantize), same products on the x22 path, and a block
    layout path still gets the right (copied back) operands."""
    kernel = kernel_for(isa)
    gen = torch.Generator().manual_seed(5)
    source = torch.randn(96, 576, generator=gen)
    w, untouched = quantize4(source, 32), quantize4(source, 32)
    x = torch.randn(3, 576, generator=gen)
    before, storage, shape = product(isa, x, w), w.q.untyped_storage().data_ptr(), w.shape
    kernel.pack_all([w])
    assert w.q.shape == (3, 576 // 4, 16, 4) and w.q.untyped_storage().data_ptr() == storage
    assert w.shape == shape and torch.equal(w.dequantize(), untouched.dequantize())
    assert torch.equal(product(isa, x, w), before)
    kernel.pack_all([w])  # idempotent
    assert torch.equal(w.q, kernel.packed(untouched)[0])
    if KERNEL.supports("avx2"):
        assert torch.equal(product("avx2", x, w), product("avx2", x, untouched))
