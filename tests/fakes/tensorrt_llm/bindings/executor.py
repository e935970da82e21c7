"""Fake `tensorrt_llm.bindings.executor`: the nanobind surface of TensorRT-LLM 1.2's C++ executor.

Mirrors NVIDIA/TensorRT-LLM cpp/tensorrt_llm/nanobind/executor/{request,executor,executorConfig,bindings}.cpp
(request.cpp and executorConfig.cpp @ 008b2b8d, executor.cpp @ 1dd50d07): the argument names, order and
defaults, which arguments may be positional (`Request(input_token_ids, max_tokens, *, ...)`,
`SamplingConfig(beam_width=1, *, ...)`, `KvCacheConfig`'s first ten; the other configs take all by position),
`Response.has_error()` as a method, `Result` fields, streaming deltas in `output_token_ids` with the full
`log_probs` list, CANCELLED final responses after `cancel_request`, error responses, iteration stats.
"""

from __future__ import annotations

import enum
import json

from .. import _fake
from .._fake import kw_init


class ModelType(enum.Enum):
    DECODER_ONLY = 0
    ENCODER_ONLY = 1
    ENCODER_DECODER = 2


class FinishReason(enum.Enum):
    NOT_FINISHED = 0
    END_ID = 1
    STOP_WORDS = 2
    LENGTH = 3
    TIMED_OUT = 4
    CANCELLED = 5


class CapacitySchedulerPolicy(enum.Enum):
    MAX_UTILIZATION = 0
    GUARANTEED_NO_EVICT = 1
    STATIC_BATCH = 2


class CommunicationType(enum.Enum):
    MPI = 0


class CommunicationMode(enum.Enum):
    LEADER = 0
    ORCHESTRATOR = 1


class _NewReason:
    """A finish reason from a newer TensorRT-LLM than the adapter knows."""

    name = "SOMETHING_NEW"


def _config_class(name: str, spec: dict, required: tuple = (), positional: int | None = None):
    def __init__(self, *args, **kwargs):
        kw_init(self, name, args, kwargs, spec, required, positional)
    return type(name, (), {"__init__": __init__})


KvCacheConfig = _config_class("KvCacheConfig", {
    "enable_block_reuse": True, "max_tokens": None, "max_attention_window": None, "sink_token_length": None,
    "free_gpu_memory_fraction": None, "host_cache_size": None, "onboard_blocks": True,
    "cross_kv_cache_fraction": None, "secondary_offload_min_priority": None, "event_buffer_max_size": 0,
    "enable_partial_reuse": True, "copy_on_partial_reuse": True, "use_uvm": False, "runtime_defaults": None},
    positional=10)  # nb::kw_only() before enable_partial_reuse
SchedulerConfig = _config_class("SchedulerConfig", {
    "capacity_scheduler_policy": CapacitySchedulerPolicy.GUARANTEED_NO_EVICT, "context_chunking_policy": None,
    "dynamic_batch_config": None})
OrchestratorConfig = _config_class("OrchestratorConfig", {
    "is_orchestrator": True, "worker_executable_path": "", "orch_leader_comm": None, "spawn_processes": True})
ParallelConfig = _config_class("ParallelConfig", {
    "communication_type": CommunicationType.MPI, "communication_mode": CommunicationMode.LEADER,
    "device_ids": None, "participant_ids": None, "orchestrator_config": None, "num_nodes": None})
ExecutorConfig = _config_class("ExecutorConfig", {
    "max_beam_width": 1, "scheduler_config": None, "kv_cache_config": None, "enable_chunked_context": False,
    "normalize_log_probs": True, "iter_stats_max_iterations": 1000, "request_stats_max_iterations": 0,
    "batching_type": None, "max_batch_size": None, "max_num_tokens": None, "parallel_config": None,
    "peft_cache_config": None, "logits_post_processor_config": None, "decoding_config": None,
    "use_gpu_direct_storage": False, "gpu_weights_percent": 1.0, "max_queue_size": None,
    "extended_runtime_perf_knob_config": None, "debug_config": None, "recv_poll_period_ms": 0,
    "max_seq_idle_microseconds": 180_000_000, "spec_dec_config": None, "guided_decoding_config": None,
    "additional_model_outputs": None, "cache_transceiver_config": None, "gather_generation_logits": False,
    "mm_embedding_offloading": False, "enable_trt_overlap": False})
OutputConfig = _config_class("OutputConfig", {
    "return_log_probs": False, "return_context_logits": False, "return_generation_logits": False,
    "exclude_input_from_output": False, "return_encoder_output": False, "return_perf_metrics": False,
    "additional_model_outputs": None})

_SAMPLING = {"beam_width": 1, "top_k": None, "top_p": None, "top_p_min": None, "top_p_reset_ids": None,
             "top_p_decay": None, "seed": None, "temperature": None, "min_tokens": None,
             "beam_search_diversity_rate": None, "repetition_penalty": None, "presence_penalty": None,
             "frequency_penalty": None, "length_penalty": None, "early_stopping": None,
             "no_repeat_ngram_size": None, "num_return_sequences": None, "min_p": None, "beam_width_array": None}
