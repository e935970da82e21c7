"""EngineConfig: the embedded engine's knobs (the `tokenloop serve` flags map onto these fields)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tokenloop.core.request import POOLINGS

from .quant import WEIGHT_MODES
from .speculation import SpeculativeConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
MATMUL_BACKENDS = ("auto", "torch", "numpy", "numpy2", "native2", "f32c2")
ATTENTION_BACKENDS = ("auto", "native", "torch")
KV_DTYPES = ("auto", "fp32", "fp16")
DEFAULT_KV_CACHE_TOKENS = 32768
DEFAULT_KV_MEMORY_FRACTION = 0.25  # of MemAvailable after the weights load, at most, for the default KV cache


@dataclass(slots=True)
class EngineConfig:
    """Engine settings; checks itself on construction (ValueError naming the field)."""

    max_batch_size: int = 32  # --max-batch-size: sequences in one step
    max_num_tokens: int = 512  # --max-num-tokens: tokens in one step (prefill chunks + decodes)
    kv_cache_tokens: int | None = None  # --kv-cache-tokens: KV cache size in tokens
    kv_cache_memory_fraction: float | None = None  # --kv-cache-memory-fraction: of available RAM
    block_size: int = 16  # --block-size: tokens per KV block
    dtype: str = "float32"  # --dtype: float32 | bfloat16 (float64 for tests)
    num_threads: int | None = None  # --num-threads: torch threads (None: all cores but one)
    max_model_len: int | None = None  # cap on prompt + output tokens (None: the model's limit)
    enable_prefix_caching: bool = True
    matmul_backend: str = "auto"  # auto: time torch and numpy at start-up and pick per batch size
    # decode attention: native = the C kernel over the paged cache (kernels.py; float32), torch = gather + SDPA,
    # auto = native where it builds and the dtype is float32, else torch
    attention_backend: str = "auto"
    # --weights: fp32 = the checkpoint's weights in `dtype`; int8 = linear layers and lm_head quantized at load
    # time (symmetric per output channel, engine/quant.py), float32 activations and accumulation; int4 = the same
    # matrices as 4-bit values with a scale and a minimum per group of 32 columns (llama.cpp's Q4_1)
    weights: str = "fp32"
    # --kv-dtype: the KV cache's element type (docs/engine.md#16-bit-kv-cache). fp32 = the activations' dtype (the
    # float32 reference); fp16 = IEEE half, written rounded to nearest and widened as attention reads it (half the
    # bytes: twice the tokens in a budget); auto = fp16 for --weights int8 / int4, fp32 otherwise
    kv_dtype: str = "auto"
    max_lora_rank: int = 64  # --max-lora-rank: the largest LoRA rank an adapter may have
    # embedding requests that name none (engine/pooling.py): None = the model's sentence-transformers config, else
    # last token, normalized
    embed_pooling: str | None = None  # --embed-pooling: last | mean
    embed_normalize: bool | None = None  # --embed-normalize / --no-embed-normalize
    # speculative decoding (engine/speculation.py): off | ngram (prompt lookup), the most tokens one sequence drafts
    # in a step, and the decoding sequences above which a step drafts nothing. On by default (docs/engine.md,
    # "Speculative decoding", the rule that made it so): the output is the same, and it drafts only where it pays
    speculative: str = "ngram"
    num_speculative_tokens: int = 4
    speculative_max_batch_size: int = 4
    # --route-retiming: re-time the quantized products' routes of one family on real steps and switch to a faster one
    # (engine/route_timing.py; same bits, so the same tokens); on by default, --no-route-retiming turns it off
    route_retiming: bool = True

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_num_tokens < self.max_batch_size:
            raise ValueError(f"max_num_tokens ({self.max_num_tokens}) must be >= max_batch_size "
                             f"({self.max_batch_size}) so every running sequence decodes each step")
        if not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be in 1..1024, got {self.block_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_memory_fraction is not None:
            raise ValueError("set kv_cache_tokens or kv_cache_memory_fraction, not both")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens must be >= block_size ({self.block_size}), got {self.kv_cache_tokens}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.attention_backend == "native" and self.dtype != "float32":
            raise ValueError(f"attention_backend 'native' needs dtype float32, got {self.dtype!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {self.weights!r}")
        if self.weights in ("int8", "int4") and self.dtype != "float32":
            raise ValueError(f"weights {self.weights!r} keeps float32 activations and needs dtype float32, "
                             f"got {self.dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.kv_dtype == "fp16" and self.dtype != "float32":
            raise ValueError(f"kv_dtype 'fp16' needs dtype float32 (the activations it is widened to), "
                             f"got {self.dtype!r}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.embed_pooling is not None and self.embed_pooling not in POOLINGS:
            raise ValueError(f"embed_pooling must be one of {', '.join(POOLINGS)}, got {self.embed_pooling!r}")
        if self.matmul_backend not in MATMUL_BACKENDS:
            raise ValueError(f"matmul_backend must be one of {', '.join(MATMUL_BACKENDS)}, got {self.matmul_backend!r}")
        self.speculative_config  # noqa: B018 - checks the speculative settings (ValueError)

    @property
    def speculative_config(self) -> SpeculativeConfig:
        return SpeculativeConfig(mode=self.speculative, num_speculative_tokens=self.num_speculative_tokens,
                                 max_batch_size=self.speculative_max_batch_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's dtype: float16 for kv_dtype fp16, or auto with int8 / int4 weights; else the activations'."""
        quantized = self.weights in ("int8", "int4")
        if self.kv_dtype == "fp16" or (self.kv_dtype == "auto" and quantized and self.dtype == "float32"):
            return torch.float16
        return self.torch_dtype

    def num_kv_blocks(self, bytes_per_token: int) -> int:
        """Blocks in the KV cache, from kv_cache_tokens, a memory fraction, or default_kv_tokens (the model's bytes per
        token and the machine's free memory)."""
        if self.kv_cache_memory_fraction is not None:
            tokens = int(available_memory_bytes() * self.kv_cache_memory_fraction) // bytes_per_token
        else:
            tokens = self.kv_cache_tokens or default_kv_tokens(bytes_per_token, self.block_size)
        num_blocks = tokens // self.block_size
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget ({tokens} tokens) is smaller than one block ({self.block_size})")
        return num_blocks


def default_kv_tokens(bytes_per_token: int, block_size: int = 16, available: int | None = None) -> int:
    """The KV cache's size when no flag sets it, from the model and the machine (docs/models.md#the-kv-cache): 32,768
    tokens, or fewer where those would take more than DEFAULT_KV_MEMORY_FRACTION of the memory available once the
    weights are loaded (a 1.7B Llama in float32 takes 384 KiB per token: 12 GiB at 32,768), and never under one
    block. vLLM's CPU backend reserves a fixed KV space (4 GiB by default); llama.cpp sizes its context from the
    model; this takes the smaller of a fixed count and a share of free memory."""
    free = available_memory_bytes() if available is None else available
    fitting = int(free * DEFAULT_KV_MEMORY_FRACTION) // max(1, bytes_per_token)
    return max(block_size, min(DEFAULT_KV_CACHE_TOKENS, fitting))


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo, or physical memory where that is unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
