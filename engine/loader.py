"""Read a Hugging Face checkpoint directory: config.json and (sharded) safetensors weights.

Weights are reshaped once here (q/k/v fused into one matrix, gate/up fused into another) so the
forward pass never reshapes a weight.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenloop.core.gguf_file import check_servable, is_gguf

from . import hugepages
from .quant import Q4Weight, QWeight, as_head, qweight, qweight4

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma3ForCausalLM", "Phi3ForCausalLM")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family transformer, from config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    sliding_window: int | None
    rope_freq_factors: tuple[float, ...] | None = None  # a GGUF's rope_freqs.weight (Llama 3): each frequency / factor
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each query and key head (weights [E]) before the rotary embedding
    # Gemma 3 (`gemma3`): GeGLU (gelu_pytorch_tanh), embeddings scaled by sqrt(D), attention scaled by
    # query_pre_attn_scalar ** -0.5, the attention's and MLP's outputs normalized before each residual add, and local
    # (sliding-window) layers with their own rotary base
    hidden_act: str = "silu"
    embed_scale: float | None = None
    attn_scale: float | None = None
    sandwich_norms: bool = False
    local_rope_theta: float | None = None  # Gemma 3's local layers' rotary base (None: every layer has rope_theta)
    local_layers: tuple[bool, ...] | None = None  # the layers that attend within sliding_window (None: none do)

    @classmethod
    def from_dict(cls, config: dict) -> ModelConfig:
        archs = config.get("architectures") or []
        arch = archs[0] if archs else config.get("model_type", "unknown")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; the engine supports "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        gemma = arch == "Gemma3ForCausalLM"
        act = config.get("hidden_activation" if gemma else "hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise ValueError(f"unsupported hidden_act {act!r}; the engine supports 'silu' (Gemma 3: "
                             "'gelu_pytorch_tanh')")
        rope = dict(config.get("rope_parameters") or {})  # transformers 5 layout
        local = None
        if gemma:  # rope_parameters by layer type (transformers 5), or rope_theta + rope_local_base_freq
            local = dict(rope.get("sliding_attention") or {"rope_theta": config.get("rope_local_base_freq", 1e4)})
            rope = dict(rope.get("full_attention") or {"rope_theta": config.get("rope_theta", 1e6),
                                                        **(config.get("rope_scaling") or {})})
            config = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling")}
        partial = float(config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
        if partial != 1.0:  # Phi-4-mini's 0.75: the rotary embedding over part of each head
            raise ValueError(f"unsupported partial_rotary_factor {partial}; the engine rotates whole heads (1.0)")
        scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise ValueError(f"unsupported rope scaling {kind!r}; the engine supports 'linear' and 'llama3'")
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}
        num_heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        gemma_fields = {}
        if gemma:
            num_layers = int(config["num_hidden_layers"])
            types = config.get("layer_types") or ["full_attention" if (i + 1) % int(
                config.get("sliding_window_pattern", 6)) == 0 else "sliding_attention" for i in range(num_layers)]
            gemma_fields = dict(hidden_act=act, embed_scale=hidden ** 0.5, sandwich_norms=True,
                                attn_scale=float(config.get("query_pre_attn_scalar", 256)) ** -0.5,
                                local_rope_theta=float(local.get("rope_theta", 1e4)),
                                local_layers=tuple(t == "sliding_attention" for t in types))
        window, windowed = sliding_layers(arch, config, gemma_fields.get("local_layers"))
        return cls(
            architecture=arch,
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(config.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            sliding_window=window,
            rope_freq_factors=tuple(config["rope_freq_factors"]) if config.get("rope_freq_factors") else None,
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            **{**gemma_fields, "local_layers": windowed},
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        """From a checkpoint directory's config.json, or a GGUF file's metadata (engine/gguf.py)."""
        if is_gguf(model_dir):
            from .gguf import config_dict

            return cls.from_dict(config_dict(check_servable(model_dir)))
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no config.json; expected a Hugging Face checkpoint directory")
        return cls.from_dict(json.loads(path.read_text()))

    @property
    def max_context_length(self) -> int:
        """Longest sequence served: the position limit (the windowed layers attend within theirs: model.layer_windows)."""
        return self.max_position_embeddings


def sliding_layers(arch: str, config: dict, gemma: tuple[bool, ...] | None) -> tuple[int | None, tuple | None]:
    """(sliding_window, which layers attend within it) as transformers reads a config: Gemma 3 by its layer_types;
    Mistral and Phi-3 every layer (Mistral: 4096 where config.json has no `sliding_window`, as MistralConfig
    defaults; Phi-3: none); Qwen2 / Qwen3 only
    with `use_sliding_window`, by `layer_types` or else the layers from `max_window_layers` on; Llama none."""
    num_layers = int(config["num_hidden_layers"])
    window = config.get("sliding_window", 4096 if arch == "MistralForCausalLM" else None)
    if arch == "Gemma3ForCausalLM":  # its local layers keep their rotary base even without a window
        return (int(window) if window else None), gemma
    if not window or arch == "LlamaForCausalLM":
        return None, None
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        return int(window), (True,) * num_layers
    if not config.get("use_sliding_window", False):  # Qwen2, Qwen3
        return None, None
    first = int(config.get("max_window_layers", 28))
    types = config.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(num_layers)]
    windowed = tuple(t == "sliding_attention" for t in types)
    return (int(window), windowed) if any(windowed) else (None, None)


def rope_inv_freq(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], float32, computed as transformers does (incl. Llama-3 scaling); `local`:
    Gemma 3's sliding-window layers (their own base, no scaling)."""
    dim = config.head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if local:
        return inv_freq
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    return files


ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}


