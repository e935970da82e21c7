"""Weights and shape of a GGUF file (llama.cpp's format), read tensor by tensor into the chosen weights mode.

`--model file.gguf`: the header comes from core/gguf_file.py; each tensor's bytes are read on their own (`pread`,
never the whole file mapped and touched) and turned into the engine's weights (loader.load_weights' names):

- Q4_0 / Q4_1 tensors under `--weights int4` keep their very values: llama.cpp's blocks are 32 columns with a
  float16 scale (and minimum), which is Q4Weight's grid, so the 4-bit levels are repacked into the kernel's layout
  (quant.pack4; Q4_0's minimum is -8 x its scale, exact in float16), never re-quantized. Q8_0 under int8 (and the
  int8 lm_head of int4) likewise (quant.pack8).
- Every other combination is dequantized per tensor with `gguf.quants` (k-quants, 5-bit, float16, ...) and
  quantized to the mode under its own contract (quant.quantize / quantize4), or kept in fp32.
- llama.cpp's converter permutes the rows of Llama's q and k for its rotary layout; they are permuted back (rows
  only, so quantized blocks move whole), as transformers does.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

from tokenloop.core.gguf_file import ARCHITECTURES, GGUFError, GGUFFile, TensorInfo, check_servable

from . import hugepages
from .quant import Q4Weight, QWeight, as_head, pack4, pack8, quantize, quantize4

PERMUTED_QK = ("llama",)  # architectures whose q / k rows llama.cpp's converter interleaves


def config_dict(g: GGUFFile) -> dict:
    """A config.json-like dict (what loader.ModelConfig.from_dict reads) from the file's `{arch}.*` keys."""
    arch, key = g.architecture, g.arch_key
    names = g.tensors

    def need(name: str):
        value = key(name)
        if value is None:
            raise GGUFError(f"{g.path}: metadata key '{arch}.{name}' is missing")
        if isinstance(value, list):
            raise GGUFError(f"{g.path}: metadata key '{arch}.{name}' varies per layer; we serve one value for all")
        return value

    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    embed = names.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{g.path}: tensor 'token_embd.weight' is missing")
    config = {
        "architectures": [ARCHITECTURES[arch]], "vocab_size": embed.shape[0], "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")), "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(key("attention.head_count_kv") or heads),
        "head_dim": int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names, "attention_bias": "blk.0.attn_q.bias" in names,
        "sliding_window": key("attention.sliding_window"), "hidden_act": "silu",
    }
    scaling = key("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise GGUFError(f"{g.path}: {arch}.rope.scaling.type {scaling!r} is not one we serve; we serve linear (and "
                        "Llama 3's rope_freqs.weight)")
    if arch == "gemma3":  # as llama.cpp runs it: every 6th layer global, the others local with base 10,000
        full = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
        full.update(config.pop("rope_scaling", {}))
        config.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=config["head_dim"],
                      rope_parameters={"full_attention": full,
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                      layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                   for i in range(config["num_hidden_layers"])])
        del config["hidden_act"]
    if "rope_factors_long.weight" in names:  # Phi-3's 128k variants
        raise GGUFError(f"{g.path}: tensor 'rope_factors_long.weight' (Phi-3's longrope scaling) is not one we serve; "
                        "we serve linear rope scaling (and Llama 3's rope_freqs.weight)")
    if "rope_freqs.weight" in names:  # Llama 3.x: llama.cpp divides each rotary frequency by its factor
        config["rope_freq_factors"] = _read_float(g, names["rope_freqs.weight"]).reshape(-1).tolist()
    return config


def _read(g: GGUFFile, t: TensorInfo) -> np.ndarray:
    """The tensor's raw bytes [N, bytes per row], read on their own."""
    buf = np.empty(t.num_bytes, dtype=np.uint8)
    view, got = memoryview(buf), 0
    with open(g.path, "rb") as f:
        while got < t.num_bytes:  # one call reads at most ~2 GiB
            n = os.preadv(f.fileno(), [view[got:]], t.offset + got)
            if n <= 0:
                raise GGUFError(f"{g.path}: tensor {t.name!r} is cut short ({got} of {t.num_bytes} bytes)")
            got += n
    rows = t.shape[0] if len(t.shape) == 2 else 1
    return buf.reshape(rows, -1)


