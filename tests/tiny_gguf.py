"""A tiny GGUF file for tests: `write_gguf(model_dir, path)` writes a tests/tiny_model.py checkpoint as llama.cpp's
convert_hf_to_gguf.py would (its tensor names, Llama's q / k rows permuted for llama.cpp's rotary layout, the
tokenizer as `tokenizer.ggml.*` keys), with the matrices in the GGML type asked for (gguf.quants quantizes them).
`metadata` adds or replaces keys (None drops one), so a test can write a file we must refuse.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.numpy import load_file

from tokenloop.bench.shape_gguf import add_key

T = GGMLQuantizationType
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3"}
GEMMA3_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.bias": "attn_v.bias", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
               "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
               "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"}  # Phi-3


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: per head, rows (2, E/2) -> (E/2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str, gemma: bool = False) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{(GEMMA3_NAMES if gemma else {}).get(rest) or LAYER_NAMES[rest]}"


def write_gguf(model_dir: str | Path, path: str | Path, matrix_type: T = T.F32, embed_type: T = T.F32,
               metadata: dict | None = None, arch: str | None = None, types: dict[str, T] | None = None,
               extra: dict[str, np.ndarray] | None = None) -> Path:
    """The checkpoint in `model_dir` as one GGUF file at `path`; `types` {gguf tensor name: type} overrides; `extra`
    {gguf tensor name: array} adds float32 tensors."""
    model_dir, path = Path(model_dir), Path(path)
    config = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    arch = arch or GGUF_ARCH[config["architectures"][0]]
    w = GGUFWriter(str(path), arch)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    keys = {f"{arch}.context_length": config["max_position_embeddings"],
            f"{arch}.embedding_length": config["hidden_size"], f"{arch}.block_count": config["num_hidden_layers"],
            f"{arch}.feed_forward_length": config["intermediate_size"], f"{arch}.attention.head_count": heads,
            f"{arch}.attention.head_count_kv": kv_heads, f"{arch}.rope.dimension_count": config["head_dim"],
            f"{arch}.rope.freq_base": float(config.get("rope_theta") or
                                            config["rope_parameters"]["full_attention"]["rope_theta"]),
            f"{arch}.attention.layer_norm_rms_epsilon": float(config["rms_norm_eps"]),
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 2,
            "tokenizer.ggml.add_bos_token": False}
    if arch == "gemma3":
        keys |= {f"{arch}.attention.sliding_window": config["sliding_window"],
                 f"{arch}.attention.key_length": config["head_dim"]}
    if arch == "phi3" and config.get("sliding_window"):
        keys[f"{arch}.attention.sliding_window"] = config["sliding_window"]
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    specials = {a["id"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    chat = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    keys |= {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
             "tokenizer.ggml.token_type": [3 if i in specials else 1 for i in range(len(tokens))],
             "tokenizer.chat_template": chat}
    for key, value in (keys | (metadata or {})).items():
        if value is None:
            continue
        add_key(w, key, value)
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        t = t.astype(np.float32)
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = permute(t, heads if "q_proj" in name else kv_heads)
        if arch == "gemma3" and name.endswith("norm.weight"):  # llama.cpp's converter stores Gemma's 1 + w
            t = t + np.float32(1.0)
        out = gguf_name(name, arch == "gemma3")
        kind = (types or {}).get(out, embed_type if out in ("token_embd.weight", "output.weight") else
                                 matrix_type if t.ndim == 2 else T.F32)
        data = t if kind == T.F32 else t.astype(np.int8) if kind == T.I8 else quants.quantize(t, kind)
        w.add_tensor(out, data, raw_dtype=kind)
    for name, t in (extra or {}).items():
        w.add_tensor(name, t.astype(np.float32), raw_dtype=T.F32)
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(config), raw_dtype=T.F32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_factors(config: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel rope_freqs.weight for Llama 3 scaling: per rotary frequency, the factor
    llama.cpp divides it by."""
    s, dim = config["rope_scaling"], config["head_dim"]
    freqs = 1.0 / (float(config["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
