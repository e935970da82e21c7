"""A kernel source that does not compile, where a C compiler exists, fails loudly: kernels.build and every load_*
call raise KernelBuildError with the compiler's message (the engine's start then fails too:
tests/integration/test_broken_kernel.py). Only a machine with no compiler gets None (the torch path), and its tests
skip saying so."""

from __future__ import annotations

import pytest

from tokenloop.engine import kernels

needs_compiler = pytest.mark.skipif(kernels.compiler() is None,
                                    reason=f"this machine has no C compiler ({kernels.NO_COMPILER}): nothing to build")
BROKEN = "int paged_path_supported(int path) { return path }  /* a deliberate syntax error: no ';' */\n"


@pytest.fixture
def broken_source(tmp_path, monkeypatch):
    """paged_attention.c replaced by a source that does not compile, built into an empty cache."""
    source = tmp_path / "src" / "paged_attention.c"
    source.parent.mkdir()
    source.write_text(BROKEN)
    monkeypatch.setenv("TOKENLOOP_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "PAGED_SOURCE", source)
    return source


@needs_compiler
def test_a_source_that_does_not_compile_raises_with_the_compilers_message(broken_source):
    with pytest.raises(kernels.KernelBuildError) as failed:
        kernels.build(broken_source)
    message = str(failed.value)
    assert "paged_attention.c" in message and "error" in message  # the compiler's own diagnostic
    assert not list((broken_source.parent.parent / "cache").glob("*.so"))  # nothing half-built is kept


@needs_compiler
def test_loading_a_broken_kernel_raises_at_every_call_never_none(broken_source):
    for _ in range(2):  # not only the first call: the failure is kept, never turned into "unavailable"
        with pytest.raises(kernels.KernelBuildError, match="paged attention kernel .*failed to build") as failed:
            kernels.load_paged_attention()
        assert "error" in str(failed.value)


def test_no_compiler_gives_none_and_says_why(monkeypatch, tmp_path, caplog):
    """The only case the torch path stands in for a kernel: the machine has no C compiler."""
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    monkeypatch.setattr(kernels, "PAGED_SOURCE", tmp_path / "paged_attention.c")  # a key no other test loaded
    with caplog.at_level("WARNING"):
        assert kernels.load_paged_attention() is None
    assert kernels.NO_COMPILER in caplog.text
    with pytest.raises(RuntimeError, match="no C compiler"):
        kernels.build()


@needs_compiler
def test_a_cache_that_cannot_be_written_names_the_variable_to_set(tmp_path, monkeypatch):
    """A read-only cache directory (a read-only root filesystem, say) is a build failure that says what to do."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would be")
    monkeypatch.setenv("TOKENLOOP_KERNEL_CACHE", str(blocker / "cache"))
    with pytest.raises(kernels.KernelBuildError, match="cannot write the kernel cache .*TOKENLOOP_KERNEL_CACHE"):
        kernels.build(kernels.PAGED_SOURCE)
