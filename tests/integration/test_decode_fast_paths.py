"""The engine's per-step fast paths against the general paths they stand in for, switched off: runner.prepare's fast
path (a plain-decode step's batch, reused while its shape stays; off: `fast=False`), Model.forward's fused step over
reused rows (Model.fused_rows; off: `fuse_decode` False, the layer loop over fresh tensors) and the sampler's
plain-greedy rows (Sequence.argmax_from; off: sample_row for every row). On a tiny int4 checkpoint, one mix of requests, admitted in two waves so that prefill chunks, mixed
steps and decode-only steps of changing sizes alternate, gives the same Steps (tokens, log probabilities, finish
reasons) and the same stats both ways."""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest

from tests.engine_helpers import greedy_request, sampled_request, with_output
from tests.tiny_model import make_tiny_model
from tokenloop.core.executor import Step
from tokenloop.engine import kernels, runner, sequence
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.quant_routes import ROUTE_ENV

needs_kernels = pytest.mark.skipif(kernels.load_ops() is None or kernels.load_paged_attention() is None
                                   or kernels.load_int4() is None, reason="no C compiler here: the torch path serves")


def requests(wave: int) -> list:
    prompt = [5 + wave, 17, 99, 3, 250, 7, 42, 11, 64, 128, 9][:7 + 2 * wave]
    return [
        greedy_request(prompt, 24),  # plain greedy: the fast row from its first token
        greedy_request(prompt[::-1], 20, ignore_eos=False, min_new_tokens=4),  # EOS held back for 4 tokens
        with_output(greedy_request(prompt[2:], 18), logprobs=True, top_logprobs=2),
        dataclasses.replace(greedy_request(prompt[1:], 16), sampling=dataclasses.replace(
            greedy_request(prompt).sampling, repetition_penalty=1.3)),
        sampled_request(prompt, seed=11 + wave, max_new_tokens=22, n=2, top_k=20),
    ]


def run(tmp_path, fast: bool) -> tuple[list[Step], object, list[str]]:
    checkpoint = make_tiny_model(tmp_path / ("fast" if fast else "general"), "llama", tied=False, num_layers=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ROUTE_ENV, f"int4-{kernels.load_int4().isa}")  # an exact C route, without timing the routes
        engine = Engine(checkpoint, EngineConfig(weights="int4", kv_cache_tokens=1024, block_size=8,
                                                 max_num_tokens=32), start=False)
    fast_calls, steps = [], []
    with pytest.MonkeyPatch.context() as patch:
        if fast:
            real, fused = runner.prepare, engine.model.ops.decode_step

            def prepare(*args, **kwargs):
                batch, samplers = real(*args, **kwargs)
                if batch is engine.model.reused_batch.batch:  # the fast path's batch
                    fast_calls.append("batch")
                return batch, samplers
            patch.setattr(runner, "prepare", prepare)
            patch.setattr(engine.model.ops, "decode_step", lambda *args: fast_calls.append("fused") or fused(*args))
        else:
            patch.setattr(runner, "prepare", partial(runner.prepare, fast=False))
            patch.setattr(sequence, "plain_greedy_from", lambda request: None)
            engine.model.fuse_decode = False
        for wave in range(2):
            for request in requests(wave):
                engine.enqueue(request)
            engine.apply()
            for _ in range(12 if wave == 0 else 1000):
                if not engine.scheduler.has_work():
                    break
                engine.step()
                steps += engine.await_responses(0)  # this step's: one per sequence, so none merged
    stats = dataclasses.replace(engine.stats(), step_latency_s=0.0)
    engine.shutdown()
    return steps, stats, fast_calls


@needs_kernels
def test_the_fast_paths_give_the_general_paths_steps_and_stats(tmp_path):
    fast, fast_stats, calls = run(tmp_path, fast=True)
    general, general_stats, _ = run(tmp_path, fast=False)
    assert calls.count("batch") > 20 and calls.count("fused") > 20  # most decode steps took both
    assert len(fast) > 200 and sum(s.is_final for s in fast) == 12 and not any(s.error for s in fast)
    assert any(s.logprobs for s in fast) and any(s.top_logprobs for s in fast)
    assert fast == general
    assert fast_stats == general_stats
