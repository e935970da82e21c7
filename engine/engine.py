"""Engine: the embedded executor. Continuous batching on its own thread behind the Executor protocol.

The looper thread calls enqueue / cancel / await_responses; the engine thread runs `step()`
(schedule, run the model, postprocess) whenever it has work and sleeps on a condition when idle.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.executor import EngineDeadError, ErrorKind, ExecutorStats, Step, merge_steps
from ..core.kv_events import CacheCleared, KvEventHub
from ..core.lora import LoraRegistry
from ..core.request import EmbedParams, FinishReason, ValidRequest
from ..core.tokenizer import ModelCard
from . import kernels, runner
from .block_manager import BlockManager
from .config import EngineConfig
from .layer_kernels import PagedAttention
from .loader import ModelConfig, load_weights
from .lora import LoraWeights, read_adapter
from .matmul import Backend, MatmulPolicy, set_blas_threads
from .model import Model
from .pooling import embed_defaults
from .postprocess import cancelled_steps, error_steps, steps_for_samples
from .quant import Q4Weight, QWeight
from .sampler import RowFailure, sample_batch
from .scheduler import Scheduler
from .sequence import Sequence
from .spec_step import propose_drafts, verify_drafts
from .speculation import SpecState, SpecStats

log = logging.getLogger(__name__)
MAX_CONSECUTIVE_STEP_FAILURES = 3


def default_num_threads() -> int:
    """All cores but one: the gRPC front and the looper need one, and an OpenMP barrier that waits
    for a descheduled worker costs a whole scheduler time slice."""
    return max(1, (os.cpu_count() or 1) - 1)


@dataclass(slots=True)
class StepRun:
    """A step's forward pass: the scheduled sequences that ran, the model's output for them, and the error steps of
    the requests that failed in it (Engine._run_isolated)."""

    scheduled: list[tuple[Sequence, int]]
    output: runner.ModelOutput
    failed: list[Step]


class Engine:
    """Serves one Llama-family checkpoint; implements tokenloop.core.executor.Executor."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, start: bool = True):
        self.config = config or EngineConfig()
        self.num_threads = self.config.num_threads or default_num_threads()
        torch.set_num_threads(self.num_threads)
        set_blas_threads(1)  # see matmul.py: spinning OpenBLAS workers starve torch's threads
        self.card = ModelCard.from_dir(model_dir)
        self.model_config = ModelConfig.from_dir(model_dir)
        self.max_context_length = min(self.model_config.max_context_length,
                                      self.config.max_model_len or self.model_config.max_context_length)
        dtype = self.config.torch_dtype
        started = time.perf_counter()
        weights = load_weights(model_dir, self.model_config, dtype, self.config.weights)
        log.info("engine: weights %s loaded in %.1f s", self.dtype, time.perf_counter() - started)
        num_blocks = self.config.num_kv_blocks(Model.kv_bytes_per_token(self.model_config, dtype))
        self._gate_ups = [weights[f"layers.{i}.gate_up"] for i in range(self.model_config.num_layers)]
        paged = self._paged_attention(dtype)
        self.model = Model(self.model_config, weights, dtype, num_blocks, self.config.block_size,
                           self._matmul_policy(weights["layers.0.gate_up"]), paged,
                           split_attention=(os.cpu_count() or 1) >= 2,
                           ops=kernels.load_ops() if paged is not None else None)
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_tokens, self.config.max_batch_size)
        self.kv_events = KvEventHub()  # the prefix cache's stored / removed blocks, for SubscribeKvEvents
        self.kv_events.publish([CacheCleared()])  # the first batch: a fresh, empty cache (TensorRT-LLM's `created`)
        self.eos_token_ids = self.card.eos_token_ids
        # core.capabilities.Embeds: what an embedding request that names no pooling gets (engine/pooling.py)
        self.embed_defaults: EmbedParams = embed_defaults(model_dir, self.config.embed_pooling,
                                                          self.config.embed_normalize)
        self.loras = LoraRegistry()  # the adapters requests may name (GenerateRequest.lora)
        self.lora_enabled, self.lora_disabled_reason = True, ""  # core.capabilities.RunsLoras
        self._requests: dict[int, list[Sequence]] = {}  # engine thread only
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._has_input = threading.Condition(self._lock)
        self._has_output = threading.Condition(self._lock)
        self._new: list[tuple[int, ValidRequest, LoraWeights | None]] = []
        self._cancels: list[int] = []
        self._pauses: list[tuple[int, bool]] = []  # (request id, pause?) in call order: pause() / resume()
        self._flushes: list[Future] = []  # flush_cache() calls waiting for the engine thread
        self._outputs: list[Step] = []
        self._stopping = False
        self._woken = False  # wake() was called: the next (or current) await_responses returns at once
        self._dead: str | None = None
        self._on_death: Callable[[str], None] | None = None  # set_death_callback
        self._num_failures = 0
        self._latencies: collections.deque[float] = collections.deque(maxlen=32)
        self._stats = ExecutorStats(kv_blocks_total=num_blocks, tokens_per_block=self.config.block_size)
        self.speculative = self.config.speculative_config  # engine/speculation.py; off unless --speculative ngram
        self.spec_stats = SpecStats()
        self._thread = threading.Thread(target=self._loop, name="tokenloop-engine", daemon=True)
        log.info("engine: %s, weights %s, activations %s, %d KV blocks of %d tokens, matmul %s, decode attention %s, "
                 "layer ops %s", self.model_config.architecture, self.dtype, self.config.dtype, num_blocks,
                 self.config.block_size, self.model.matmul.describe(), f"native ({self.model.paged.isa})" if self.model.paged is not None else "torch",
                 "native" if self.model.ops is not None else "torch")
        log.info("engine: %s", self.speculative.describe())
        if start:
            self._thread.start()

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
        """Load the checkpoint in `model_dir` and start the engine thread."""
        return cls(model_dir, config)

    def _paged_attention(self, dtype: torch.dtype) -> PagedAttention | None:
        """The native decode-attention kernel when wanted and there is a C compiler; `native` insists (start-up error).
        A kernel that fails to build raises kernels.KernelBuildError (start-up error) whatever is wanted."""
        wanted = self.config.attention_backend
        if wanted == "torch" or dtype != torch.float32:
            return None
        paged = kernels.load_paged_attention()
        if paged is None and wanted == "native":
            raise RuntimeError(f"attention_backend 'native' is unavailable here ({kernels.NO_COMPILER}); use 'torch'")
        return paged

    @property
    def dtype(self) -> str:
        """The weights' data type (GetModelInfo.dtype): `int8` / `int4` with --weights int8 / int4, else the engine's
        dtype."""
        return self.config.weights if self.config.weights in ("int8", "int4") else self.config.dtype

    def _matmul_policy(self, sample_weight: torch.Tensor | QWeight | Q4Weight) -> MatmulPolicy:
        if isinstance(sample_weight, Q4Weight):  # timed over every layer's gate_up, as int8
            return MatmulPolicy.calibrate_int4(self._gate_ups, kernels.load_int4(), kernels.load_int8())
        if isinstance(sample_weight, QWeight):  # timed over every layer's gate_up: they stream from memory
            return MatmulPolicy.calibrate_int8(self._gate_ups, kernels.load_int8())
        if self.config.matmul_backend == "auto":
            return MatmulPolicy.calibrate(self._gate_ups, kernels.load_int8())
        usable = sample_weight.dtype in (torch.float32, torch.float64)
        wanted = Backend(self.config.matmul_backend)
        return MatmulPolicy.fixed(wanted if usable else Backend.TORCH)

    # --- the Executor protocol (looper thread) ---

    def enqueue(self, request: ValidRequest) -> int:
        """Submit a request; raises ValueError for one this engine cannot serve."""
        self._check_request(request)
        lora = self.loras.acquire(request.lora) if request.lora else None  # LoraError (ValueError) when unknown
        request_id = next(self._ids)
        with self._lock:
            if self._dead or self._stopping:
                if lora is not None:
                    self.loras.release(lora)
                raise EngineDeadError(self._dead or "the engine is shutting down")
            self._new.append((request_id, request, lora))
            self._has_input.notify()
        return request_id

    # --- LoRA adapters (any thread) ---

    def read_lora(self, name: str, path: str | Path) -> LoraWeights:
        """Read and check a PEFT adapter for this model (slow: call it off the event loop); raises LoraError."""
        return read_adapter(name, path, self.model_config, self.config.torch_dtype, self.config.max_lora_rank)

    def add_lora(self, weights: LoraWeights) -> None:
        """Make a read adapter available to requests that name it."""
        self.loras.add(weights)

    def unload_lora(self, name: str) -> LoraWeights:
        """Remove an adapter no request uses; LoraInUseError while requests use it (they keep running)."""
        return self.loras.remove(name)

    def _check_request(self, request: ValidRequest) -> None:
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.max_context_length:
            raise ValueError(f"the prompt has {len(prompt)} tokens; this model takes at most "
                             f"{self.max_context_length - 1} so that one can be generated")
        vocab = self.model_config.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        if request.n < 1:
            raise ValueError(f"n must be >= 1, got {request.n}")
        if request.embed is not None and (request.n != 1 or request.structured is not None):
            raise ValueError("an embedding request has n 1 and no `structured` constraint")
        if request.structured is not None and request.structured.grammar is None:
            raise ValueError(f"`{request.structured.kind}` was not compiled (validation compiles it)")
        need = min(len(prompt) + request.stopping.max_new_tokens, self.max_context_length)
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if need > capacity:
            raise ValueError(f"prompt plus max_new_tokens ({need} tokens) exceeds the KV cache ({capacity} tokens)")

    def await_responses(self, timeout: float) -> list[Step]:
        """Block up to `timeout` s for steps (releases the GIL); raises EngineDeadError once dead and drained."""
        with self._lock:
            if not self._outputs and not self._dead and not self._woken:
                self._has_output.wait(timeout)
            self._woken = False
            if self._dead and not self._outputs:
                raise EngineDeadError(self._dead)
            outputs, self._outputs = self._outputs, []
        return merge_steps(outputs)

    def wake(self) -> None:
        """Make a blocked (or the next) `await_responses` return now (the looper has a new command)."""
        with self._lock:
            self._woken = True
            self._has_output.notify_all()

    def cancel(self, request_id: int) -> None:
        """Idempotent; the request's unfinished sequences end with CANCELLED at the next step."""
        with self._lock:
            self._cancels.append(request_id)
            self._has_input.notify()

    def pause(self, request_id: int) -> None:
        """Stop generating for a request and free its KV blocks (it keeps its tokens); idempotent, unknown or
        finished ids are ignored. Steps already made still arrive."""
        with self._lock:
            self._pauses.append((request_id, True))
            self._has_input.notify()

    def resume(self, request_id: int) -> None:
        """Generate again for a paused request: it waits for a batch slot and recomputes its K/V (greedy output is
        the same as never paused; a seeded one too: each sequence keeps its RNG). Idempotent."""
        with self._lock:
            self._pauses.append((request_id, False))
            self._has_input.notify()

    def flush_cache(self) -> int:
        """Drop the prefix cache's unused blocks (core.capabilities.FlushesCache): the engine thread does it between
        steps, emitting their KV "removed" events; blocks that running requests hold stay. Blocks until done (call
        it off the event loop); returns how many were dropped. EngineDeadError once the engine is dead."""
        done: Future = Future()
        with self._lock:
            if self._dead or self._stopping:
                raise EngineDeadError(self._dead or "the engine is shutting down")
            self._flushes.append(done)
            self._has_input.notify()
        return done.result()

    def stats(self) -> ExecutorStats:
        """Thread-safe snapshot."""
        with self._lock:
            s = self._stats
            return ExecutorStats(s.num_running, s.num_waiting + len(self._new), s.kv_blocks_used, s.kv_blocks_total,
                                 s.tokens_per_block, s.step_latency_s, s.num_preemptions, s.num_steps,
                                 s.kv_blocks_cached, s.prefix_cache_hit_rate, s.num_prefix_cache_evictions,
                                 s.num_prefix_cache_hit_tokens, s.num_prefix_cache_query_tokens, s.spec_num_drafts,
                                 s.spec_num_draft_tokens, s.spec_num_accepted_tokens, s.spec_accepted_per_pos)

    def shutdown(self) -> None:
        """Stop the engine thread; pending requests get no more steps."""
        with self._lock:
            self._stopping = True
            self._has_input.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        with self._lock:
            flushes, self._flushes = self._flushes, []
        for done in flushes:
            done.set_exception(EngineDeadError("the engine is shutting down"))

    # --- the engine thread ---

    def _loop(self) -> None:
        kernels.name_this_thread("tokenloop-eng")
        torch.set_num_threads(self.num_threads)
        try:
            while True:
                with self._lock:
                    while not (self._stopping or self._new or self._cancels or self._pauses or self._flushes
                               or self.scheduler.has_work()):
                        self._has_input.wait()
                    if self._stopping:
                        return
                    new, self._new = self._new, []
                    cancels, self._cancels = self._cancels, []
                    pauses, self._pauses = self._pauses, []
                    flushes, self._flushes = self._flushes, []
                self._admit(new)
                self._pause(pauses)
                self._cancel(cancels)
                self._flush(flushes)
                if self.scheduler.has_work():
                    self.step()
        except BaseException as exc:  # noqa: BLE001 - anything here leaves the engine unusable
            log.exception("engine thread died")
            self._die(f"the engine failed: {type(exc).__name__}: {exc}")

    def _admit(self, new: list[tuple[int, ValidRequest, LoraWeights | None]]) -> None:
        for request_id, request, lora in new:
            seqs = [Sequence.from_request(request_id, i, request) for i in range(request.n)]
            for seq in seqs:
                seq.lora, seq.cache_key = lora, (lora.cache_key if lora is not None else None)
                if self.speculative.enabled and seq.embed is None:
                    seq.spec = SpecState.for_config(self.speculative)
            self._requests[request_id] = seqs
            for seq in seqs:
                self.scheduler.add(seq)

    def _forget(self, request_id: int) -> list[Sequence]:
        """The request leaves the engine (finished, cancelled or failed): its adapter is one request less in use."""
        seqs = self._requests.pop(request_id, None) or []
        if seqs and seqs[0].lora is not None:
            self.loras.release(seqs[0].lora)
        return seqs

    def _pause(self, pauses: list[tuple[int, bool]]) -> None:
        for request_id, pause in pauses:
            for seq in self._requests.get(request_id, ()):
                (self.scheduler.pause if pause else self.scheduler.resume)(seq)
        if pauses:
            self._publish([])  # the freed blocks show in stats at once

    def _cancel(self, request_ids: list[int]) -> None:
        steps = []
        for request_id in request_ids:
            seqs = self._forget(request_id)
            if seqs:
                steps.extend(cancelled_steps(seqs, self.scheduler))
        self._publish(steps)

    def _flush(self, flushes: list[Future]) -> None:
        """flush_cache() calls: the first drops the unused blocks, the others find none left."""
        for i, done in enumerate(flushes):
            done.set_result(self.block_manager.flush_unused() if i == 0 else 0)
        if flushes:
            self._publish([])  # the removed events go out now, with stats that show the cache smaller

    def step(self) -> None:
        """One iteration: schedule, run the model, sample, advance, postprocess, publish. A row that fails fails its
        request alone (`_run_isolated`, `_sampled`)."""
        start = time.perf_counter()
        if self.speculative.enabled:  # 0. draft (speculation: spec_step.py)
            running = self.scheduler.running
            propose_drafts(running, self.speculative, self.config.max_num_tokens - len(running),
                           self.max_context_length)
        scheduled = self.scheduler.schedule()  # 1. schedule
        if not scheduled:
            return
        ran = self._run_isolated(scheduled)  # 2. run the model
        if ran is None:
            return
        out = ran.output
        samples = sample_batch(out.logits, out.samplers, self.eos_token_ids) if out.samplers else []  # 3. sample
        self.scheduler.advance(ran.scheduled)  # 4. advance
        steps = ran.failed + self._embedded(out.pooled) + self._sampled(out.samplers, samples, out.drafts)  # 5.
        self._latencies.append(time.perf_counter() - start)
        self._publish(steps)  # 6. publish

    def _sampled(self, samplers: list[Sequence], samples: list,
                 drafts: list[tuple[Sequence, torch.Tensor]]) -> list[Step]:
        """The steps of the sampled tokens, then of the drafts verified after them (spec_step.verify_drafts); the
        requests that finished leave. A request whose own values (or row) failed in sampling (RowFailure) ends alone,
        with its error."""
        steps = self._fail_rows([(seq, s) for seq, s in zip(samplers, samples) if isinstance(s, RowFailure)])
        if steps:
            samples = [s for seq, s in zip(samplers, samples) if not isinstance(s, RowFailure) and
                       seq.executor_id in self._requests]
            samplers = [seq for seq in samplers if seq.executor_id in self._requests]
        made = steps_for_samples(samplers, samples, self.scheduler, self.eos_token_ids, self.max_context_length)
        steps += made
        if drafts:
            first = {seq.seq_id: step for seq, step in zip(samplers, made)}
            verified, failures = verify_drafts([d for d in drafts if d[0].seq_id in first], first, self.scheduler,
                                               self.eos_token_ids, self.max_context_length, self.spec_stats)
            steps += verified + self._fail_rows(failures)
        self._retire_finished(samplers)
        return steps

    def _fail_rows(self, failures: list[tuple[Sequence, RowFailure]]) -> list[Step]:
        """The requests of rows that could not be sampled end alone, with their errors."""
        steps = []
        for request_id, failure in {seq.executor_id: f for seq, f in failures}.items():
            log.warning("request %d failed in sampling: %s", request_id, failure.message)
            kind = ErrorKind.INVALID_ARGUMENT if failure.invalid else ErrorKind.INTERNAL
            steps += error_steps(request_id, self._forget(request_id), self.scheduler, failure.message, kind)
        return steps

    def _retire_finished(self, seqs: list[Sequence]) -> None:
        """The requests whose sequences have all finished leave the engine (their adapters released)."""
        for seq in seqs:
            if seq.is_finished and all(s.is_finished for s in self._requests.get(seq.executor_id, ())):
                self._forget(seq.executor_id)

    def _embedded(self, pooled: list[tuple[Sequence, torch.Tensor]]) -> list[Step]:
        """Pool the embedding sequences' new hidden states; one whose prompt is all computed ends with its vector
        and leaves at once (its blocks freed; the full ones stay in the prefix cache like any prompt's)."""
        steps = []
        for seq, hidden in pooled:
            seq.pool(hidden)
            if seq.num_uncomputed_tokens == 0:
                steps.append(Step(seq.executor_id, seq.seq_index, [], is_final=True,
                                  finish_reason=FinishReason.LENGTH, embedding=seq.embedding(),
                                  num_cached_prompt_tokens=seq.num_cached_prompt_tokens or 0))
                self.scheduler.finish(seq)
                self._forget(seq.executor_id)
        return steps

    def _run_isolated(self, scheduled: list[tuple[Sequence, int]]) -> StepRun | None:
        """The model over `scheduled`. When the batch fails, each sequence runs alone (`_run_each_alone`)."""
        try:
            output = runner.run(self.model, scheduled, self.block_manager.block_size)
        except Exception as exc:  # noqa: BLE001 - find the rows at fault before failing anyone
            log.exception("engine forward failed for %d sequences; running each alone", len(scheduled))
            return self._run_each_alone(scheduled, exc)
        self._num_failures = 0
        return StepRun(scheduled, output, [])

    def _run_each_alone(self, scheduled: list[tuple[Sequence, int]], batch_error: Exception) -> StepRun | None:
        """Run each sequence of a failed batch alone: the requests of those that fail alone fail (their error steps
        in `failed`), the rest go on. None when nothing is left to run. The step counts towards the engine's death
        only when every sequence failed alone and a one-token probe fails too (a fault no request explains)."""
        block_size = self.block_manager.block_size
        outputs, bad = [], {}
        for seq, n in scheduled:
            try:
                outputs.append((seq, runner.run(self.model, [(seq, n)], block_size)))
            except Exception as exc:  # noqa: BLE001 - this sequence's forward fails alone
                bad.setdefault(seq.executor_id, exc)
        ok = [(seq, n) for seq, n in scheduled if seq.executor_id not in bad]
        if not ok and not self._probe_runs():
            self._fail_step(scheduled, batch_error)  # raises once MAX_CONSECUTIVE_STEP_FAILURES steps failed so
            return None
        failed = []
        for request_id, exc in bad.items():
            log.warning("request %d fails alone in the model forward: %s: %s", request_id, type(exc).__name__, exc)
            failed += error_steps(request_id, self._forget(request_id), self.scheduler,
                                  f"generation failed: the model failed on this request: {type(exc).__name__}: {exc}")
        if not ok:
            self._publish(failed)
            return None
        self._num_failures = 0
        parts = [output for seq, output in outputs if seq.executor_id not in bad]
        return StepRun(ok, runner.ModelOutput.concat(parts), failed)

    def _probe_runs(self) -> bool:
        """Whether the model still runs a one-token sequence of no request (in a free block, freed after): when
        it does, the sequences that failed alone explain their failure."""
        probe = Sequence(-1, 0, [0], 1)
        if not self.block_manager.append_slots(probe, 1):
            return False  # no block to try in: count the failure
        try:
            runner.run(self.model, [(probe, 1)], self.block_manager.block_size)
            return True
        except Exception:  # noqa: BLE001 - the engine's own fault
            log.exception("the model fails a one-token probe too")
            return False
        finally:
            self.block_manager.free(probe)

    def _fail_step(self, scheduled: list[tuple[Sequence, int]], exc: Exception) -> None:
        """A model forward failed for every sequence of the step, each alone too: a fault of the engine, not of a
        request. Its requests fail; MAX_CONSECUTIVE_STEP_FAILURES such steps in a row kill the engine."""
        log.error("engine step failed for every sequence (%d in a row)", self._num_failures + 1)
        self._num_failures += 1
        message = f"generation failed: {type(exc).__name__}: {exc}"
        request_ids = dict.fromkeys(seq.executor_id for seq, _ in scheduled)
        steps = []
        for request_id in request_ids:
            seqs = self._forget(request_id)
            steps.extend(error_steps(request_id, seqs, self.scheduler, message))
        self._publish(steps)
        if self._num_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise RuntimeError(f"{self._num_failures} engine steps failed in a row; last: {message}")

    def _publish(self, steps: list[Step]) -> None:
        sched, blocks = self.scheduler, self.block_manager
        running = {s.executor_id for s in sched.running}
        with self._lock:
            self._outputs.extend(steps)
            st = self._stats
            st.num_running = len(running)
            st.num_waiting = len({s.executor_id for s in sched.waiting} - running) if sched.waiting else 0
            st.kv_blocks_used = blocks.num_used_blocks
            st.num_preemptions = sched.num_preemptions
            st.num_steps += 1
            st.step_latency_s = sum(self._latencies) / len(self._latencies) if self._latencies else 0.0
            st.kv_blocks_cached = blocks.num_cached_blocks
            st.prefix_cache_hit_rate = blocks.hit_rate
            st.num_prefix_cache_evictions = blocks.num_evictions
            st.num_prefix_cache_hit_tokens = blocks.num_hit_tokens
            st.num_prefix_cache_query_tokens = blocks.num_query_tokens
            spec = self.spec_stats
            st.spec_num_drafts, st.spec_num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
            st.spec_num_accepted_tokens, st.spec_accepted_per_pos = spec.num_accepted_tokens, tuple(spec.accepted_per_pos)
            if steps:
                self._has_output.notify_all()
        self.kv_events.publish(blocks.take_events())  # after the stats: a batch's load record is current

    def set_death_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` is called once, from the engine thread, when the engine dies (the looper uses it to
        notice a death while it waits for commands, with no request in flight)."""
        with self._lock:
            self._on_death = callback
            dead = self._dead
        if dead is not None:
            callback(dead)

    def _die(self, message: str) -> None:
        with self._lock:
            self._dead = message
            self._has_output.notify_all()
            callback = self._on_death
            flushes, self._flushes = self._flushes, []
        for done in flushes:
            done.set_exception(EngineDeadError(message))
        if callback is not None:
            callback(message)