_REQUEST = {"input_token_ids": None, "max_tokens": None, "streaming": False, "sampling_config": None,
            "output_config": None, "end_id": None, "pad_id": None, "position_ids": None, "bad_words": None,
            "stop_words": None, "embedding_bias": None, "client_id": None, "return_all_generated_tokens": False,
            "num_return_sequences": 1, "guided_decoding_params": None, "allotted_time_ms": None,
            "lora_config": None}


class LoraConfig:
    """request.cpp: LoraConfig(task_id, weights=None, config=None), all positional; weights [num_module_layers,
    D*Hi + Ho*D] and config [num_module_layers, 3] (docs/source/advanced/lora.md) come together or not at all."""

    def __init__(self, task_id, weights=None, config=None):
        if not isinstance(task_id, int):
            raise TypeError("LoraConfig.__init__(): task_id must be an int")
        if (weights is None) != (config is None):
            raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: lora weights and lora config must both be "
                               "given or both omitted")
        self.task_id, self.weights, self.config = task_id, weights, config


class GuidedDecodingParams:
    """request.cpp: GuidedDecodingParams(guide_type, guide=None), with the nested GuideType enum."""

    class GuideType(enum.Enum):
        JSON = 0
        JSON_SCHEMA = 1
        REGEX = 2
        EBNF_GRAMMAR = 3
        STRUCTURAL_TAG = 4

    def __init__(self, *args, **kwargs):
        kw_init(self, "GuidedDecodingParams", args, kwargs, {"guide_type": None, "guide": None}, ("guide_type",))
        if not isinstance(self.guide_type, GuidedDecodingParams.GuideType):
            raise TypeError("GuidedDecodingParams.__init__(): guide_type must be a GuideType")


class GuidedDecodingConfig:
    """executorConfig.cpp: GuidedDecodingConfig(backend, encoded_vocab=None, tokenizer_str=None,
    stop_token_ids=None), with the nested GuidedDecodingBackend enum."""

    class GuidedDecodingBackend(enum.Enum):
        XGRAMMAR = 0
        LLGUIDANCE = 1

    def __init__(self, *args, **kwargs):
        kw_init(self, "GuidedDecodingConfig", args, kwargs,
                {"backend": None, "encoded_vocab": None, "tokenizer_str": None, "stop_token_ids": None}, ("backend",))
        if not isinstance(self.backend, GuidedDecodingConfig.GuidedDecodingBackend):
            raise TypeError("GuidedDecodingConfig.__init__(): backend must be a GuidedDecodingBackend")


class DecodingMode:
    """bindings.cpp: DecodingMode's factories (`DecodingMode.Lookahead()`, ...); `name` says which one made it."""

    def __init__(self, name: str):
        self.name = name

    @staticmethod
    def Auto():  # noqa: N802 - the binding's names
        return DecodingMode("Auto")

    @staticmethod
    def Lookahead():  # noqa: N802
        return DecodingMode("Lookahead")

    @staticmethod
    def Medusa():  # noqa: N802
        return DecodingMode("Medusa")

    @staticmethod
    def Eagle():  # noqa: N802
        return DecodingMode("Eagle")


class LookaheadDecodingConfig:
    """request.cpp: LookaheadDecodingConfig(max_window_size, max_ngram_size, max_verification_set_size), all
    required; the C++ constructor rejects sizes below 1."""

    def __init__(self, *args, **kwargs):
        kw_init(self, "LookaheadDecodingConfig", args, kwargs,
                {"max_window_size": None, "max_ngram_size": None, "max_verification_set_size": None},
                ("max_window_size", "max_ngram_size", "max_verification_set_size"))
        if min(self.max_window_size, self.max_ngram_size, self.max_verification_set_size) < 1:
            raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: lookahead sizes must be >= 1")


def _decoding_config_init(self, *args, **kwargs):
    kw_init(self, "DecodingConfig", args, kwargs, {"decoding_mode": None, "lookahead_decoding_config": None,
                                                   "medusa_choices": None, "eagle_config": None})
    if self.decoding_mode is not None and not isinstance(self.decoding_mode, DecodingMode):
        raise TypeError("DecodingConfig.__init__(): decoding_mode must be a DecodingMode")
    if self.lookahead_decoding_config is not None and not isinstance(self.lookahead_decoding_config,
                                                                     LookaheadDecodingConfig):
        raise TypeError("DecodingConfig.__init__(): lookahead_decoding_config must be a LookaheadDecodingConfig")


DecodingConfig = type("DecodingConfig", (), {"__init__": _decoding_config_init,
                                             "__doc__": "executorConfig.cpp: DecodingConfig(decoding_mode=None, "
                                                        "lookahead_decoding_config=None, medusa_choices=None, "
                                                        "eagle_config=None), all positional or keyword."})