class SafetensorsReader:
    """A checkpoint's safetensors shards, each tensor read from its file (pread) when it is taken (`pop`) and owned by
    the caller: the files are never mapped, so what a load has read does not stay resident as the file's pages
    (safetensors' safe_open maps each shard whole: a 1.7B float32 checkpoint's 6.8 GB counted in the server's
    resident memory until the mapping went, and a weight it returned without a copy kept it there)."""

    def __init__(self, model_dir: str | Path):
        self.where: dict[str, tuple[Path, str, list[int], int, int]] = {}  # name -> (file, dtype, shape, start, end)
        for path in _weight_files(Path(model_dir)):
            with open(path, "rb") as f:
                head = f.read(8)
                size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                try:
                    header = json.loads(f.read(size)) if 0 < size < 1 << 30 else None
                except ValueError:
                    header = None
            if not isinstance(header, dict):
                raise ValueError(f"{path}: not a safetensors file (its header cannot be read)")
            for name, info in header.items():
                if name != "__metadata__":
                    start, end = info["data_offsets"]
                    self.where[name] = (path, info["dtype"], list(info["shape"]), 8 + size + start, 8 + size + end)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def keys(self) -> list[str]:
        return list(self.where)

    def pop(self, name: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        """The tensor `name`, read now and forgotten here (its memory is the caller's); `default` when absent."""
        if name not in self.where:
            return default
        path, dtype, shape, start, end = self.where.pop(name)
        if dtype not in ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype}, which we do not read")
        out = torch.empty(shape, dtype=ST_DTYPES[dtype])
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        if len(view) != end - start:
            raise ValueError(f"{path}: tensor {name!r} has {end - start} bytes for shape {shape} {dtype}")
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], start + done)
                if n <= 0:
                    raise ValueError(f"{path}: tensor {name!r} ends past the end of the file; the file is truncated")
                done += n
        finally:
            os.close(fd)
        return out