DEQUANTIZE_ROWS = 1024  # rows dequantized at a time: gguf.quants' temporaries are a few float32 copies of its input


def _read_float(g: GGUFFile, t: TensorInfo) -> np.ndarray:
    """The tensor dequantized to float32, in its shape (rows x columns). Quantized rows go through gguf.quants
    DEQUANTIZE_ROWS at a time into the result: whole, an 8B model's embedding (128,256 x 4,096) made ~6 GB of
    float32 temporaries beside its 2 GB result."""
    raw = _read(g, t)
    if t.kind == T.F32:
        return raw.view(np.float32).reshape(t.shape)
    if t.kind == T.F16:
        return raw.view(np.float16).astype(np.float32).reshape(t.shape)
    out = np.empty((raw.shape[0], int(np.prod(t.shape)) // raw.shape[0]), dtype=np.float32)
    for start in range(0, raw.shape[0], DEQUANTIZE_ROWS):
        out[start:start + DEQUANTIZE_ROWS] = quants.dequantize(raw[start:start + DEQUANTIZE_ROWS], t.kind)
    return out.reshape(t.shape)


def _blocks(raw: np.ndarray, size: int) -> np.ndarray:
    return raw.reshape(raw.shape[0], -1, size)  # [N, K / 32, bytes per block]


def _levels4(raw: np.ndarray, kind: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 rows -> (q [N, K] uint8 in 0..15, d, m [N, K / 32] float16): w = d * q + m. A block: d (and m)
    float16, then 16 bytes whose low nibbles are columns 0..15 and high nibbles 16..31."""
    b = _blocks(raw, 18 if kind == T.Q4_0 else 20)
    d = b[:, :, 0:2].copy().view(np.float16)[..., 0]
    if kind == T.Q4_0:
        m, qs = (d.astype(np.float32) * -8.0).astype(np.float16), b[:, :, 2:]
    else:
        m, qs = b[:, :, 2:4].copy().view(np.float16)[..., 0], b[:, :, 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(raw.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m)


def _levels8(raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> (q [N, K] int8, scale [N, K / 32] float32): w = scale * q. A block: d float16, 32 int8."""
    b = _blocks(raw, 34)
    d = b[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = b[:, :, 2:].copy().view(np.int8).reshape(raw.shape[0], -1)
    return torch.from_numpy(q), torch.from_numpy(d)


class _Reader:
    """Reads the engine's matrices from one file in one weights mode; `parts` of a fused matrix are stacked rows."""

    def __init__(self, g: GGUFFile, config, dtype: torch.dtype, weights: str):
        self.g, self.config, self.dtype, self.weights = g, config, dtype, weights
        self.permute = g.architecture in PERMUTED_QK

    def info(self, name: str) -> TensorInfo:
        t = self.g.tensors.get(name)
        if t is None:
            raise GGUFError(f"{self.g.path}: tensor {name!r} is missing")
        return t

    def _unpermute(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """Undo llama.cpp's interleaving of q / k rows: per head, rows (E/2, 2) -> (2, E/2)."""
        c = self.config
        heads = c.num_heads if name.endswith("attn_q.weight") or name.endswith("attn_q.bias") else \
            c.num_kv_heads if name.endswith(("attn_k.weight", "attn_k.bias")) else 0
        if not self.permute or not heads:
            return x
        rest = x.shape[1:]
        return x.reshape(heads, -1, 2, *rest).transpose(1, 2).reshape(x.shape[0], *rest)

    def float(self, name: str) -> torch.Tensor:
        t = self.info(name)
        return self._unpermute(name, torch.from_numpy(np.ascontiguousarray(_read_float(self.g, t))))

    def cast(self, name: str) -> torch.Tensor:
        return self.float(name).to(self.dtype).contiguous()

    def matrix(self, names: list[str], mode: str | None = None) -> torch.Tensor | QWeight | Q4Weight:
        """The rows of `names` stacked, in `mode` (default: the weights mode)."""
        mode = mode or self.weights
        kinds = {self.info(n).kind for n in names}
        if mode == "int4" and kinds <= {T.Q4_0, T.Q4_1}:
            parts = [_levels4(_read(self.g, self.info(n)), self.info(n).kind) for n in names]
            q, d, m = (torch.cat([self._unpermute(n, p[i]) for n, p in zip(names, parts)]) for i in range(3))
            return pack4(q, d, m)
        if mode == "int8" and kinds == {T.Q8_0}:
            parts = [_levels8(_read(self.g, self.info(n))) for n in names]
            q, s = (torch.cat([self._unpermute(n, p[i]) for n, p in zip(names, parts)]) for i in range(2))
            return pack8(q, s)
        w = torch.cat([self.float(n) for n in names]) if len(names) > 1 else self.float(names[0])
        if mode == "int4":
            return quantize4(w)
        if mode == "int8":
            return quantize(w)
        return w.to(self.dtype).contiguous()


def load_gguf_weights(path: str | Path, config, dtype: torch.dtype,
                      weights: str = "fp32") -> dict[str, torch.Tensor | QWeight | Q4Weight]:
    """loader.load_weights for a GGUF file: the same names and modes, read one tensor (one fused matrix) at a
    time, so at most one matrix is ever held in float32 beside the finished weights."""
    g = check_servable(path)
    r = _Reader(g, config, dtype, weights)
    head = "output.weight" if "output.weight" in g.tensors else "token_embd.weight"
    quantized = weights in ("int8", "int4")
    lm_head = as_head(r.matrix([head], "int8")) if quantized else None  # int4 keeps an int8 lm_head, as loader does
    # a tied Q8_0 embedding (Gemma 3's files) is the int8 lm_head itself: its rows dequantize to the very float32
    # values the file's table does (quant.embedding_rows), so no float32 copy of the table is kept (671 MB, Gemma 3 270M)
    tied_q8 = quantized and head == "token_embd.weight" and r.info(head).kind == T.Q8_0
    out = {"embed": lm_head if tied_q8 else r.cast("token_embd.weight"), "norm": r.cast("output_norm.weight")}
    out["lm_head"] = lm_head if quantized else out["embed"] if head == "token_embd.weight" else r.cast(head)
    for i in range(config.num_layers):
        b = f"blk.{i}."
        fused = b + "attn_qkv.weight" in g.tensors  # Phi-3: q/k/v in one tensor, gate/up in ffn_up (no ffn_gate)
        out[f"layers.{i}.qkv"] = r.matrix([b + "attn_qkv.weight"] if fused else
                                          [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"])
        if config.qkv_bias:
            out[f"layers.{i}.qkv_bias"] = torch.cat([r.cast(b + f"attn_{x}.bias") for x in "qkv"])
        out[f"layers.{i}.o"] = r.matrix([b + "attn_output.weight"])
        out[f"layers.{i}.gate_up"] = r.matrix([b + "ffn_up.weight"] if fused else
                                              [b + "ffn_gate.weight", b + "ffn_up.weight"])
        out[f"layers.{i}.down"] = r.matrix([b + "ffn_down.weight"])
        out[f"layers.{i}.input_norm"] = r.cast(b + "attn_norm.weight")  # Gemma 3's norms: 1 + w in the file already
        out[f"layers.{i}.post_norm"] = r.cast(b + "ffn_norm.weight")
        if config.sandwich_norms:
            out[f"layers.{i}.post_attn_norm"] = r.cast(b + "post_attention_norm.weight")
            out[f"layers.{i}.post_ff_norm"] = r.cast(b + "post_ffw_norm.weight")
        if config.qk_norm:
            out[f"layers.{i}.q_norm"] = r.cast(b + "attn_q_norm.weight")
            out[f"layers.{i}.k_norm"] = r.cast(b + "attn_k_norm.weight")
        hugepages.release_free_memory()  # the layer's raw bytes and float32 rows
    return hugepages.move_weights(out)
