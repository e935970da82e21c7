"""Incremental detokenization and stop strings, per sequence.

Decoding token by token breaks multi-byte characters (emoji, CJK split across byte-level
tokens) and drops SentencePiece leading spaces (TGI #131). We keep two offsets into the
sequence's ids, as TGI and vLLM do: text is decoded from `prefix_offset` (a few tokens of
context) and only the part past `ids[prefix_offset:read_offset]` is new. A delta that ends in
U+FFFD (an incomplete UTF-8 sequence) is held until the next token completes it.

Byte-level BPE tokenizers (GPT-2 style, SmolLM2, Llama 3) decode by concatenating bytes, so once
the ids read so far decoded cleanly, the new text is just the decoding of the new ids: those
take a fast path that decodes only the unread ids, once per push, with no context re-decoded.
The commonest push, one token after a clean read, does not decode at all: the text of each single
token that decodes to whole characters is kept in a table shared by every sequence on the tokenizer. A character
split over a few tokens (CJK, emoji, accents) is read the same way: the decoding of each short run of unread ids
(up to `_MAX_RUN`, whole or still incomplete) is kept in a second table, so a character seen before is not decoded
again.
"""

from __future__ import annotations

import weakref
from typing import Protocol

_CONTEXT_TOKENS = 5  # prompt tokens used as decoding context for the first generated token


class Decoder(Protocol):
    def decode(self, ids, skip_special_tokens: bool = True) -> str: ...


_BYTE_LEVEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> decodes by concatenation


def is_byte_level(tokenizer: Decoder) -> bool:
    """True when the tokenizer's decoder is plain byte-level BPE (decode(a + b) == decode(a) + decode(b)
    whenever `a` ends on a character boundary)."""
    try:
        return _BYTE_LEVEL[tokenizer]
    except (KeyError, TypeError):
        pass
    decoder = getattr(getattr(tokenizer, "hf", None), "decoder", None)
    result = type(decoder).__name__ == "ByteLevel"
    try:
        _BYTE_LEVEL[tokenizer] = result
    except TypeError:
        pass
    return result


_TOKEN_TEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(skip, kind): table}
_MAX_TOKEN_TEXTS = 1 << 18  # ids (or runs) remembered per tokenizer and table (a vocabulary is usually smaller)
_MAX_RUN = 4  # the longest run of unread ids whose decoding is kept (a UTF-8 character has at most 4 bytes)


def _shared_table(tokenizer: Decoder, skip_special_tokens: bool, kind: str) -> dict:
    try:
        tables = _TOKEN_TEXTS[tokenizer]
    except KeyError:
        tables = _TOKEN_TEXTS[tokenizer] = {}
    except TypeError:  # not weak-referenceable: a private table
        return {}
    return tables.setdefault((bool(skip_special_tokens), kind), {})


def token_texts(tokenizer: Decoder, skip_special_tokens: bool) -> dict[int, str]:
    """The texts of single byte-level tokens that decode to whole characters, filled as tokens are seen. Shared
    by every sequence on one tokenizer; a racing second writer stores the same text."""
    return _shared_table(tokenizer, skip_special_tokens, "token")


def run_texts(tokenizer: Decoder, skip_special_tokens: bool) -> dict[tuple[int, ...], str]:
    """What each run of 1 to `_MAX_RUN` byte-level ids (other than one whole-character token) decodes to, as decode returns it (ending in U+FFFD while the
    run is an incomplete character), filled as runs are seen; shared like `token_texts`."""
    return _shared_table(tokenizer, skip_special_tokens, "run")