def read_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors shard, by name."""
    reader = SafetensorsReader(model_dir)
    return {name: reader.pop(name) for name in reader.keys()}


def _take(tensors: SafetensorsReader, name: str) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"checkpoint is missing weight {name!r}")
    return tensors.pop(name)


def load_weights(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
                 weights: str = "fp32") -> dict[str, torch.Tensor | QWeight | Q4Weight]:
    """Weights by engine name, fused and cast to `dtype`: embed, norm, lm_head, layers.{i}.{qkv,o,gate_up,down,...}.
    weights="int8": the matrices of the linear layers and the lm_head become QWeight (quantized from the
    checkpoint's own values, after fusing); the embedding lookup, norms and biases keep `dtype`.
    weights="int4": the layers' matrices become Q4Weight (4 bits, a scale and a minimum per group of 32 columns) and
    the lm_head int8, as llama.cpp's 4-bit files keep their output matrix at 6 or 8 bits (docs/engine.md: a 4-bit
    lm_head costs 6 % of perplexity on the default model, the layers 0.x %).
    Every weight but the embedding (which a step reads only a few rows of) ends in one huge-page arena
    (hugepages.py), so the decode step streams it through 2 MiB pages; TOKENLOOP_HUGE_PAGES=off keeps torch's.
    A GGUF file is read by engine/gguf.py, tensor by tensor."""
    if is_gguf(model_dir):
        from .gguf import load_gguf_weights

        return load_gguf_weights(model_dir, config, dtype, weights)
    raw = SafetensorsReader(model_dir)  # each tensor read when taken: at most a layer's in memory beside the weights
    cast = lambda t: t.to(dtype).contiguous()  # noqa: E731
    # Gemma 3's norms multiply by (1 + w), computed in float32: folded into the weight once
    norm = (lambda t: cast(t.float() + 1.0)) if config.sandwich_norms else cast
    linear = {"int8": qweight, "int4": qweight4}.get(weights, cast)
    out = {"embed": cast(_take(raw, "model.embed_tokens.weight")), "norm": norm(_take(raw, "model.norm.weight"))}
    lm_head = raw.pop("lm_head.weight", None)
    if weights in ("int8", "int4"):
        out["lm_head"] = as_head(qweight(out["embed"] if lm_head is None or config.tie_word_embeddings else lm_head))
    else:
        out["lm_head"] = out["embed"] if lm_head is None or config.tie_word_embeddings else cast(lm_head)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        fused = a + "qkv_proj.weight" in raw  # Phi-3: q/k/v and gate/up stored fused, in the engine's order
        out[f"layers.{i}.qkv"] = linear(_take(raw, a + "qkv_proj.weight") if fused else
                                        torch.cat([_take(raw, a + f"{x}_proj.weight") for x in "qkv"]))
        if config.qkv_bias:
            out[f"layers.{i}.qkv_bias"] = cast(torch.cat([_take(raw, a + f"{x}_proj.bias") for x in "qkv"]))
        out[f"layers.{i}.o"] = linear(_take(raw, a + "o_proj.weight"))
        out[f"layers.{i}.gate_up"] = linear(_take(raw, p + "mlp.gate_up_proj.weight") if fused else
                                            torch.cat([_take(raw, p + f"mlp.{x}_proj.weight") for x in ("gate", "up")]))
        out[f"layers.{i}.down"] = linear(_take(raw, p + "mlp.down_proj.weight"))
        out[f"layers.{i}.input_norm"] = norm(_take(raw, p + "input_layernorm.weight"))
        if config.sandwich_norms:  # Gemma 3: post_norm is the MLP's input norm; the outputs get their own
            out[f"layers.{i}.post_attn_norm"] = norm(_take(raw, p + "post_attention_layernorm.weight"))
            out[f"layers.{i}.post_norm"] = norm(_take(raw, p + "pre_feedforward_layernorm.weight"))
            out[f"layers.{i}.post_ff_norm"] = norm(_take(raw, p + "post_feedforward_layernorm.weight"))
        else:
            out[f"layers.{i}.post_norm"] = cast(_take(raw, p + "post_attention_layernorm.weight"))
        if config.qk_norm:
            out[f"layers.{i}.q_norm"] = norm(_take(raw, a + "q_norm.weight"))
            out[f"layers.{i}.k_norm"] = norm(_take(raw, a + "k_norm.weight"))
        hugepages.release_free_memory()  # the layer's checkpoint tensors, freed on the C heap
    return hugepages.move_weights(out)