def _legacy(spec: dict, new: str, old: str) -> dict:
    return {(old if k == new else k): v for k, v in spec.items()} if _fake.LEGACY_NAMES else spec


class SamplingConfig:
    def __init__(self, *args, **kwargs):
        kw_init(self, "SamplingConfig", args, kwargs, _legacy(_SAMPLING, "seed", "random_seed"),
                positional=1)  # beam_width, then nb::kw_only()


class Request:
    def __init__(self, *args, **kwargs):
        spec = _legacy(_REQUEST, "max_tokens", "max_new_tokens")
        required = ("input_token_ids", "max_new_tokens" if _fake.LEGACY_NAMES else "max_tokens")
        kw_init(self, "Request", args, kwargs, spec, required, positional=2)  # then nb::kw_only()
        if _fake.LEGACY_NAMES:
            self.max_tokens = self.max_new_tokens
        if not all(isinstance(t, int) for t in self.input_token_ids):
            raise TypeError("Request.__init__(): input_token_ids must be a list of int")
        self.sampling_config = self.sampling_config or SamplingConfig()
        self.output_config = self.output_config or OutputConfig()


class Result:
    def __init__(self):
        self.is_final = False
        self.output_token_ids: list[list[int]] = []
        self.cum_log_probs: list[float] | None = None
        self.log_probs: list[list[float]] | None = None
        self.finish_reasons: list = []
        self.sequence_index = 0
        self.is_sequence_final = False
        self.decoding_iter = 0
        self.request_perf_metrics: RequestPerfMetrics | None = None  # set when OutputConfig.return_perf_metrics


class SpeculativeDecodingMetrics:
    """request.cpp: RequestPerfMetrics.SpeculativeDecodingMetrics (acceptance_rate, total_accepted_draft_tokens,
    total_draft_tokens)."""

    def __init__(self):
        self.acceptance_rate = 0.0
        self.total_accepted_draft_tokens = self.total_draft_tokens = 0


class RequestPerfMetrics:
    """request.cpp: RequestPerfMetrics; only `speculative_decoding` is modelled."""

    def __init__(self):
        self.speculative_decoding = SpeculativeDecodingMetrics()


class Response:
    def __init__(self, *args, request_id: int, error_msg: str | None = None, result: Result | None = None,
                 client_id: int | None = None):
        if args:
            raise TypeError("Response.__init__(): keyword arguments only in the fake")
        self.request_id, self.client_id = request_id, client_id
        self._error, self._result = error_msg, result

    def has_error(self) -> bool:
        return self._error is not None

    @property
    def error_msg(self) -> str:
        if self._error is None:
            raise RuntimeError("Cannot get the error message of a response without an error")
        return self._error

    @property
    def result(self) -> Result:
        if self._error is not None:
            raise RuntimeError("Cannot get the result of a response with an error")
        return self._result


class KvCacheStats:
    def __init__(self):
        self.max_num_blocks = self.free_num_blocks = self.used_num_blocks = self.tokens_per_block = 0


class IterationStats:
    def __init__(self):
        self.iter = 0
        self.iter_latency_ms = 0.0
        self.num_active_requests = self.num_queued_requests = 0
        self.kv_cache_stats: KvCacheStats | None = None
        self.spec_decoding_stats = None  # _fake.SpecIteration when the engine speculates

    def to_json_str(self) -> str:
        out = {"iter": self.iter, "iterLatencyMS": self.iter_latency_ms, "numActiveRequests": self.num_active_requests,
               "numQueuedRequests": self.num_queued_requests}
        if self.kv_cache_stats is not None:
            kv = self.kv_cache_stats
            out["kvCacheStats"] = {"maxNumBlocks": kv.max_num_blocks, "freeNumBlocks": kv.free_num_blocks,
                                   "usedNumBlocks": kv.used_num_blocks, "tokensPerBlock": kv.tokens_per_block}
        if self.spec_decoding_stats is not None:
            out["specDecodingStats"] = self.spec_decoding_stats.to_json()
        return json.dumps(out)


from ._engine import Executor

__all__ = [
    "CapacitySchedulerPolicy",
    "CommunicationMode",
    "CommunicationType",
    "DecodingConfig",
    "DecodingMode",
    "Executor",
    "ExecutorConfig",
    "FinishReason",
    "GuidedDecodingConfig",
    "GuidedDecodingParams",
    "IterationStats",
    "KvCacheConfig",
    "KvCacheStats",
    "LookaheadDecodingConfig",
    "ModelType",
    "OrchestratorConfig",
    "OutputConfig",
    "ParallelConfig",
    "Request",
    "RequestPerfMetrics",
    "Response",
    "Result",
    "SamplingConfig",
    "SchedulerConfig",
    "SpeculativeDecodingMetrics",
]
