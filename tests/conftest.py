"""Shared fixtures: tiny tokenizer directories, a scripted executor, an in-process server on loopback."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.tiny_tokenizer import write_tokenizer_dir  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A checkpoint-shaped directory with a byte-level BPE tokenizer and a ChatML template."""
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok-bytelevel"), "byte_level", max_context=8192)


@pytest.fixture(scope="session")
def metaspace_dir(tmp_path_factory) -> Path:
    """The same with a SentencePiece-style (Metaspace) tokenizer."""
    return write_tokenizer_dir(tmp_path_factory.mktemp("tok-metaspace"), "metaspace")


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from tokenloop.core.tokenizer import Tokenizer
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="session")
def default_model_or_none() -> Path | None:
    """The default model's directory when `make model` made it, else None (for tests that use it only if there)."""
    return DEFAULT_MODEL if (DEFAULT_MODEL / "config.json").is_file() else None


@pytest.fixture(scope="session")
def default_model_dir(default_model_or_none) -> Path:
    """The real default model made by `make model`; tests that need it skip when it is absent."""
    if default_model_or_none is None:
        pytest.skip("the default model is not prepared: run `make model`")
    return default_model_or_none


_LOOP: asyncio.AbstractEventLoop | None = None


def run(coro):
    """Run a coroutine on the session's one event loop (tests stay plain functions; no plugin needed).

    One loop for the whole session: grpc.aio binds its I/O engine to the loop it first runs on,
    and a fresh loop per test leaves callbacks of earlier tests' calls pointing at a closed loop.
    """
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    asyncio.set_event_loop(_LOOP)
    return _LOOP.run_until_complete(coro)
