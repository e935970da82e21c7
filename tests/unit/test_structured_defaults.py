"""core/structured.py's first-try defaults: what `bounded_schema` fills in where a schema leaves a bound out, and what
the compiled grammar then admits (how many first schemas complete on the default model:
bench/structured_first_try.py)."""

from __future__ import annotations

import json

import pytest

from tokenloop.core.structured import (
    MAX_ITEMS,
    MAX_PROPERTIES,
    MAX_SAFE_INTEGER,
    MAX_STRING_CHARS,
    GrammarCompiler,
    GrammarError,
    bounded_schema,
    schema_text,
)
from tokenloop.core.tokenizer import ModelCard, Tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"]}


def test_each_open_ended_part_gets_its_bound():
    assert bounded_schema(CITY) == {
        "type": "object", "required": ["city", "population"], "additionalProperties": False,
        "properties": {"city": {"type": "string", "maxLength": MAX_STRING_CHARS},
                       "population": {"type": "integer", "maximum": MAX_SAFE_INTEGER, "minimum": -MAX_SAFE_INTEGER}}}
    assert bounded_schema({"type": "number"}) == {"type": "number", "maximum": MAX_SAFE_INTEGER,
                                                  "minimum": -MAX_SAFE_INTEGER, "multipleOf": 1e-6}
    assert bounded_schema({"type": "array", "items": {"type": "boolean"}}) == {
        "type": "array", "items": {"type": "boolean"}, "maxItems": MAX_ITEMS}
    assert bounded_schema({"type": "object"}) == {"type": "object", "maxProperties": MAX_PROPERTIES}


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "additionalProperties": True},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "additionalProperties": {}},
    {"type": "integer", "minimum": 0, "exclusiveMaximum": 10},
    {"type": "number", "multipleOf": 0.5, "maximum": 1e30, "minimum": 0},
    {"type": "string", "pattern": "^[a-z]+$"}, {"type": "string", "format": "date"}, {"enum": ["a", "b"]},
    {"type": "string", "const": "x"}, {"$ref": "#/$defs/x"}, {"type": "array", "maxItems": 1000},
    {"type": "object", "patternProperties": {"^a": {"type": "boolean"}}, "maxProperties": 3},
])
def test_a_bound_the_schema_gives_is_kept(schema):
    assert bounded_schema(schema) == schema


def test_nested_schemas_and_defs_are_bounded_and_the_input_is_not_changed():
    schema = {"$defs": {"tag": {"type": "string"}}, "type": "object",
              "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}},
                             "where": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}}
    sent = json.dumps(schema)
    out = bounded_schema(schema)
    assert json.dumps(schema) == sent
    assert out["$defs"]["tag"]["maxLength"] == MAX_STRING_CHARS
    assert out["properties"]["tags"]["maxItems"] == MAX_ITEMS
    assert out["properties"]["where"]["anyOf"][0]["maximum"] == MAX_SAFE_INTEGER


@pytest.fixture(scope="module")
def admits(tokenizer_dir):
    tok, card = Tokenizer.from_dir(tokenizer_dir), ModelCard.from_dir(tokenizer_dir)
    compiler = GrammarCompiler(tok.to_json(), tok.vocab_size, card.eos_token_ids, cache_size=0)

    def admits(kind: str, spec, text: str) -> bool:
        """Whether the compiled constraint takes `text` whole and is then complete."""
        matcher = compiler.compile(kind, json.dumps(spec) if spec is not None else "").matcher()
        ids = tok.encode(text)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()
    return admits


def test_the_compiled_grammar_admits_what_the_bounds_allow_and_nothing_more(admits):
    assert admits("json_schema", CITY, '{"city": "Paris", "population": 2100000}')
    assert not admits("json_schema", CITY, '{"city": "Paris", "population": 2, "density": 3}')  # an extra key
    assert not admits("json_schema", CITY, '{"city": "Paris", "population": 90071992547409910}')  # 17 digits
    assert not admits("json_schema", CITY, '{"city": "' + "a" * (MAX_STRING_CHARS + 1) + '", "population": 1}')
    allows = {**CITY, "additionalProperties": True}
    assert admits("json_schema", allows, '{"city": "Paris", "population": 2, "density": 3}')
    assert admits("json_schema", {"type": "number"}, "2.5") and not admits("json_schema", {"type": "number"}, "0.1234567")


def test_json_object_is_any_object_with_bounded_keys_and_values(admits):
    assert admits("json_object", None, '{"name": "Ava", "tags": ["a", 1, null], "home": {"city": "Oslo"}, "ok": true}')
    many = "{" + ", ".join(f'"k{i}": {i}' for i in range(MAX_PROPERTIES + 1)) + "}"
    assert not admits("json_object", None, many)
    assert json.loads(schema_text("json_object", ""))["maxProperties"] == MAX_PROPERTIES


# A default never contradicts a bound the schema gives: each of these admitted its value before the defaults, and
# with them llguidance refused the schema ("Unsatisfiable schema: minLength (200) is greater than maxLength (128)",
# a maxLength the client never sent), or admitted no object at all (allOf's parts each closed).
@pytest.mark.parametrize(("schema", "value"), [
    ({"type": "string", "minLength": 200}, "a" * 200),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 20}, list(range(20))),
    ({"type": "object", "minProperties": 10}, {f"k{i}": i for i in range(10)}),
    ({"type": "object", "required": [f"k{i}" for i in range(10)]}, {f"k{i}": i for i in range(10)}),
    ({"type": "array", "prefixItems": [{"type": "integer"}] * 20, "minItems": 20}, list(range(20))),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, {"a": 1, "b": 2}),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]}, {"a": 1, "b": 2}),
    # an object whose anyOf branches add properties: closing it, or a branch, refused the other's keys
    ({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
      "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}]}, {"kind": "x", "a": 1}),
])
def test_a_default_never_makes_a_satisfiable_schema_unsatisfiable(admits, schema, value):
    assert admits("json_schema", schema, json.dumps(value))


def test_the_defaults_stay_where_the_schema_gives_only_a_small_lower_bound():
    assert bounded_schema({"type": "string", "minLength": 3})["maxLength"] == MAX_STRING_CHARS
    assert bounded_schema({"type": "array", "minItems": 2})["maxItems"] == MAX_ITEMS
    assert bounded_schema({"type": "integer", "minimum": 0})["maximum"] == MAX_SAFE_INTEGER
    assert bounded_schema({"anyOf": [CITY]})["anyOf"][0]["additionalProperties"] is False  # alternatives: closed
    # a bound inside `not` would let more through, one inside `if` would change which branch applies: none there
    negated = {"type": "string", "not": {"type": "string", "pattern": "^x"}, "if": {"type": "string"}}
    assert bounded_schema(negated) == {**negated, "maxLength": MAX_STRING_CHARS}
    # a lower bound past the default maximum gets none (llguidance cannot compile a one-sided range that large, but
    # that is the schema as sent: the default no longer says `maximum` < `minimum`)
    assert "maximum" not in bounded_schema({"type": "integer", "minimum": 2**60})
    assert "minimum" not in bounded_schema({"type": "number", "exclusiveMaximum": -(2**60)})


@pytest.mark.parametrize("spec", ['{"items": ' * 5000 + "{}" + "}" * 5000,
                                  '{"type": "array", "items": ' * 900 + "{}" + "}" * 900])
def test_a_schema_nested_past_pythons_recursion_limit_is_a_grammar_error(spec):
    with pytest.raises(GrammarError, match="nested too deeply"):
        schema_text("json_schema", spec)
