"""Helpers shared by the engine tests: build requests, run an Engine until every sequence ends, make a BlockManager
compute tokens as if the model ran them, and transformers' greedy reference."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tokenloop.core.executor import Step
from tokenloop.core.request import OutputParams, SamplingParams, StoppingParams, ValidRequest

if TYPE_CHECKING:
    from tokenloop.engine.block_manager import BlockManager
    from tokenloop.engine.sequence import Sequence


# 16 fixed chat prompts for the default model's tests (weights quality, speculative decoding)
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash table is.",
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Write a short poem about a cat who likes rain.",
    "How do I boil an egg?",
    "Name the planets of the solar system in order.",
    "What does a compiler do?",
    "Suggest a name for a small bakery by the sea.",
    "Summarise the story of Cinderella in one sentence.",
    "What are the health benefits of walking every day?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a polite email declining a meeting invitation.",
]


def greedy_request(prompt, max_new_tokens: int = 64, **stopping) -> ValidRequest:
    """A greedy request for `prompt` token ids that ignores EOS unless told otherwise."""
    stopping.setdefault("ignore_eos", True)
    return ValidRequest(request_id="t", prompt_token_ids=tuple(prompt), sampling=SamplingParams(temperature=0.0),
                        stopping=StoppingParams(max_new_tokens=max_new_tokens, **stopping))


def sampled_request(prompt, seed: int, max_new_tokens: int = 24, n: int = 1, **sampling) -> ValidRequest:
    """A seeded sampling request (temperature 1 unless told otherwise)."""
    return ValidRequest(request_id="s", prompt_token_ids=tuple(prompt),
                        sampling=SamplingParams(seed=seed, **{"temperature": 1.0, **sampling}),
                        stopping=StoppingParams(max_new_tokens=max_new_tokens, ignore_eos=True), n=n)


def with_output(request: ValidRequest, **output) -> ValidRequest:
    return ValidRequest(request.request_id, request.prompt_token_ids, request.sampling, request.stopping,
                        OutputParams(**output), request.n)


def collect(engine, expected: dict[int, int], timeout: float = 120.0) -> dict[tuple[int, int], list[Step]]:
    """Await steps until each request id in `expected` has that many final steps (one per sequence,
    or one error step); returns steps by (request id, seq index)."""
    steps: dict[tuple[int, int], list[Step]] = {}
    open_seqs = dict(expected)
    deadline = time.monotonic() + timeout
    while any(n > 0 for n in open_seqs.values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"sequences still open after {timeout} s: {open_seqs}")
        for step in engine.await_responses(0.5):
            steps.setdefault((step.executor_id, step.seq_index), []).append(step)
            if step.is_final and step.executor_id in open_seqs:
                open_seqs[step.executor_id] = 0 if step.error else open_seqs[step.executor_id] - 1
    return steps


def run_all(engine, requests: list[ValidRequest], timeout: float = 120.0):
    """Enqueue every request at once; returns (ids, steps by (id, seq index))."""
    ids = [engine.enqueue(r) for r in requests]
    return ids, collect(engine, {i: r.n for i, r in zip(ids, requests)}, timeout)


def tokens(steps: list[Step]) -> list[int]:
    return [t for s in steps for t in s.token_ids]


def final(steps: list[Step]) -> Step:
    assert steps[-1].is_final and all(not s.is_final for s in steps[:-1])
    return steps[-1]


def hf_greedy(model, prompt: list[int], num_new: int = 64) -> list[int]:
    """transformers' greedy continuation of `prompt`, EOS ignored."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
                             min_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """Pretend the model ran `n` more tokens of `s`."""
    assert bm.append_slots(s, n)
    s.num_computed_tokens += n
    bm.commit_full_blocks(s)
