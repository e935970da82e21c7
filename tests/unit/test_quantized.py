"""Quantized weights (`--weights int8`, `--weights int4`): the formats (int8: symmetric per channel and group of 32;
int4: Q4_1-like), the native kernels on every code path this CPU runs (portable, avx2, avx512, vnni) against a
float64 product of the same arithmetic, batch invariance of each path, the matmul policy's routes (C paths and
torch's kernels), the start-up calibration (one family for every bucket, cached per CPU) and forcing a route.

A path or route this CPU cannot run skips with the reason (pytest -rs prints it), never passes silently."""

from __future__ import annotations

import json
import platform
import threading
from pathlib import Path

import pytest
import torch

from tokenloop.engine import calibration, kernel_lib, kernels, matmul
from tokenloop.engine.calibration import BUCKETS
from tokenloop.engine.matmul import Backend, MatmulPolicy
from tokenloop.engine.quant import quantize, quantize4
from tokenloop.engine.quant_routes import ROUTE_ENV, QuantRoute, choose_routes, quant_routes, route_missing

MODES = {"int8": (quantize, kernels.load_int8()), "int4": (quantize4, kernels.load_int4())}
ALL_PATHS = list(kernels.QuantKernel.PATHS)
NO_CC = "no C compiler here: the torch path is what runs"


def native(mode: str):
    kernel = MODES[mode][1]
    if kernel is None:
        pytest.skip(NO_CC)
    return kernel


def kernel_for(mode: str, isa: str):
    """The kernel of `mode` on code path `isa`; skips (with the reason in the report) where this CPU cannot run it."""
    kernel = native(mode)
    if not kernel.supports(isa):
        pytest.skip(kernel.missing(isa))
    return kernel.with_isa(isa)


def quantized(mode: str, w: torch.Tensor, group: int = 32):
    return MODES[mode][0](w, group)


def reference(x: torch.Tensor, w, isa: str = "avx2") -> torch.Tensor:
    """The product in float64 of what path `isa` multiplies: the dequantized weight by x, and on the vnni path by x
    quantized per row and group of 32 as the kernel does (llama.cpp's Q8 activations: round(x / (max|x| / 127))), int4's
    minimums included (they multiply the sums of the quantized x, as llama.cpp's Q8_1 does); on int8's x16 path by x
    quantized to 16 bits the same way (round(x / (max|x| / 32767)))."""
    if isa not in ("vnni", "x16-avx2"):
        return (x.double() @ w.dequantize().double().T).float()
    g = w.group_size
    xg = x.double().view(x.shape[0], -1, g)
    sx = xg.abs().amax(dim=2, keepdim=True) / (127 if isa == "vnni" else 32767)
    xq = torch.where(sx > 0, torch.round(xg / torch.where(sx > 0, sx, 1)), 0) * sx
    return (xq.view(x.shape) @ w.dequantize().double().T).float()


# ---- the formats ----

def test_quantize_is_symmetric_per_channel_and_group():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(7, 64, generator=gen) * torch.tensor([1e-3, 0.1, 1, 10, 100, 0.5, 2.0])[:, None]
    w[3] = 0.0  # an all-zero group keeps scale 1 and quantizes to zeros
    w[5, 32:] *= 1000  # a loud second group does not drown the first one's resolution
    qw = quantize(w, group_size=32)
    q, scale = qw.unpacked()
    assert q.dtype is torch.int8 and scale.shape == (7, 2) and qw.group_size == 32 and qw.shape == (7, 64)
    assert qw.q.shape == (1, 64, 32)  # packed: 32 channels per column, the last 25 padding
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(q[3], torch.zeros(64, dtype=torch.int8)) and bool((scale[3] == 1.0).all())
    err = (qw.dequantize() - w).abs()
    step = scale.repeat_interleave(32, dim=1)
    assert bool((err <= step / 2 + 1e-6 * w.abs()).all())  # round to nearest: half a step at most
    assert float(scale[5, 1] / scale[5, 0]) > 100
    for row in (0, 1, 2, 4, 5, 6):  # each group's largest value is exactly +-127 steps
        assert bool((q[row].view(2, 32).abs().amax(dim=1) == 127).all())


