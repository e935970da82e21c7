"""A tiny random-weight checkpoint for tests: `make_tiny_model(dir)` writes a complete HF model dir.

It has config.json, model.safetensors, generation_config.json, a byte-level BPE tokenizer.json
(trained here on a few sentences, so emoji and CJK round-trip), and tokenizer_config.json with
ChatML special tokens and a chat template. transformers can load it too (the reference in tests).
Special ids: 0 `<|endoftext|>` (unk), 1 `<|im_start|>` (bos), 2 `<|im_end|>` (eos), like SmolLM2.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today? I am fine, thank you.",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "def main():\n    print('hello')\n    return 0\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Emoji 😀🎉 and CJK 你好世界 こんにちは 안녕하세요 survive byte-level BPE.",
]
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "mistral": ("MistralForCausalLM", "mistral"), "qwen3": ("Qwen3ForCausalLM", "qwen3"),
                 "gemma3": ("Gemma3ForCausalLM", "gemma3_text"), "phi3": ("Phi3ForCausalLM", "phi3")}


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with the special tokens at ids 0, 1, 2."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    return tok


def _config(arch: str, vocab_size: int, hidden: int, num_layers: int, num_heads: int, num_kv_heads: int,
            tied: bool, max_positions: int, rope_scaling: dict | None, sliding_window: int | None = None) -> dict:
    architecture, model_type = ARCHITECTURES[arch]
    config = {
        "architectures": [architecture], "model_type": model_type, "vocab_size": vocab_size,
        "hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": hidden // num_heads,
        "hidden_act": "silu", "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2, "torch_dtype": "float32", "attention_bias": False, "use_cache": True,
    }
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if arch in ("qwen2", "qwen3"):  # with a window: the layers from max_window_layers on (the upper half) use it
        config.update(use_sliding_window=bool(sliding_window), sliding_window=sliding_window,
                      max_window_layers=num_layers // 2 if sliding_window else num_layers)
    if arch in ("mistral", "phi3"):  # with a window: every layer
        config["sliding_window"] = sliding_window
    if arch == "gemma3":  # local (sliding-window) layers 0, 2, ...; global 1, 3, ...; a query scalar other than E
        del config["hidden_act"]
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                      sliding_window=sliding_window or max_positions,
                      layer_types=["full_attention" if i % 2 else "sliding_attention"
                                   for i in range(num_layers)],
                      rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                      final_logit_softcapping=None, attn_logit_softcapping=None)
        del config["rope_theta"]
    return config


def _weights(config: dict, seed: int, std: float) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * std  # noqa: E731
    d, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    e = config["head_dim"]
    q, kv = config["num_attention_heads"] * e, config["num_key_value_heads"] * e
    w = {"model.embed_tokens.weight": torch.randn(v, d, generator=gen), "model.norm.weight": 1 + rand(d)}
    if config["model_type"] == "gemma3_text":  # its embeddings are scaled by sqrt(D) on input
        w["model.norm.weight"] -= 1
        w["model.embed_tokens.weight"] /= d ** 0.5
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = torch.randn(v, d, generator=gen) * 0.5
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        w |= {p + "input_layernorm.weight": 1 + rand(d), p + "post_attention_layernorm.weight": 1 + rand(d),
              p + "self_attn.q_proj.weight": rand(q, d), p + "self_attn.k_proj.weight": rand(kv, d),
              p + "self_attn.v_proj.weight": rand(kv, d), p + "self_attn.o_proj.weight": rand(d, q),
              p + "mlp.gate_proj.weight": rand(i, d), p + "mlp.up_proj.weight": rand(i, d),
              p + "mlp.down_proj.weight": rand(d, i)}
        if config["model_type"] == "qwen3":
            w |= {p + "self_attn.q_norm.weight": 1 + rand(e), p + "self_attn.k_norm.weight": 1 + rand(e)}
        if config["model_type"] == "gemma3_text":  # its norms multiply by 1 + w
            w |= {p + "self_attn.q_norm.weight": rand(e), p + "self_attn.k_norm.weight": rand(e),
                  p + "pre_feedforward_layernorm.weight": rand(d), p + "post_feedforward_layernorm.weight": rand(d)}
            w[p + "input_layernorm.weight"] -= 1
            w[p + "post_attention_layernorm.weight"] -= 1
        if config["model_type"] == "qwen2":
            w |= {p + "self_attn.q_proj.bias": rand(q), p + "self_attn.k_proj.bias": rand(kv),
                  p + "self_attn.v_proj.bias": rand(kv)}
        if config["model_type"] == "phi3":  # q/k/v and gate/up stored fused
            w[p + "self_attn.qkv_proj.weight"] = torch.cat([w.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            w[p + "mlp.gate_up_proj.weight"] = torch.cat([w.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    return {k: t.contiguous() for k, t in w.items()}


def make_tiny_model(model_dir: str | Path, arch: str = "llama", tied: bool = True, *, hidden: int = 64,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, vocab_size: int = 384,
                    max_positions: int = 1024, rope_scaling: dict | None = None, seed: int = 0,
                    std: float = 0.3, sliding_window: int | None = None) -> Path:
    """Write a tiny random-weight checkpoint of `arch` ("llama", "qwen2", "mistral", "qwen3", "gemma3", "phi3") to
    `model_dir`. `sliding_window`: Gemma 3's local layers' (default: max_positions, so every layer sees it all);
    Mistral's and Phi-3's (every layer) and Qwen2/Qwen3's (the upper half of the layers, by max_window_layers) where
    given."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab_size)
    tok.save(str(model_dir / "tokenizer.json"))
    config = _config(arch, vocab_size, hidden, num_layers, num_heads, num_kv_heads, tied, max_positions,
                     rope_scaling, sliding_window)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(_weights(config, seed, std), str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    (model_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tok_config = {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
        "model_max_length": max_positions, "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False}
                                 for i, t in enumerate(SPECIAL_TOKENS)},
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    return model_dir
