"""engine/guided.py and core/structured.py without a model: bitmasks, logit masking, the compile cache."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenloop.core.structured import GrammarCompiler, GrammarError, describe_error
from tokenloop.core.tokenizer import ModelCard, Tokenizer
from tokenloop.engine import guided


@pytest.fixture(scope="module")
def compiler(tokenizer_dir):
    tok, card = Tokenizer.from_dir(tokenizer_dir), ModelCard.from_dir(tokenizer_dir)
    return GrammarCompiler(tok.to_json(), tok.vocab_size, card.eos_token_ids, cache_size=2)


def seq(grammar, prefix: str = "", tokenizer=None):
    matcher = grammar.matcher()
    if prefix:
        assert matcher.consume_tokens(tokenizer.encode(prefix))
    return SimpleNamespace(matcher=matcher, request=SimpleNamespace(structured=SimpleNamespace(grammar=grammar)))


def allowed_by_library(matcher, vocab: int) -> set[int]:
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:vocab]).tolist())


def test_forbidden_tokens_is_the_complement_of_the_library_mask_and_pads(compiler, tokenizer):
    grammar = compiler.compile("regex", "(cat|dog)s?")
    matcher = grammar.matcher()
    vocab = compiler.vocab_size
    forbidden = guided.forbidden_tokens([matcher], grammar.num_mask_words, vocab + 40)  # logits wider than vocab
    assert forbidden.shape == (1, vocab + 40) and forbidden[0, vocab:].all()
    assert set(np.flatnonzero(~forbidden[0, :vocab]).tolist()) == allowed_by_library(matcher, vocab)
    assert {tokenizer.decode([t]) for t in np.flatnonzero(~forbidden[0])} <= {"c", "ca", "cat", "d", "do", "dog"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_mask_logits_touches_only_constrained_rows(compiler, tokenizer, dtype):
    grammar = compiler.compile("regex", "[0-9]+")
    free = SimpleNamespace(matcher=None)
    seqs = [seq(grammar), free, seq(grammar, "1", tokenizer)]
    logits = torch.randn(3, compiler.vocab_size, dtype=dtype)
    before = logits.clone()
    guided.mask_logits(logits, seqs)
    assert torch.equal(logits[1], before[1])
    for row in (0, 2):
        allowed = allowed_by_library(seqs[row].matcher, compiler.vocab_size)
        finite = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
        assert finite == allowed and all(logits[row, t] == before[row, t] for t in allowed)
    all_rows = [seq(grammar), seq(grammar, "12", tokenizer)]
    logits = torch.randn(2, compiler.vocab_size, dtype=dtype)
    guided.mask_logits(logits, all_rows)  # the one-pass path
    assert set(torch.nonzero(torch.isfinite(logits[1])).flatten().tolist()) == allowed_by_library(
        all_rows[1].matcher, compiler.vocab_size)


def test_a_complete_structure_allows_only_eos_and_advance_reports_refusals(compiler, tokenizer, tokenizer_dir):
    grammar = compiler.compile("regex", "ab")
    done = seq(grammar, "ab", tokenizer)
    assert guided.structure_complete(done)
    eos = ModelCard.from_dir(tokenizer_dir).eos_token_ids
    assert allowed_by_library(done.matcher, compiler.vocab_size) == set(eos)
    fresh = seq(grammar)
    assert "doesn't satisfy the grammar" in guided.advance(fresh, tokenizer.encode("z")[0])
    assert not guided.structure_complete(SimpleNamespace(matcher=None))


def test_cache_is_lru_bounded_and_a_hit_is_the_same_grammar(compiler):
    a = compiler.compile("regex", "a+")
    assert compiler.compile("regex", "a+") is a and compiler.cached("regex", "a+") is a
    compiler.compile("regex", "b+")
    compiler.compile("regex", "c+")  # cache_size 2: "a+" was the least recently used
    assert compiler.cached("regex", "a+") is None and len(compiler) == 2
    assert a.matcher() is not a.template  # each sequence gets its own copy


@pytest.mark.parametrize("kind, spec, message", [
    ("json_schema", '{"type": 5}', "`json_schema` is not a valid JSON schema: "),
    ("json_schema", "null", "`json_schema` is not a valid JSON schema: a JSON schema is a JSON object; got NoneType"),
    ("regex", "(", "`regex` is not a valid regular expression: "),
    ("grammar", "root ::= [a-", "`grammar` is not a valid grammar: "),
    ("structural_tag", json.dumps({"type": "structural_tag", "format": {"type": "tag", "begin": 1}}),
     "`structural_tag` is not a valid structural tag: `begin` must be a str"),
])
def test_compile_errors_name_the_field(compiler, kind, spec, message):
    with pytest.raises(GrammarError) as err:
        compiler.compile(kind, spec)
    assert describe_error(err.value).startswith(message) and "\n" not in describe_error(err.value)


def test_a_constraint_too_costly_to_match_is_refused_at_compile(compiler):
    with pytest.raises(GrammarError, match=r"too costly to match: its first token mask took \d+ ms of CPU "
                                           r"\(the limit is 50 ms\)"):
        compiler.compile("regex", "a{100000}")  # 9 bytes; every step would take ~300 ms
    with pytest.raises(GrammarError, match="recursion limit exceeded"):
        compiler.compile("json_schema", '{"type": "object", "properties": {"a": ' * 80 + "{}" + "}}" * 80)


def test_a_matcher_that_fails_fails_its_row_alone(compiler, tokenizer):
    """The batched mask fails when one matcher does: the rows are then masked one at a time, and only the row
    whose matcher failed is reported (its request fails; the others are masked exactly as in a batch)."""
    grammar = compiler.compile("regex", "[0-9]+")

    class Broken:
        def unsafe_compute_mask_ptr(self, *args):
            raise RuntimeError("matcher state is corrupt")

    broken = SimpleNamespace(matcher=Broken(), request=SimpleNamespace(structured=SimpleNamespace(grammar=grammar)))
    seqs = [seq(grammar), broken, seq(grammar, "1", tokenizer)]
    logits = torch.randn(3, compiler.vocab_size)
    before = logits.clone()
    failures = guided.mask_logits(logits, seqs)
    assert failures == {1: "the structured-output matcher failed: RuntimeError: matcher state is corrupt"}
    assert torch.equal(logits[1], before[1])
    for row in (0, 2):
        finite = set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())
        assert finite == allowed_by_library(seqs[row].matcher, compiler.vocab_size)
    assert guided.mask_logits(torch.randn(2, compiler.vocab_size), [seq(grammar), seq(grammar)]) == {}


def test_a_rule_past_the_row_limit_is_refused_at_compile_not_at_its_first_token(compiler):
    """llguidance checks `max_items_in_row` only once a token is consumed: the probe walks a few tokens."""
    alternatives = " | ".join(f'"w{i}"' for i in range(20000))
    with pytest.raises(GrammarError) as err:
        compiler.compile("grammar", f"start: {alternatives}\n")
    assert describe_error(err.value) == ("`grammar` is not a valid grammar: Parser Error: Current row has 20001 items; "
                                         "max is 2000; consider making your grammar left-recursive if it's "
                                         "right-recursive")
    small = compiler.compile("grammar", 'start: "w1" | "w2" | "w3"\n')  # the same shape, within the limit
    assert small.matcher().consume_tokens(compiler.tokenizer.tokenize_str("w2"))
