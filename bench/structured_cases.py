"""The structured-output cases that the tests sample and the benchmarks compile: a dozen JSON schemas, regexes and
an arithmetic grammar.

Every string, array and number here is bounded (maxLength, maxItems, minimum/maximum, multipleOf for the digits of a
fraction, additionalProperties false),
so that even a random-weight model sampling at temperature 1 reaches the end of the structure within
`MAX_NEW_TOKENS`: an unbounded string is a legal output that such a model may never close.
"""

from __future__ import annotations

MAX_NEW_TOKENS = 320  # enough for every case below, whatever a random model picks

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "flat_object": {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    },
    "nested_object": {
        "type": "object", "additionalProperties": False, "required": ["user"],
        "properties": {"user": {
            "type": "object", "additionalProperties": False, "required": ["name", "address"],
            "properties": {"name": _NAME, "address": {
                "type": "object", "additionalProperties": False, "required": ["city", "zip"],
                "properties": {"city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}},
    },
    "array_of_numbers": {"type": "array", "items": {"type": "integer", "minimum": -99, "maximum": 99},
                         "minItems": 1, "maxItems": 6},
    "array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object", "additionalProperties": False, "required": ["id", "tag"],
                  "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999}, "tag": _NAME}},
    },
    "enums": {
        "type": "object", "additionalProperties": False, "required": ["color", "size", "level"],
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
                       "level": {"enum": [1, 2, 3, None]}},
    },
    "bounded_numbers": {
        "type": "object", "additionalProperties": False, "required": ["temperature", "humidity", "ratio"],
        "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60, "multipleOf": 0.25},
                       "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                       "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1, "multipleOf": 0.125}},
    },
    "optional_keys": {
        "type": "object", "additionalProperties": False, "required": ["id"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "nickname": _NAME,
                       "active": {"type": "boolean"}, "score": {"type": "integer", "minimum": 0, "maximum": 10}},
    },
    "ref_defs": {
        "$defs": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                           "y": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "type": "object", "additionalProperties": False, "required": ["start", "end"],
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
    },
    "recursive_ref": {
        "$defs": {"node": {"type": "object", "additionalProperties": False, "required": ["value"],
                           "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "children": {"type": "array", "maxItems": 2,
                                                       "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node",
    },
    "any_of": {
        "type": "object", "additionalProperties": False, "required": ["result"],
        "properties": {"result": {"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["ok"],
             "properties": {"ok": {"const": True}, "value": {"type": "integer", "minimum": 0, "maximum": 100}}},
            {"type": "object", "additionalProperties": False, "required": ["error"],
             "properties": {"error": {"type": "string", "maxLength": 10}}}]}},
    },
    "string_patterns": {
        "type": "object", "additionalProperties": False, "required": ["code", "date"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                       "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]$"}},
    },
    "tool_call": {
        "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
        "properties": {"name": {"enum": ["get_weather", "get_time"]}, "arguments": {
            "type": "object", "additionalProperties": False, "required": ["city"],
            "properties": {"city": _NAME, "unit": {"enum": ["celsius", "fahrenheit"]},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}}}},
    },
}

# `\d` is any Unicode digit in llguidance's (Rust) regex syntax, as in Python's: ASCII digits are [0-9].
REGEXES: dict[str, str] = {
    "phone": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
    "yes_no": r"(yes|no)(, because [a-z ]{1,20})?",
    "word_list": r"[a-z]{1,8}(,[a-z]{1,8}){0,4}",
}

# Arithmetic expressions in GBNF (llama.cpp's dialect, root rule `root`), bounded so that a random model ends them.
ARITHMETIC_GRAMMAR = r"""
root   ::= expr
expr   ::= term (("+" | "-") term){0,3}
term   ::= factor (("*" | "/") factor){0,2}
factor ::= number | "(" expr ")"
number ::= [1-9] [0-9]{0,2}
"""


def arithmetic_value(text: str) -> float:
    """Evaluate an output of ARITHMETIC_GRAMMAR (it holds only digits, + - * / and parentheses)."""
    if set(text) - set("0123456789+-*/()"):
        raise ValueError(f"not an arithmetic expression: {text!r}")
    return eval(text, {"__builtins__": {}}, {})  # noqa: S307 - the character set is checked above


# One schema the engine benchmark constrains every stream with: an array of records long enough that the
# streams run to max_new_tokens inside the structure, so that constrained and free runs decode the same tokens.
BENCH_SCHEMA = {
    "type": "array", "minItems": 64,
    "items": {"type": "object", "additionalProperties": False, "required": ["id", "name", "score"],
              "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                             "name": {"type": "string", "maxLength": 16},
                             "score": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.125}}},
}
