"""int8 products with 16-bit integer activations (Int8Linear.X16: x16-avx2, int8_linear.c's header defines the
arithmetic; the lm_head's path of the quant_routes.HEAD_SUFFIX routes): against a float64 reference of that
arithmetic, close to the dequantized float product, identical bits for a row alone, in any batch and on two threads,
odd shapes, and the groups it refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenloop.engine import kernels
from tokenloop.engine.quant import as_head, quantize
from tokenloop.engine.quant_routes import HEAD_SUFFIX, quant_routes, route_missing

KERNEL = kernels.load_int8()
X16_MAX = 32767


def x16_kernel():
    """int8's kernel on x16-avx2; skipped, with the reason, where there is no compiler or this CPU lacks AVX2."""
    if KERNEL is None:
        pytest.skip("no C compiler here: the torch path is what runs")
    if not KERNEL.supports("x16-avx2"):
        pytest.skip(KERNEL.missing("x16-avx2"))
    return KERNEL.with_isa("x16-avx2")


def x16_reference(x: torch.Tensor, w) -> np.ndarray:
    """The x16 arithmetic in float64: x quantized per row and group as the kernel does (float32 steps), the integer
    dot products exact (int64), then the sum over groups of isum * (scale * sx)."""
    g = w.group_size
    q, scale = (t.numpy() for t in w.unpacked())
    xg = x.numpy().astype(np.float32).reshape(x.shape[0], -1, g)
    amax = np.abs(xg).max(axis=2, keepdims=True)
    sx = (amax / np.float32(X16_MAX)).astype(np.float32)
    inv = np.where(amax > 0, np.float32(X16_MAX) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xi = np.clip(np.rint((xg * inv).astype(np.float32)), -X16_MAX, X16_MAX).astype(np.int64)  # [M, NG, G]
    isum = np.einsum("mgk,ngk->mng", xi, q.astype(np.int64).reshape(q.shape[0], -1, g))  # exact
    ss = (scale[None].astype(np.float32) * sx[:, None, :, 0]).astype(np.float64)  # [M, N, NG]: one float multiply
    return (isum * ss).sum(axis=2)


def product(x: torch.Tensor, w, two_threads: bool = False) -> torch.Tensor:
    out = torch.full((x.shape[0], w.num_out), float("nan"))
    kernel = x16_kernel()
    (kernel.linear2 if two_threads else kernel.linear)(x, w, out)
    return out


@pytest.mark.parametrize("num_tokens", [1, 5, 6, 13])
@pytest.mark.parametrize("shape, group", [((960, 576), 32), ((577, 640), 32), ((200, 1536), 512), ((45, 576), 64),
                                          ((19, 64), 32), ((33, 100), 100)])
def test_x16_matches_the_float64_reference_of_its_arithmetic(num_tokens, shape, group):
    gen = torch.Generator().manual_seed(num_tokens * 7 + group)
    w = quantize(torch.randn(*shape, generator=gen), group)
    assert w.group_size == group
    x = torch.randn(num_tokens, shape[1], generator=gen)
    x[0, :group] = 0.0  # an all-zero group: sx = 0, inv = 0
    out = product(x, w).double().numpy()
    ref = x16_reference(x, w)
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_x16_is_close_to_the_dequantized_product():
    """16-bit activations: within 1e-4 of the output's scale of the exact float64 product of x and the dequantized
    weight (the int8 weights' own error is ~1e-2 of theirs), where vnni's int8 activations are ~1e-2 away."""
    gen = torch.Generator().manual_seed(3)
    w = quantize(torch.randn(577, 1536, generator=gen), 32)
    x = torch.randn(9, 1536, generator=gen) * torch.logspace(-3, 2, 1536)  # groups of very different scales
    exact = x.double() @ w.dequantize().double().T
    scale = exact.abs().max().item()
    err = (product(x, w).double() - exact).abs().max().item() / scale
    assert err < 1e-4, err
    if KERNEL.supports("vnni"):
        out = torch.empty(9, 577)
        KERNEL.with_isa("vnni").linear(x, w, out)
        assert (out.double() - exact).abs().max().item() / scale > 10 * err


def test_rounding_ties_clamps_and_extreme_scales():
    """x * inv on halves (amax = 32767: inv = 1, ties to even), tiny and huge rows, a group with one value."""
    x = torch.zeros(4, 576)
    x[0, :32] = torch.arange(32) - 15.5
    x[0, 0] = float(X16_MAX)
    x[0, 32:64] = torch.arange(32) * 2.5 + 0.5
    x[0, 63] = float(X16_MAX)
    x[1] = torch.randn(576) * 1e-30
    x[2] = torch.randn(576) * 1e30
    x[3, ::7] = -3.0
    w = quantize(torch.randn(70, 576, generator=torch.Generator().manual_seed(2)), 32)
    out, ref = product(x, w).double().numpy(), x16_reference(x, w)
    for row, want in zip(out, ref):  # rows of scales 1e-30 .. 1e30
        np.testing.assert_allclose(row, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


def test_a_row_gets_the_same_bits_alone_in_any_batch_and_on_two_threads():
    """Batches of 1 .. 40 rows (tiles of six, the rows left over, the one-row step) on one thread and two: every row
    identical to itself alone."""
    gen = torch.Generator().manual_seed(5)
    w = quantize(torch.randn(300, 576, generator=gen), 32)
    x = torch.randn(40, 576, generator=gen)
    alone = torch.cat([product(x[i:i + 1].contiguous(), w) for i in range(40)])
    assert torch.equal(product(x[:1], w, two_threads=True), alone[:1])
    for rows in (*range(1, 15), 19, 32, 40):
        batch = x[:rows].contiguous()
        assert torch.equal(product(batch, w), alone[:rows]), rows
        assert torch.equal(product(batch, w, two_threads=True), alone[:rows]), rows


def test_groups_past_512_columns_or_not_a_multiple_of_4_are_refused_and_the_route_falls_back():
    """G = 1024 could overflow the int32 sums and G = 42 does not fit four-column lanes: the kernel refuses (code -1)
    or the packing does; a HEAD_SUFFIX route multiplies such an lm_head on its layers' path instead."""
    kernel = x16_kernel()
    big = quantize(torch.randn(64, 1024), 1024)
    with pytest.raises(RuntimeError, match=r"code -1"):
        kernel.linear(torch.randn(2, 1024), big, torch.empty(2, 64))
    with pytest.raises(ValueError, match="multiple of 4 columns"):
        kernel.linear(torch.randn(2, 84), quantize(torch.randn(64, 84), 42), torch.empty(2, 64))
    route = quant_routes("int8", KERNEL)["int8-avx2" + HEAD_SUFFIX]
    x = torch.randn(3, 1024)
    assert torch.equal(route.product(x, as_head(big), False), quant_routes("int8", KERNEL)["int8-avx2"].product(
        x, big, False))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_head_routes_multiply_the_lm_head_alone_on_x16(mode):
    """A HEAD_SUFFIX route: the lm_head (QWeight.head) on x16, every other weight as the route without the suffix;
    its family is its base's + the suffix (one family for every bucket: batch invariant)."""
    x16_kernel()
    routes = quant_routes(mode, KERNEL, kernels.load_int4())
    base = routes[f"{mode}-avx2"]
    head_route = routes[f"{mode}-avx2{HEAD_SUFFIX}"]
    assert head_route.family == base.family + HEAD_SUFFIX and head_route.head.isa == "x16-avx2"
    assert route_missing(mode, f"{mode}-avx2{HEAD_SUFFIX}", KERNEL, kernels.load_int4()) == ""
    assert "not a route" in route_missing("int8", "int8-x16-avx2", KERNEL)
    gen = torch.Generator().manual_seed(4)
    layer, head = quantize(torch.randn(96, 576, generator=gen)), as_head(quantize(torch.randn(130, 576, generator=gen)))
    x = torch.randn(5, 576, generator=gen)
    assert torch.equal(head_route.product(x, layer, True), base.product(x, layer, True))
    assert torch.equal(head_route.product(x, head, True), product(x, head))
    assert not torch.equal(base.product(x, head, True), product(x, head))  # the base route: the float path


def test_the_calibration_times_head_routes_on_the_lm_head_and_copies_their_base_elsewhere():
    """Buckets that time the lm_head (up to COLD_TOKENS rows) time each HEAD_SUFFIX route; the others give it its base
    route's times (the same products: a difference there would be noise deciding the family)."""
    from tokenloop.engine.calibration import BUCKETS, COLD_TOKENS
    from tokenloop.engine.quant_routes import choose_routes, time_routes

    x16_kernel()
    routes = quant_routes("int8", KERNEL)
    gen = torch.Generator().manual_seed(6)
    weights = [quantize(torch.randn(64, 64, generator=gen)) for _ in range(2)]
    times = time_routes(routes, weights + [as_head(quantize(torch.randn(200, 64, generator=gen)))])
    for b in BUCKETS:
        base = {c: t for c, t in times[b].items() if c.startswith("int8-avx2/")}
        head = {c.replace(HEAD_SUFFIX, ""): t for c, t in times[b].items() if c.startswith("int8-avx2" + HEAD_SUFFIX)}
        assert base.keys() == head.keys() and base
        if b > COLD_TOKENS:
            assert base == head
    assert choose_routes(times, routes)["family"] in ("exact", "exact" + HEAD_SUFFIX)


def test_the_timed_weights_keep_the_lm_head_past_the_bound():
    """matmul.timed_weights bounds the gate_ups the calibration times (float32 copies for torch's routes); the lm_head,
    which the torch routes skip, is kept last whatever the bound."""
    from tokenloop.engine.matmul import timed_weights

    class Shape:
        def __init__(self, n, k, head=False):
            self.shape, self.head = (n, k), head
    big, head = [Shape(28672, 4096) for _ in range(32)], Shape(128256, 4096, head=True)
    timed = timed_weights(big + [head])
    assert len(timed) == 3 and timed[-1] is head and timed[:2] == big[:2]
    ws = [quantize(torch.randn(64, 32)) for _ in range(3)]
    lm_head = as_head(quantize(torch.randn(100, 32)))
    assert [id(w) for w in timed_weights(ws + [lm_head])] == [id(w) for w in ws + [lm_head]]