class IncrementalDetokenizer:
    """Turns appended token ids into text deltas."""

    __slots__ = ("_tok", "_skip", "_ids", "_prefix_offset", "_read_offset", "_prefix_text", "_fast", "_raw",
                 "_texts", "_runs")

    def __init__(self, tokenizer: Decoder, prompt_ids, skip_special_tokens: bool = True, fast: bool = True):
        """`fast=False`: the offset algorithm for every push, no byte-level shortcut (what the fast paths must
        match)."""
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._fast = fast and is_byte_level(tokenizer)
        # the `tokenizers` object itself when wrapped by core.tokenizer.Tokenizer: one call less per push
        raw = getattr(tokenizer, "hf", None)
        self._raw = raw.decode if self._fast and hasattr(raw, "decode") else None
        self._texts = token_texts(tokenizer, skip_special_tokens) if self._fast else None
        self._runs = run_texts(tokenizer, skip_special_tokens) if self._fast else None

    def _decode(self, ids) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_ids) -> str:
        """Append ids; return the text they complete (possibly empty)."""
        ids = self._ids
        texts = self._texts
        if texts is not None and len(token_ids) == 1 and self._read_offset == len(ids):
            # the common step: one token after a clean read. Byte-level decoding concatenates, so its text
            # is the token's own decoding, kept per tokenizer once seen (whole characters only)
            text = texts.get(token_ids[0])
            if text is not None:
                ids.append(token_ids[0])
                self._prefix_offset = self._read_offset
                self._read_offset += 1
                self._prefix_text = text
                return text
        ids.extend(token_ids)
        if self._fast:  # byte-level: decode only what was not read yet
            unread = ids[self._read_offset:]
            text = self._unread_text(unread)
            if text.endswith("\ufffd"):
                return ""  # an incomplete UTF-8 sequence: wait for the next token
            if "\ufffd" not in text:
                self._prefix_offset = self._read_offset
                self._read_offset = len(ids)
                self._prefix_text = text
                return text
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text) or text.endswith("\ufffd"):
            return ""
        delta = text[len(self._prefix_text):]
        # keep the decoding window short: the new prefix is what was just read
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return delta

    def _unread_text(self, unread: list[int]) -> str:
        """Byte-level: what `unread` decodes to, from the shared tables when seen before (a run of ids decodes
        the same wherever it stands after a clean read), else decoded and kept: one whole-character token in
        `token_texts` (where the commonest push finds it), any other run of up to `_MAX_RUN` ids in `run_texts`."""
        if not unread or len(unread) > _MAX_RUN:
            return self._decode_ids(unread) if unread else ""
        key = tuple(unread)
        text = self._runs.get(key)
        if text is None:
            text = self._decode_ids(unread)
            whole_token = len(key) == 1 and "\ufffd" not in text
            table = self._texts if whole_token else self._runs
            if len(table) < _MAX_TOKEN_TEXTS:
                table[key[0] if whole_token else key] = text
        return text

    def _decode_ids(self, ids: list[int]) -> str:
        return self._raw(ids, self._skip) if self._raw is not None else self._decode(ids)

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back, replacement characters included."""
        text = self._decode(self._ids[self._prefix_offset:])
        delta = text[len(self._prefix_text):] if len(text) > len(self._prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        return delta


class StopMatcher:
    """Finds stop strings in streamed text without ever releasing a partial match.

    Only the longest tail of the pending text that could still begin a stop string is held
    back (at most `max(len(stop)) - 1` characters); everything before it is safe to send.
    """

    __slots__ = ("_stops", "_include", "_pending", "_max_hold")

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False):
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop
        self._pending = ""
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1

    def push(self, delta: str) -> tuple[str, str | None]:
        """Feed new text; return (text safe to emit, matched stop string or None)."""
        if not self._stops:
            return delta, None
        buf = self._pending + delta
        best, best_at = None, -1
        for stop in self._stops:
            at = buf.find(stop)
            if at != -1 and (best is None or at < best_at or (at == best_at and len(stop) > len(best))):
                best, best_at = stop, at
        if best is not None:
            self._pending = ""
            end = best_at + len(best) if self._include else best_at
            return buf[:end], best
        hold = self._hold_length(buf)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], None

    def _hold_length(self, buf: str) -> int:
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(stop.startswith(tail) for stop in self._stops):
                return k
        return 0

    def flush(self) -> str:
        """The held-back text, once the sequence ended without a match."""
        text, self._pending = self._pending, ""
        return text