def test_rows_that_do_not_divide_into_groups_get_one_scale():
    qw = quantize(torch.randn(5, 40), group_size=32)
    assert qw.group_size == 40 and qw.unpacked()[1].shape == (5, 1)


def test_quantize_keeps_a_scale_and_a_minimum_per_channel_and_group():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(7, 64, generator=gen) * torch.tensor([1e-2, 0.1, 1, 10, 100, 0.5, 2.0])[:, None]
    w[3] = 0.25  # a constant group: scale 0, the minimum carries the value exactly
    w[5, 32:] = w[5, 32:] * 1000 + 3000  # a loud, offset second group does not drown the first one's resolution
    qw = quantize4(w, group_size=32)
    q, d, m = qw.unpacked()
    assert qw.q.dtype is torch.uint8 and qw.q.shape == (1, 64, 16)  # 32 channels per column in 16 bytes
    assert qw.sm.dtype is torch.float16 and qw.sm.shape == (1, 2, 2, 32) and qw.shape == (7, 64)
    assert q.shape == (7, 64) and d.shape == m.shape == (7, 2) and int(q.max()) <= 15
    assert torch.equal(qw.dequantize()[3], w[3]) and bool((d[3] == 0).all())
    for row in (0, 1, 2, 4, 5, 6):  # each group spans the levels 0 .. 15: its minimum and maximum are levels
        assert bool((q[row].view(2, 32).amin(dim=1) == 0).all()) and bool((q[row].view(2, 32).amax(dim=1) == 15).all())
    err = (qw.dequantize() - w).abs()
    # half a step, plus what float16 scales and minimums cost (a relative 2^-11 of each)
    bound = d.repeat_interleave(32, dim=1) * (0.5 + 16 * 2 ** -11) + m.abs().repeat_interleave(32, dim=1) * 2 ** -11
    assert bool((err <= bound + 1e-6).all())
    assert float(d[5, 1] / d[5, 0]) > 100


def test_packing_puts_channel_j_low_and_channel_16_plus_j_high():
    w = torch.arange(32, dtype=torch.float32)[:, None].repeat(1, 32)  # channel n: all n ...
    w[:, 0] = 0.0
    w[:, 1] = 15.0 * torch.arange(1, 33)  # ... spread so each channel's levels are 0, 15 and n / (n+1) in between
    qw = quantize4(w)
    q, _, _ = qw.unpacked()
    packed = qw.q[0]  # [K, 16]
    assert torch.equal(packed & 15, q[:16].T.to(torch.uint8)) and torch.equal(packed >> 4, q[16:].T.to(torch.uint8))


def test_a_weight_on_a_q4_1_grid_comes_back_exactly():
    """The default checkpoint is a dequantized Q4_1 GGUF: requantizing it recovers its levels, scales and minimums."""
    gen = torch.Generator().manual_seed(3)
    d = (torch.rand(40, 3, 1, generator=gen) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(40, 3, 1, generator=gen) * 0.1).half().float()
    levels = torch.randint(0, 16, (40, 3, 32), generator=gen)
    levels[:, :, 0], levels[:, :, 1] = 0, 15  # llama.cpp's min and max land on levels 0 and 15
    w = (levels.float() * d + m).view(40, 96)
    qw = quantize4(w)
    assert torch.equal(qw.unpacked()[0], levels.view(40, 96).to(torch.uint8))
    assert torch.equal(qw.dequantize(), w)


