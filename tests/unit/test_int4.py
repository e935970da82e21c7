"""4-bit weights (`--weights int4`): Q4_1-like quantization and packing, the native kernel on every code path this
CPU runs against a float64 product of the dequantized weight, batch invariance of its paths, and the matmul
policy's int4 path (native and torch fallback)."""

from __future__ import annotations

import platform
import subprocess
import threading

import pytest
import torch

from tokenloop.engine import kernels
from tokenloop.engine.matmul import BUCKETS, Backend, MatmulPolicy
from tokenloop.engine.quant import Q4Weight, quantize4

native = kernels.load_int4()
needs_kernel = pytest.mark.skipif(native is None, reason="no C compiler here: the torch path is what runs")
ALL_PATHS = list(kernels.Int4Linear.PATHS)


def kernel_for(isa: str) -> kernels.Int4Linear:
    """The kernel on code path `isa`; skips (with the reason in the report) where this CPU cannot run it."""
    if native is None:
        pytest.skip("no C compiler here: the torch path is what runs")
    if not native.supports(isa):
        pytest.skip(f"this CPU cannot run the int4 kernel's {isa} path (it runs {', '.join(native.supported())})")
    return native.with_isa(isa)


def reference(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """The product in float64 on the dequantized weight: what the kernel computes in float32."""
    return (x.double() @ w.dequantize().double().T).float()


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


@pytest.mark.parametrize("isa", ALL_PATHS)
@pytest.mark.parametrize("num_tokens", [1, 3, 5, 6, 7, 13, 33, 100])
@pytest.mark.parametrize("shape, group", [((960, 576), 32), ((577, 1536), 32), ((64, 96), 96), ((5, 13), 32),
                                          ((19, 64), 32)])
def test_kernel_matches_float64_reference_on_every_path(isa, num_tokens, shape, group):
    kernel = kernel_for(isa)
    gen = torch.Generator().manual_seed(num_tokens)
    w = quantize4(torch.randn(*shape, generator=gen), group)
    x = torch.randn(num_tokens, shape[1], generator=gen)
    out = torch.full((num_tokens, shape[0]), float("nan"))
    kernel.linear(x, w, out)
    torch.testing.assert_close(out, reference(x, w), rtol=1e-4, atol=2e-4)


@pytest.mark.parametrize("isa", ALL_PATHS)
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(isa):
    """On each path, rows one at a time (widened on the fly) and tiles of six (widened into a buffer), split or not
    over channels and threads, give identical bits."""
    kernel = kernel_for(isa)
    gen = torch.Generator().manual_seed(4)
    w, x = quantize4(torch.randn(300, 576, generator=gen)), torch.randn(14, 576, generator=gen)
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


@needs_kernel
def test_the_default_path_is_the_fastest_this_cpu_runs():
    assert native.isa == native.supported()[-1] and "portable" in native.supported()
    with pytest.raises(ValueError, match="int4 kernel path 'avx9' is not available on this CPU"):
        native.with_isa("avx9")


@needs_kernel
def test_kernel_writes_only_its_columns_and_refuses_bad_ranges():
    gen = torch.Generator().manual_seed(1)
    w, x = quantize4(torch.randn(50, 64, generator=gen)), torch.randn(6, 64, generator=gen)
    out = torch.full((6, 50), 7.0)
    native.linear(x, w, out, 32, 43)
    torch.testing.assert_close(out[:, 32:43], reference(x, w)[:, 32:43], rtol=1e-4, atol=1e-4)
    assert bool((out[:, :32] == 7.0).all()) and bool((out[:, 43:] == 7.0).all())
    with pytest.raises(RuntimeError, match="int4_linear_f32 failed"):
        native.linear(x, w, out, 32, 16)
    with pytest.raises(RuntimeError, match="int4_linear_f32 failed"):  # a split inside a block of 32 channels
        native.linear(x, w, out, 16, 23)


@needs_kernel
def test_worker_thread_serves_concurrent_callers():
    """Two threads calling at once (two engines in one process): one gets the worker, the other computes alone."""
    gen = torch.Generator().manual_seed(5)
    w, x = quantize4(torch.randn(320, 96, generator=gen), 32), torch.randn(3, 96, generator=gen)
    want = reference(x, w)
    errors = []

    def run():
        for _ in range(200):
            out = torch.empty(3, 320)
            native.linear2(x, w, out)
            if not torch.allclose(out, want, rtol=1e-4, atol=1e-4):
                errors.append(out)
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 17])
def test_policy_multiplies_q4weights_on_every_path(use_native, split, num_tokens):
    if use_native and native is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(2)
    w, x = quantize4(torch.randn(90, 64, generator=gen)), torch.randn(num_tokens, 64, generator=gen)
    policy = MatmulPolicy(dict.fromkeys(BUCKETS, Backend.TORCH), int4=native if use_native else None,
                          int8_split=dict.fromkeys(BUCKETS, split))
    out = policy.linear(x, w, policy.backend(num_tokens))
    torch.testing.assert_close(out, reference(x, w), rtol=1e-4, atol=1e-4)


def test_calibration_without_the_kernel_falls_back_to_torch():
    policy = MatmulPolicy.calibrate_int4(quantize4(torch.randn(64, 32)), None)
    assert policy.int4 is None and not policy.int8_split
    assert "int4" not in policy.describe()


@needs_kernel
def test_calibration_covers_every_bucket():
    policy = MatmulPolicy.calibrate_int4(quantize4(torch.randn(64, 32)), native)
    assert policy.int4 is native and policy.describe().startswith(f"int4 native kernel ({native.isa})")
    if policy.int8_split:
        assert set(policy.int8_split) == set(BUCKETS)


def test_the_cli_takes_weights_int4_and_refuses_other_modes(capsys):
    from tokenloop.service.cli import _parser, config_from_args

    config = config_from_args(_parser().parse_args(["serve", "--weights", "int4"]))
    assert config.executor_options["weights"] == "int4"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--weights", "int2"])
    assert "invalid choice: 'int2'" in capsys.readouterr().err


@pytest.mark.skipif(kernels.compiler() is None or platform.machine() != "x86_64", reason="needs cc on x86-64")
def test_a_baseline_x86_64_build_still_dispatches_to_every_path(tmp_path):
    """Built for any x86-64 (no -march=native: SSE2 only), the library still runs the AVX2 path where the CPU has it
    (a target attribute, chosen at run time) and the portable one everywhere."""
    cc, obj, lib = kernels.compiler(), tmp_path / "i4.o", tmp_path / "i4.so"
    flags = [f for f in kernels.COMPILE_FLAGS if not f.startswith("-march")] + ["-march=x86-64"]
    subprocess.run([cc, *flags, "-c", str(kernels.INT4_SOURCE), "-o", str(obj)], check=True, timeout=120)
    subprocess.run([cc, *kernels.LINK_FLAGS, str(obj), "-o", str(lib), "-lm"], check=True, timeout=120)
    baseline = kernels.Int4Linear(lib)
    assert baseline.supported() == native.supported() and baseline.isa == native.isa
    gen = torch.Generator().manual_seed(8)
    w, x = quantize4(torch.randn(200, 192, generator=gen)), torch.randn(9, 192, generator=gen)
    for isa in baseline.supported():
        out = torch.empty(9, 200)
        baseline.with_isa(isa).linear2(x, w, out)
        torch.testing.assert_close(out, reference(x, w), rtol=1e-4, atol=2e-4)
