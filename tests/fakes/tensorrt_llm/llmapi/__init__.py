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


class _DecodingBase(_StrictModel):
    """llm_args.py DecodingBaseConfig @ 00043967: max_draft_len, speculative_model (alias speculative_model_dir),
    max_concurrency, draft_len_schedule, ... (the fields the adapter may set, and a few it does not)."""

    BASE: ClassVar[dict] = {"max_draft_len": None, "max_total_draft_tokens": None, "speculative_model": None,
                            "max_concurrency": None, "draft_len_schedule": None, "load_format": None,
                            "acceptance_window": None, "acceptance_length_threshold": None}

    def __init__(self, **kwargs):
        self.FIELDS = {**self.BASE, **type(self).FIELDS}
        super().__init__(**kwargs)
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"{type(self).__name__}: max_concurrency: Input should be greater than 0")


class NGramDecodingConfig(_DecodingBase):
    """PyTorch backend only; max_draft_len must be > 0."""

    FIELDS: ClassVar[dict] = {"max_matching_ngram_size": 2, "is_keep_all": True, "is_use_oldest": True,
                              "is_public_pool": True}
    decoding_type = "NGram"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.max_draft_len is None or self.max_draft_len <= 0:
            raise ValueError("max_draft_len must be > 0 for NGram")


class DraftTargetDecodingConfig(_DecodingBase):
    """max_draft_len > 0 and a speculative_model."""

    FIELDS: ClassVar[dict] = {}
    decoding_type = "Draft_Target"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.max_draft_len is None or self.max_draft_len <= 0:
            raise ValueError("max_draft_len must be > 0 for DraftTarget")
        if self.speculative_model is None:
            raise ValueError("speculative_model must be specified for DraftTarget")


class LookaheadDecodingConfig(_DecodingBase):
    """Each size positive (the bindings' defaults otherwise)."""

    FIELDS: ClassVar[dict] = {"max_window_size": 4, "max_ngram_size": 3, "max_verification_set_size": 4}
    decoding_type = "Lookahead"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        for name in ("max_window_size", "max_ngram_size", "max_verification_set_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Value must be positive, got {getattr(self, name)}")


class SchedulerConfig(_StrictModel):
    FIELDS: ClassVar[dict] = {"capacity_scheduler_policy": CapacitySchedulerPolicy.GUARANTEED_NO_EVICT,
              "context_chunking_policy": None, "dynamic_batch_config": None}


__all__ = [
    "LLM",
    "CapacitySchedulerPolicy",
    "CompletionOutput",
    "DraftTargetDecodingConfig",
    "GuidedDecodingParams",
    "KvCacheConfig",
    "LookaheadDecodingConfig",
    "LoraConfig",
    "NGramDecodingConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