def test_symmetric_is_q4_0_like():
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(33, 64, generator=gen)
    q, d, m = quantize4(w, symmetric=True).unpacked()
    torch.testing.assert_close(m, (-8 * d).half().float())  # zero sits on level 8
    err = (quantize4(w, symmetric=True).dequantize() - w).abs().view(33, 2, 32)
    # half a step, but a whole one at the far end: -8 .. 7 levels, the value of largest magnitude on -8
    assert bool((err <= d.abs()[:, :, None] + 1e-3).all()) and int(q.max()) <= 15
    assert bool((q.view(33, 2, 32).amin(dim=2) == 0).all())


def test_rows_that_do_not_divide_into_groups_get_one_group():
    qw = quantize4(torch.randn(5, 40), group_size=32)
    assert qw.group_size == 40 and qw.unpacked()[1].shape == (5, 1) and qw.sm.shape == (1, 1, 2, 32)



# ---- the kernels, on every code path ----

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("isa", ALL_PATHS)
@pytest.mark.parametrize("num_tokens", [1, 3, 5, 6, 7, 13, 33, 100])
@pytest.mark.parametrize("shape, group", [((960, 576), 32), ((577, 1536), 32), ((64, 96), 96), ((5, 13), 32),
                                          ((19, 64), 32)])
