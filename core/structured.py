"""Structured output: a request's constraint compiled by llguidance, kept in a bounded cache, matched per sequence.

`GrammarCompiler.compile(kind, spec)` turns a `StructuredOutput` (a JSON schema, any JSON object, a regex, a grammar
or a structural tag) into a `Grammar`: an llguidance matcher that has never consumed a token, the template each
sequence's own matcher is copied from (`Grammar.matcher()`). Compiled grammars are cached by their text (LRU), so a
schema sent again is admitted without compiling. Why llguidance and not xgrammar: docs/structured-output.md
(measured by bench/grammar_libs.py).

JSON is laid out as `json.dumps` does by default (`", "` and `": "` between items, no other whitespace): with any
whitespace allowed, a model can emit blanks forever and never finish the value (both libraries, bench/grammar_libs.py).
A JSON schema gets the first-try defaults of `bounded_schema` before it compiles (docs/structured-output.md).
"""

from __future__ import annotations

import collections
import json
import math
import re
import threading
import time
from dataclasses import dataclass

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from .structural_tag import StructuralTagError, to_lark

KINDS = ("json_schema", "json_object", "regex", "grammar", "structural_tag")
# A constraint whose first token mask takes longer than this is refused: every engine step would wait that long
# for its sequences (a 9-byte regex, `a{100000}`, takes ~300 ms a step). The test schemas take 0.1-5 ms. Measured as
# the compiling thread's CPU time: on a loaded machine the wall time of a 1 ms mask reached 64 ms (a descheduled
# compile), and a valid regex was refused.
MAX_FIRST_MASK_S = 0.05
# The compile walks this many tokens into the constraint (the lowest token id allowed at each step): llguidance
# checks its row limit (`max_items_in_row`, 2,000 Earley items) only once a token is consumed, so a Lark rule of
# 20,000 alternatives compiled and computed its first mask fine, then failed the request at its first token.
PROBE_TOKENS = 4
# GBNF is converted to Lark by llguidance's Python converter, whose rule resolution is quadratic in a chain of rules
# (and holds the GIL): 256 rules take at most ~0.25 s, 5,000 took 93 s. Larger grammars are welcome in Lark.
MAX_GBNF_RULES = 256
_GBNF_RULE = re.compile(r"^\s*[A-Za-z0-9_-]+\s*::=", re.MULTILINE)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The first-try defaults (`bounded_schema`), each applied only where the schema leaves that bound out: an object that
# lists its properties admits no other key (OpenAI's strict mode; xgrammar's strict_mode, vLLM's default); an integer
# or number stays within the integers a double holds exactly, 2**53 - 1 (JavaScript's Number.MAX_SAFE_INTEGER); a
# number has at most NUMBER_DECIMALS decimals; a string at most MAX_STRING_CHARS characters, an array at most
# MAX_ITEMS items. Every value the bounded schema admits is valid under the schema as sent.
MAX_SAFE_INTEGER = 2**53 - 1
NUMBER_DECIMALS = 6
MAX_STRING_CHARS = 128
MAX_ITEMS = 16
MAX_PROPERTIES = 8  # an object that lists no properties (`json_object`, `{"type": "object"}`): at most this many keys
ANY_OBJECT = '{"type": "object"}'
# what `json_object` compiles to: any object, its values any JSON value, each bounded as above
_ANY_VALUE = {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "boolean"}, {"type": "null"},
                        {"type": "array", "items": {"$ref": "#/$defs/value"}},
                        {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}}]}
BOUNDED_ANY_OBJECT = {"type": "object", "additionalProperties": {"$ref": "#/$defs/value"}, "$defs": {"value": _ANY_VALUE}}
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "then", "else", "contains", "propertyNames")
# not bounded: a bound inside `not` would let more through, one inside `if` would change which branch applies
# subschemas that describe the same object as the schema they sit in (parts of it, not alternatives to it)
_PARTS = ("anyOf", "oneOf", "allOf", "if", "then", "else", "dependentSchemas")
_WHAT = {"json_schema": "a valid JSON schema", "json_object": "valid", "regex": "a valid regular expression",
         "grammar": "a valid grammar", "structural_tag": "a valid structural tag"}


