"""MatmulPolicy: every backend computes x @ w.T; buckets pick the backend by tokens per step."""

from __future__ import annotations

import pytest
import torch

from tokenloop.engine.calibration import BUCKETS
from tokenloop.engine.matmul import Backend, MatmulPolicy


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
    policy = MatmulPolicy.calibrate(torch.randn(64, 32), use_cache=False)
    assert set(policy.buckets) == set(BUCKETS)


def test_calibration_times_the_native_gemm_and_uses_it_where_it_wins(monkeypatch):
    """f32c2 is a candidate in every bucket of a float32 model; whatever wins a bucket is what linear() runs."""
    from tokenloop.engine import kernels, matmul
    f32 = kernels.load_f32()
    if f32 is None:
        pytest.skip("no C compiler here: torch multiplies instead")
    timed = []
    real = matmul.fastest

    def fastest(candidates, rounds=7):
        timed.append(set(candidates))
        return Backend.C_GEMM_TWO_THREADS if Backend.C_GEMM_TWO_THREADS in candidates else real(candidates, rounds)
    monkeypatch.setattr(matmul, "fastest", fastest)
    policy = MatmulPolicy.calibrate(torch.randn(64, 32), use_cache=False)
    if len(timed) == len(BUCKETS):  # two CPUs or more: the two-thread backends are candidates
        assert all(Backend.C_GEMM_TWO_THREADS in c and Backend.TORCH in c and Backend.NUMPY_TWO_THREADS in c for c in timed)
        assert set(policy.buckets.values()) == {Backend.C_GEMM_TWO_THREADS} and policy.f32 is f32
        gen = torch.Generator().manual_seed(3)
        x, w = torch.randn(33, 576, generator=gen), torch.randn(70, 576, generator=gen)
        torch.testing.assert_close(policy.linear(x, w, policy.backend(33)), x @ w.T, rtol=1e-4, atol=1e-4)


def test_f32c2_leaves_other_dtypes_and_layouts_to_torch():
    policy = MatmulPolicy.fixed(Backend.C_GEMM_TWO_THREADS)
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(20, 48, generator=gen), torch.randn(30, 48, generator=gen)
    for xs, ws in ((x, w.T.contiguous().T), (x.double(), w.double()), (x[:, ::2], w[:, ::2])):
        torch.testing.assert_close(policy.linear(xs, ws, Backend.C_GEMM_TWO_THREADS), xs @ ws.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["native2", "f32c2"])
def test_the_native_backends_can_be_named_on_the_command_line(name):
    from tokenloop.engine.config import EngineConfig
    from tokenloop.service.cli import build_parser

    args = build_parser().parse_args(["serve", "--matmul-backend", name])
    assert args.matmul_backend == name and EngineConfig(matmul_backend=name).matmul_backend == name
    policy = MatmulPolicy.fixed(Backend(name))
    assert {policy.backend(b) for b in BUCKETS} == {Backend(name)}


def test_the_quantized_routes_are_timed_over_a_bounded_set_of_weights():
    """The torch-fp32 route times float32 copies of what it multiplies: an 8B model's 32 gate_up matrices
    [28672, 4096] would be 15 GB of them, so the timing keeps as many as TIMED_COPY_BYTES allows, at least one."""
    from tokenloop.engine.matmul import TIMED_COPY_BYTES, timed_weights

    class Shape:
        def __init__(self, n, k):
            self.shape = (n, k)
    big = [Shape(28672, 4096) for _ in range(32)]
    assert len(timed_weights(big)) == TIMED_COPY_BYTES // (28672 * 4096 * 4) == 2
    small = [Shape(3072, 576) for _ in range(30)]  # SmolLM2-135M: every layer
    assert timed_weights(small) == small
    assert len(timed_weights([Shape(1 << 20, 1 << 12)])) == 1