def test_kernel_matches_float64_reference_on_every_path(mode, isa, num_tokens, shape, group):
    kernel = kernel_for(mode, isa)
    gen = torch.Generator().manual_seed(num_tokens)
    w = quantized(mode, torch.randn(*shape, generator=gen), group)
    x = torch.randn(num_tokens, shape[1], generator=gen)
    out = torch.full((num_tokens, shape[0]), float("nan"))
    if isa == "vnni" and w.group_size % 4:
        with pytest.raises(ValueError, match="multiple of 4 columns"):
            kernel.linear(x, w, out)
        return
    kernel.linear(x, w, out)
    torch.testing.assert_close(out, reference(x, w, isa), rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("isa", ALL_PATHS)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(mode, isa):
    """On each path, rows one at a time and in tiles of six, split or not over channels and threads, give
    identical bits (vnni quantizes each row's activations alone, so it holds there too)."""
    kernel = kernel_for(mode, isa)
    gen = torch.Generator().manual_seed(4)
    w, x = quantized(mode, torch.randn(300, 576, generator=gen)), torch.randn(14, 576, generator=gen)
    together = torch.empty(14, 300)
    kernel.linear(x, w, together)
    halves = torch.empty(14, 300)
    kernel.linear(x, w, halves, 0, 160)
    kernel.linear(x, w, halves, 160, 300)
    assert torch.equal(halves, together)
    both = torch.empty(14, 300)
    kernel.linear2(x, w, both)  # the library's worker thread takes half the channels
    assert torch.equal(both, together)
    for i in range(14):
        alone = torch.empty(1, 300)
        kernel.linear(x[i:i + 1].contiguous(), w, alone)
        assert torch.equal(alone[0], together[i]), i


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("isa", ALL_PATHS)
@pytest.mark.parametrize("rows, channels", [(7, 224), (8, 300), (9, 224), (10, 300), (11, 97), (32, 224),
                                            (32, 300)])
def test_every_tile_shape_gives_a_row_its_bits_alone(mode, isa, rows, channels):
    """Six rows and more all go through tiles: six rows a tile and the rows left over (1 to 5) in one smaller
    tile; a row alone goes through the one-row step, on 1 to 4 blocks at once (224 channels: 7 blocks = 4 + 3, on
    two threads 3 | 4; 300: 10 blocks = 4 + 4 + 2). Every such shape gives a row the same bits."""
    kernel = kernel_for(mode, isa)
    gen = torch.Generator().manual_seed(rows * 1000 + channels)
    w, x = quantized(mode, torch.randn(channels, 576, generator=gen)), torch.randn(rows, 576, generator=gen)
    together, both = torch.empty(rows, channels), torch.empty(rows, channels)
    kernel.linear(x, w, together)
    kernel.linear2(x, w, both)
    assert torch.equal(both, together)
    for i in range(rows):
        alone, alone2 = torch.empty(1, channels), torch.empty(1, channels)
        kernel.linear(x[i:i + 1].contiguous(), w, alone)
        kernel.linear2(x[i:i + 1].contiguous(), w, alone2)
        assert torch.equal(alone[0], together[i]) and torch.equal(alone2[0], together[i]), i


@pytest.mark.parametrize("mode", MODES)
def test_avx2_and_avx512_give_the_same_bits(mode):
    """One family: a step may run either (the calibration mixes them across buckets) and a row stays the same."""
    avx2, avx512 = kernel_for(mode, "avx2"), kernel_for(mode, "avx512")
    gen = torch.Generator().manual_seed(9)
    w = quantized(mode, torch.randn(200, 576, generator=gen))
    for rows in (1, 2, 3, 4, 6, 8, 19, 32):
        x = torch.randn(rows, 576, generator=gen)
        a, b = torch.empty(rows, 200), torch.empty(rows, 200)
        avx2.linear2(x, w, a)
        avx512.linear(x, w, b)
        assert torch.equal(a, b), rows


@pytest.mark.parametrize("mode", MODES)
def test_the_default_path_is_the_fastest_exact_one_this_cpu_runs(mode):
    kernel = native(mode)
    exact = [isa for isa in kernel.supported() if isa in kernels.QuantKernel.EXACT]
    assert kernel.isa == exact[-1] and "portable" in kernel.supported()
    with pytest.raises(ValueError, match=f"{mode} kernel path 'avx9' is not available on this CPU"):
        kernel.with_isa("avx9")
    assert "lacks" in kernel.missing("vnni") if not kernel.supports("vnni") else kernel.missing("vnni") == ""


@pytest.mark.parametrize("mode, isa", [(m, None) for m in MODES] + [("int8", "x16-avx2")])
def test_kernel_writes_only_its_columns_and_refuses_bad_ranges(mode, isa):
    kernel = native(mode) if isa is None else kernel_for(mode, isa)
    gen = torch.Generator().manual_seed(1)
    w, x = quantized(mode, torch.randn(50, 64, generator=gen)), torch.randn(6, 64, generator=gen)
    out = torch.full((6, 50), 7.0)
    kernel.linear(x, w, out, 32, 43)
    torch.testing.assert_close(out[:, 32:43], reference(x, w, isa or "avx2")[:, 32:43], rtol=1e-4, atol=1e-4)
    assert bool((out[:, :32] == 7.0).all()) and bool((out[:, 43:] == 7.0).all())
    with pytest.raises(RuntimeError, match=f"{mode}_linear_f32 failed"):
        kernel.linear(x, w, out, 32, 16)
    with pytest.raises(RuntimeError, match=f"{mode}_linear_f32 failed"):  # a split inside a block of 32 channels
        kernel.linear(x, w, out, 16, 23)


@pytest.mark.parametrize("mode", MODES)
def test_worker_thread_serves_concurrent_callers(mode):
    """Two threads calling at once (two engines in one process): one gets the worker, the other computes alone."""
    kernel = native(mode)
    gen = torch.Generator().manual_seed(5)
    w, x = quantized(mode, torch.randn(320, 96, generator=gen), 32), torch.randn(3, 96, generator=gen)
    want = reference(x, w)
    errors = []

    def run():
        for _ in range(200):
            out = torch.empty(3, 320)
            kernel.linear2(x, w, out)
            if not torch.allclose(out, want, rtol=1e-4, atol=1e-4):
                errors.append(out)
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("mode", MODES)
def test_hand_offs_that_go_through_sleep_never_lose_a_wake(mode):
    """kernel_worker.h wakes a sleeper with a futex only when it may be asleep: with the worker's spin at 0 every
    product's hand-off goes through its sleep, and a split that leaves the worker most of a large product makes the
    caller outlast its own 2 ms spin and sleep too. A lost wake would hang here (the join's timeout)."""
    kernel = native(mode)
    gen = torch.Generator().manual_seed(9)
    big, small = quantized(mode, torch.randn(4096, 1024, generator=gen), 32), quantized(
        mode, torch.randn(96, 64, generator=gen), 32)
    xb, xs = torch.randn(64, 1024, generator=gen), torch.randn(2, 64, generator=gen)
    want_b, want_s = torch.empty(64, 4096), torch.empty(2, 96)
    kernel.linear(xb, big, want_b)
    kernel.linear(xs, small, want_s)
    bad = []

    def run():
        for i in range(400):
            out = torch.empty(2, 96)
            kernel.linear2(xs, small, out, mid=32 * (i % 3))  # the caller's part: none, one block or two
            bad.extend([i] if not torch.equal(out, want_s) else [])
            if i % 50 == 0:  # the worker takes 4064 of 4096 channels: the caller waits on it for milliseconds
                out = torch.empty(64, 4096)
                kernel.linear2(xb, big, out, mid=32)
                bad.extend([i] if not torch.equal(out, want_b) else [])
    kernel_lib.set_spin_us(kernel.lib, 0)
    try:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), "a hand-off hung: a wake was lost"
    finally:
        kernel_lib.set_spin_us(kernel.lib)
    assert not bad


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc/self/task")
def test_every_kernel_library_posts_to_one_worker_thread():
    """kernel_worker.c: the int4, int8 and float32 libraries' two-thread products run their second halves on the
    process's one kernel worker, not on a worker per library (which spun beside the next library's two threads)."""
    f32 = kernels.load_f32()
    if f32 is None or native("int8") is None:
        pytest.skip(NO_CC)
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(96, 64, generator=gen), torch.randn(3, 64, generator=gen)
    for mode in MODES:
        native(mode).linear2(x, quantized(mode, w), torch.empty(3, 96))
    f32.linear2(x, w, torch.empty(3, 96))
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    assert names.count("tokenloop-kw") == 1, names
    assert not {"tokenloop-i4", "tokenloop-i8", "tokenloop-f32", "tokenloop-ops"} & set(names), names


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16])
@pytest.mark.parametrize("shape", [(960, 576), (577, 1536), (7, 13), (4, 16)])
def test_float32_kernel_matches_torch_on_two_threads(num_tokens, shape):
    """f32_linear_f32 (--weights fp32, decode steps of a few tokens): x @ w.T, each row the same bits alone."""
    kernel = native("int8")
    gen = torch.Generator().manual_seed(num_tokens)
    w, x = torch.randn(*shape, generator=gen), torch.randn(num_tokens, shape[1], generator=gen)
    out = torch.full((num_tokens, shape[0]), float("nan"))
    kernel.f32_linear2(x, w, out)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-4, atol=1e-4)
    alone = torch.empty(1, shape[0])
    kernel.f32_linear2(x[-1:].contiguous(), w, alone)
    assert torch.equal(alone[0], out[-1])


