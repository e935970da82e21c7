"""What both TensorRT-LLM adapters share: their configuration and the request / stats mapping.

Imports neither adapter nor `tensorrt_llm`: `trtllm/__init__.py` (the factory) and both adapters import this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tokenloop.core.executor import ExecutorStats
from tokenloop.core.request import FinishReason, StructuredOutput, ValidRequest
from tokenloop.core.tokenizer import Tokenizer

from .speculative import SpecCounts, check_speculative

APIS = ("auto", "executor", "llm")
GUIDED_BACKENDS = ("auto", "xgrammar", "llguidance", "none")
STATS_MAX_AGE_S = 5.0
SCHEDULER_POLICIES = ("max_utilization", "guaranteed_no_evict")


@dataclass(frozen=True, slots=True)
class TrtllmConfig:
    """Settings passed through to TensorRT-LLM; None leaves TensorRT-LLM's own default."""

    api: str = "auto"  # auto: a directory with *.engine files -> executor, else llm
    max_batch_size: int | None = None
    max_num_tokens: int | None = None
    kv_cache_free_gpu_memory_fraction: float | None = None
    enable_block_reuse: bool | None = None
    enable_chunked_context: bool | None = None
    scheduler_policy: str | None = None  # max_utilization | guaranteed_no_evict
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    beam_width: int = 1
    tokenizer_dir: str | None = None  # where generation_config.json lives (default: the model dir)
    executor_worker_path: str | None = None  # executorWorker binary for multi-GPU engines
    # who matches `structured` requests on the GPU; auto: llguidance on the LLM API (the library the server
    # validates with and the embedded engine uses), xgrammar on the C++ executor (its runtime's backend)
    guided_decoding_backend: str = "auto"
    # KvCacheConfig(event_buffer_max_size=...): TensorRT-LLM keeps this many KV-cache events for SubscribeKvEvents
    # (0: none; ignored when block reuse is off)
    kv_event_buffer_max_size: int = 1024
    # LoRA (trtllm/lora.py): the --lora directories turn it on; --max-loras adapters on the GPU (and on the
    # host), --max-lora-rank the largest rank
    lora_dirs: tuple[str, ...] = ()
    max_loras: int | None = None
    max_lora_rank: int = 64
    # TensorRT-LLM's own speculative decoding (trtllm/speculative.py): off | ngram | lookahead | draft_target, the
    # most drafted tokens (max_draft_len), the batch size above which it is off (max_concurrency), the draft model
    # of draft_target, and lookahead's (window, n-gram, verification set) sizes
    speculative: str = "off"
    num_speculative_tokens: int | None = None
    speculative_max_batch_size: int | None = None
    speculative_model: str | None = None
    lookahead_config: tuple[int, int, int] | None = None

    def __post_init__(self):
        if self.api not in APIS:
            raise ValueError(f"--trtllm-api must be one of {', '.join(APIS)}; got {self.api!r}")
        if self.guided_decoding_backend not in GUIDED_BACKENDS:
            raise ValueError(f"--guided-decoding-backend must be one of {', '.join(GUIDED_BACKENDS)}; "
                             f"got {self.guided_decoding_backend!r}")
        for name in ("max_batch_size", "max_num_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {value}")
        fraction = self.kv_cache_free_gpu_memory_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"--kv-cache-free-gpu-memory-fraction must be > 0 and <= 1; got {fraction}")
        if self.scheduler_policy is not None and self.scheduler_policy not in SCHEDULER_POLICIES:
            raise ValueError(f"--scheduler-policy must be one of {', '.join(SCHEDULER_POLICIES)}; "
                             f"got {self.scheduler_policy!r}")
        if self.kv_event_buffer_max_size < 0:
            raise ValueError(f"--kv-event-buffer-max-size must be >= 0; got {self.kv_event_buffer_max_size}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "beam_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}")
        check_speculative(self.speculative, self.api, self.speculative_model, self.num_speculative_tokens)

    @property
    def kv_events_enabled(self) -> bool:
        return self.kv_event_buffer_max_size > 0 and self.enable_block_reuse is not False

    def kv_cache_options(self) -> dict:
        """KvCacheConfig keyword arguments (both APIs name them the same); unset ones left to TensorRT-LLM."""
        kv = {"enable_block_reuse": self.enable_block_reuse,
              "free_gpu_memory_fraction": self.kv_cache_free_gpu_memory_fraction}
        if self.kv_events_enabled:
            kv["event_buffer_max_size"] = self.kv_event_buffer_max_size
        return {k: v for k, v in kv.items() if v is not None}

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


def engine_world_size(engine_dir: str | Path) -> int:
    """tp * pp the engine was built for (config.json `pretrained_config.mapping`), 1 if unknown."""
    try:
        config = json.loads((Path(engine_dir) / "config.json").read_text())
        mapping = config.get("pretrained_config", {}).get("mapping", {})
        return int(mapping.get("world_size") or mapping.get("tp_size", 1) * mapping.get("pp_size", 1))
    except (OSError, ValueError, AttributeError, TypeError):
        return 1


def end_and_stop_ids(request: ValidRequest, eos_token_ids: tuple[int, ...]) -> tuple[int, list[int]]:
    """The executor's `end_id` and single-token stop words: the request's stop_token_ids plus
    every further EOS id of the model. ignore_eos: end_id -1 (TensorRT-LLM's own convention)."""
    stop = list(dict.fromkeys(request.stopping.stop_token_ids))
    if request.stopping.ignore_eos or not eos_token_ids:
        return -1, stop
    return eos_token_ids[0], stop + [t for t in eos_token_ids[1:] if t not in stop]


