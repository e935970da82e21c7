"""The model's tokenizer and card: `tokenizer.json`, chat template, special and EOS ids, limits.

Read from a Hugging Face checkpoint directory with the `tokenizers` library and jinja2
only (no transformers). Shared by the service (validation, Tokenize), the looper
(detokenization) and the executors (EOS ids, context length).
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from .gguf_file import check_servable, is_gguf
from .gguf_tokenizer import build_tokenizer, gguf_card


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


_SETTINGS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
_INT_SETTINGS = ("top_k", "max_new_tokens")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _token_text(value) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclass(frozen=True, slots=True)
class ModelCard:
    """What config.json and generation_config.json say about a checkpoint."""

    model_id: str
    architecture: str
    max_context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str
    default_temperature: float | None
    default_top_p: float | None
    default_top_k: int | None
    # generation_config.json's numeric settings that are set, under its own names: max_new_tokens, and the sampling
    # ones (temperature, top_p, top_k, min_p, repetition_penalty) only with do_sample true, as transformers reads them
    generation: dict = field(default_factory=dict)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelCard:
        """From a checkpoint directory's config.json and generation_config.json, or a GGUF file's metadata."""
        if is_gguf(model_dir):
            return gguf_card(check_servable(model_dir))
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "config.json")
        gen = _read_json(model_dir / "generation_config.json")
        archs = config.get("architectures") or ["unknown"]
        eos = _as_list(gen.get("eos_token_id", config.get("eos_token_id")))
        bos = gen.get("bos_token_id", config.get("bos_token_id"))
        sampling = gen.get("do_sample", False)
        return cls(
            model_id=model_dir.resolve().name,
            architecture=archs[0],
            max_context_length=int(config.get("max_position_embeddings", 2048)),
            vocab_size=int(config.get("vocab_size", 0)),
            eos_token_ids=tuple(eos),
            bos_token_id=int(bos) if bos is not None else None,
            torch_dtype=str(config.get("torch_dtype", config.get("dtype", "float32"))),
            default_temperature=gen.get("temperature") if sampling else None,
            default_top_p=gen.get("top_p") if sampling else None,
            default_top_k=gen.get("top_k") if sampling else None,
            generation={key: int(value) if key in _INT_SETTINGS else float(value) for key in _SETTINGS
                        if (sampling or key == "max_new_tokens") and _is_number(value := gen.get(key))},
        )


# Inputs longer than this (characters, or ids) are (de)tokenized with the GIL released; shorter ones hold it.
RELEASE_GIL_OVER = 2048


class ChatTemplateError(ValueError):
    """The chat template could not render the conversation."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered conversation. `pieces` None: encode `text` as is (no message content holds special-token text, or
    the operator allows it). Otherwise `text` cut at the special tokens the TEMPLATE wrote: (piece, True) is one of
    those, encoded as its token; (piece, False) is text between them, message content included, in which
    special-token text is encoded as text."""

    text: str
    pieces: tuple[tuple[str, bool], ...] | None = None


class Tokenizer:
    """tokenizer.json plus the chat template and special tokens of tokenizer_config.json."""

    def __init__(self, tokenizer: HFTokenizer, config: dict, chat_template: str | None):
        self.hf = tokenizer  # the `tokenizers` Tokenizer of tokenizer.json
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = chat_template
        self.add_bos = bool(config.get("add_bos_token", False))
        special_text = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}  # built once:
        # Gemma 3 has ~6,000 special tokens among 262,144
        self.special_ids = frozenset(
            tid for tok, tid in tokenizer.get_vocab(with_added_tokens=True).items() if tok in special_text)
        specials = sorted(special_text, key=len, reverse=True)  # longest first, as the tokenizer matches them
        self._special_text = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._template = None
        if chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = self._raise
            self._template = env.from_string(chat_template)

    @staticmethod
    def _raise(message: str):
        raise ChatTemplateError(message)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """From a checkpoint directory, or a GGUF file's `tokenizer.*` metadata (core/gguf_tokenizer.py)."""
        if is_gguf(model_dir):
            tok, config = build_tokenizer(check_servable(model_dir))
            return cls(tok, config, config["chat_template"])
        model_dir = Path(model_dir)
        tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _read_json(model_dir / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = model_dir / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        return cls(tok, config, template)

    @functools.cached_property
    def _text_tok(self) -> HFTokenizer:
        """A second instance that encodes special-token text as text (made on the first chat that needs it)."""
        tok = HFTokenizer.from_str(self.hf.to_str())
        tok.encode_special_tokens = True
        return tok

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`. Up to `RELEASE_GIL_OVER` characters through `tokenizers`' `encode`, which holds the GIL:
        a release would cost more than tokenizing a short text, since a caller that lets a busy thread (the looper)
        take the GIL waits up to the switch interval (5 ms) to get it back; every prompt of the flooded bench doing
        that cut its tokens/s by a third. Longer texts through the batch entry point without offsets: the same ids,
        ~25 % faster, with the GIL released, so that while a tokenizer thread works on one (`App.tokenizing`) the
        event loop and the looper run (`encode` holds the GIL for its whole run: ~20 ms for 7,000 tokens)."""
        if len(text) <= RELEASE_GIL_OVER:
            return self.hf.encode(text, add_special_tokens=add_special_tokens).ids
        return self.hf.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_with_tokens(self, text: str, add_special_tokens: bool = False) -> tuple[list[int], list[str]]:
        """The ids of `text` and each one's vocabulary string (Tokenize); the GIL released past `RELEASE_GIL_OVER`."""
        if len(text) <= RELEASE_GIL_OVER:
            encoding = self.hf.encode(text, add_special_tokens=add_special_tokens)
        else:
            encoding = self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return encoding.ids, encoding.tokens

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of `ids`; the GIL released (the batch entry point) past `RELEASE_GIL_OVER` ids."""
        ids = list(ids)
        if len(ids) <= RELEASE_GIL_OVER:
            return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters of input text one token can stand for, where the tokenizer bounds it: byte-level
        BPE with no normalizer, whose tokens are at most their vocabulary strings long in bytes (an added token:
        its content) while a character is at least one byte. None otherwise: an unknown-token id or a normalizer
        that drops characters can make one token of any length. Lets validation refuse a text that cannot fit
        the prompt limit without tokenizing it."""
        tok = self.hf
        if (tok.normalizer is not None or type(tok.model).__name__ != "BPE"
                or type(tok.decoder).__name__ != "ByteLevel" or "ByteLevel" not in repr(tok.pre_tokenizer)):
            return None
        return max(len(t) for t in tok.get_vocab(with_added_tokens=True))

    def to_json(self) -> str:
        """tokenizer.json as text (what llguidance and TensorRT-LLM's guided decoding take)."""
        return self.hf.to_str()

    def encoded_vocab(self) -> list[str]:
        """Every token's vocabulary string, in id order."""
        vocab = self.hf.get_vocab(with_added_tokens=True)
        return [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def render_chat(self, messages: list[dict[str, str]], allow_special_tokens: bool = False) -> ChatPrompt:
        """Render a conversation so that special-token text in a message's content stays text (unless
        `allow_special_tokens`): a user cannot close its turn and open a system one by writing `<|im_end|>`.
        Content without special-token text (almost all of it) takes the plain path: the same text, the same ids.
        Otherwise the template renders again with a random placeholder for each content, which locates the special
        tokens the template itself wrote; raises ChatTemplateError where the template changes content (then the
        placeholders cannot stand for it)."""
        text = self.apply_chat_template(messages)
        find = self._special_text
        if allow_special_tokens or find is None or not any(find.search(m["content"]) for m in messages):
            return ChatPrompt(text)
        nonce = secrets.token_hex(8)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        marked = self.apply_chat_template([dict(m, content=mark) for m, mark in zip(messages, marks)])
        parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", marked)  # markup, index, markup, ..., markup
        for content in (lambda i: messages[i]["content"], lambda i: messages[i]["content"].strip()):  # `| trim`
            pieces = self._cut(parts, content)
            if "".join(p for p, _ in pieces) == text:
                return ChatPrompt(text, pieces)
        raise ChatTemplateError("the chat template changes message content, so special-token text in it cannot "
                                "be kept as text")

    def _cut(self, parts: list[str], content) -> tuple[tuple[str, bool], ...]:
        """`ChatPrompt.pieces` of a render split at its placeholders (markup, index, markup, ..., markup), each
        placeholder standing for `content(index)`."""
        pieces: list[tuple[str, bool]] = []
        run: list[str] = []  # text since the last template special token
        for k, part in enumerate(parts):
            if k % 2:  # a message's content
                run.append(content(int(part)))
                continue
            start = 0
            for match in self._special_text.finditer(part):  # the template's own special tokens
                run.append(part[start:match.start()])
                pieces += [("".join(run), False), (match.group(), True)]
                run, start = [], match.end()
            run.append(part[start:])
        pieces.append(("".join(run), False))
        return tuple(p for p in pieces if p[0])

    def encode_chat(self, prompt: ChatPrompt, add_special_tokens: bool = False) -> tuple[list[int], list[str]]:
        """The ids of a rendered conversation and each one's vocabulary string (the GIL released past
        `RELEASE_GIL_OVER`, like `encode`)."""
        if prompt.pieces is None:
            return self.encode_with_tokens(prompt.text, add_special_tokens)
        texts = [p for p, special in prompt.pieces if not special]
        encoded = iter(self._text_tok.encode_batch(texts, add_special_tokens=False))
        parts = [self.hf.encode(p, add_special_tokens=False) if special else next(encoded)
                 for p, special in prompt.pieces]
        encoding = self.hf.post_process(Encoding.merge(parts), add_special_tokens=add_special_tokens)
        return encoding.ids, encoding.tokens

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render a conversation to prompt text; raises ChatTemplateError."""
        if self._template is None:
            raise ChatTemplateError("the model has no chat template")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None
