"""Engine: the embedded executor. Continuous batching on its own thread behind the Executor protocol.

The looper thread calls enqueue / cancel / await_responses; the engine thread runs `step()`
(schedule, run the model, postprocess) whenever it has work and sleeps on a condition when idle.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from tokenloop.core.executor import EngineDeadError, ErrorKind, ExecutorStats, Step
from tokenloop.core.kv_events import CacheCleared, KvEventHub
from tokenloop.core.lora import LoraRegistry
from tokenloop.core.request import EmbedParams, ValidRequest
from tokenloop.core.tokenizer import ModelCard

from . import kernels
from .admission import check_request
from .block_manager import BlockManager
from .config import EngineConfig
from .isolation import StepRun, run_isolated
from .load_stats import update_stats
from .loader import ModelConfig
from .lora import LoraWeights, read_adapter
from .mailbox import SHUTTING_DOWN, Commands, Mailbox
from .matmul import set_blas_threads
from .model_setup import build_model, default_num_threads
from .pooling import embed_defaults, pool_rows
from .postprocess import cancelled_steps, error_steps, steps_for_samples
from .route_timing import RouteTimer
from .sampler import RowFailure, sample_batch
from .scheduler import Scheduler
from .sequence import Sequence
from .spec_step import propose_drafts, verify_drafts
from .speculation import SpecState, SpecStats

log = logging.getLogger(__name__)
MAX_CONSECUTIVE_STEP_FAILURES = 3


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
        self.model = build_model(model_dir, self.config, self.model_config, self.dtype)
        num_blocks = self.model.num_blocks
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
        # the looper thread's commands in, steps out, the death (mailbox.py)
        self.mailbox = Mailbox(ExecutorStats(kv_blocks_total=num_blocks, tokens_per_block=self.config.block_size))
        self.num_failed_steps = 0  # steps in a row that failed for a fault of the engine (StepRun.fault)
        self._latencies: collections.deque[float] = collections.deque(maxlen=32)
        # engine/speculation.py; ngram unless --speculative off; a verified row's cost from the calibration's timings
        self.speculative = self.config.speculative_config.with_measured_row_cost(self.model.matmul.row_timing())
        self.spec_stats = SpecStats()
        # --route-retiming: quantized routes re-timed on real steps (route_timing.py); only where the calibration chose
        # C routes (not forced with TOKENLOOP_MATMUL_ROUTE)
        timed = self.config.route_retiming and self.config.weights in ("int8", "int4") and \
            not self.model.matmul.chosen.startswith("forced")
        self.route_timer = RouteTimer(self.model.matmul) if timed else None
        self._thread = threading.Thread(target=self._loop, name="tokenloop-engine", daemon=True)
        log.info("engine: %s, weights %s, activations %s, %d KV blocks of %d tokens (%s), matmul %s, decode attention "
                 "%s, layer ops %s", self.model_config.architecture, self.dtype, self.config.dtype, num_blocks,
                 self.config.block_size, str(self.model.kv_dtype).removeprefix("torch."), self.model.matmul.describe(), f"native ({self.model.paged.isa})" if self.model.paged is not None else "torch",
                 "native" if self.model.ops is not None else "torch")
        log.info("engine: %s", self.speculative.describe())
        if start:
            self._thread.start()

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
        """Load the checkpoint in `model_dir` and start the engine thread."""
        return cls(model_dir, config)

    @property
    def dtype(self) -> str:
        """The weights' data type (GetModelInfo.dtype): `int8` / `int4` with --weights int8 / int4, else the engine's
        dtype."""
        return self.config.weights if self.config.weights in ("int8", "int4") else self.config.dtype

    # --- the Executor protocol (looper thread) ---

    def enqueue(self, request: ValidRequest) -> int:
        """Submit a request; raises ValueError for one this engine cannot serve."""
        check_request(request, self.max_context_length, self.model_config.vocab_size,
                      self.block_manager.num_blocks * self.block_manager.block_size)
        lora = self.loras.acquire(request.lora) if request.lora else None  # LoraError (ValueError) when unknown
        request_id = next(self._ids)
        try:
            self.mailbox.post_request(request_id, request, lora)
        except EngineDeadError:
            if lora is not None:
                self.loras.release(lora)
            raise
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

    def await_responses(self, timeout: float) -> list[Step]:
        """Block up to `timeout` s for steps (releases the GIL); raises EngineDeadError once dead and drained."""
        return self.mailbox.await_steps(timeout)

    def wake(self) -> None:
        """Make a blocked (or the next) `await_responses` return now (the looper has a new command)."""
        self.mailbox.wake()

    def cancel(self, request_id: int) -> None:
        """Idempotent; the request's unfinished sequences end with CANCELLED at the next step."""
        self.mailbox.post_cancel(request_id)

    def pause(self, request_id: int) -> None:
        """Stop generating for a request and free its KV blocks (it keeps its tokens); idempotent, unknown or
        finished ids are ignored. Steps already made still arrive."""
        self.mailbox.post_pause(request_id, True)

    def resume(self, request_id: int) -> None:
        """Generate again for a paused request: it waits for a batch slot and recomputes its K/V (greedy output is
        the same as never paused; a seeded one too: each sequence keeps its RNG). Idempotent."""
        self.mailbox.post_pause(request_id, False)

    def flush_cache(self) -> int:
        """Drop the prefix cache's unused blocks (core.capabilities.FlushesCache): the engine thread does it between
        steps, emitting their KV "removed" events; blocks that running requests hold stay. Blocks until done (call
        it off the event loop); returns how many were dropped. EngineDeadError once the engine is dead."""
        done: Future = Future()
        self.mailbox.post_flush(done)
        return done.result()

    def stats(self) -> ExecutorStats:
        """Thread-safe snapshot."""
        return self.mailbox.snapshot()

    @property
    def dead(self) -> str | None:
        """Why the engine died (its requests failed, new ones are refused), or None while it serves."""
        return self.mailbox.dead

    @property
    def num_requests(self) -> int:
        """Requests in the engine: admitted and not yet finished, cancelled or failed (engine thread's view)."""
        return len(self._requests)

    def shutdown(self) -> None:
        """Stop the engine thread; pending requests get no more steps."""
        self.mailbox.stop()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        self.mailbox.fail_flushes(SHUTTING_DOWN)

    # --- the engine thread ---

    def _loop(self) -> None:
        kernels.name_this_thread("tokenloop-eng")
        torch.set_num_threads(self.num_threads)
        try:
            while (commands := self.mailbox.take(self.scheduler.has_work)) is not None:  # blocks while idle
                self.apply(commands)
                if self.scheduler.has_work():
                    self.step()
        except BaseException as exc:  # noqa: BLE001 - anything here leaves the engine unusable
            log.exception("engine thread died")
            self.mailbox.die(f"the engine failed: {type(exc).__name__}: {exc}")

    def apply(self, commands: Commands | None = None) -> None:
        """Carry out the looper's commands (default: those posted so far): admit the new requests, then pause /
        resume, cancel, flush. The engine thread does it before each step; a test or benchmark that drives an
        engine built with `start=False` calls it, then `step()`, itself."""
        commands = self.mailbox.take(self.scheduler.has_work, wait=False) if commands is None else commands
        if commands is None:
            return
        self._admit(commands.new)
        self._pause(commands.pauses)
        self._cancel(commands.cancels)
        self._flush(commands.flushes)

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
        request alone (`_run`, `_sampled`)."""
        start = time.perf_counter()
        if self.speculative.enabled:  # 0. draft (speculation: spec_step.py)
            running = self.scheduler.running
            propose_drafts(running, self.speculative, self.config.max_num_tokens - len(running),
                           self.max_context_length)
        scheduled = self.scheduler.schedule()  # 1. schedule
        if not scheduled:
            return
        trial = self.route_timer.begin(sum(n for _, n in scheduled)) if self.route_timer else None
        ran = self._run(scheduled)  # 2. run the model (now and then on another route of the same bits: route_timing)
        if trial is not None:
            self.route_timer.end(trial)
        if ran is None:
            return
        out = ran.output
        samples = sample_batch(out.logits, out.samplers, self.eos_token_ids) if out.samplers else []  # 3. sample
        self.scheduler.advance(ran.scheduled)  # 4. advance
        steps = ran.error_steps + self._embedded(out.pooled) + self._sampled(out.samplers, samples, out.drafts)  # 5.
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
            # a request's own values (invalid): the client gets the message and the request log's line, within its
            # budget for failed calls, says so; a warning per request would let a client flood the log at will
            log.log(logging.DEBUG if failure.invalid else logging.WARNING, "request %d failed in sampling: %s",
                    request_id, failure.message)
            kind = ErrorKind.INVALID_ARGUMENT if failure.invalid else ErrorKind.INTERNAL
            steps += error_steps(request_id, self._forget(request_id), self.scheduler, failure.message, kind)
        return steps

    def _retire_finished(self, seqs: list[Sequence]) -> None:
        """The requests whose sequences have all finished leave the engine (their adapters released)."""
        for seq in seqs:
            if seq.is_finished and all(s.is_finished for s in self._requests.get(seq.executor_id, ())):
                self._forget(seq.executor_id)

    def _embedded(self, pooled: list[tuple[Sequence, torch.Tensor]]) -> list[Step]:
        """Pool the embedding sequences' new hidden states (pooling.pool_rows); the requests that end leave."""
        steps = pool_rows(pooled, self.scheduler)
        for step in steps:
            self._forget(step.executor_id)
        return steps

    def _run(self, scheduled: list[tuple[Sequence, int]]) -> StepRun | None:
        """The model over `scheduled`, failures isolated (isolation.run_isolated): the requests that fail alone fail
        (their error steps in the StepRun); None when nothing is left to sample or pool."""
        ran = run_isolated(self.model, self.block_manager, scheduled)
        if ran.fault is not None:
            self._fail_step(scheduled, ran.fault)  # raises once MAX_CONSECUTIVE_STEP_FAILURES steps failed so
            return None
        for request_id, exc in ran.errors.items():
            log.warning("request %d fails alone in the model forward: %s: %s", request_id, type(exc).__name__, exc)
            ran.error_steps += error_steps(request_id, self._forget(request_id), self.scheduler, "generation failed: "
                                           f"the model failed on this request: {type(exc).__name__}: {exc}")
        if ran.output is None:
            self._publish(ran.error_steps)
            return None
        self.num_failed_steps = 0
        return ran

    def _fail_step(self, scheduled: list[tuple[Sequence, int]], exc: Exception) -> None:
        """A model forward failed for every sequence of the step, each alone too: a fault of the engine, not of a
        request. Its requests fail; MAX_CONSECUTIVE_STEP_FAILURES such steps in a row kill the engine."""
        log.error("engine step failed for every sequence (%d in a row)", self.num_failed_steps + 1)
        self.num_failed_steps += 1
        message = f"generation failed: {type(exc).__name__}: {exc}"
        request_ids = dict.fromkeys(seq.executor_id for seq, _ in scheduled)
        steps = []
        for request_id in request_ids:
            seqs = self._forget(request_id)
            steps.extend(error_steps(request_id, seqs, self.scheduler, message))
        self._publish(steps)
        if self.num_failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise RuntimeError(f"{self.num_failed_steps} engine steps failed in a row; last: {message}")

    def _publish(self, steps: list[Step]) -> None:
        """Hand `steps` to await_responses, with the engine's load as it is now; then the prefix cache's events."""
        self.mailbox.publish(steps, lambda stats: update_stats(stats, self.scheduler, self.block_manager,
                                                               self._latencies, self.spec_stats))
        self.kv_events.publish(self.block_manager.take_events())  # after the stats: a batch's load record is current

    def set_death_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` is called once, from the engine thread, when the engine dies (the looper uses it to
        notice a death while it waits for commands, with no request in flight)."""
        self.mailbox.set_death_callback(callback)
