"""The LLM API adapter: `tensorrt_llm.LLM` (PyTorch backend) on a Hugging Face checkpoint directory.

Written against NVIDIA/TensorRT-LLM:
  tensorrt_llm/llmapi/llm.py        @ 00966934ce32e0603a33f8c922525cf3678afab4 (generate_async,
                                      get_stats_async; _prepare_sampling_params needs end_id when
                                      the LLM has no tokenizer)
  tensorrt_llm/executor/result.py   @ 005bc848893f575ec14b45d6b13139360d67c790 (CompletionOutput,
                                      GenerationResult.abort, IterationResult yields dicts)
  tensorrt_llm/sampling_params.py   @ 000a01de66f0eab4ab05640711f0253f50f5209c
  tensorrt_llm/llmapi/llm_args.py   (kv_cache_config, scheduler_config, enable_chunked_prefill,
                                      enable_iter_perf_stats, guided_decoding_backend: "xgrammar" |
                                      "llguidance", llguidance on the PyTorch backend only)
  tensorrt_llm/sampling_params.py   @ 000a01de66f0eab4ab05640711f0253f50f5209c (GuidedDecodingParams: json,
                                      regex, grammar, json_object, structural_tag; one at a time)

A dead executor is noticed in two ways. `LLM._check_health()`, polled once a second, where the release has it
(since PR #9057, December 2025; not at the commit above). And, in every release, by what fails: at that commit
(tensorrt_llm/executor/executor.py and proxy.py @ 005bc848) a request's own failure raises `RequestError` from
its result, while an engine failure is queued and raised, after the executor shuts down, from the next result
that handles a response and from the next `generate_async`; later ones raise "LLM is shutting down". So a
`RequestError`, `ValueError` or `TypeError` fails that request alone, and any other exception from
`generate_async` or from a result means the executor is gone.

The LLM API is asyncio-based: `generate_async` must run on the event loop that later iterates
its result. The adapter owns that loop on its own thread; the looper sees only the `Executor`
protocol and blocks on a thread-safe queue of steps (`SimpleQueue.get` releases the GIL). A result's outputs
become steps in llmapi_outputs.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import threading
import time

from tokenloop.core.executor import EngineDeadError, ExecutorStats, Step
from tokenloop.core.kv_events import KvEventHub
from tokenloop.core.request import FinishReason, ValidRequest

from . import kv_events as trtllm_kv_events
from .common import (
    TrtllmConfig,
    current_stats,
    end_and_stop_ids,
    guide_for,
    guided_backend,
    sampling_kwargs,
    stats_from_iteration,
    wants_logprobs,
)
from .llmapi_outputs import steps_of
from .lora import TrtllmLoras
from .speculative import SpecCounts, llm_speculative_config, perf_metrics_kwargs

log = logging.getLogger("tokenloop.trtllm")

_STATS_TIMEOUT_S = 0.5
_HEALTH_INTERVAL_S = 1.0


_WAKE = object()  # put on the ready queue by wake(): ends a wait, carries no step


def request_scoped(exc: BaseException) -> bool:
    """An exception that fails one request (the LLM API's `RequestError`, an argument refused); any other from
    `generate_async` or a result is the executor's failure."""
    return isinstance(exc, (ValueError, TypeError)) or type(exc).__name__ == "RequestError"


class TrtllmLlmApi(TrtllmLoras):
    """`Executor` on `tensorrt_llm.LLM` with its own asyncio loop thread."""

    def __init__(self, model_dir: str, config: TrtllmConfig, eos_token_ids: tuple[int, ...] = ()):
        import tensorrt_llm  # lazily: see trtllm/__init__.py

        self._trtllm = tensorrt_llm
        self._config = config
        self._eos = tuple(eos_token_ids)
        self._ids = itertools.count(1)
        self._init_loras(bool(config.lora_dirs), config.max_lora_rank)  # LoRA adapters: trtllm/lora.py
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # Steps, and _WAKE
        self._results: dict[int, object] = {}  # id -> RequestOutput (loop thread only)
        self._aborted: set[int] = set()  # (loop thread only)
        self._stats, self._stats_at = None, 0.0  # ExecutorStats | None, and when it was taken
        self._stats_lock = threading.Lock()
        self._spec = SpecCounts()  # specDecodingStats summed over every iteration (loop thread)
        self._perf_metrics = perf_metrics_kwargs(config.speculative, tensorrt_llm.SamplingParams)  # drafted/accepted
        self._stats_task: asyncio.Task | None = None
        # TensorRT-LLM's KV-cache events (KvCacheConfig.event_buffer_max_size), passed on to SubscribeKvEvents
        self.kv_events = KvEventHub() if config.kv_events_enabled else None
        self._events_task: asyncio.Task | None = None
        self._health_due = 0.0
        self._dead: str | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tokenloop-trtllm-llmapi", daemon=True)
        self._thread.start()
        try:
            self._llm = self._call(lambda: tensorrt_llm.LLM(model=model_dir, **self._llm_kwargs()))
        except BaseException:
            self._stop_loop()
            raise

    def _llm_kwargs(self) -> dict:
        from tensorrt_llm import llmapi

        c = self._config
        kwargs = {
            "backend": "pytorch",
            "skip_tokenizer_init": True,  # the looper tokenizes and detokenizes
            "tensor_parallel_size": c.tensor_parallel_size,
            "pipeline_parallel_size": c.pipeline_parallel_size,
            "kv_cache_config": llmapi.KvCacheConfig(**c.kv_cache_options()),
            "enable_iter_perf_stats": True,
            "max_batch_size": c.max_batch_size,
            "max_num_tokens": c.max_num_tokens,
            "max_beam_width": c.beam_width if c.beam_width > 1 else None,
            "enable_chunked_prefill": c.enable_chunked_context,
            "guided_decoding_backend": guided_backend(c, "llm"),
            "speculative_config": llm_speculative_config(llmapi, c),
        }
        if c.lora_dirs:  # the --lora adapters; others load later by directory (LoRARequest.lora_path)
            kwargs["enable_lora"] = True
            kwargs["lora_config"] = llmapi.LoraConfig(lora_dir=list(c.lora_dirs), max_lora_rank=c.max_lora_rank,
                                                      max_loras=c.max_loras, max_cpu_loras=c.max_loras)
        if c.scheduler_policy is not None:
            policy = getattr(llmapi.CapacitySchedulerPolicy, c.scheduler_policy.upper())
            kwargs["scheduler_config"] = llmapi.SchedulerConfig(capacity_scheduler_policy=policy)
        return {k: v for k, v in kwargs.items() if v is not None}

    def _call(self, fn):
        """Run `fn()` on the adapter's loop thread and return its result (or raise its error)."""
        async def call():
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result()

    # -- Executor protocol -----------------------------------------------------------------
    def enqueue(self, request: ValidRequest) -> int:
        """Submit a request; ValueError when the LLM API refuses it."""
        self._check_alive(force=True)
        params = self._sampling_params(request)
        lora = self._acquire_lora(request.lora)  # LoraError (a ValueError) when it is not loaded
        request_id = next(self._ids)
        try:
            self._call(lambda: self._start(request_id, request, params, lora))
        except BaseException:
            self._release_lora(lora)
            raise
        return request_id

    def _sampling_params(self, request: ValidRequest):
        beams = self._config.beam_width
        if request.n > 1 and request.sampling.greedy and beams == 1:
            raise ValueError("n > 1 needs sampling (temperature > 0) with the TensorRT-LLM LLM API")
        end_id, stop_ids = end_and_stop_ids(request, self._eos)
        default_end = self._eos[0] if self._eos else -1
        kwargs = sampling_kwargs(request)
        if beams > 1:  # beam search: n of best_of=beam_width beams; the beams replace sampling
            kwargs = {"seed": kwargs["seed"], "use_beam_search": True, "best_of": beams}
        top = request.output.top_logprobs
        if request.structured is not None:
            kwargs["guided_decoding"] = self._guide(request)
        try:
            return self._trtllm.SamplingParams(
                max_tokens=request.stopping.max_new_tokens, n=request.n,
                end_id=end_id if end_id >= 0 else default_end, pad_id=default_end,
                ignore_eos=request.stopping.ignore_eos, stop_token_ids=stop_ids or None,
                **self._perf_metrics,
                include_stop_str_in_output=True,  # keep stop tokens, as the C++ executor does
                logprobs=(top or 1) if wants_logprobs(request) else None,
                detokenize=False, **kwargs)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"TensorRT-LLM refused the request: {exc}") from None

    def _guide(self, request: ValidRequest):
        """SamplingParams.guided_decoding for a `structured` request; ValueError when structured output is off."""
        from tensorrt_llm.sampling_params import GuidedDecodingParams

        kind, guide = guide_for(request.structured, guided_backend(self._config, "llm"))
        return GuidedDecodingParams(**{kind: guide})

    def _start(self, request_id: int, request: ValidRequest, params, lora=None) -> None:
        """On the loop thread: submit and start reading the result."""
        lora_request = None
        if lora is not None:  # executor/request.py: LoRARequest(lora_name, lora_int_id, lora_path)
            from tensorrt_llm.executor.request import LoRARequest
            lora_request = LoRARequest(lora.name, lora.task_id, lora.path)
        try:
            result = self._llm.generate_async(list(request.prompt_token_ids), sampling_params=params,
                                              lora_request=lora_request, streaming=self._config.beam_width == 1)
        except Exception as exc:
            if request_scoped(exc):
                raise ValueError(f"TensorRT-LLM refused the request: {exc}") from None
            self._died(exc)
            raise EngineDeadError(self._dead) from None
        self._results[request_id] = result
        self._loop.create_task(self._consume(request_id, request, result, lora))
        if self._stats_task is None:  # stats exist only once something was submitted
            self._stats_task = self._loop.create_task(self._poll_stats())
        if self._events_task is None and self.kv_events is not None:
            self._events_task = self._loop.create_task(self._poll_kv_events())

    def await_responses(self, timeout: float) -> list[Step]:
        """Block up to `timeout` for steps; EngineDeadError once the LLM is gone."""
        self._check_alive()
        try:
            items = [self._ready.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._ready.get_nowait())
            except queue.Empty:
                break
        if self._dead is not None:  # died while we waited: these steps are the death's echoes
            raise EngineDeadError(self._dead)
        return [step for step in items if step is not _WAKE]

    def wake(self) -> None:
        """Make a blocked (or the next) `await_responses` return now: the looper has a new command."""
        self._ready.put(_WAKE)

    def cancel(self, request_id: int) -> None:
        """Idempotent; the request then ends with `cancelled` outputs."""
        if self._dead is None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._abort, request_id)

    def _abort(self, request_id: int) -> None:
        result = self._results.get(request_id)
        if result is None or request_id in self._aborted or result.finished:
            return
        self._aborted.add(request_id)
        try:
            result.abort()
        except Exception:
            log.exception("abort of request %d failed", request_id)

    def stats(self) -> ExecutorStats:
        with self._stats_lock:
            snapshot, taken_at = self._stats, self._stats_at
        return current_stats(snapshot, taken_at, len(self._results), time.monotonic())

    def shutdown(self) -> None:
        if self._thread.is_alive():
            try:
                self._call(self._llm.shutdown)
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        async def cancel_tasks():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        try:
            asyncio.run_coroutine_threadsafe(cancel_tasks(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self._loop.close()

    def _check_alive(self, force: bool = False) -> None:
        """Raise EngineDeadError once the loop thread or the LLM's executor is gone."""
        now = time.monotonic()
        if self._dead is None and (force or now >= self._health_due):
            self._health_due = now + _HEALTH_INTERVAL_S
            self._check_health()
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _died(self, exc: BaseException) -> None:
        if self._dead is None:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            self._dead = f"the TensorRT-LLM executor failed: {first}"
            log.error("TensorRT-LLM executor failed", exc_info=exc)

    def _check_health(self) -> None:
        if not self._thread.is_alive():
            self._dead = "the TensorRT-LLM LLM API thread stopped"
        check = getattr(self._llm, "_check_health", None)  # BaseLLM._check_health (what trtllm-serve's /health uses)
        if self._dead is None and callable(check) and not check():
            self._dead = "the TensorRT-LLM executor is no longer healthy"

    # -- results (loop thread) -------------------------------------------------------------
    async def _consume(self, request_id: int, request: ValidRequest, result, lora=None) -> None:
        """Turn each update of one request into steps, one final step per sequence."""
        sent = [0] * request.n
        try:
            async for output in result:
                for step in steps_of(request_id, request, output, sent, request_id in self._aborted):
                    self._ready.put(step)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  (a failed request, e.g. RequestError: becomes its error step)
            if not request_scoped(exc):
                self._died(exc)  # the executor failed: every request fails with it, reported by await_responses
                self._ready.put(_WAKE)
                return
            self._check_health()  # a dead executor fails every request: report death, not this error
            if request_id in self._aborted:
                for seq in range(request.n):
                    self._ready.put(Step(request_id, seq, [], is_final=True, finish_reason=FinishReason.CANCELLED))
            else:
                self._ready.put(Step(request_id, 0, [], is_final=True, error=str(exc) or type(exc).__name__))
        finally:
            self._results.pop(request_id, None)
            self._aborted.discard(request_id)
            self._release_lora(lora)

    async def _poll_kv_events(self) -> None:
        """Pass the LLM's KV-cache events on to SubscribeKvEvents, one batch per read."""
        while True:
            try:
                async for event in self._llm.get_kv_cache_events_async(timeout=_STATS_TIMEOUT_S):
                    raw = json.loads(event) if isinstance(event, str) else event
                    self.kv_events.publish(trtllm_kv_events.convert([raw]))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.debug("get_kv_cache_events_async failed", exc_info=True)
            await asyncio.sleep(_STATS_TIMEOUT_S)

    async def _poll_stats(self) -> None:
        """Keep the latest iteration stats (needs `enable_iter_perf_stats`)."""
        while True:
            try:
                async for stats in self._llm.get_stats_async(timeout=_STATS_TIMEOUT_S):
                    iteration = json.loads(stats) if isinstance(stats, str) else stats
                    self._spec.add(iteration)
                    snapshot = stats_from_iteration(iteration, self._spec)
                    with self._stats_lock:
                        self._stats, self._stats_at = snapshot, time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.debug("get_stats_async failed", exc_info=True)
            await asyncio.sleep(_STATS_TIMEOUT_S)
