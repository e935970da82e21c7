"""Fake `tensorrt_llm.LLM` and its results, after NVIDIA/TensorRT-LLM tensorrt_llm/llmapi/llm.py @ 00966934 (the
commit the adapter cites) and tensorrt_llm/executor/{result,executor,proxy}.py @ 005bc848.

`generate_async` returns a result whose async iteration reads an asyncio queue bound to the loop
that called it (as the real one does); a background "engine" thread decodes one token per
sequence per iteration and posts responses with `call_soon_threadsafe`. `_handle_sequence`
keeps the real quirks: `token_ids_diff` is refreshed only for the sequence a response carries,
and `finish_reason` is set only when the whole request is done.

Errors follow `GenerationExecutor._handle_background_error` (executor.py @ 005bc848): a request's error response
raises `RequestError` from that result alone; an engine failure is queued and raised, after the executor shuts
down, from the next result that handles a response (`_handle_response` calls the handler after each one) and from
the next `generate_async` (the proxy's `submit` calls it first); later submissions raise "LLM is shutting down"
(llm.py's check in newer releases). `LLM._check_health()` exists only when `_fake.LLM_CHECK_HEALTH` is set, as in
releases since PR #9057 (December 2025), where it returns `not self._executor.is_shutdown()`.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from .. import _fake
from ..bindings import kv_cache
from ..bindings.executor import FinishReason, _NewReason
from ..sampling_params import SamplingParams

LLM_ARGS = {"tokenizer", "skip_tokenizer_init", "trust_remote_code", "tensor_parallel_size", "dtype", "backend",
            "pipeline_parallel_size", "kv_cache_config", "enable_chunked_prefill", "scheduler_config",
            "max_batch_size", "max_num_tokens", "max_beam_width", "enable_iter_perf_stats", "max_seq_len",
            "guided_decoding_backend", "enable_lora", "lora_config", "speculative_config"}
GUIDED_DECODING_BACKENDS = (None, "xgrammar", "llguidance")  # llm_args.py: Optional[Literal[...]]


class RequestError(RuntimeError):
    """A request failed in the executor."""


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    request_perf_metrics: object | None = None  # RequestPerfMetrics, when SamplingParams.return_perf_metrics
    _last_token_ids_len: int = 0
    _last_logprobs_len: int = 0

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len:]

    @property
    def logprobs_diff(self) -> list:
        return self.logprobs[self._last_logprobs_len:]


@dataclass(slots=True)
class _Response:
    """What the engine posts: one sequence (or every beam) of one request."""

    sequence_index: int
    output_token_ids: list[list[int]]
    log_probs: list[list] | None
    finish_reasons: list
    is_final: bool
    error: str | None = None
    request_perf_metrics: object | None = None


class RequestOutput:
    """Fake `tensorrt_llm.llmapi.RequestOutput` (a GenerationResult)."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams, llm: LLM):
        self.request_id, self.prompt_token_ids, self.sampling_params = request_id, prompt_token_ids, params
        self._llm, self._done, self._aborted = llm, False, False
        self._outputs = [CompletionOutput(i) for i in range(params.best_of)]
        try:
            self._loop = asyncio.get_running_loop()
            self._aqueue: asyncio.Queue | None = asyncio.Queue()
        except RuntimeError:
            self._loop, self._aqueue = None, None

    @property
    def outputs(self) -> list[CompletionOutput]:
        sp = self.sampling_params
        if sp.use_beam_search or sp.n == sp.best_of:
            return self._outputs[:sp.n]
        ranked = sorted(self._outputs, key=lambda o: o.cumulative_logprob or float("-inf"), reverse=True)
        for i, out in enumerate(ranked):
            out.index = i
        return ranked[:sp.n]

    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        self._llm._abort(self.request_id)
        self._aborted = True

    def aborted(self) -> bool:
        return self._aborted

    def _post(self, response: _Response) -> None:
        """Engine thread -> the result's loop."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._aqueue.put_nowait, response)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._done:
            raise StopAsyncIteration
        assert self._aqueue is not None, "The asyncio event loop was not present during initialization"
        self._handle_response(await self._aqueue.get())
        return self

    def _handle_response(self, response: _Response) -> None:
        if response.error is not None:
            self._done = True
            self._llm._handle_background_error(response.error)  # a str: RequestError for this request
        self._done = response.is_final
        if self.sampling_params.use_beam_search:
            for beam in range(len(response.output_token_ids)):
                self._handle_sequence(response, beam, beam)
        else:
            self._handle_sequence(response, response.sequence_index, 0)
        self._llm._handle_background_error()  # "processing background errors here ASAP during generation"

    def _handle_sequence(self, response: _Response, seq: int, src: int) -> None:
        out, reason = self._outputs[seq], response.finish_reasons[src]
        if response.request_perf_metrics is not None:  # result.py @ a678b91a: copied from each response that has it
            out.request_perf_metrics = response.request_perf_metrics
        out._last_token_ids_len = len(out.token_ids)
        if self.sampling_params.use_beam_search:
            out.token_ids = list(response.output_token_ids[src])
        else:
            out.token_ids.extend(response.output_token_ids[src])
        if response.log_probs is not None:
            out._last_logprobs_len = len(out.logprobs)
            out.logprobs = list(response.log_probs[src])
            out.cumulative_logprob = sum(lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids))
        if reason == FinishReason.CANCELLED:
            out.finish_reason = "cancelled"
        if not self._done:
            return
        if reason == FinishReason.END_ID:
            out.finish_reason = "stop"
        elif reason == FinishReason.STOP_WORDS:
            out.finish_reason = "stop"
            for stop_reason, stop_ids in self.sampling_params._get_stop_reasons_and_words():
                if out.token_ids[-len(stop_ids):] == stop_ids:
                    out.stop_reason = stop_reason
                    if not self.sampling_params.include_stop_str_in_output:
                        out.token_ids = out.token_ids[:-len(stop_ids)]
                    break
        elif reason == FinishReason.LENGTH:
            out.finish_reason = "length"
        elif reason == FinishReason.TIMED_OUT:
            out.finish_reason = "timeout"
        elif reason != FinishReason.CANCELLED:
            raise ValueError(f"Unknown finish reason: {reason}")


class _Gen:
    """Engine-side state of one request."""

    def __init__(self, result: RequestOutput, streaming: bool, draft_len: int = 0):
        sp = result.sampling_params
        self.result, self.streaming, self.params = result, streaming, sp
        self.end_id = -1 if sp.ignore_eos else sp.end_id
        self.stop = set(sp.stop_token_ids or [])
        self.tokens = [[] for _ in range(sp.best_of)]
        self.logprobs = [[] for _ in range(sp.best_of)]
        self.reasons: list = [None] * sp.best_of
        self.cancelled = False
        self.drafting = [_fake.Drafting(draft_len) for _ in range(sp.best_of)] if draft_len else None

    def advance(self, seq: int) -> list[int]:
        prompt = self.result.prompt_token_ids
        tok = _fake.next_token(prompt + self.tokens[seq], seq)
        if _fake.UNKNOWN_REASON_TOKEN in prompt:
            self.reasons[seq] = _NewReason()
        elif tok == self.end_id and len(self.tokens[seq]) >= (self.params.min_tokens or 0):
            self.reasons[seq] = FinishReason.END_ID
            return []
        self.tokens[seq].append(tok)
        k = max(self.params.logprobs or 1, 1)
        self.logprobs[seq].append({t: Logprob(lp, rank) for rank, (t, lp) in
                                   enumerate(_fake.top_logprobs(tok, k).items(), start=1)})
        if self.reasons[seq] is None:
            if tok in self.stop:
                self.reasons[seq] = FinishReason.STOP_WORDS
            elif len(self.tokens[seq]) >= self.params.max_tokens:
                self.reasons[seq] = FinishReason.LENGTH
        return [tok]

    def decode(self, seq: int, iteration: _fake.SpecIteration | None) -> list[int]:
        """One iteration of one sequence (1 + accepted drafts tokens when the LLM speculates)."""
        return _fake.draft_step(self.drafting[seq] if self.drafting else None, iteration,
                                lambda: self.advance(seq), lambda: self.reasons[seq] is not None)

    def response(self, seqs: list[int], deltas: list[list[int]]) -> _Response:
        lps = [list(self.logprobs[s]) for s in seqs] if self.params.logprobs else None
        perf = (_fake.perf_metrics(self.drafting[seqs[0]])
                if self.drafting is not None and self.params.return_perf_metrics else None)
        return _Response(seqs[0], deltas, lps, [self.reasons[s] or FinishReason.NOT_FINISHED for s in seqs],
                         all(r is not None for r in self.reasons), request_perf_metrics=perf)

    def step(self, iteration: _fake.SpecIteration | None = None) -> list[_Response]:
        """One iteration: a token per open sequence (1 + accepted drafts with speculation; streaming), or everything
        (not streaming)."""
        open_seqs = [s for s, r in enumerate(self.reasons) if r is None]
        if self.cancelled:
            for s in open_seqs:
                self.reasons[s] = FinishReason.CANCELLED
            return [self.response([s], [[]]) for s in open_seqs]
        if self.streaming:
            return [self.response([s], [self.decode(s, iteration)]) for s in open_seqs]
        for s in open_seqs:
            while self.reasons[s] is None:
                self.advance(s)
        if self.params.use_beam_search:
            return [self.response(list(range(len(self.tokens))), [list(t) for t in self.tokens])]
        return [self.response([s], [list(self.tokens[s])]) for s in open_seqs]


class LLM:
    """Fake `tensorrt_llm.LLM` (PyTorch backend)."""

    instances: ClassVar[list[LLM]] = []

    def __init__(self, model, **kwargs):
        unknown = set(kwargs) - LLM_ARGS
        if unknown:
            raise ValueError(f"1 validation error for TorchLlmArgs: {sorted(unknown)}: Extra inputs are not permitted")
        if kwargs.get("guided_decoding_backend") not in GUIDED_DECODING_BACKENDS:
            raise ValueError("1 validation error for TorchLlmArgs: guided_decoding_backend: Input should be "
                             "'xgrammar' or 'llguidance'")
        self.model, self.args = str(model), kwargs
        self.create_thread = threading.current_thread().name
        self.submits: list[tuple[list[int], SamplingParams, bool]] = []
        self.lora_requests: list = []  # the lora_request of each generate_async, in order
        self.generate_threads: set[str] = set()
        self._ids = itertools.count(1)
        self._active: dict[int, _Gen] = {}
        self._stats: deque[dict] = deque(maxlen=1000)
        self._cv = threading.Condition()
        self._stopped, self._shut_down, self._iter = False, False, 0
        kv = kwargs.get("kv_cache_config")
        size = getattr(kv, "event_buffer_max_size", 0) if kv is not None else 0
        reuse = getattr(kv, "enable_block_reuse", True) if kv is not None else True
        self.kv_cache = kv_cache.FakeKvCache(64, size) if size and reuse else None
        spec = kwargs.get("speculative_config")  # each iteration verifies this many drafted tokens per sequence
        self.draft_len = 0 if spec is None else (getattr(spec, "max_draft_len", None) or 3)
        self._error_queue: queue.Queue = queue.Queue()  # the engine's fatal errors, as GenerationExecutor keeps them
        if _fake.LLM_CHECK_HEALTH:
            self._check_health = lambda: not self._shut_down
        self._thread = threading.Thread(target=self._run, name="fake-trtllm-engine", daemon=True)
        self._thread.start()
        LLM.instances.append(self)

    def generate_async(self, inputs, sampling_params: SamplingParams | None = None, lora_request=None,
                       prompt_adapter_request=None, streaming: bool = False, **kwargs) -> RequestOutput:
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError("The sampling_params must be type SamplingParams or None")
        if params.end_id is None and self.args.get("skip_tokenizer_init"):
            raise ValueError("tokenizer is required to reset end_id if it is None, or you can explicitly specify "
                             "the end_id for sampling_params")
        ids = inputs["prompt_token_ids"] if isinstance(inputs, dict) else inputs
        if isinstance(ids, str) or not all(isinstance(t, int) for t in ids):
            raise TypeError("The inputs must be token ids when the tokenizer is skipped")
        if not ids or len(ids) > _fake.MAX_INPUT_LEN:
            raise ValueError(f"The sum of prompt length ({len(ids)}) and query length (0) should not exceed "
                             f"max_num_tokens ({_fake.MAX_INPUT_LEN})")
        if self._shut_down:
            raise RuntimeError("LLM is shutting down")
        self._handle_background_error()  # proxy.submit: a queued engine failure is raised here
        self.submits.append((list(ids), params, streaming))
        self.lora_requests.append(lora_request)
        if self.kv_cache is not None:
            self.kv_cache.on_prompt(list(ids))
        self.generate_threads.add(threading.current_thread().name)
        result = RequestOutput(next(self._ids), list(ids), params, self)
        with self._cv:
            self._active[result.request_id] = _Gen(result, streaming, self.draft_len)
            self._cv.notify_all()
        return result

    def _abort(self, request_id: int) -> None:
        with self._cv:
            if request_id in self._active:
                self._active[request_id].cancelled = True

    def _handle_background_error(self, error: Exception | str | None = None) -> None:
        """GenerationExecutor._handle_background_error: a str is one request's error; an exception (given or
        queued by the engine) shuts the executor down and is raised."""
        if isinstance(error, str):
            raise RequestError(error)
        if error is None:
            try:
                error = self._error_queue.get_nowait()
            except queue.Empty:
                return
        self._shut_down = True
        raise error

    def get_stats_async(self, timeout: float | None = 2):
        return _IterationResult(self, timeout or 0.0)

    def get_kv_cache_events_async(self, timeout: float | None = 2):
        """KV events as dicts (KVCacheEventSerializer's format), one per iteration step; [] when events are off."""
        return _KvEventResult(self, timeout or 0.0)

    def shutdown(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._active and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                self._iterate()
            time.sleep(0.001)

    def _iterate(self) -> None:
        if any(_fake.DIE_TOKEN in gen.result.prompt_token_ids for gen in self._active.values()):
            self._die()
            return
        iteration = _fake.SpecIteration() if self.draft_len else None
        for request_id, gen in list(self._active.items()):
            if _fake.ERROR_TOKEN in gen.result.prompt_token_ids:
                gen.result._post(_Response(0, [], None, [], True, error="[TensorRT-LLM][ERROR] fake request failure"))
                del self._active[request_id]
                continue
            for response in gen.step(iteration):
                gen.result._post(response)
            if all(r is not None for r in gen.reasons):
                del self._active[request_id]
        self._iter += 1
        if self.args.get("enable_iter_perf_stats"):
            self._stats.append({"iter": self._iter, "iterLatencyMS": 2.5, "numActiveRequests": len(self._active),
                                "numQueuedRequests": 0, "kvCacheStats": {"maxNumBlocks": 500, "usedNumBlocks":
                                len(self._active), "freeNumBlocks": 500 - len(self._active), "tokensPerBlock": 64}})
            if iteration is not None:
                self._stats[-1]["specDecodingStats"] = iteration.to_json()


    def _die(self) -> None:
        """The engine fails: the error is queued, and each request in flight gets one last (empty, not final)
        response, whose handling raises it; then nothing more is decoded."""
        self._error_queue.put(RuntimeError("[TensorRT-LLM][ERROR] fake engine failure: the executor loop died"))
        for gen in self._active.values():
            gen.result._post(_Response(0, [[]], None, [FinishReason.NOT_FINISHED], False))
        self._active.clear()
        self._stopped = True


class _IterationResult:
    """Async iterable of stats dicts; ends after `timeout` seconds without a new one."""

    def __init__(self, llm: LLM, timeout: float):
        self._llm, self._timeout = llm, timeout

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        deadline = time.monotonic() + self._timeout
        while True:
            with self._llm._cv:
                if self._llm._stats:
                    return self._llm._stats.popleft()
            if time.monotonic() >= deadline:
                raise StopAsyncIteration
            await asyncio.sleep(0.01)


class _KvEventResult:
    """Async iterable of KV-event dicts; ends after `timeout` seconds without a new one."""

    def __init__(self, llm: LLM, timeout: float):
        self._llm, self._timeout, self._pending = llm, timeout, deque()

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        deadline = time.monotonic() + self._timeout
        while True:
            if not self._pending and self._llm.kv_cache is not None:
                self._pending.extend(kv_cache.to_dict(e) for e in self._llm.kv_cache.take())
            if self._pending:
                return self._pending.popleft()
            if time.monotonic() >= deadline:
                raise StopAsyncIteration
            await asyncio.sleep(0.01)
