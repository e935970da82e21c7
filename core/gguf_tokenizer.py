"""The tokenizer, chat template and model card a GGUF file's metadata describes, built without transformers.

A GGUF has no tokenizer.json: it keeps the vocabulary, merges, token types and special ids under llama.cpp's
`tokenizer.ggml.*` keys. We build the `tokenizers.Tokenizer` transformers builds from the same keys
(transformers/integrations/gguf/gguf_tokenizer_mapping.py; tests/integration/test_gguf.py compares the ids):

- `gpt2` (byte-level BPE: SmolLM2, Llama 3, Qwen2): the merges as given, split on the pre-tokenizer regex that
  `tokenizer.ggml.pre` names (GPT-2's own where it names none we know);
- `llama` (sentencepiece BPE: Llama 2, Mistral, Gemma): Metaspace, byte fallback, merges from the file or, where it
  has none, rebuilt from the vocabulary in score order (Gemma: file order), BOS added unless the file says not.

Tokens typed CONTROL are special added tokens, USER_DEFINED plain added ones, as llama.cpp matches both whole.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from .gguf_file import ARCHITECTURES, GGUFFile

CONTROL, USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex its merges were learned on (as transformers' GGUF_PRE_TOKENIZER_SPLITS)
PRE_TOKENIZER_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
                        "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
                        "deepseek-r1-qwen": _QWEN2_SPLIT}
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the alphabet byte-level vocabularies are spelled in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def _merges_from_vocab(tokens: list[str], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary, best token (highest score) first
    (transformers' generate_merges)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _byte_level(g: GGUFFile, tokens: list[str]) -> HFTokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges") or []]
    tok = HFTokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(g.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(g: GGUFFile, tokens: list[str]) -> HFTokenizer:
    gemma = g.architecture in GEMMA_ARCHITECTURES
    if gemma:  # runs of spaces are stored as spaces; Gemma's merges follow the file's order, not its scores
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = {t: -i for i, t in enumerate(tokens)}
    else:
        scores = dict(zip(tokens, g.get("tokenizer.ggml.scores") or [0.0] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    given = g.get("tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in given] if given else _merges_from_vocab(tokens, scores)
    unk_id = g.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if gemma and unk_id is not None else None
    tok = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None,
                          unk_token=unk))
    fuse = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        tok.decoder = decoders.Sequence(fuse)
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([*fuse, decoders.Strip(content=" ", left=1)])
    return tok


def build_tokenizer(g: GGUFFile) -> tuple[HFTokenizer, dict]:
    """(the tokenizer, a tokenizer_config-like dict: bos_token, eos_token, add_bos_token) of a servable file
    (gguf_file.check_servable)."""
    tokens = list(g.require("tokenizer.ggml.tokens"))
    model = g.get("tokenizer.ggml.model")
    tok = _byte_level(g, tokens) if model == "gpt2" else _sentencepiece(g, tokens)
    types = g.get("tokenizer.ggml.token_type") or []
    alphabet = set(bytes_to_unicode().values()) if model == "gpt2" else None
    named = {g.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "unknown", "padding")} - {None}
    special = [AddedToken(t, normalized=False, special=True) for i, (t, kind) in enumerate(zip(tokens, types))
               if (kind == CONTROL or i in named) and (alphabet is None or set(t) <= alphabet)]
    tok.add_special_tokens(special)
    vocab = tok.get_vocab()
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types)
                    if kind == USER_DEFINED and t in vocab])

    def token(key: str) -> str | None:
        i = g.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    add_bos = g.get("tokenizer.ggml.add_bos_token", model == "llama")  # llama.cpp: sentencepiece adds BOS
    add_eos = g.get("tokenizer.ggml.add_eos_token", False)
    bos, eos = token("bos"), token("eos")
    add_bos, add_eos = bool(add_bos and bos), bool(add_eos and eos)
    single = " ".join([f"{bos}:0"] * add_bos + ["$A:0"] + [f"{eos}:0"] * add_eos)
    pair = " ".join([single] + [f"{bos}:1"] * add_bos + ["$B:1"] + [f"{eos}:1"] * add_eos)
    specials = [(bos, tok.token_to_id(bos))] * add_bos + [(eos, tok.token_to_id(eos))] * add_eos
    tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    config = {"bos_token": bos, "eos_token": eos, "add_bos_token": add_bos,
              "chat_template": g.get("tokenizer.chat_template")}
    return tok, config


# general.sampling.* (llama.cpp's recommended-sampling keys) -> generation_config.json's names
SAMPLING_KEYS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "penalty_repeat": "repetition_penalty"}


def gguf_card(g: GGUFFile):
    """The ModelCard of a servable GGUF file: its architecture, context, vocabulary, EOS / BOS ids and the sampling
    settings its `general.sampling.*` keys recommend (applied, as generation_config.json's, to requests that leave
    them unset)."""
    from .tokenizer import ModelCard

    sampling = {name: g.get(f"general.sampling.{key}") for key, name in SAMPLING_KEYS.items()}
    sampling = {k: int(v) if k == "top_k" else float(v) for k, v in sampling.items() if v is not None}
    eos = g.get("tokenizer.ggml.eos_token_id")
    eot = g.get("tokenizer.ggml.eot_token_id")  # llama.cpp also ends a turn on its end-of-turn token
    bos = g.get("tokenizer.ggml.bos_token_id")
    return ModelCard(
        model_id=g.path.stem, architecture=ARCHITECTURES.get(g.architecture, g.architecture),
        max_context_length=int(g.arch_key("context_length", 2048)),
        vocab_size=g.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in g.tensors else 0,
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in (eos, eot) if i is not None)),
        bos_token_id=int(bos) if bos is not None else None, torch_dtype=g.weights_mode(),
        default_temperature=sampling.get("temperature"), default_top_p=sampling.get("top_p"),
        default_top_k=sampling.get("top_k"), generation=sampling)
