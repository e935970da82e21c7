"""A small real tokenizer for tests, trained in a fraction of a second with the `tokenizers` library."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello tokenloop, hello gRPC streams.",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "東京は日本の首都です。我喜欢机器学习。",
    "Emoji time: 😀 🚀 👩‍💻 🎉 and more 😀😀.",
    "def main():\n    return 42\n",
] * 4
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_byte_level(vocab_size: int = 400) -> Tokenizer:
    """GPT-2 style byte-level BPE (like SmolLM2's): every string round-trips, emoji split across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def build_metaspace(vocab_size: int = 300) -> Tokenizer:
    """SentencePiece-style BPE with a Metaspace ('▁') pre-tokenizer and byte fallback (Llama 2 style)."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    alphabet = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size + 256, special_tokens=SPECIAL + alphabet,
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_tokenizer_dir(path: str | Path, kind: str = "byte_level", max_context: int = 256) -> Path:
    """A checkpoint-shaped directory with tokenizer.json, tokenizer_config.json, config.json, generation_config.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_byte_level() if kind == "byte_level" else build_metaspace()
    tok.save(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHATML}))
    config = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": max_context,
              "vocab_size": tok.get_vocab_size(), "torch_dtype": "float32", "eos_token_id": eos,
              "bos_token_id": tok.token_to_id("<|im_start|>")}
    if not (path / "config.json").exists():
        (path / "config.json").write_text(json.dumps(config))
    if not (path / "generation_config.json").exists():
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": config["bos_token_id"]}))
    return path
