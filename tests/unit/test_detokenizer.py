"""Incremental detokenization and stop strings: emoji, CJK, leading spaces, matches across tokens."""

import pytest

from tokenloop.bench.null_executor import sample_token_ids
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.looper.detokenizer import IncrementalDetokenizer, StopMatcher, is_byte_level, run_texts, token_texts

TEXTS = [
    "Emoji time: 😀 🚀 👩‍💻 🎉 and more 😀😀.",
    "東京は日本の首都です。我喜欢机器学习。",
    " The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, then\nnew lines\n\n and tabs\t.",
    "mixed: Paris 🇫🇷 東京 hello 😀!",
]


@pytest.fixture(params=["tokenizer_dir", "metaspace_dir"])
def tok(request):
    return Tokenizer.from_dir(request.getfixturevalue(request.param))


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_deltas_rebuild_the_text(tok, text):
    prompt = tok.encode("Hello world")
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push([t]) for t in ids]
    out = "".join(deltas) + detok.flush()
    # the reference: what the whole sequence decodes to, past the prompt's text
    assert out == tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert all("\ufffd" not in d for d in deltas), "an incomplete UTF-8 sequence leaked"


def test_emoji_split_across_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🦀")
    assert len(ids) > 1, "the tiny tokenizer should split this emoji into byte tokens"
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"))
    assert [detok.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push([ids[-1]]) == "🦀"


def test_leading_space_of_first_generated_token_survives(metaspace_dir):
    tok = Tokenizer.from_dir(metaspace_dir)
    prompt = tok.encode("The capital of France is")
    ids = tok.encode(" Paris")  # metaspace: '▁Paris' decodes to 'Paris' alone
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(detok.push([t]) for t in ids) == " Paris"


def test_multi_token_push_equals_single_pushes(tokenizer):
    ids = tokenizer.encode(TEXTS[0] + TEXTS[1])
    a = IncrementalDetokenizer(tokenizer, [1])
    b = IncrementalDetokenizer(tokenizer, [1])
    one = "".join(a.push([t]) for t in ids) + a.flush()
    many = "".join(b.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + b.flush()
    assert one == many == tokenizer.decode(ids)


def test_special_tokens_skipped_or_kept(tokenizer):
    end = tokenizer.token_to_id("<|im_end|>")
    ids = tokenizer.encode("Hello") + [end]
    skip = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    assert "".join(skip.push([t]) for t in ids) == "Hello"
    assert "".join(keep.push([t]) for t in ids) == "Hello<|im_end|>"


def feed(matcher: StopMatcher, pieces):
    out, matched = [], None
    for p in pieces:
        text, matched = matcher.push(p)
        out.append(text)
        if matched:
            break
    return out, matched


def test_stop_string_across_deltas_never_leaks_partial_match():
    m = StopMatcher(("STOP",))
    out, matched = feed(m, ["Hello S", "T", "O", "P and more"])
    assert matched == "STOP"
    assert "".join(out) == "Hello "
    assert out[0] == "Hello " and out[1] == "" and out[2] == ""


def test_partial_match_that_fails_is_released():
    m = StopMatcher(("STOP",))
    out, matched = feed(m, ["ST", "ar", "t"])
    assert matched is None
    assert out == ["", "STar", "t"]
    assert m.flush() == ""


def test_held_text_is_flushed_at_end():
    m = StopMatcher(("</s>",))
    text, matched = m.push("end </")
    assert (text, matched) == ("end ", None)
    assert m.flush() == "</"


def test_include_stop_string_and_earliest_match():
    m = StopMatcher(("world", "lo w"), include_stop=True)
    text, matched = m.push("Hello world")
    assert (text, matched) == ("Hello w", "lo w")


def test_stop_in_one_delta_cuts_the_rest():
    m = StopMatcher(("\n\n",))
    assert m.push("line one\n\nline two") == ("line one", "\n\n")


def test_no_stops_passes_through():
    assert StopMatcher(()).push("abc") == ("abc", None)


def test_byte_level_fast_path_matches_the_offset_algorithm(tokenizer, metaspace_dir):
    assert is_byte_level(tokenizer)
    assert not is_byte_level(Tokenizer.from_dir(metaspace_dir))
    ids = sample_token_ids(tokenizer)
    fast = IncrementalDetokenizer(tokenizer, [1, 2])
    slow = IncrementalDetokenizer(tokenizer, [1, 2], fast=False)
    for i in range(0, len(ids), 2):
        assert fast.push(ids[i:i + 2]) == slow.push(ids[i:i + 2])
    assert fast.flush() == slow.flush()


def test_token_table_fast_path_matches_the_offset_algorithm(tokenizer):
    """One token per push (the common step) is served from the per-tokenizer table of whole-character tokens;
    emoji and CJK split across byte-level tokens still go through decoding and match the offset algorithm."""
    ids = sample_token_ids(tokenizer)
    slow = IncrementalDetokenizer(tokenizer, [1, 2], fast=False)
    expected = [slow.push([t]) for t in ids] + [slow.flush()]
    table = token_texts(tokenizer, True)
    for _ in range(2):  # the first pass fills the table, the second reads it
        fast = IncrementalDetokenizer(tokenizer, [1, 2])
        assert [fast.push([t]) for t in ids] + [fast.flush()] == expected
    assert table and all("\ufffd" not in text for text in table.values())
    partial = {t for t in ids if "\ufffd" in tokenizer.decode([t])}
    assert partial and not partial & table.keys()  # tokens of part of an emoji or CJK character are never kept
    assert token_texts(tokenizer, False) is not table  # skip_special_tokens=False keeps its own texts


class _CountingHf:
    """A `tokenizers.Tokenizer` stand-in that counts decode calls (the detokenizer's byte-level path calls it)."""

    def __init__(self, hf):
        self.hf, self.decoder, self.calls = hf, hf.decoder, 0

    def decode(self, ids, skip_special_tokens=True):
        self.calls += 1
        return self.hf.decode(ids, skip_special_tokens)


class _CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer, self.hf = tokenizer, _CountingHf(tokenizer.hf)

    def decode(self, ids, skip_special_tokens=True):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_characters_split_over_tokens_are_decoded_once_per_tokenizer(tokenizer):
    """Emoji and CJK split over byte-level tokens: each run of unread ids (a character still incomplete, then
    whole) is decoded once and kept per tokenizer, so a later sequence with the same text decodes nothing, and its
    deltas are still what the offset algorithm gives."""
    counting = _CountingTokenizer(tokenizer)
    ids = sample_token_ids(tokenizer)
    slow = IncrementalDetokenizer(tokenizer, [1, 2], fast=False)
    expected = [slow.push([t]) for t in ids]
    first = IncrementalDetokenizer(counting, [1, 2])
    assert [first.push([t]) for t in ids] == expected
    assert counting.hf.calls > 0
    runs = run_texts(counting, True)
    assert any(text.endswith("\ufffd") for text in runs.values())  # an incomplete character is kept too
    assert any(len(key) > 1 and "\ufffd" not in text for key, text in runs.items())  # and the whole one
    counting.hf.calls = 0
    second = IncrementalDetokenizer(counting, [1, 2])
    assert [second.push([t]) for t in ids] == expected
    assert counting.hf.calls == 0
