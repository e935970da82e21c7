"""The engine's model, built from a checkpoint and the engine's config: weights loaded, the matrix-product policy
calibrated, the native kernels chosen, the KV cache sized."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path

import torch

from . import hugepages, kernels
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
    hugepages.release_free_memory()  # before the KV cache is touched: what the load freed leaves the peak
    kv_dtype = config.kv_torch_dtype
    num_blocks = config.num_kv_blocks(Model.kv_bytes_per_token(model_config, kv_dtype))
    gate_ups = [weights[f"layers.{i}.gate_up"] for i in range(model_config.num_layers)]
    paged = paged_attention(config, dtype)
    model = Model(model_config, weights, dtype, num_blocks, config.block_size,
                  matmul_policy(config, gate_ups, weights["lm_head"]), paged,
                  split_attention=(os.cpu_count() or 1) >= 2, ops=kernels.load_ops() if paged is not None else None,
                  kv_dtype=kv_dtype)
    hugepages.release_free_memory()  # the calibration's buffers
    kv = 2 * model.k_cache.numel() * model.k_cache.element_size()
    size = weight_bytes(weights)
    log.info("engine: weights %.2f GiB (%d bytes), KV cache %.2f GiB (%d bytes, %s)", size / 2**30, size, kv / 2**30,
             kv, str(kv_dtype).removeprefix("torch."))
    return model


def weight_bytes(weights: dict) -> int:
    """Bytes of the loaded weights (loader.load_weights' values: tensors, QWeight, Q4Weight), each tensor once (a tied
    lm_head is the embedding)."""
    seen: dict[int, int] = {}
    for value in weights.values():
        tensors = [value] if isinstance(value, torch.Tensor) else [getattr(value, f.name) for f in
                                                                  dataclasses.fields(value)]
        for t in tensors:
            if isinstance(t, torch.Tensor):
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


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


def matmul_policy(config: EngineConfig, gate_ups: list, lm_head=None) -> MatmulPolicy:
    """How the products run, timed over every layer's gate_up (they stream from memory) unless config fixes it; a
    quantized lm_head (QWeight.head) is timed with them (quant_routes.HEAD_SUFFIX: routes differ in its path)."""
    sample = gate_ups[0]
    head = lm_head if isinstance(lm_head, QWeight) and lm_head.head else None
    timed = gate_ups + [head] if head is not None else gate_ups
    if isinstance(sample, (Q4Weight, QWeight)):
        policy = (MatmulPolicy.calibrate_int4(timed, kernels.load_int4(), kernels.load_int8())
                  if isinstance(sample, Q4Weight) else MatmulPolicy.calibrate_int8(timed, kernels.load_int8()))
        route = policy.route(1)[0]
        if head is not None and route.head is not None and route.head.x16_takes(head):
            route.head.packed(head)  # at start-up, not in the first request (one packing for the family's routes)
        return policy
    if config.matmul_backend == "auto":
        return MatmulPolicy.calibrate(gate_ups, kernels.load_int8())
    usable = sample.dtype in (torch.float32, torch.float64)
    wanted = Backend(config.matmul_backend)
    return MatmulPolicy.fixed(wanted if usable else Backend.TORCH)
