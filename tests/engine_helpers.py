"""Helpers shared by the engine tests: build requests, run an Engine until every sequence ends, make a BlockManager
compute tokens as if the model ran them, transformers' greedy reference, the chat prompts of the default model's
tests, and the float32 copy of a checkpoint that a quantized mode's outputs are compared with."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from pathlib import Path
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


def greedy_batch(engine, batch: list[list[int]], num_new: int = 64, **request) -> list[list[int]]:
    """The greedy tokens of each prompt of `batch`, all enqueued at once (`request`: fields to replace, lora=...)."""
    ids, steps = run_all(engine, [dataclasses.replace(greedy_request(p, num_new), **request) for p in batch])
    return [tokens(steps[(i, 0)]) for i in ids]


@contextlib.contextmanager
def engine_on(checkpoint, backend: str, **config):
    """A float32 Engine on `checkpoint` with `attention_backend=backend` ('native': the C decode kernel, which it
    must have loaded; 'torch': gather + SDPA), shut down afterwards; the test skips where 'native' has no C compiler
    (a kernel that fails to build raises KernelBuildError, not a skip)."""
    import pytest

    from tokenloop.engine.config import EngineConfig
    from tokenloop.engine.engine import Engine
    from tokenloop.engine.kernels import NO_COMPILER

    try:
        engine = Engine.from_dir(checkpoint, EngineConfig(dtype="float32", attention_backend=backend, **config))
    except RuntimeError as exc:
        if backend != "native" or NO_COMPILER not in str(exc):
            raise
        pytest.skip(str(exc))  # no C compiler on this machine
    try:
        assert (engine.model.paged is not None) == (backend == "native")
        yield engine
    finally:
        engine.shutdown()


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


def chat_prompts(model_dir, questions: list[str] = CHAT_QUESTIONS) -> list[list[int]]:
    """Each question as a one-turn chat, rendered with the model's template and tokenized."""
    from tokenloop.core.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]


def served_weights_copy(checkpoint: Path, mode: str, into: Path) -> Path:
    """`into`: a copy of `checkpoint` whose layer matrices and lm_head hold what `--weights mode` serves, dequantized
    (int8: values times scales; int4: 4-bit levels times scales plus minimums; the lm_head int8 in both). A float32
    engine on it computes what the quantized engine does on its exact route, but for float rounding."""
    from safetensors.torch import load_file, save_file

    from tokenloop.engine.quant import qweight, qweight4

    for path in Path(checkpoint).iterdir():
        shutil.copy(path, into / path.name)
    layer = qweight4 if mode == "int4" else qweight
    served = {k: layer(w).dequantize() if k.endswith("_proj.weight") else
              qweight(w).dequantize() if k == "lm_head.weight" else w
              for k, w in load_file(str(Path(checkpoint) / "model.safetensors")).items()}
    save_file(served, str(into / "model.safetensors"), metadata={"format": "pt"})
    return into


def exact_route(mode: str) -> str:
    """The fastest float32-activation C path of `mode` this CPU runs (the torch fallback's name without a compiler)."""
    from tokenloop.engine import kernels

    kernel = kernels.load_int4() if mode == "int4" else kernels.load_int8()
    return f"{mode}-{kernel.isa}" if kernel is not None else "torch-fp32"


@contextlib.contextmanager
def quantized_and_reference(checkpoint: Path, reference: Path, mode: str, adapter: Path, config: dict):
    """(an Engine on `checkpoint` in `mode` on its exact route, a float32 one on `reference`, the checkpoint's
    served_weights_copy), both over a float32 KV cache and each with the LoRA adapter at `adapter` as `a`: the two
    differ only in float rounding, so their greedy tokens agree. Shut down afterwards."""
    import pytest

    from tokenloop.engine.config import EngineConfig
    from tokenloop.engine.engine import Engine
    from tokenloop.engine.quant_routes import ROUTE_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ROUTE_ENV, exact_route(mode))
        quant = Engine.from_dir(checkpoint, EngineConfig(weights=mode, kv_dtype="fp32", **config))
    ref = Engine.from_dir(reference, EngineConfig(weights="fp32", **config))
    try:
        for e in (quant, ref):
            e.add_lora(e.read_lora("a", adapter))
        yield quant, ref
    finally:
        quant.shutdown()
        ref.shutdown()


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """Pretend the model ran `n` more tokens of `s`."""
    assert bm.append_slots(s, n)
    s.num_computed_tokens += n
    bm.commit_full_blocks(s)
