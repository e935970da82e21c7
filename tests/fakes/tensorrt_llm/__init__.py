"""A fake `tensorrt_llm` for tests: the Python API surface tokenloop uses, on a scripted model.

Tests put `tests/fakes` on sys.path (and take it off again); nothing else imports this.
"""

from .llmapi import LLM, SamplingParams

__version__ = "1.2.0+fake"
__all__ = ["LLM", "SamplingParams"]
