"""The C++ executor adapter: `tensorrt_llm.bindings.executor.Executor` on a prebuilt TensorRT engine.

Written against NVIDIA/TensorRT-LLM's bindings, nanobind (1.x, keyword arguments required):
  cpp/tensorrt_llm/nanobind/executor/request.cpp        @ 008b2b8d23af95e4e19fa6f354f9c5f6349b2bfc
  cpp/tensorrt_llm/nanobind/executor/executor.cpp       @ 1dd50d0741fa3bdae3ffd2f54e53547cbe1a043d
  cpp/tensorrt_llm/nanobind/executor/executorConfig.cpp @ 008b2b8d23af95e4e19fa6f354f9c5f6349b2bfc
  cpp/tensorrt_llm/nanobind/executor/bindings.cpp       @ 01315fdb274cd036bfc6d893761ce97eb55305cd
(guided decoding: `GuidedDecodingParams(guide_type, guide)` in request.cpp, `GuidedDecodingConfig(backend,
encoded_vocab, tokenizer_str, stop_token_ids)` and `ExecutorConfig(guided_decoding_config=)` in
executorConfig.cpp, both @ 008b2b8d; the C++ runtime's GuidedDecoder refuses LLGUIDANCE in some releases
("LLGuidance is not supported for guided decoding in C++ runtime"), so `auto` picks XGRAMMAR here)
and pybind (0.1x; `max_new_tokens` and `random_seed` were the old names):
  cpp/tensorrt_llm/pybind/executor/bindings.cpp (the version that still accepts both names).
Response mapping follows TGI's backends/trtllm/csrc/ffi.hpp (`as_generation_step`): in streaming
mode `Result.output_token_ids[beam]` is the new tokens only, while `log_probs[beam]` holds every
log probability so far, so the adapter takes its tail.

Only the looper thread calls this object, except `stats()`, which returns a snapshot that the
looper thread refreshes from `get_latest_iteration_stats()`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from tokenloop.core.executor import EngineDeadError, ExecutorStats, Step
from tokenloop.core.kv_events import KvEventHub
from tokenloop.core.request import FinishReason, ValidRequest

from . import kv_events as trtllm_kv_events
from .common import (
    TrtllmConfig,
    current_stats,
    end_and_stop_ids,
    engine_world_size,
    guide_for,
    guided_backend,
    guided_decoding_config_kwargs,
    sampling_kwargs,
    stats_from_iteration,
    stop_reason,
    wants_logprobs,
)
from .lora import TrtllmLoras
from .speculative import SpecCounts, draft_counts, executor_decoding_config, perf_metrics_kwargs

log = logging.getLogger("tokenloop.trtllm")

_STATS_INTERVAL_S = 0.5
_REASONS = {"LENGTH": FinishReason.LENGTH, "END_ID": FinishReason.EOS, "CANCELLED": FinishReason.CANCELLED,
            # a TIMED_OUT request was stopped by TensorRT-LLM before it finished: the closest of ours
            "TIMED_OUT": FinishReason.CANCELLED}
_GUIDE_TYPES = {"json": "JSON_SCHEMA", "regex": "REGEX", "grammar": "EBNF_GRAMMAR", "structural_tag": "STRUCTURAL_TAG"}


@dataclass(slots=True)
class _Tracked:
    """What the adapter remembers about one request until its final response."""

    request: ValidRequest
    open_seqs: set[int]
    last_token: dict[int, int] = field(default_factory=dict)
    cancelled: bool = False
    lora: object | None = None  # lora.TrtllmLora it uses, released when it ends


class TrtllmExecutor(TrtllmLoras):
    """`Executor` on `tensorrt_llm.bindings.executor.Executor` (prebuilt TensorRT engines)."""

    def __init__(self, engine_dir: str, config: TrtllmConfig, eos_token_ids: tuple[int, ...] = ()):
        from tensorrt_llm.bindings import executor as tle  # lazily: see trtllm/__init__.py

        self._tle = tle
        self._config = config
        self._eos = tuple(eos_token_ids)
        self._tracked: dict[int, _Tracked] = {}
        self._with_tensors = True  # LoRA weights go in the first request of a task id (trtllm/lora.py)
        self._init_loras(bool(config.lora_dirs), config.max_lora_rank)
        self._stats: ExecutorStats | None = None
        self._stats_at = 0.0
        self._stats_lock = threading.Lock()
        self._stats_due = 0.0
        self._spec = SpecCounts()  # specDecodingStats summed over every iteration read
        self._perf_metrics = perf_metrics_kwargs(config.speculative, tle.OutputConfig)  # drafted/accepted per request
        self._max_tokens_arg = self._probe(tle.Request, {"input_token_ids": [1]}, "max_tokens", "max_new_tokens", 1)
        self._seed_arg = self._probe(tle.SamplingConfig, {"beam_width": 1}, "seed", "random_seed", 0)
        self._guided_backend = guided_backend(config, "executor")
        self._guided = self._guided_decoding_config(config.tokenizer_dir or engine_dir)
        self._executor = tle.Executor(engine_dir, tle.ModelType.DECODER_ONLY, self._executor_config(engine_dir))
        # TensorRT-LLM's KV-cache events (KvCacheConfig.event_buffer_max_size), passed on to SubscribeKvEvents
        self._kv_manager = self._executor.get_kv_cache_event_manager() if config.kv_events_enabled else None
        self.kv_events = KvEventHub() if self._kv_manager is not None else None

    @staticmethod
    def _probe(binding, base: dict, name: str, old_name: str, value) -> str:
        """Which keyword this binding version takes: 1.x `name`, or 0.1x `old_name`."""
        try:
            binding(**base, **{name: value})
            return name
        except TypeError:
            return old_name

    def _guided_decoding_config(self, tokenizer_dir: str):
        """GuidedDecodingConfig for `structured` requests, built from the tokenizer; None when off or impossible."""
        backend = self._guided_backend
        kwargs = guided_decoding_config_kwargs(tokenizer_dir, self._eos) if backend else None
        if backend and kwargs is None:
            log.warning("no tokenizer.json in %s: structured output is off", tokenizer_dir)
        if not kwargs:
            return None
        return self._tle.GuidedDecodingConfig(
            backend=getattr(self._tle.GuidedDecodingConfig.GuidedDecodingBackend, backend.upper()), **kwargs)

    def _executor_config(self, engine_dir: str):
        tle, c = self._tle, self._config
        kwargs = {
            "max_beam_width": c.beam_width,
            "kv_cache_config": tle.KvCacheConfig(**c.kv_cache_options()),
            "max_batch_size": c.max_batch_size,
            "max_num_tokens": c.max_num_tokens,
            "decoding_config": executor_decoding_config(tle, c),  # --speculative lookahead
        }
        if c.scheduler_policy is not None:
            policy = getattr(tle.CapacitySchedulerPolicy, c.scheduler_policy.upper())
            kwargs["scheduler_config"] = tle.SchedulerConfig(capacity_scheduler_policy=policy)
        if c.enable_chunked_context is not None:
            kwargs["enable_chunked_context"] = c.enable_chunked_context
        if self._guided is not None:
            kwargs["guided_decoding_config"] = self._guided
        world = engine_world_size(engine_dir)
        if c.world_size > 1 and c.world_size != world:
            raise ValueError(f"--tensor-parallel-size x --pipeline-parallel-size is {c.world_size} but the engine "
                             f"in {engine_dir} was built for {world} GPUs")
        if world > 1:
            kwargs["parallel_config"] = self._orchestrator_config()
        return tle.ExecutorConfig(**{k: v for k, v in kwargs.items() if v is not None})

    def _orchestrator_config(self):
        """A multi-GPU engine from a single process: the executor spawns its MPI workers itself."""
        tle = self._tle
        worker = self._config.executor_worker_path
        if worker is None:
            import tensorrt_llm
            worker = os.path.join(os.path.dirname(tensorrt_llm.__file__), "bin", "executorWorker")
        orchestrator = tle.OrchestratorConfig(is_orchestrator=True, worker_executable_path=worker)
        return tle.ParallelConfig(communication_type=tle.CommunicationType.MPI,
                                  communication_mode=tle.CommunicationMode.ORCHESTRATOR,
                                  orchestrator_config=orchestrator)

    # -- Executor protocol -----------------------------------------------------------------
    def enqueue(self, request: ValidRequest) -> int:
        """Submit a request; ValueError when TensorRT-LLM refuses it."""
        beams = self._config.beam_width
        if request.output.top_logprobs > 0:
            raise ValueError("top_logprobs is not supported by the TensorRT-LLM C++ executor; use logprobs")
        if beams > 1 and request.n > beams:
            raise ValueError(f"n must be <= the beam width ({beams})")
        lora = self._acquire_lora(request.lora)  # LoraError (a ValueError) when it is not loaded
        try:
            try:
                request_id = self._executor.enqueue_request(self._to_request(request, lora))
            except RuntimeError as exc:
                if lora is None or not lora.sent or "not found in cache" not in str(exc):
                    raise
                lora.sent = False  # TensorRT-LLM's LoRA cache evicted it: send the weights again, once
                request_id = self._executor.enqueue_request(self._to_request(request, lora))
        except (RuntimeError, TypeError) as exc:  # TllmException, or a field this version lacks
            self._release_lora(lora)
            raise ValueError(f"TensorRT-LLM refused the request: {exc}") from None
        if lora is not None:
            lora.sent = True  # cached by TensorRT-LLM from now on: later requests send the task id only
        self._tracked[request_id] = _Tracked(request, set(range(request.n)), lora=lora)
        return request_id

    def _lora_config(self, lora):
        """request.cpp LoraConfig(task_id, weights=None, config=None): the weights with the first request only."""
        if lora.sent:
            return self._tle.LoraConfig(lora.task_id)
        return self._tle.LoraConfig(lora.task_id, lora.weights, lora.config)

    def _to_request(self, request: ValidRequest, lora=None):
        tle, beams = self._tle, self._config.beam_width
        end_id, stop_ids = end_and_stop_ids(request, self._eos)
        sampling = sampling_kwargs(request)
        sampling[self._seed_arg] = sampling.pop("seed")
        if beams > 1:  # beam search: the beams replace sampling; whole beams come at the end
            sampling = {self._seed_arg: sampling[self._seed_arg]}
        num_sequences = {"num_return_sequences": request.n} if request.n > 1 else {}
        guided = {"guided_decoding_params": self._guide(request)} if request.structured is not None else {}
        if lora is not None:
            guided["lora_config"] = self._lora_config(lora)
        return tle.Request(
            input_token_ids=list(request.prompt_token_ids),
            **{self._max_tokens_arg: request.stopping.max_new_tokens},
            streaming=beams == 1,
            sampling_config=tle.SamplingConfig(beam_width=beams, **num_sequences, **sampling),
            output_config=tle.OutputConfig(return_log_probs=wants_logprobs(request), exclude_input_from_output=True,
                                           **self._perf_metrics),
            end_id=end_id,
            pad_id=end_id if end_id >= 0 else (self._eos[0] if self._eos else 0),
            stop_words=[[t] for t in stop_ids] or None,
            **guided,
        )

    def _guide(self, request: ValidRequest):
        """GuidedDecodingParams for a `structured` request (ValueError when the executor has no guided decoding)."""
        if self._guided is None:
            raise ValueError("structured output is off on this executor (--guided-decoding-backend none, or no "
                             "tokenizer.json to build its GuidedDecodingConfig from)")
        kind, guide = guide_for(request.structured, self._guided_backend)
        params = self._tle.GuidedDecodingParams
        return params(guide_type=getattr(params.GuideType, _GUIDE_TYPES[kind]), guide=guide)

    def await_responses(self, timeout: float) -> list[Step]:
        """Wait up to `timeout` for responses (TensorRT-LLM releases the GIL meanwhile)."""
        try:
            responses = self._executor.await_responses(timeout=timedelta(seconds=timeout))
        except Exception as exc:  # the executor itself failed: nothing more will come
            raise EngineDeadError(f"TensorRT-LLM executor failed: {exc}") from exc
        steps: list[Step] = []
        for response in responses:
            steps += self._steps(response)
        self._refresh_stats(force=bool(responses) and not self._tracked)  # the last request ended: read it all now
        self._pump_kv_events()
        return steps

    def _pump_kv_events(self) -> None:
        """Hand the executor's buffered KV-cache events (if any) to SubscribeKvEvents; never waits."""
        if self._kv_manager is None:
            return
        try:
            events = self._kv_manager.get_latest_events(0)  # timeout_ms 0: what is buffered now
        except Exception:  # best effort, like the stats: a dead executor shows up in await_responses
            log.debug("get_latest_events failed", exc_info=True)
            return
        self.kv_events.publish(trtllm_kv_events.convert(events))

    def cancel(self, request_id: int) -> None:
        """Idempotent; TensorRT-LLM answers with CANCELLED final responses."""
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.cancelled:
            return
        tracked.cancelled = True
        self._executor.cancel_request(request_id)

    def stats(self) -> ExecutorStats:
        with self._stats_lock:
            snapshot, taken_at = self._stats, self._stats_at
        return current_stats(snapshot, taken_at, len(self._tracked), time.monotonic())

    def shutdown(self) -> None:
        self._executor.shutdown()

    # -- responses -------------------------------------------------------------------------
    def _steps(self, response) -> list[Step]:
        """One response -> a step per sequence it carries (a beam result carries every beam)."""
        request_id = response.request_id
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return []  # a late response for a request that already ended
        if response.has_error():
            del self._tracked[request_id]
            self._release_lora(tracked.lora)
            return [Step(request_id, 0, [], is_final=True, error=response.error_msg)]
        result = response.result
        if self._config.beam_width > 1:
            seqs = [(beam, beam) for beam in range(min(len(result.output_token_ids), tracked.request.n))]
        else:
            seqs = [(getattr(result, "sequence_index", 0), 0)]  # 0.1x results have no sequence index
        steps = [self._step(request_id, tracked, result, seq, beam) for seq, beam in seqs]
        if result.is_final:
            del self._tracked[request_id]
            self._release_lora(tracked.lora)
            steps += [self._unfinished(request_id, tracked, seq) for seq in sorted(tracked.open_seqs)]
        return steps

    @staticmethod
    def _unfinished(request_id: int, tracked: _Tracked, seq: int) -> Step:
        """A sequence the request's final response left open: cancelled with it, or an error."""
        if tracked.cancelled:
            return Step(request_id, seq, [], is_final=True, finish_reason=FinishReason.CANCELLED)
        return Step(request_id, seq, [], is_final=True,
                    error=f"TensorRT-LLM ended the request without finishing sequence {seq}")

    def _step(self, request_id: int, tracked: _Tracked, result, seq: int, beam: int) -> Step:
        tokens = list(result.output_token_ids[beam])
        step = Step(request_id, seq, tokens, logprobs=self._logprobs(tracked, result, beam, len(tokens)))
        counts = draft_counts(getattr(result, "request_perf_metrics", None))
        if counts is not None:  # speculation: the request's drafted and accepted tokens so far (usage)
            step.num_draft_tokens, step.num_accepted_draft_tokens = counts
        if tokens:
            tracked.last_token[seq] = tokens[-1]
        if not (getattr(result, "is_sequence_final", False) or result.is_final) or seq not in tracked.open_seqs:
            return step
        tracked.open_seqs.discard(seq)
        step.is_final = True
        reason = result.finish_reasons[beam] if beam < len(result.finish_reasons) else None
        name = getattr(reason, "name", str(reason))
        if name == "STOP_WORDS":
            step.finish_reason, step.matched_stop_token = stop_reason(tracked.last_token.get(seq), tracked.request)
        elif name in _REASONS:
            step.finish_reason = _REASONS[name]
        else:
            step.error = f"TensorRT-LLM finished sequence {seq} with an unknown reason {name}"
        return step

    @staticmethod
    def _logprobs(tracked: _Tracked, result, beam: int, num_tokens: int) -> list[float] | None:
        """Log probs of this step's tokens: the tail of the full list TensorRT-LLM returns."""
        if not wants_logprobs(tracked.request):
            return None
        every = list(result.log_probs[beam]) if result.log_probs is not None else []
        tail = every[len(every) - num_tokens:] if num_tokens <= len(every) else every
        return [float("nan")] * (num_tokens - len(tail)) + [float(lp) for lp in tail]

    def _refresh_stats(self, force: bool = False) -> None:
        """Every half second (and when the executor falls idle), keep the latest iteration's stats for `stats()`."""
        now = time.monotonic()
        if now < self._stats_due and not force:
            return
        self._stats_due = now + _STATS_INTERVAL_S
        try:
            iterations = self._executor.get_latest_iteration_stats()
        except Exception:  # stats are best effort; a dead executor shows up in await_responses
            log.debug("get_latest_iteration_stats failed", exc_info=True)
            return
        if iterations:
            parsed = [json.loads(it.to_json_str()) for it in iterations]
            for iteration in parsed:  # every iteration since the last read: the speculation counts add up
                self._spec.add(iteration)
            snapshot = stats_from_iteration(parsed[-1], self._spec)
            with self._stats_lock:
                self._stats, self._stats_at = snapshot, now
