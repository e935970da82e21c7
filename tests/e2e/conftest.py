"""Fixtures shared by the e2e tests (helpers that are not fixtures live in live_server.py, tools.py, gateway.py)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.e2e import gemma3
from tests.e2e.tools import BUF_PREFIX, BUF_VERSION


@pytest.fixture(scope="module")
def buf() -> str:
    """The buf binary: on PATH, in .cache/buf, or installed there from npm now."""
    found = shutil.which("buf")
    local = BUF_PREFIX / "node_modules" / ".bin" / "buf"
    if found:
        return found
    if not local.exists():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("neither buf nor npm is installed")
        done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(BUF_PREFIX),
                               f"@bufbuild/buf@{BUF_VERSION}"], check=False, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not local.exists():
            pytest.skip(f"could not install @bufbuild/buf from npm: {done.stderr[-500:]}")
    return str(local)


@pytest.fixture(scope="module")
def gguf():
    """Gemma 3 270M's GGUF file (tests/e2e/gemma3.py), fetched where it is missing."""
    return gemma3.fetch()
