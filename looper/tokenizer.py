"""The model's tokenizer and card: `tokenizer.json`, chat template, special and EOS ids, limits.

Read from a Hugging Face checkpoint directory with the `tokenizers` library and jinja2
only (no transformers). Shared by the service (validation, Tokenize), the looper
(detokenization) and the executors (EOS ids, context length).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


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

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelCard:
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
        )


# Inputs longer than this (characters, or ids) are (de)tokenized with the GIL released; shorter ones hold it.
RELEASE_GIL_OVER = 2048


class ChatTemplateError(ValueError):
    """The chat template could not render the conversation."""


class Tokenizer:
    """tokenizer.json plus the chat template and special tokens of tokenizer_config.json."""

    def __init__(self, tokenizer: HFTokenizer, config: dict, chat_template: str | None):
        self._tok = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = chat_template
        self.add_bos = bool(config.get("add_bos_token", False))
        self.special_ids = frozenset(
            tid for tok, tid in tokenizer.get_vocab(with_added_tokens=True).items()
            if tok in {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
        )
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

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The ids of `text`. Up to `RELEASE_GIL_OVER` characters through `tokenizers`' `encode`, which holds the GIL:
        a release would cost more than tokenizing a short text, since a caller that lets a busy thread (the looper)
        take the GIL waits up to the switch interval (5 ms) to get it back; every prompt of the flooded bench doing
        that cut its tokens/s by a third. Longer texts through the batch entry point without offsets: the same ids,
        ~25 % faster, with the GIL released, so that while a tokenizer thread works on one (`App.tokenizing`) the
        event loop and the looper run (`encode` holds the GIL for its whole run: ~20 ms for 7,000 tokens)."""
        if len(text) <= RELEASE_GIL_OVER:
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_with_tokens(self, text: str, add_special_tokens: bool = False) -> tuple[list[int], list[str]]:
        """The ids of `text` and each one's vocabulary string (Tokenize); the GIL released past `RELEASE_GIL_OVER`."""
        if len(text) <= RELEASE_GIL_OVER:
            encoding = self._tok.encode(text, add_special_tokens=add_special_tokens)
        else:
            encoding = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return encoding.ids, encoding.tokens

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of `ids`; the GIL released (the batch entry point) past `RELEASE_GIL_OVER` ids."""
        ids = list(ids)
        if len(ids) <= RELEASE_GIL_OVER:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters of input text one token can stand for, where the tokenizer bounds it: byte-level
        BPE with no normalizer, whose tokens are at most their vocabulary strings long in bytes (an added token:
        its content) while a character is at least one byte. None otherwise: an unknown-token id or a normalizer
        that drops characters can make one token of any length. Lets validation refuse a text that cannot fit
        the prompt limit without tokenizing it."""
        tok = self._tok
        if (tok.normalizer is not None or type(tok.model).__name__ != "BPE"
                or type(tok.decoder).__name__ != "ByteLevel" or "ByteLevel" not in repr(tok.pre_tokenizer)):
            return None
        return max(len(t) for t in tok.get_vocab(with_added_tokens=True))

    def to_json(self) -> str:
        """tokenizer.json as text (what llguidance and TensorRT-LLM's guided decoding take)."""
        return self._tok.to_str()

    def encoded_vocab(self) -> list[str]:
        """Every token's vocabulary string, in id order."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

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
