"""int8 weights: per-channel quantization, the native kernel against torch, and the matmul policy's int8 path."""

from __future__ import annotations

import pytest
import torch

from tokenloop.engine import kernels
from tokenloop.engine.matmul import BUCKETS, Backend, MatmulPolicy
from tokenloop.engine.quant import QWeight, quantize_per_channel, qweight

native = kernels.load_int8()
needs_kernel = pytest.mark.skipif(native is None, reason="no C compiler here: the torch path is what runs")


def reference(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """The product in float64: what the kernel approximates in float32."""
    return ((x.double() @ w.q.double().T) * w.scale.double()).float()


def test_quantize_is_symmetric_per_output_channel():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(7, 33, generator=gen) * torch.tensor([1e-3, 0.1, 1, 10, 100, 0.5, 2.0])[:, None]
    w[3] = 0.0  # an all-zero channel keeps scale 1 and quantizes to zeros
    q, scale = quantize_per_channel(w)
    assert q.dtype is torch.int8 and scale.dtype is torch.float32 and scale.shape == (7,)
    assert q.abs().max() == 127 and int(q.min()) >= -127
    assert torch.equal(q[3], torch.zeros(33, dtype=torch.int8)) and scale[3] == 1.0
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-6 * w.abs()).all())  # round to nearest: half a step at most
    for row in (0, 1, 2, 4):  # each row's largest value is exactly +-127 steps
        assert float(q[row].abs().max()) == 127.0


@needs_kernel
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 8, 33, 100])
@pytest.mark.parametrize("shape", [(960, 576), (577, 1536), (5, 13), (64, 7)])
def test_kernel_matches_float64_reference(num_tokens, shape):
    gen = torch.Generator().manual_seed(num_tokens)
    w = qweight(torch.randn(*shape, generator=gen))
    x = torch.randn(num_tokens, shape[1], generator=gen)
    out = torch.full((num_tokens, shape[0]), float("nan"))
    native.linear(x, w.q, w.scale, out)
    torch.testing.assert_close(out, reference(x, w), rtol=1e-4, atol=1e-4)


@needs_kernel
def test_kernel_writes_only_its_columns():
    gen = torch.Generator().manual_seed(1)
    w, x = qweight(torch.randn(50, 40, generator=gen)), torch.randn(6, 40, generator=gen)
    out = torch.full((6, 50), 7.0)
    native.linear(x, w.q, w.scale, out, 10, 23)
    torch.testing.assert_close(out[:, 10:23], reference(x, w)[:, 10:23], rtol=1e-4, atol=1e-4)
    assert bool((out[:, :10] == 7.0).all()) and bool((out[:, 23:] == 7.0).all())
    with pytest.raises(RuntimeError, match="int8_linear_f32 failed"):
        native.linear(x, w.q, w.scale, out, 20, 10)


@pytest.mark.parametrize("use_native", [True, False])
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 17])
def test_policy_multiplies_qweights_on_every_path(use_native, split, num_tokens):
    if use_native and native is None:
        pytest.skip("no C compiler here")
    gen = torch.Generator().manual_seed(2)
    w, x = qweight(torch.randn(90, 48, generator=gen)), torch.randn(num_tokens, 48, generator=gen)
    policy = MatmulPolicy(dict.fromkeys(BUCKETS, Backend.TORCH), int8=native if use_native else None,
                          int8_split=dict.fromkeys(BUCKETS, split))
    out = policy.linear(x, w, policy.backend(num_tokens))
    torch.testing.assert_close(out, reference(x, w), rtol=1e-4, atol=1e-4)


def test_calibration_without_the_kernel_falls_back_to_torch():
    policy = MatmulPolicy.calibrate_int8(qweight(torch.randn(64, 32)), None)
    assert policy.int8 is None and not policy.int8_split
    assert "int8" not in policy.describe()


@needs_kernel
def test_calibration_covers_every_bucket():
    policy = MatmulPolicy.calibrate_int8(qweight(torch.randn(64, 32)), native)
    assert policy.int8 is native and policy.describe().startswith("int8 native kernel")
    if policy.int8_split:
        assert set(policy.int8_split) == set(BUCKETS)