class GrammarError(ValueError):
    """The constraint does not compile; `kind` is the field at fault, the message the library's words."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def one_line(message: str, limit: int = 400) -> str:
    """A library message (often several lines with a caret) as one bounded line for a gRPC status."""
    text = " | ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    return text if len(text) <= limit else text[:limit] + "..."


def lark_of(kind: str, spec: str) -> str:
    """A `grammar` (GBNF or Lark) or `structural_tag` as a Lark grammar that llguidance takes."""
    if kind == "grammar" and is_lark_syntax(spec):
        return spec
    if kind == "grammar" and (num_rules := len(_GBNF_RULE.findall(spec))) > MAX_GBNF_RULES:
        raise GrammarError(kind, f"it has {num_rules} GBNF rules; at most {MAX_GBNF_RULES} are converted (send "
                                 "larger grammars in Lark, llguidance's own syntax)")
    try:
        return gbnf_to_lark(spec) if kind == "grammar" else to_lark(spec)
    except StructuralTagError as exc:
        raise GrammarError(kind, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the GBNF converter raises its own error types
        raise GrammarError(kind, f"{type(exc).__name__}: {exc}") from None


def bounded_schema(schema, close: bool | None = None):
    """`schema` (parsed JSON) with the first-try defaults filled in where it leaves a bound out (see MAX_SAFE_INTEGER
    above): a new dict, the input untouched. A bound the schema gives is kept, so is `additionalProperties: true`;
    a default never contradicts a bound the schema gives (a `minLength` of 200 gets a `maxLength` of 200, not 128),
    so a schema that admits a value still admits one. `close`: whether objects that list properties are closed
    (None: unless the schema has an `allOf`, whose parts, each closed, would admit no object together)."""
    if not isinstance(schema, dict):
        return schema
    if close is None:
        close = not _mentions(schema, "allOf")
    out = dict(schema)
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    is_object = "object" in types or "properties" in out
    # an object whose anyOf / oneOf / if-then-else add properties: closed, it or its parts would refuse the others'
    parts_close = close and not (is_object and any(key in out for key in _PARTS))
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            sub_close = parts_close if key in _PARTS else close
            out[key] = {name: bounded_schema(sub, sub_close) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_schema(sub, parts_close if key in _PARTS else close) for sub in out[key]]
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = bounded_schema(out[key], parts_close if key in _PARTS else close)
    if "enum" in out or "const" in out or "$ref" in out:
        return out
    if is_object:
        _bound_object(out, parts_close)
    if types & {"integer", "number"}:
        low = max((v for v in (_number(out.get("minimum")), _number(out.get("exclusiveMinimum"))) if v is not None),
                  default=None)
        high = min((v for v in (_number(out.get("maximum")), _number(out.get("exclusiveMaximum"))) if v is not None),
                   default=None)
        if "maximum" not in out and "exclusiveMaximum" not in out and (low is None or low < MAX_SAFE_INTEGER):
            out["maximum"] = MAX_SAFE_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out and (high is None or high > -MAX_SAFE_INTEGER):
            out["minimum"] = -MAX_SAFE_INTEGER
        if "number" in types and "integer" not in types and "multipleOf" not in out:
            out["multipleOf"] = 10.0**-NUMBER_DECIMALS
    if "string" in types and not {"maxLength", "pattern", "format"} & out.keys():
        out["maxLength"] = max(MAX_STRING_CHARS, _count(out.get("minLength")))
    if "array" in types and "maxItems" not in out and not isinstance(out.get("items"), bool):
        prefix = out.get("prefixItems")
        out["maxItems"] = max(MAX_ITEMS, _count(out.get("minItems")), len(prefix) if isinstance(prefix, list) else 0)
    return out


def _bound_object(schema: dict, close: bool) -> None:
    properties = schema.get("properties")
    if properties:
        required = schema.get("required")
        # a required key the schema does not list is allowed only as an extra key: closing would forbid it
        unlisted = isinstance(required, list) and any(name not in properties for name in required)
        if close and not unlisted and \
                not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & schema.keys():
            schema["additionalProperties"] = False
    elif "maxProperties" not in schema:  # keys of any name: as many as a model wants, unless bounded
        required = schema.get("required")
        schema["maxProperties"] = max(MAX_PROPERTIES, _count(schema.get("minProperties")),
                                      len(required) if isinstance(required, list) else 0)


def _number(value) -> float | None:
    """A numeric bound's value; None for none (or a draft-4 boolean `exclusiveMinimum`)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _count(value) -> int:
    """A `minLength` / `minItems` / `minProperties` as an int (0 when absent or not a number)."""
    number = _number(value)
    return int(number) if number is not None and math.isfinite(number) else 0


def _mentions(schema, key: str) -> bool:
    """Whether `key` is a key anywhere in `schema` (parsed JSON)."""
    if isinstance(schema, dict):
        return key in schema or any(_mentions(v, key) for v in schema.values())
    if isinstance(schema, list):
        return any(_mentions(v, key) for v in schema)
    return False


