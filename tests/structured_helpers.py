"""Helpers for structured-output tests: compile a constraint for a checkpoint, build constrained requests, check."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema

from tests.engine_helpers import final, run_all, tokens
from tokenloop.bench.structured_cases import MAX_NEW_TOKENS, SCHEMAS, arithmetic_value
from tokenloop.core.request import FinishReason, SamplingParams, StoppingParams, StructuredOutput, ValidRequest
from tokenloop.core.structured import GrammarCompiler
from tokenloop.core.tokenizer import ModelCard, Tokenizer


def compiler_for(model_dir: str | Path) -> GrammarCompiler:
    """A GrammarCompiler for the checkpoint in `model_dir` (as the service builds it)."""
    card, tok = ModelCard.from_dir(model_dir), Tokenizer.from_dir(model_dir)
    return GrammarCompiler(tok.to_json(), max(card.vocab_size, tok.vocab_size), card.eos_token_ids)


def constrained(compiler: GrammarCompiler, kind: str, spec, prompt, *, seed: int = 0, temperature: float = 1.0,
                max_new_tokens: int = MAX_NEW_TOKENS, n: int = 1, request_id: str = "c", **stopping) -> ValidRequest:
    """A request for `prompt` token ids under one constraint (a dict spec is a JSON schema), compiled."""
    spec = json.dumps(spec) if isinstance(spec, dict) else spec
    structured = StructuredOutput(kind, spec, compiler.compile(kind, spec))
    return ValidRequest(request_id=request_id, prompt_token_ids=tuple(prompt),
                        sampling=SamplingParams(temperature=temperature, seed=seed),
                        stopping=StoppingParams(max_new_tokens=max_new_tokens, **stopping), n=n, structured=structured)


def with_structured(request: ValidRequest, structured: StructuredOutput | None) -> ValidRequest:
    return replace(request, structured=structured)


def check_json(text: str, schema: dict) -> None:
    """`text` parses and validates against `schema` (raises otherwise)."""
    jsonschema.validate(json.loads(text), schema)


def check_regex(text: str, pattern: str) -> None:
    assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"


def check_arithmetic(text: str) -> None:
    arithmetic_value(text)  # raises SyntaxError / ValueError when it is not an expression of the grammar


def schemas_agree(engines: list, model_dir: str | Path, names: list[str]) -> None:
    """Greedy decoding under each JSON schema of `names` (SCHEMAS) on every engine: each output ends complete, the
    first validates against its schema, and every engine gives the first's tokens."""
    compiler, tok = compiler_for(model_dir), Tokenizer.from_dir(model_dir)
    for name in names:
        request = constrained(compiler, "json_schema", SCHEMAS[name], [5, 17, 99, 3], temperature=0.0)
        outs = []
        for engine in engines:
            _, steps = run_all(engine, [request])
            (got,) = steps.values()
            assert final(got).error is None and final(got).finish_reason == FinishReason.STRUCTURE_COMPLETE
            outs.append(tokens(got))
        check_json(tok.decode(outs[0]), SCHEMAS[name])
        assert all(out == outs[0] for out in outs), name
