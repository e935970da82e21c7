"""core/structural_tag.py: structural tags as routers send them, read into Lark and matched by llguidance."""

from __future__ import annotations

import json

import pytest

from tokenloop.core.structural_tag import StructuralTagError, to_lark
from tokenloop.core.structured import GrammarCompiler
from tokenloop.core.tokenizer import ModelCard, Tokenizer

ARGS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
# what SMG's default tool parser builds (crates/tool_parser: `format` as the discriminator)
SMG = {"format": "triggered_tags", "triggers": ["<tool_call>"],
       "tags": [{"format": "tag", "begin": '<tool_call>\n{"name": "get_weather", "arguments": ',
                 "content": {"format": "json_schema", "schema": ARGS}, "end": "}\n</tool_call>"}],
       "at_least_one": False, "stop_after_first": False}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler(tokenizer_dir):
    tok, card = Tokenizer.from_dir(tokenizer_dir), ModelCard.from_dir(tokenizer_dir)
    return GrammarCompiler(tok.to_json(), tok.vocab_size, card.eos_token_ids)


def accepts(compiler, tag: dict, text: str) -> bool:
    """Whether `text` is a complete output under the tag."""
    matcher = compiler.compile("structural_tag", json.dumps(tag)).matcher()
    return matcher.consume_tokens(compiler.tokenizer.tokenize_str(text)) and matcher.is_accepting()


def test_text_with_tool_calls_in_between(compiler):
    assert accepts(compiler, SMG, f"Let me look. {CALL} Done.")
    assert accepts(compiler, SMG, "No tool needed.")
    assert accepts(compiler, SMG, f"{CALL}{CALL}")
    assert not accepts(compiler, SMG, CALL.replace('"Paris"', "Paris"))  # arguments must follow their schema


def test_type_discriminator_and_wrapper(compiler):
    wrapped = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f="], "at_least_one": True, "stop_after_first": True,
        "tags": [{"type": "tag", "begin": "<f=get>", "content": {"type": "json_schema", "json_schema": ARGS},
                  "end": "</f>"}]}}
    assert accepts(compiler, wrapped, '<f=get>{"city": "Rome"}</f>')
    assert not accepts(compiler, wrapped, "plain text")  # at_least_one
    assert not accepts(compiler, wrapped, '<f=get>{"city": "Rome"}</f><f=get>{"city": "Rome"}</f>')  # first only


def test_the_older_structures_and_triggers_form(compiler):
    legacy = {"structures": [{"begin": "<fn>", "schema": {"type": "integer"}, "end": "</fn>"}], "triggers": ["<fn"]}
    assert accepts(compiler, legacy, "x <fn>42</fn> y")
    assert not accepts(compiler, legacy, "x <fn>forty</fn>")


def test_sequence_or_const_regex(compiler):
    tag = {"type": "sequence", "elements": [
        {"type": "const_string", "value": "answer: "},
        {"type": "or", "elements": [{"type": "regex", "pattern": "[0-9]+"}, {"type": "const_string", "value": "none"}]}]}
    assert accepts(compiler, tag, "answer: 17") and accepts(compiler, tag, "answer: none")
    assert not accepts(compiler, tag, "answer: x")


@pytest.mark.parametrize("tag, message", [
    ({"type": "qwen_xml_parameter"}, "format type 'qwen_xml_parameter' is not supported"),
    ({"type": "triggered_tags", "triggers": [], "tags": []}, "triggered_tags needs non-empty `triggers`"),
    ({"type": "triggered_tags", "triggers": ["<a"], "tags": [{"begin": "<b>", "content": {"type": "any_text"},
                                                             "end": ""}]},
     "tag begin '<b>' starts with none of the triggers ['<a']"),
    ({"type": "json_schema", "json_schema": ARGS, "style": "qwen_xml"}, "json_schema style 'qwen_xml' is not supported"),
    ({"type": "sequence", "elements": []}, "`elements` must not be empty"),
])
def test_what_cannot_be_read_is_refused_with_a_reason(tag, message):
    with pytest.raises(StructuralTagError, match=message.replace("[", r"\[").replace("]", r"\]")):
        to_lark(json.dumps(tag))