@pytest.mark.skipif(kernels.compiler() is None or platform.machine() != "x86_64", reason="needs cc on x86-64")
@pytest.mark.parametrize("mode", MODES)
def test_a_baseline_x86_64_build_still_dispatches_to_every_path(mode):
    """Built for any x86-64 (-march=x86-64: SSE2 only), the library runs each SIMD path where the CPU has it (a
    target attribute, chosen at run time) and the portable one everywhere."""
    kernel = native(mode)
    flags = [f for f in kernels.DISPATCHED_FLAGS if not f.startswith(("-march", "-mtune"))] + ["-march=x86-64"]
    source = kernels.INT4_SOURCE if mode == "int4" else kernels.INT8_SOURCE
    baseline = type(kernel)(kernels.build(source, tuple(flags)))
    assert baseline.supported() == kernel.supported() and baseline.isa == kernel.isa
    gen = torch.Generator().manual_seed(8)
    w, x = quantized(mode, torch.randn(200, 192, generator=gen)), torch.randn(9, 192, generator=gen)
    for isa in baseline.supported():
        out = torch.empty(9, 200)
        baseline.with_isa(isa).linear2(x, w, out)
        torch.testing.assert_close(out, reference(x, w, isa), rtol=1e-4, atol=2e-4)


# ---- the policy's routes, the calibration, forcing a route ----

