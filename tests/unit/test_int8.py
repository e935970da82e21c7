"""int8 weights: symmetric group-wise quantization, the native kernel against float64, batch invariance of its
paths, and the matmul policy's int8 path (native and torch fallback)."""

from __future__ import annotations

import pytest
import torch

from tokenloop.engine import kernels
from tokenloop.engine.matmul import BUCKETS, Backend, MatmulPolicy
from tokenloop.engine.quant import QWeight, quantize

native = kernels.load_int8()
needs_kernel = pytest.mark.skipif(native is None, reason="no C compiler here: the torch path is what runs")


def reference(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """The product in float64 on the dequantized weight: what the kernel computes in float32."""
    return (x.double() @ w.dequantize().double().T).float()


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


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 6, 7, 8, 13, 33, 100])
@pytest.mark.parametrize("shape, group", [((960, 576), 32), ((577, 1536), 32), ((64, 96), 96), ((5, 13), 32),
                                          ((19, 64), 32)])
def test_kernel_matches_float64_reference(num_tokens, shape, group):
    gen = torch.Generator().manual_seed(num_tokens)
    w = quantize(torch.randn(*shape, generator=gen), group)
    x = torch.randn(num_tokens, shape[1], generator=gen)
    out = torch.full((num_tokens, shape[0]), float("nan"))
    native.linear(x, w, out)
    torch.testing.assert_close(out, reference(x, w), rtol=1e-4, atol=1e-4)


@needs_kernel
def test_a_row_gets_the_same_bits_alone_and_in_any_batch():
    """The one-row path (weights widened on the fly) and the tiled path (widened into a buffer) agree exactly."""
    gen = torch.Generator().manual_seed(4)
    w, x = quantize(torch.randn(300, 576, generator=gen)), torch.randn(14, 576, generator=gen)
    together = torch.empty(14, 300)
    native.linear(x, w, together)
    halves = torch.empty(14, 300)
    native.linear(x, w, halves, 0, 160)
    native.linear(x, w, halves, 160, 300)
    assert torch.equal(halves, together)
    both = torch.empty(14, 300)
    native.linear2(x, w, both)  # the library's worker thread takes half the channels
    assert torch.equal(both, together)
    for i in range(14):
        alone = torch.empty(1, 300)
        native.linear(x[i:i + 1].contiguous(), w, alone)
        assert torch.equal(alone[0], together[i]), i


@needs_kernel
def test_kernel_writes_only_its_columns():
    gen = torch.Generator().manual_seed(1)
    w, x = quantize(torch.randn(50, 64, generator=gen)), torch.randn(6, 64, generator=gen)
    out = torch.full((6, 50), 7.0)
    native.linear(x, w, out, 32, 43)
    torch.testing.assert_close(out[:, 32:43], reference(x, w)[:, 32:43], rtol=1e-4, atol=1e-4)
    assert bool((out[:, :32] == 7.0).all()) and bool((out[:, 43:] == 7.0).all())
    with pytest.raises(RuntimeError, match="int8_linear_f32 failed"):
        native.linear(x, w, out, 24, 16)
    with pytest.raises(RuntimeError, match="int8_linear_f32 failed"):  # a split inside a block of 32 channels
        native.linear(x, w, out, 16, 23)


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16])
@pytest.mark.parametrize("shape", [(960, 576), (577, 1536), (7, 13), (4, 16)])
def test_float32_kernel_matches_torch_on_two_threads(num_tokens, shape):
    """f32_linear_f32 (--weights fp32, decode steps of a few tokens): x @ w.T, each row the same bits alone."""
    gen = torch.Generator().manual_seed(num_tokens)
    w, x = torch.randn(*shape, generator=gen), torch.randn(num_tokens, shape[1], generator=gen)
    out = torch.full((num_tokens, shape[0]), float("nan"))
    native.f32_linear2(x, w, out)
    torch.testing.assert_close(out, x @ w.T, rtol=1e-4, atol=1e-4)
    alone = torch.empty(1, shape[0])
    native.f32_linear2(x[-1:].contiguous(), w, alone)
    assert torch.equal(alone[0], out[-1])


@needs_kernel
def test_worker_thread_serves_concurrent_callers():
    """Two threads calling at once (two engines in one process): one gets the worker, the other computes alone."""
    import threading
    gen = torch.Generator().manual_seed(5)
    w, x = quantize(torch.randn(320, 96, generator=gen), 32), torch.randn(3, 96, generator=gen)
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
def test_policy_multiplies_qweights_on_every_path(use_native, split, num_tokens):
    if use_native and native is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(2)
    w, x = quantize(torch.randn(90, 64, generator=gen)), torch.randn(num_tokens, 64, generator=gen)
    policy = MatmulPolicy(dict.fromkeys(BUCKETS, Backend.TORCH), int8=native if use_native else None,
                          int8_split=dict.fromkeys(BUCKETS, split))
    out = policy.linear(x, w, policy.backend(num_tokens))
    torch.testing.assert_close(out, reference(x, w), rtol=1e-4, atol=1e-4)


def test_calibration_without_the_kernel_falls_back_to_torch():
    policy = MatmulPolicy.calibrate_int8(quantize(torch.randn(64, 32)), None)
    assert policy.int8 is None and not policy.int8_split
    assert "int8" not in policy.describe()


@needs_kernel
def test_calibration_covers_every_bucket():
    policy = MatmulPolicy.calibrate_int8(quantize(torch.randn(64, 32)), native)
    assert policy.int8 is native and policy.describe().startswith("int8 native kernel")
    if policy.int8_split:
        assert set(policy.int8_split) == set(BUCKETS)
