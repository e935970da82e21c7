"""The fake C++ `Executor`: one decoding iteration per `await_responses` call that has work.

Responses follow TensorRT-LLM's streaming contract: one `Result` per sequence per iteration,
`output_token_ids` = the new tokens, `log_probs` = every log probability so far, the END_ID
token not emitted, a stop word emitted, `is_sequence_final` per sequence and `is_final` on the
last response of the request. Non-streaming requests (beam search) answer once, whole.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from datetime import timedelta
from typing import ClassVar

from .. import _fake
from . import kv_cache
from .executor import (
    ExecutorConfig,
    FinishReason,
    IterationStats,
    KvCacheStats,
    ModelType,
    Request,
    Response,
    Result,
    _NewReason,
)

_TOKENS_PER_BLOCK = 32
_ITERATION_S = 0.001


class _Req:
    """One enqueued request: generated tokens and log probs per sequence."""

    def __init__(self, request: Request, draft_len: int = 0):
        sc = request.sampling_config
        self.request = request
        self.beams = sc.beam_width
        self.n = sc.num_return_sequences or (self.beams if self.beams > 1 else request.num_return_sequences or 1)
        self.tokens: list[list[int]] = [[] for _ in range(self.n)]
        self.logprobs: list[list[float]] = [[] for _ in range(self.n)]
        self.reasons: list = [None] * self.n
        self.cancelled = False
        self.stop = {tuple(w) for w in (request.stop_words or [])}
        self.drafting = [_fake.Drafting(draft_len) for _ in range(self.n)] if draft_len else None

    def advance(self, seq: int) -> list[int]:
        """One token of one sequence; returns the tokens to report (none on END_ID)."""
        r = self.request
        tok = _fake.next_token(list(r.input_token_ids) + self.tokens[seq], seq)
        if _fake.UNKNOWN_REASON_TOKEN in r.input_token_ids:
            self.reasons[seq] = _NewReason()
        elif r.end_id is not None and r.end_id >= 0 and tok == r.end_id \
                and len(self.tokens[seq]) >= (r.sampling_config.min_tokens or 0):
            self.reasons[seq] = FinishReason.END_ID
            return []
        self.tokens[seq].append(tok)
        self.logprobs[seq].append(_fake.logprob(tok))
        if self.reasons[seq] is None:
            if (tok,) in self.stop:
                self.reasons[seq] = FinishReason.STOP_WORDS
            elif len(self.tokens[seq]) >= r.max_tokens:
                self.reasons[seq] = FinishReason.LENGTH
        return [tok]

    def result(self, seqs: list[int], deltas: list[list[int]], seq_index: int) -> Result:
        res = Result()
        res.output_token_ids = deltas
        if self.request.output_config.return_log_probs:
            res.log_probs = [list(self.logprobs[s]) for s in seqs]
            res.cum_log_probs = [sum(self.logprobs[s]) for s in seqs]
        res.finish_reasons = [self.reasons[s] or FinishReason.NOT_FINISHED for s in seqs]
        res.sequence_index = seq_index
        res.is_sequence_final = all(self.reasons[s] is not None for s in seqs)
        res.is_final = all(reason is not None for reason in self.reasons)
        if self.drafting is not None and self.request.output_config.return_perf_metrics:
            res.request_perf_metrics = _fake.perf_metrics(self.drafting[seqs[0]])
        return res

    def step(self, seq: int, iteration: _fake.SpecIteration | None) -> list[int]:
        """One iteration of one sequence (1 + accepted drafts tokens when the engine speculates)."""
        return _fake.draft_step(self.drafting[seq] if self.drafting else None, iteration,
                                lambda: self.advance(seq), lambda: self.reasons[seq] is not None)


class Executor:
    """Fake `tensorrt_llm.bindings.executor.Executor(model_path, model_type, executor_config)`."""

    instances: ClassVar[list[Executor]] = []

    def __init__(self, model_path, model_type, executor_config):
        if not isinstance(model_type, ModelType) or not isinstance(executor_config, ExecutorConfig):
            raise TypeError("Executor.__init__(): incompatible function arguments")
        self.model_path, self.model_type, self.config = str(model_path), model_type, executor_config
        self.requests: dict[int, Request] = {}  # everything enqueued, for tests to inspect
        self.lora_cache: dict[int, tuple] = {}  # task id -> (weights, config), as the PEFT cache keeps them
        self.cancel_calls: list[int] = []
        self._active: dict[int, _Req] = {}
        self._stats: deque[IterationStats] = deque(maxlen=executor_config.iter_stats_max_iterations or 1)
        self._cv = threading.Condition()
        self._next_id = 1
        self._iter = 0
        self._dead: str | None = None
        self.is_shutdown = False
        # lookahead decoding (DecodingConfig(decoding_mode=DecodingMode.Lookahead())): each iteration verifies drafts
        decoding = executor_config.decoding_config
        mode = getattr(getattr(decoding, "decoding_mode", None), "name", None)
        self.draft_len = 3 if mode == "Lookahead" else 0
        self._spec_iteration: _fake.SpecIteration | None = None
        kv = executor_config.kv_cache_config
        size = getattr(kv, "event_buffer_max_size", 0) if kv is not None else 0
        reuse = getattr(kv, "enable_block_reuse", True) if kv is not None else True
        self.kv_cache = kv_cache.FakeKvCache(_TOKENS_PER_BLOCK, size) if size and reuse else None
        Executor.instances.append(self)

    def enqueue_request(self, request: Request) -> int:
        if not isinstance(request, Request):
            raise TypeError("enqueue_request(): incompatible function arguments")
        ids = request.input_token_ids
        if self.is_shutdown:
            raise RuntimeError("[TensorRT-LLM][ERROR] Shutdown called, cannot enqueue request")
        if not ids or len(ids) > _fake.MAX_INPUT_LEN:
            raise RuntimeError(f"[TensorRT-LLM][ERROR] Assertion failed: input length {len(ids)} is not in "
                               f"[1, {_fake.MAX_INPUT_LEN}]")
        if request.sampling_config.beam_width > self.config.max_beam_width:
            raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: beam width exceeds max_beam_width")
        if request.guided_decoding_params is not None and self.config.guided_decoding_config is None:
            raise RuntimeError("[TensorRT-LLM][ERROR] Assertion failed: Guided decoding is not enabled")
        lora = request.lora_config
        if lora is not None:  # the PEFT cache (docs/source/advanced/lora.md): weights on first use, then the id
            if lora.weights is not None:
                self.lora_cache[lora.task_id] = (lora.weights, lora.config)
            elif lora.task_id not in self.lora_cache:
                raise RuntimeError(f"[TensorRT-LLM][ERROR] LoRA task {lora.task_id} not found in cache. Please send "
                                   "LoRA weights with request")
        with self._cv:
            request_id, self._next_id = self._next_id, self._next_id + 1
            self.requests[request_id] = request
            self._active[request_id] = _Req(request, self.draft_len)
            if self.kv_cache is not None:
                self.kv_cache.on_prompt(list(ids))
            self._cv.notify_all()
        return request_id

    def get_kv_cache_event_manager(self):
        """None unless KvCacheConfig(event_buffer_max_size > 0) with block reuse, as in executor.cpp."""
        return kv_cache.KVCacheEventManager(self.kv_cache) if self.kv_cache is not None else None

    def await_responses(self, *args, timeout=None) -> list[Response]:
        """`await_responses(timeout=None)`. The binding's `std::optional<std::chrono::milliseconds>` takes None, a
        `datetime.timedelta` or a float of seconds (nanobind's duration caster: `PyFloat_Check`, so not an int;
        include/nanobind/stl/chrono.h). An int given by position is the binding's `await_responses(id)` overload,
        which the adapter does not use and the fake does not model."""
        if args:
            if len(args) == 1 and isinstance(args[0], (timedelta, float)) and timeout is None:
                timeout = args[0]
            else:
                raise NotImplementedError("the fake models await_responses(timeout) only, not (id) / (ids)")
        if timeout is not None and not isinstance(timeout, (timedelta, float)):
            raise TypeError("await_responses(): incompatible function arguments: timeout must be "
                            f"datetime.timedelta | float | None, got {type(timeout).__name__}")
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        with self._cv:
            if not self._active and self._dead is None:
                self._cv.wait(None if seconds is None else max(seconds, 0.0))
            elif self._active:
                self._cv.wait(_ITERATION_S)  # a decoding iteration takes time (and releases the GIL)
            if self._dead is not None:
                raise RuntimeError(self._dead)
            return self._iterate()

    def cancel_request(self, id: int) -> None:
        with self._cv:
            self.cancel_calls.append(id)
            if id in self._active:
                self._active[id].cancelled = True
                self._cv.notify_all()

    def get_latest_iteration_stats(self) -> list[IterationStats]:
        with self._cv:
            out, self._stats = list(self._stats), deque(maxlen=self._stats.maxlen)
            return out

    def get_num_responses_ready(self, id: int | None = None) -> int:
        return len(self._active)

    def can_enqueue_requests(self) -> bool:
        return True

    def shutdown(self) -> None:
        with self._cv:
            self.is_shutdown = True
            self._cv.notify_all()

    # -- one iteration ---------------------------------------------------------------------
    def _iterate(self) -> list[Response]:
        out: list[Response] = []
        if not self._active:
            return out
        self._spec_iteration = _fake.SpecIteration() if self.draft_len else None
        for request_id, req in list(self._active.items()):
            if _fake.DIE_TOKEN in req.request.input_token_ids:
                self._dead = "[TensorRT-LLM][ERROR] CUDA runtime error in cudaMemcpyAsync: an illegal memory access"
                raise RuntimeError(self._dead)
            if _fake.ERROR_TOKEN in req.request.input_token_ids:
                out.append(Response(request_id=request_id, error_msg="[TensorRT-LLM][ERROR] fake request failure"))
                del self._active[request_id]
                continue
            out += self._cancel(request_id, req) if req.cancelled else self._advance(request_id, req)
            if all(reason is not None for reason in req.reasons):
                del self._active[request_id]
        self._record_stats()
        return out

    def _cancel(self, request_id: int, req: _Req) -> list[Response]:
        out = []
        for seq in range(req.n):
            if req.reasons[seq] is None:
                req.reasons[seq] = FinishReason.CANCELLED
                out.append(Response(request_id=request_id, result=req.result([seq], [[]], seq)))
        return out

    def _advance(self, request_id: int, req: _Req) -> list[Response]:
        if not req.request.streaming:  # whole answers at once
            for seq in range(req.n):
                while req.reasons[seq] is None:
                    req.advance(seq)
            if req.beams > 1:
                seqs = list(range(req.n))
                return [Response(request_id=request_id, result=req.result(seqs, [list(req.tokens[s]) for s in seqs], 0))]
            return [Response(request_id=request_id, result=req.result([s], [list(req.tokens[s])], s))
                    for s in range(req.n)]
        out = []
        for seq in range(req.n):
            if req.reasons[seq] is None:
                delta = req.step(seq, self._spec_iteration)
                out.append(Response(request_id=request_id, result=req.result([seq], [delta], seq)))
        return out

    def _record_stats(self) -> None:
        self._iter += 1
        stats = IterationStats()
        stats.iter, stats.iter_latency_ms = self._iter, 1.25
        stats.num_active_requests, stats.num_queued_requests = len(self._active), 0
        kv = stats.kv_cache_stats = KvCacheStats()
        kv.tokens_per_block, kv.max_num_blocks = _TOKENS_PER_BLOCK, 1000
        kv.used_num_blocks = sum(math.ceil((len(r.request.input_token_ids) + len(t)) / _TOKENS_PER_BLOCK)
                                 for r in self._active.values() for t in r.tokens)
        kv.free_num_blocks = kv.max_num_blocks - kv.used_num_blocks
        stats.spec_decoding_stats = self._spec_iteration
        self._stats.append(stats)
