"""The engine's model, built from a checkpoint and the engine's config: weights loaded, the matrix-product policy
calibrated, the native kernels chosen, the KV cache sized."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from . import kernels
from .config import EngineConfig
from .layer_kernels import PagedAttention
from .loader import ModelConfig, load_weights
from .matmul import Backend, MatmulPolicy
from .model import Model
from .quant import Q4Weight, QWeight

log = logging.getLogger(__name__)


def default_num_threads() -> int:
    """All cores but one: the gRPC front and the looper need one, and an OpenMP barrier that waits
    for a descheduled worker costs a whole scheduler time slice."""
    return max(1, (os.cpu_count() or 1) - 1)


def build_model(model_dir: str | Path, config: EngineConfig, model_config: ModelConfig, weights_name: str) -> Model:
    """Load the checkpoint's weights (`weights_name`: what the log calls them) and build the Model over a KV cache of
    config.num_kv_blocks blocks."""
    dtype = config.torch_dtype
    started = time.perf_counter()
    weights = load_weights(model_dir, model_config, dtype, config.weights)
    log.info("engine: weights %s loaded in %.1f s", weights_name, time.perf_counter() - started)
    kv_dtype = config.kv_torch_dtype
    num_blocks = config.num_kv_blocks(Model.kv_bytes_per_token(model_config, kv_dtype))
    gate_ups = [weights[f"layers.{i}.gate_up"] for i in range(model_config.num_layers)]
    paged = paged_attention(config, dtype)
    return Model(model_config, weights, dtype, num_blocks, config.block_size, matmul_policy(config, gate_ups), paged,
                 split_attention=(os.cpu_count() or 1) >= 2, ops=kernels.load_ops() if paged is not None else None,
                 kv_dtype=kv_dtype)


def paged_attention(config: EngineConfig, dtype: torch.dtype) -> PagedAttention | None:
    """The native decode-attention kernel when wanted and there is a C compiler; `native` insists (start-up error).
    A kernel that fails to build raises kernels.KernelBuildError (start-up error) whatever is wanted."""
    wanted = config.attention_backend
    if wanted == "torch" or dtype != torch.float32:
        return None
    paged = kernels.load_paged_attention()
    if paged is None and wanted == "native":
        raise RuntimeError(f"attention_backend 'native' is unavailable here ({kernels.NO_COMPILER}); use 'torch'")
    return paged


def matmul_policy(config: EngineConfig, gate_ups: list) -> MatmulPolicy:
    """How the products run, timed over every layer's gate_up (they stream from memory) unless config fixes it."""
    sample = gate_ups[0]
    if isinstance(sample, Q4Weight):
        return MatmulPolicy.calibrate_int4(gate_ups, kernels.load_int4(), kernels.load_int8())
    if isinstance(sample, QWeight):
        return MatmulPolicy.calibrate_int8(gate_ups, kernels.load_int8())
    if config.matmul_backend == "auto":
        return MatmulPolicy.calibrate(gate_ups, kernels.load_int8())
    usable = sample.dtype in (torch.float32, torch.float64)
    wanted = Backend(config.matmul_backend)
    return MatmulPolicy.fixed(wanted if usable else Backend.TORCH)