def schema_text(kind: str, spec: str) -> str:
    """The JSON schema the server compiles for a `json_schema` or `json_object` constraint: the schema sent (or any
    object) with the first-try defaults (`bounded_schema`). Raises GrammarError when the spec is not a JSON object."""
    if kind == "json_object":
        return json.dumps(bounded_schema(BOUNDED_ANY_OBJECT))
    try:
        schema = json.loads(spec)
        if not isinstance(schema, dict):
            raise GrammarError(kind, f"a JSON schema is a JSON object; got {type(schema).__name__}")
        return json.dumps(bounded_schema(schema))
    except GrammarError:
        raise
    except ValueError as exc:
        raise GrammarError(kind, f"not JSON: {exc}") from None
    except RecursionError:  # Python's parser and `bounded_schema` recurse once per level (llguidance stops sooner)
        raise GrammarError(kind, "the schema is nested too deeply") from None


def grammar_text(kind: str, spec: str) -> str:
    """The llguidance grammar for one constraint; raises GrammarError for a spec that is not even well formed."""
    try:
        return _grammar_text(kind, spec)
    except GrammarError:
        raise
    except ValueError as exc:  # the library's own (e.g. "recursion limit exceeded" for a deeply nested schema)
        raise GrammarError(kind, str(exc)) from None


def _grammar_text(kind: str, spec: str) -> str:
    if kind in ("json_schema", "json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(schema_text(kind, spec), overrides=JSON_LAYOUT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind in ("grammar", "structural_tag"):
        return llguidance.LLMatcher.grammar_from_lark(lark_of(kind, spec))
    raise GrammarError(kind, f"unknown kind {kind!r}; one of {', '.join(KINDS)}")


@dataclass(frozen=True, eq=False, slots=True)
class Grammar:
    """A compiled constraint: `matcher()` gives a fresh llguidance matcher for one sequence."""

    kind: str
    template: llguidance.LLMatcher  # never advanced; only copied
    vocab_size: int  # the bitmask covers this many token ids

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()

    @property
    def num_mask_words(self) -> int:
        """int32 words of one sequence's token bitmask."""
        return (self.vocab_size + 31) // 32


class GrammarCompiler:
    """Compiles constraints for one tokenizer, keeping the `cache_size` most recently used (thread-safe)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...], cache_size: int = 256):
        eos = list(eos_token_ids) or None
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self.cache_size = max(0, cache_size)
        self._cache: collections.OrderedDict[tuple[str, str], Grammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def cached(self, kind: str, spec: str) -> Grammar | None:
        """The compiled grammar for (kind, spec) when it is in the cache (and mark it recently used)."""
        with self._lock:
            grammar = self._cache.get((kind, spec))
            if grammar is not None:
                self._cache.move_to_end((kind, spec))
            return grammar

    def compile(self, kind: str, spec: str, text: str | None = None) -> Grammar:
        """Compile (llguidance releases the GIL meanwhile) and cache; raises GrammarError naming the library's
        reason. Call it off the event loop: a large schema takes milliseconds to seconds. `text`: the spec's
        `grammar_text`, when a compile process already made it (a GBNF conversion holds the GIL)."""
        grammar = self.cached(kind, spec)
        if grammar is not None:
            return grammar
        matcher = llguidance.LLMatcher(self.tokenizer, text or grammar_text(kind, spec), log_level=0)
        grammar = Grammar(kind, matcher, self.vocab_size)
        self._probe(grammar)
        with self._lock:
            self.num_compiled += 1
            if self.cache_size:
                self._cache[(kind, spec)] = grammar
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return grammar

    def _probe(self, grammar: Grammar) -> None:
        """Walk the first PROBE_TOKENS tokens here, off the engine thread: it warms the lexer states every copy
        shares, and a constraint too costly to match (MAX_FIRST_MASK_S a mask) or past llguidance's row limit is
        refused at admission, before it can slow every step or fail mid-generation."""
        matcher = grammar.template.deep_copy()
        mask = np.zeros(grammar.num_mask_words, dtype=np.int32)
        for step in range(PROBE_TOKENS):
            if matcher.is_error() or matcher.is_stopped():
                break
            start = time.thread_time()  # llguidance computes one mask on the calling thread
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            elapsed = time.thread_time() - start
            if elapsed > MAX_FIRST_MASK_S:
                which = "first token mask" if step == 0 else f"token mask {step + 1}"
                raise GrammarError(grammar.kind, f"too costly to match: its {which} took {elapsed * 1e3:.0f} ms of CPU (the "
                                                 f"limit is {MAX_FIRST_MASK_S * 1e3:.0f} ms)")
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
            if matcher.is_error() or not len(allowed):
                break
            matcher.consume_token(int(allowed[0]))
        if matcher.is_error():  # the library's reason, without the parser state dump that follows it
            raise GrammarError(grammar.kind, matcher.get_error().split("<state>")[0].strip())

    def __len__(self) -> int:
        return len(self._cache)


def describe_error(exc: GrammarError) -> str:
    """`GrammarError` as a client message: the field, what it should be, and the library's words."""
    return f"`{exc.kind}` is not {_WHAT.get(exc.kind, 'valid')}: {one_line(str(exc))}"
