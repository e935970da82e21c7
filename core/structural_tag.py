"""Structural tags (xgrammar's JSON format, what routers send for tool calls) as Lark grammars llguidance takes.

Two shapes are read:
- `{"type": "structural_tag", "format": F}` (or `{"format": F}`, or F itself), where F is one of
  `const_string {value}`, `json_schema {json_schema | schema}`, `regex {pattern}`, `any_text`,
  `sequence {elements}`, `or {elements}`, `tag {begin, content, end}` and
  `triggered_tags {triggers, tags, at_least_one, stop_after_first}`; the discriminator is `type` (the Shepherd Model
  Gateway writes `format` for it: both are read);
- the older `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` (vLLM, SGLang).
Free text around triggered tags uses llguidance's lazy lexemes: text runs until a trigger appears, then the tag's
grammar applies (the construction of `llguidance.StructTag.to_grammar`). Any other format type is refused.
"""

from __future__ import annotations

import json

TEXT = r"/(.|\n)*/"


class StructuralTagError(ValueError):
    """A structural tag this converter cannot read."""


class _Lark:
    """Collects rules while a format tree is converted."""

    def __init__(self):
        self.rules: list[str] = []

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def convert(self, node) -> str:
        if not isinstance(node, dict):
            raise StructuralTagError(f"a format must be a JSON object; got {json.dumps(node)[:60]}")
        kind = node.get("type", node.get("format"))
        handler = getattr(self, f"_{kind}", None) if isinstance(kind, str) else None
        if handler is None:
            raise StructuralTagError(f"format type {kind!r} is not supported")
        return handler(node)

    def _const_string(self, node) -> str:
        return json.dumps(_field(node, "value", str))

    def _json_schema(self, node) -> str:
        schema = node.get("json_schema", node.get("schema"))
        if not isinstance(schema, (dict, bool)):
            raise StructuralTagError("a json_schema format needs `json_schema` (a JSON schema object)")
        if node.get("style", "json") != "json":
            raise StructuralTagError(f"json_schema style {node['style']!r} is not supported")
        return self.rule("%json " + json.dumps(schema))

    def _regex(self, node) -> str:
        return "/" + _field(node, "pattern", str).replace("/", "\\/") + "/"

    def _any_text(self, node) -> str:
        return self.rule(TEXT)

    def _sequence(self, node) -> str:
        return " ".join(self.convert(e) for e in _elements(node))

    def _or(self, node) -> str:
        return self.rule(" | ".join(self.convert(e) for e in _elements(node)))

    def _tag(self, node) -> str:
        parts = [json.dumps(_field(node, "begin", str)), self.convert(node.get("content")),
                 json.dumps(_field(node, "end", str))]
        return " ".join(p for p in parts if p != '""')

    def _triggered_tags(self, node) -> str:
        triggers = _field(node, "triggers", list)
        tags = _field(node, "tags", list)
        if not triggers or not tags or not all(isinstance(t, str) and t for t in triggers):
            raise StructuralTagError("triggered_tags needs non-empty `triggers` (strings) and `tags`")
        options = []
        for tag in tags:
            begin = _field(tag, "begin", str)
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise StructuralTagError(f"tag begin {begin!r} starts with none of the triggers {triggers}")
            head = self.rule(f"TEXT {json.dumps(trigger)}", lazy=True)
            rest = [json.dumps(begin[len(trigger):]), self.convert(tag.get("content")), json.dumps(_field(tag, "end", str))]
            options.append(self.rule(" ".join([head] + [p for p in rest if p != '""'])))
        any_tag = self.rule(" | ".join(options))
        if node.get("stop_after_first"):
            return any_tag if node.get("at_least_one") else self.rule(f"{any_tag} | TEXT")
        return self.rule(f"{any_tag}+ TEXT" if node.get("at_least_one") else f"{any_tag}* TEXT")


def _field(node, name: str, kind: type):
    value = node.get(name) if isinstance(node, dict) else None
    if not isinstance(value, kind):
        raise StructuralTagError(f"`{name}` must be a {kind.__name__}")
    return value


def _elements(node) -> list:
    elements = _field(node, "elements", list)
    if not elements:
        raise StructuralTagError("`elements` must not be empty")
    return elements


def _legacy(tag: dict) -> dict:
    """{"structures", "triggers"} -> the triggered_tags format."""
    tags = [{"type": "tag", "begin": s.get("begin"), "content": {"type": "json_schema", "json_schema": s.get("schema")},
             "end": s.get("end")} for s in _field(tag, "structures", list)]
    return {"type": "triggered_tags", "triggers": tag.get("triggers"), "tags": tags}


def to_lark(spec: str) -> str:
    """The Lark grammar (start rule `start`) for a structural tag in JSON text; raises StructuralTagError."""
    try:
        tag = json.loads(spec)
    except ValueError as exc:
        raise StructuralTagError(f"not JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise StructuralTagError("a structural tag is a JSON object")
    if "structures" in tag:
        root = _legacy(tag)
    elif tag.get("type") == "structural_tag" or isinstance(tag.get("format"), dict):
        root = tag.get("format")
    else:
        root = tag
    lark = _Lark()
    start = lark.convert(root)
    return "\n".join(["%llguidance {}", f"start: {start}", f"TEXT: {TEXT}", *lark.rules]) + "\n"
