"""f32_linear.c (Backend.C_GEMM_TWO_THREADS, --weights fp32 steps of a batch): x @ w.T for float32 weights read in place, on every
code path this CPU runs, against a float64 product; each output one FMA chain over the columns in order, so a row gets
the same bits alone and in any batch, split over threads or not, and avx2 == avx512.

A path this CPU cannot run skips with the reason (pytest -rs prints it), never passes silently. The engine on it against
transformers: tests/integration/test_f32_linear.py."""

from __future__ import annotations

import platform
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tokenloop.engine import kernels

KERNEL = kernels.load_f32()


def kernel_for(isa: str):
    if KERNEL is None:
        pytest.skip("no C compiler here: torch multiplies instead")
    if not KERNEL.supports(isa):
        pytest.skip(f"this CPU ({platform.machine()}) cannot run the f32 {isa} path (it runs "
                    f"{', '.join(KERNEL.supported())})")
    return KERNEL.with_isa(isa)


def operands(rows: int, shape: tuple[int, int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, shape[1], generator=gen), torch.randn(*shape, generator=gen)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()


@pytest.mark.parametrize("isa", list(kernels.F32Linear.PATHS))
@pytest.mark.parametrize("num_tokens", [1, 7, 8, 9, 16, 17, 32, 33, 48, 100])
@pytest.mark.parametrize("shape", [(832, 576), (576, 1536), (35, 13), (1, 5), (12, 1)])
def test_kernel_matches_float64_reference_on_every_path(isa, num_tokens, shape):
    """Tiles of every height (one or two vectors of rows, the last one padded) and widths (the channels left after
    the full tiles of 12 or 6), on one thread and on two."""
    kernel = kernel_for(isa)
    x, w = operands(num_tokens, shape, num_tokens)
    want = reference(x, w)
    for run in (kernel.linear, kernel.linear2):
        out = torch.full((num_tokens, shape[0]), float("nan"))
        run(x, w, out)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", list(kernels.F32Linear.PATHS))
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(isa):
    kernel = kernel_for(isa)
    x, w = operands(40, (300, 576), 4)
    together = torch.empty(40, 300)
    kernel.linear(x, w, together)
    halves = torch.empty(40, 300)
    kernel.linear(x, w, halves, 0, 157)  # any channel splits the work: no block to keep whole
    kernel.linear(x, w, halves, 157, 300)
    assert torch.equal(halves, together)
    both = torch.empty(40, 300)
    kernel.linear2(x, w, both)
    assert torch.equal(both, together)
    for i in (0, 15, 16, 31, 32, 39):
        for rows in (x[i:i + 1], x[i:]):
            alone = torch.empty(rows.shape[0], 300)
            kernel.linear(rows.contiguous(), w, alone)
            assert torch.equal(alone[0], together[i]), (i, rows.shape[0])


def test_avx2_and_avx512_give_the_same_bits():
    avx2, avx512 = kernel_for("avx2"), kernel_for("avx512")
    for rows in (1, 9, 32, 70):
        x, w = operands(rows, (100, 576), rows)
        a, b = torch.empty(rows, 100), torch.empty(rows, 100)
        avx2.linear2(x, w, a)
        avx512.linear(x, w, b)
        assert torch.equal(a, b), rows


def test_the_default_path_is_the_fastest_this_cpu_runs_and_bad_calls_are_refused():
    kernel = kernel_for("portable")
    assert KERNEL.isa == KERNEL.supported()[-1]
    with pytest.raises(ValueError, match="f32 kernel path 'avx9' is not available on this CPU"):
        kernel.with_isa("avx9")
    x, w = operands(3, (20, 16))
    out = torch.full((3, 20), 7.0)
    kernel.linear(x, w, out, 5, 11)
    torch.testing.assert_close(out[:, 5:11], reference(x, w)[:, 5:11], rtol=1e-4, atol=1e-4)
    assert bool((out[:, :5] == 7.0).all()) and bool((out[:, 11:] == 7.0).all())
    with pytest.raises(RuntimeError, match="f32_gemm .* failed"):
        kernel.linear(x, w, out, 11, 5)
    with pytest.raises(ValueError, match="contiguous float32"):
        kernel.linear(x, w.T.contiguous(), out)
    with pytest.raises(ValueError, match="contiguous float32"):
        kernel.linear2(x.double(), w, out)


def test_worker_thread_serves_concurrent_callers():
    """Two threads calling at once (two engines in one process): one gets the worker, the other computes alone."""
    kernel = kernel_for("portable").with_isa(KERNEL.isa)
    x, w = operands(20, (200, 96), 5)
    want = torch.empty(20, 200)
    kernel.linear(x, w, want)

    def mismatches(_) -> int:
        outs = [torch.empty(20, 200) for _ in range(200)]
        for out in outs:
            kernel.linear2(x, w, out)
        return sum(not torch.equal(out, want) for out in outs)
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(mismatches, range(3), timeout=60)) == [0, 0, 0]


@pytest.mark.skipif(kernels.compiler() is None or platform.machine() != "x86_64", reason="needs cc on x86-64")
def test_a_baseline_x86_64_build_still_dispatches_to_every_path():
    """Built for any x86-64 (-march=x86-64), the library runs each SIMD path where the CPU has it."""
    kernel = kernel_for("portable").with_isa(KERNEL.isa)
    flags = [f for f in kernels.DISPATCHED_FLAGS if not f.startswith(("-march", "-mtune"))] + ["-march=x86-64"]
    baseline = kernels.F32Linear(kernels.build(kernels.F32_SOURCE, tuple(flags)))
    assert baseline.supported() == kernel.supported() and baseline.isa == kernel.isa
    x, w = operands(37, (50, 192), 8)
    for isa in baseline.supported():
        out = torch.empty(37, 50)
        baseline.with_isa(isa).linear2(x, w, out)
        torch.testing.assert_close(out, reference(x, w), rtol=1e-4, atol=1e-4)
    assert kernels.compile_flags_for(kernels.F32_SOURCE) == kernels.DISPATCHED_FLAGS
