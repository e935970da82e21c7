"""MatmulPolicy: every backend computes x @ w.T; buckets pick the backend by tokens per step."""

from __future__ import annotations

import pytest
import torch

from tokenloop.engine.matmul import BUCKETS, Backend, MatmulPolicy


@pytest.mark.parametrize("backend", list(Backend))
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_each_backend_multiplies(backend, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    x, w = torch.randn(num_tokens, 24, generator=gen), torch.randn(40, 24, generator=gen)
    policy = MatmulPolicy.fixed(backend)
    torch.testing.assert_close(policy.linear(x, w, backend), x @ w.T, rtol=1e-5, atol=1e-5)


def test_backend_follows_the_smallest_bucket_that_fits():
    policy = MatmulPolicy({b: (Backend.NUMPY if b <= 16 else Backend.TORCH) for b in BUCKETS})
    assert policy.backend(1) is Backend.NUMPY and policy.backend(16) is Backend.NUMPY
    assert policy.backend(17) is Backend.TORCH and policy.backend(100_000) is Backend.TORCH
    assert "<=16: numpy" in policy.describe()


def test_calibration_never_picks_numpy_for_bfloat16():
    policy = MatmulPolicy.calibrate(torch.randn(64, 32).to(torch.bfloat16))
    assert set(policy.buckets.values()) == {Backend.TORCH}


def test_calibration_covers_every_bucket():
    policy = MatmulPolicy.calibrate(torch.randn(64, 32))
    assert set(policy.buckets) == set(BUCKETS)
