"""Structured output in the embedded engine, on a tiny random-weight checkpoint.

A random model sampling at temperature 1 is the hardest client a constraint can have: it picks among the allowed
tokens almost at random, so every output that parses and validates here was forced to by the mask alone.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from tests.engine_helpers import collect, final, greedy_request, run_all, sampled_request, tokens
from tests.structured_helpers import check_arithmetic, check_json, check_regex, compiler_for, constrained
from tests.tiny_model import make_tiny_model
from tokenloop.bench.structured_cases import ARITHMETIC_GRAMMAR, REGEXES, SCHEMAS
from tokenloop.core.request import FinishReason, OutputParams
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine

PROMPT = [5, 17, 99, 3, 250, 7, 42]
SEEDS = range(20)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama-structured"), "llama")


@pytest.fixture(scope="module")
def compiler(checkpoint):
    return compiler_for(checkpoint)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_dir(checkpoint)


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = Engine.from_dir(checkpoint, EngineConfig(kv_cache_tokens=65536, max_num_tokens=512, max_batch_size=256))
    yield eng
    eng.shutdown()


def check_output(kind: str, spec: str, text: str) -> None:
    if kind == "json_schema":
        check_json(text, json.loads(spec))
    elif kind == "regex":
        check_regex(text, spec)
    else:
        check_arithmetic(text)


def outputs(engine, tokenizer, requests):
    """(text, finish reason) of every sequence of every request, in order."""
    ids, steps = run_all(engine, requests, timeout=300)
    out = []
    for rid, request in zip(ids, requests):
        for seq in range(request.n):
            got = steps[(rid, seq)]
            assert final(got).error is None, final(got).error
            out.append((tokenizer.decode(tokens(got)), final(got).finish_reason))
    return out


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_sampled_output_of_a_schema_validates(engine, compiler, tokenizer, name):
    schema = SCHEMAS[name]
    requests = [constrained(compiler, "json_schema", schema, PROMPT, seed=seed) for seed in SEEDS]
    results = outputs(engine, tokenizer, requests)
    for text, reason in results:
        check_json(text, schema)
        assert reason == FinishReason.STRUCTURE_COMPLETE, (text, reason)


def test_json_object_outputs_are_objects(engine, compiler, tokenizer):
    requests = [constrained(compiler, "json_object", "", PROMPT, seed=seed, max_new_tokens=64) for seed in SEEDS]
    for text, reason in outputs(engine, tokenizer, requests):
        if reason == FinishReason.STRUCTURE_COMPLETE:  # a random model may nest deeper than 64 tokens
            assert isinstance(json.loads(text), dict)
        else:
            assert reason == FinishReason.LENGTH and text.startswith("{")


@pytest.mark.parametrize("name", list(REGEXES))
def test_every_sampled_output_of_a_regex_fullmatches(engine, compiler, tokenizer, name):
    pattern = REGEXES[name]
    requests = [constrained(compiler, "regex", pattern, PROMPT, seed=seed) for seed in SEEDS]
    for text, reason in outputs(engine, tokenizer, requests):
        check_regex(text, pattern)
        assert reason in (FinishReason.STRUCTURE_COMPLETE, FinishReason.EOS)


def test_arithmetic_grammar_outputs_are_expressions(engine, compiler, tokenizer):
    requests = [constrained(compiler, "grammar", ARITHMETIC_GRAMMAR, PROMPT, seed=seed) for seed in SEEDS]
    results = outputs(engine, tokenizer, requests)
    for text, _ in results:
        check_arithmetic(text)
    assert any(set("+-*/") & set(text) for text, _ in results)


def test_n_sequences_each_have_their_own_matcher(engine, compiler, tokenizer):
    schema = SCHEMAS["array_of_objects"]
    results = outputs(engine, tokenizer, [constrained(compiler, "json_schema", schema, PROMPT, seed=3, n=6)])
    assert len(results) == 6 and len({text for text, _ in results}) > 1
    for text, _ in results:
        check_json(text, schema)


def test_max_new_tokens_mid_structure_ends_with_length(engine, compiler, tokenizer):
    (text, reason), = outputs(engine, tokenizer, [
        constrained(compiler, "json_schema", SCHEMAS["nested_object"], PROMPT, seed=1, max_new_tokens=3)])
    assert reason == FinishReason.LENGTH
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_ignore_eos_never_ends_on_eos(engine, compiler, tokenizer):
    requests = [constrained(compiler, "regex", REGEXES["word_list"], PROMPT, seed=seed, ignore_eos=True)
                for seed in SEEDS]
    for text, reason in outputs(engine, tokenizer, requests):
        check_regex(text, REGEXES["word_list"])
        assert reason == FinishReason.STRUCTURE_COMPLETE


def test_min_new_tokens_holds_eos_back_but_not_a_complete_structure(engine, compiler, tokenizer):
    for seed in SEEDS:
        request = constrained(compiler, "regex", REGEXES["word_list"], PROMPT, seed=seed, min_new_tokens=6)
        ids, steps = run_all(engine, [request])
        got = steps[(ids[0], 0)]
        assert len(tokens(got)) >= 6 or final(got).finish_reason == FinishReason.STRUCTURE_COMPLETE


def test_logprobs_are_renormalized_over_the_allowed_tokens(engine, compiler, tokenizer):
    request = replace(constrained(compiler, "json_schema", SCHEMAS["enums"], PROMPT, seed=0),
                      output=OutputParams(logprobs=True, top_logprobs=20))
    ids, steps = run_all(engine, [request])
    got = steps[(ids[0], 0)]
    first = got[0]
    alternatives = first.top_logprobs[0]
    assert 0 < len(alternatives) < 20  # only the tokens that can start `{"color": ...` are possible
    assert sum(torch.tensor([lp for _, lp in alternatives]).exp()) == pytest.approx(1.0, abs=1e-4)
    assert all(tokenizer.decode([t]).startswith("{") for t, _ in alternatives)
    check_json(tokenizer.decode(tokens(got)), SCHEMAS["enums"])


def test_cancel_mid_structure_and_keep_serving(engine, compiler, tokenizer):
    slow = constrained(compiler, "json_schema", SCHEMAS["recursive_ref"], PROMPT, seed=5, n=2)
    rid = engine.enqueue(slow)
    engine.cancel(rid)
    steps = collect(engine, {rid: 2})
    assert {final(s).finish_reason for s in steps.values()} == {FinishReason.CANCELLED}
    assert engine.num_requests == 0  # the sequences, and their matchers, are gone
    (text, reason), = outputs(engine, tokenizer, [constrained(compiler, "regex", REGEXES["phone"], PROMPT)])
    check_regex(text, REGEXES["phone"])


def test_preemption_recomputes_without_advancing_the_matcher_twice(checkpoint, compiler, tokenizer):
    """A KV cache too small for every sequence at once: sequences are preempted and recomputed mid-structure, and
    greedy outputs are the same as in a roomy cache."""
    schema = SCHEMAS["array_of_objects"]
    requests = [constrained(compiler, "json_schema", schema, [7 + i] * 40, temperature=0.0, max_new_tokens=150,
                            request_id=f"p{i}") for i in range(8)]
    results = {}
    for tokens_in_cache in (65536, 192):
        eng = Engine.from_dir(checkpoint, EngineConfig(kv_cache_tokens=tokens_in_cache, block_size=16,
                                                       max_num_tokens=512, max_batch_size=64))
        try:
            results[tokens_in_cache] = outputs(eng, tokenizer, requests)
            preemptions = eng.stats().num_preemptions
        finally:
            eng.shutdown()
    assert preemptions > 0
    assert results[192] == results[65536]
    for text, reason in results[192]:
        assert reason == FinishReason.STRUCTURE_COMPLETE
        check_json(text, schema)


def test_mixed_batch_of_16_and_free_greedy_rows_equal_transformers(checkpoint, compiler, tokenizer):
    """16 requests at once: 8 free greedy, 2 free sampled, 6 constrained. The free greedy ones are token-for-token
    transformers' greedy output (float64 on both sides, as test_engine_vs_hf's batch), the constrained ones valid."""
    transformers = pytest.importorskip("transformers")
    from tests.engine_helpers import hf_greedy

    free = [greedy_request([11 + i, 40 + 3 * i, 7, 99 - i], 48) for i in range(8)]
    sampled = [sampled_request([30 + i, 12], seed=i, max_new_tokens=48) for i in range(2)]
    cases = [("json_schema", SCHEMAS[n]) for n in ("flat_object", "ref_defs", "any_of", "tool_call")]
    cases += [("regex", REGEXES["ipv4"]), ("grammar", ARITHMETIC_GRAMMAR)]
    guided = [constrained(compiler, kind, spec, [20 + i, 5, 6], seed=i, temperature=1.0 if i % 2 else 0.0)
              for i, (kind, spec) in enumerate(cases)]
    requests = [free[0], guided[0], free[1], sampled[0], guided[1], free[2], guided[2], free[3], free[4], guided[3],
                sampled[1], free[5], guided[4], free[6], guided[5], free[7]]
    eng = Engine.from_dir(checkpoint, EngineConfig(dtype="float64", kv_cache_tokens=8192, max_num_tokens=96,
                                                   max_batch_size=16))
    try:
        ids, steps = run_all(eng, requests, timeout=300)
    finally:
        eng.shutdown()
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()
    for rid, request in zip(ids, requests):
        got = tokens(steps[(rid, 0)])
        if request.structured is None and request.sampling.greedy:
            assert got == hf_greedy(hf, list(request.prompt_token_ids), 48)
        elif request.structured is not None:
            check_output(request.structured.kind, request.structured.spec, tokenizer.decode(got))
