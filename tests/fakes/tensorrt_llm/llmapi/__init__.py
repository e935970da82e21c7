"""Fake `tensorrt_llm.llmapi`: LLM, SamplingParams, and the pydantic-style config objects."""

from __future__ import annotations

import enum
from typing import ClassVar

from ..sampling_params import GuidedDecodingParams, SamplingParams
from .llm import LLM, CompletionOutput, RequestError, RequestOutput


class CapacitySchedulerPolicy(enum.StrEnum):
    MAX_UTILIZATION = "MAX_UTILIZATION"
    GUARANTEED_NO_EVICT = "GUARANTEED_NO_EVICT"
    STATIC_BATCH = "STATIC_BATCH"


class _StrictModel:
    """Keyword-only, unknown fields refused (pydantic `extra="forbid"`, a ValueError)."""

    FIELDS: ClassVar[dict] = {}

    def __init__(self, *args, **kwargs):
        if args:
            raise TypeError(f"{type(self).__name__}() takes keyword arguments only")
        unknown = set(kwargs) - set(self.FIELDS)
        if unknown:
            raise ValueError(f"{type(self).__name__}: extra inputs are not permitted: {sorted(unknown)}")
        for name, default in self.FIELDS.items():
            setattr(self, name, kwargs.get(name, default))


class KvCacheConfig(_StrictModel):
    FIELDS: ClassVar[dict] = {"enable_block_reuse": True, "max_tokens": None, "free_gpu_memory_fraction": 0.9,
              "host_cache_size": None, "enable_partial_reuse": True, "event_buffer_max_size": 0}


class LoraConfig(_StrictModel):
    """llm-api/reference LoraConfig (tensorrt_llm/lora_helper.py): keyword-only, extra fields forbidden."""

    FIELDS: ClassVar[dict] = {"lora_dir": [], "lora_ckpt_source": "hf", "max_lora_rank": 64,
                              "lora_target_modules": [], "trtllm_modules_to_hf_modules": {}, "max_loras": None,
                              "max_cpu_loras": None, "swap_gate_up_proj_lora_b_weight": True}


class SchedulerConfig(_StrictModel):
    FIELDS: ClassVar[dict] = {"capacity_scheduler_policy": CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
              "context_chunking_policy": None, "dynamic_batch_config": None}


__all__ = [
    "LLM",
    "CapacitySchedulerPolicy",
    "CompletionOutput",
    "GuidedDecodingParams",
    "KvCacheConfig",
    "LoraConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