@pytest.mark.parametrize("mode, route", [(m, f"{m}-{isa}") for m in MODES for isa in ALL_PATHS] +
                         [(m, lib) for m in MODES for lib in ("torch-fp32", "torch-dynq")])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 17])
def test_every_route_multiplies_its_weights(mode, route, split, num_tokens):
    missing = route_missing(mode, route, kernels.load_int8(), kernels.load_int4())
    if missing:
        pytest.skip(missing)
    r = quant_routes(mode, kernels.load_int8(), kernels.load_int4())[route]
    gen = torch.Generator().manual_seed(2)
    w, x = quantized(mode, torch.randn(90, 64, generator=gen)), torch.randn(num_tokens, 64, generator=gen)
    policy = MatmulPolicy(dict.fromkeys(BUCKETS, Backend.TORCH), qroutes=dict.fromkeys(BUCKETS, (r, split)))
    out = policy.linear(x, w, policy.backend(num_tokens))
    if route == "torch-dynq":  # one activation scale for the whole call: a few % of the largest output
        torch.testing.assert_close(out, reference(x, w), rtol=0, atol=0.03 * float(reference(x, w).abs().max()))
    else:
        torch.testing.assert_close(out, reference(x, w, route.rpartition("-")[2]), rtol=1e-4, atol=2e-4)
    if mode == "int4" and r.int8 is not None:  # int4's lm_head is int8: the route multiplies it on its own path
        head = quantize(torch.randn(40, 64, generator=gen))
        torch.testing.assert_close(policy.linear(x, head, Backend.TORCH), reference(x, head, r.int8.isa),
                                   rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("mode", MODES)
def test_without_the_kernel_torch_multiplies(mode):
    policy = MatmulPolicy.calibrate_quant(mode, quantized(mode, torch.randn(64, 32)), None, None)
    assert policy.int8 is None and policy.int4 is None and "native" not in policy.describe()
    x, w = torch.randn(3, 32), quantized(mode, torch.randn(64, 32))
    torch.testing.assert_close(policy.linear(x, w, Backend.TORCH), reference(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_calibration_keeps_one_family_and_caches_its_choice(mode, tmp_path, monkeypatch):
    kernel = native(mode)
    monkeypatch.setattr(matmul, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(calibration, "LOAD_LIMIT", float("inf"))  # cached for good however busy the machine (test_route_cache.py)
    monkeypatch.delenv(ROUTE_ENV, raising=False)
    weights = [quantized(mode, torch.randn(64, 32)) for _ in range(2)]
    int4 = kernel if mode == "int4" else None
    policy = MatmulPolicy.calibrate_quant(mode, weights, kernels.load_int8(), int4)
    families = {policy.route(b)[0].family for b in BUCKETS}
    assert len(families) == 1 and not policy.route(1)[0].ineligible
    assert policy.chosen.startswith("timed in") and set(policy.timings) == set(BUCKETS)
    text = policy.describe()
    for b in BUCKETS:  # each bucket: its winner, and the times of every candidate, libraries marked ineligible
        route, split = policy.route(b)
        assert f"<={b}: {route.name} {'2 threads' if split else '1 thread'}" in text
    assert "torch-fp32/1t*" in text and f"{mode}-{kernel.isa}/" in text
    if kernel.supports("vnni"):  # timed, never chosen: its int8 activations fail the quality contract
        assert f"{mode}-vnni/2t*" in text and policy.route(1)[0].family == "exact"
    [cache] = tmp_path.glob(f"matmul-{mode}-*.json")
    again = MatmulPolicy.calibrate_quant(mode, weights, kernels.load_int8(), int4)
    assert again.chosen == f"cached in {cache}"
    assert {b: (r.name, s) for b, (r, s) in again.qroutes.items()} == \
        {b: (r.name, s) for b, (r, s) in policy.qroutes.items()}
    cache.write_text(json.dumps({"family": "exact", "buckets": {"1": ["int8-avx9", True]}, "times": {}}))
    assert MatmulPolicy.calibrate_quant(mode, weights, kernels.load_int8(), int4).chosen.startswith("timed in")


def test_the_choice_keeps_one_family_and_never_an_ineligible_route():
    routes = {"int8-avx2": QuantRoute("int8-avx2", "exact"), "int8-avx512": QuantRoute("int8-avx512", "exact"),
              "int8-vnni": QuantRoute("int8-vnni", "vnni")}
    times = {1: {"int8-avx2/1t": 1.0, "int8-avx512/2t": 1.1, "int8-vnni/1t": 1.2, "torch-dynq/1t*": 0.1},
             4: {"int8-avx2/2t": 2.0, "int8-avx512/2t": 1.5, "int8-vnni/2t": 1.0, "torch-dynq/1t*": 0.1}}
    choice = choose_routes(times, routes)  # exact: log(1) + log(1.5); vnni: log(1.2) + log(1): vnni
    assert choice["family"] == "vnni" and choice["buckets"] == {1: ("int8-vnni", False), 4: ("int8-vnni", True)}
    times[4]["int8-vnni/2t"] = 1.45  # now exact costs log(1.5 / 1.45) < vnni's log(1.2): exact, mixing its paths
    choice = choose_routes(times, routes)
    assert choice["family"] == "exact" and choice["buckets"] == {1: ("int8-avx2", False), 4: ("int8-avx512", True)}


@pytest.mark.parametrize("mode", MODES)
def test_a_forced_route_runs_every_bucket(mode, monkeypatch):
    kernel = native(mode)
    isa = [i for i in kernel.supported() if i not in kernel.X16][-1]  # x16: a lm_head path, not a route of its own
    monkeypatch.setenv(ROUTE_ENV, f"{mode}-{isa}")
    int4 = kernel if mode == "int4" else None
    policy = MatmulPolicy.calibrate_quant(mode, quantized(mode, torch.randn(64, 32)), kernels.load_int8(), int4)
    assert {policy.route(b)[0].name for b in BUCKETS} == {f"{mode}-{isa}"}
    assert f"forced by {ROUTE_ENV}" in policy.describe() and not policy.timings
    monkeypatch.setenv(ROUTE_ENV, "torch-dynq")
    policy = MatmulPolicy.calibrate_quant(mode, quantized(mode, torch.randn(64, 32)), kernels.load_int8(), int4)
    assert policy.route(1)[0].ineligible  # forced anyway: the quality tests force every route
    other = "int4" if mode == "int8" else "int8"
    for bad, why in ((f"{mode}-avx9", f"no {mode} kernel path 'avx9'"), (f"{other}-avx2", "is not a route of")):
        monkeypatch.setenv(ROUTE_ENV, bad)
        with pytest.raises(RuntimeError, match=why):
            MatmulPolicy.calibrate_quant(mode, quantized(mode, torch.randn(64, 32)), kernels.load_int8(), int4)


def test_the_cli_takes_weights_int4_and_refuses_other_modes(capsys):
    from tokenloop.service.cli import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["serve", "--weights", "int4"]))
    assert config.executor_options["weights"] == "int4"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--weights", "int2"])
    assert "invalid choice: 'int2'" in capsys.readouterr().err