def sampling_kwargs(request: ValidRequest) -> dict:
    """SamplingConfig / SamplingParams fields shared by both APIs (seed under the name `seed`).

    Greedy is top_k 1; sampling always sets top_k and top_p, because TensorRT-LLM treats
    "neither set" as greedy.
    """
    s, stopping = request.sampling, request.stopping
    kwargs: dict = {"seed": s.seed}
    if s.greedy:
        kwargs["top_k"] = 1
    else:
        kwargs.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
        if s.min_p > 0.0:
            kwargs["min_p"] = s.min_p
    if s.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = s.repetition_penalty
    if s.presence_penalty != 0.0:
        kwargs["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty != 0.0:
        kwargs["frequency_penalty"] = s.frequency_penalty
    if stopping.min_new_tokens > 0:
        kwargs["min_tokens"] = stopping.min_new_tokens
    return kwargs


def guided_backend(config: TrtllmConfig, api: str) -> str | None:
    """The guided-decoding backend this adapter asks TensorRT-LLM for; None: structured output is off."""
    backend = config.guided_decoding_backend
    if backend == "auto":
        return "xgrammar" if api == "executor" else "llguidance"
    return None if backend == "none" else backend


def _with_layout(schema: str) -> str:
    """A JSON schema that tells llguidance the JSON layout the embedded engine uses (its `x-guidance` options)."""
    from tokenloop.core.structured import JSON_LAYOUT

    value = json.loads(schema)
    return json.dumps({**value, "x-guidance": {**JSON_LAYOUT, **value.get("x-guidance", {})}})


def guide_for(structured: StructuredOutput, backend: str | None) -> tuple[str, str]:
    """(kind, text) of the guide TensorRT-LLM gets for a constraint: kind is `json` (a JSON schema), `regex`,
    `grammar` or `structural_tag`. A JSON schema (any JSON object: {"type": "object"}) goes with the first-try
    defaults the embedded engine compiles (`schema_text`).
    TensorRT-LLM's llguidance backend reads a grammar as Lark and has no structural tags: both go as the Lark
    grammar the server compiled; xgrammar takes the GBNF grammar and the structural tag as they came.
    Raises ValueError when structured output is off."""
    from tokenloop.core.structured import lark_of, schema_text

    if backend is None:
        raise ValueError("structured output is off on this server (--guided-decoding-backend none)")
    kind, spec = structured.kind, structured.spec
    if kind in ("json_schema", "json_object"):
        schema = schema_text(kind, spec)
        return "json", _with_layout(schema) if backend == "llguidance" else schema
    if kind == "regex":
        return "regex", spec
    if backend == "llguidance":
        return "grammar", lark_of(kind, spec)
    return kind, spec


def guided_decoding_config_kwargs(tokenizer_dir: str | Path, eos_token_ids: tuple[int, ...]) -> dict | None:
    """GuidedDecodingConfig's encoded_vocab, tokenizer_str and stop_token_ids, from tokenizer.json alone, as
    TensorRT-LLM's own `_xgrammar_tokenizer_info` builds them (tensorrt_llm/llmapi/tokenizer.py @ 89fd9b74ab7a:
    the vocabulary sorted by id, the tokenizer.json text, the one EOS id). None without a tokenizer.json."""
    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        return None
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    return {"encoded_vocab": tokenizer.encoded_vocab(), "tokenizer_str": tokenizer.to_json(),
            "stop_token_ids": list(eos_token_ids[:1]) or None}


def wants_logprobs(request: ValidRequest) -> bool:
    return request.output.logprobs or request.output.top_logprobs > 0


def stop_reason(token: int | None, request: ValidRequest) -> tuple[FinishReason, int | None]:
    """A sequence stopped on a stop word: the request's own stop token, or one more EOS id."""
    if token is not None and token in request.stopping.stop_token_ids:
        return FinishReason.STOP_TOKEN, token
    return FinishReason.EOS, None


def current_stats(snapshot: ExecutorStats | None, taken_at: float, num_in_flight: int, now: float) -> ExecutorStats:
    """The latest iteration's stats, with request counts from the adapter's own bookkeeping when
    TensorRT-LLM has nothing in flight (an idle executor reports no new iterations) or the
    snapshot is older than STATS_MAX_AGE_S."""
    snapshot = snapshot or ExecutorStats()
    if num_in_flight == 0:
        return replace(snapshot, num_running=0, num_waiting=0)
    if now - taken_at > STATS_MAX_AGE_S:
        return replace(snapshot, num_running=num_in_flight, num_waiting=0)
    return snapshot


def stats_from_iteration(stats: dict, spec: SpecCounts | None = None) -> ExecutorStats:
    """ExecutorStats from one iteration's stats in TensorRT-LLM's JSON names
    (`IterationStats.to_json_str()`, and what `LLM.get_stats_async` yields), with the speculation counts so far."""
    kv = stats.get("kvCacheStats") or {}
    spec = spec or SpecCounts()
    return ExecutorStats(
        num_running=int(stats.get("numActiveRequests", 0)),
        num_waiting=int(stats.get("numQueuedRequests", 0)),
        kv_blocks_used=int(kv.get("usedNumBlocks", 0)),
        kv_blocks_total=int(kv.get("maxNumBlocks", 0)),
        tokens_per_block=int(kv.get("tokensPerBlock", 0)),
        step_latency_s=float(stats.get("iterLatencyMS", 0.0)) / 1000.0,
        num_steps=int(stats.get("iter", 0)),
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
    )


def infer_finish(token_ids: list[int], request: ValidRequest, aborted: bool) -> tuple[FinishReason, int | None]:
    """Why a sequence ended when the LLM API did not say."""
    if aborted:
        return FinishReason.CANCELLED, None
    if len(token_ids) >= request.stopping.max_new_tokens:
        return FinishReason.LENGTH, None
    return stop_reason(token_ids[-1] if token_ids else None, request)
