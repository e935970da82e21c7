"""The server's state: model metadata, validator, looper, admission, health, and the numbers it reports."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2

from tokenloop.core.capabilities import Capabilities
from tokenloop.core.executor import Executor
from tokenloop.core.request import ValidRequest
from tokenloop.core.structured import GrammarCompiler
from tokenloop.core.tokenizer import ModelCard, Tokenizer
from tokenloop.looper.looper import Looper
from tokenloop.looper.stream import Complete
from tokenloop.v1 import tokenloop_pb2 as pb

from .admission import Admission
from .compile_pool import CompilePool, CompileThreads
from .config import ServerConfig, parse_lora_flag
from .errors import Unavailable
from .health import HealthServicer
from .lora import LoraCatalog
from .placement import FrontPlacement
from .structured import GrammarGate
from .validation import Limits, Validator

log = logging.getLogger("tokenloop.service")

SERVICE_NAMES = ("tokenloop.v1.TextGeneration", "trtllm.TrtllmService", "vllm.grpc.engine.VllmEngine")
ROUTER_SERVICES = {"trtllm": ("trtllm.TrtllmService",), "vllm": ("vllm.grpc.engine.VllmEngine",),
                   "both": ("trtllm.TrtllmService", "vllm.grpc.engine.VllmEngine")}  # by --router-protocol


# Each service's Generate is its front door's `generate` (service.frontdoor), which keeps its own request-log record
GENERATE_RPCS = frozenset(f"/{name}/Generate" for name in SERVICE_NAMES)


def served_names(config: ServerConfig) -> tuple[str, ...]:
    """The gRPC services this server answers (grpc.health names them): tokenloop.v1 and the router protocols."""
    return SERVICE_NAMES[:1] + ROUTER_SERVICES[config.router_protocol]
TOKENIZE_THREADS = 2  # threads that tokenize long inputs (App.tokenizing); more would only share the same cores
# Grammars compile on threads of their own (service/compile_pool.py), and llguidance recurses ~3 KB of stack per nested
# grammar rule: a GBNF chain of 3,000 rules overflowed the default 8 MB and killed the process. 256 MB holds the
# deepest grammar --max-grammar-bytes lets in (past ~30,000 levels llguidance refuses it); it is address space, touched
# only as used. The tokenizer threads keep it too (a tokenizer's pre-tokenizer regexes recurse as well).
TOKENIZE_THREAD_STACK = 256 << 20
# Objects allocated between two young-generation collections of the cyclic GC (CPython's default is 700).
GC_GEN0_THRESHOLD = 20_000


def tune_gc() -> None:
    """Once the model is loaded: move everything alive (modules, protobuf descriptors, the model) out of the
    cyclic GC's reach (`gc.freeze()`) and collect the young generation less often. Garbage cycles are still
    collected; the collector just stops walking what lives as long as the process. A stream whose reader
    lags holds its unsent events, a few tracked objects per token: with the defaults they reach the old
    generation and every full collection walks them and the whole heap again. At 256 streams of 512 tokens,
    one token per message, this cut the server's CPU per message by 10-15 % (bench/service_overhead.py)."""
    gc.collect()
    gc.freeze()
    gen0, *older = gc.get_threshold()
    gc.set_threshold(max(gen0, GC_GEN0_THRESHOLD), *older)


class App:
    """Shared by every servicer: readiness, the looper, and what GetLoad / GetModelInfo report."""

    def __init__(self, config: ServerConfig, executor_factory: Callable[[ServerConfig], Executor]):
        self.config = config
        self._executor_factory = executor_factory
        self.health = HealthServicer()
        self.admission = Admission(config.max_concurrent_requests, config.max_queue)
        self.tokenizer: Tokenizer | None = None
        self.card: ModelCard | None = None
        self.validator: Validator | None = None
        self.executor: Executor | None = None
        self.capabilities = Capabilities()  # what the executor can do beyond Executor (core.capabilities), once built
        self.grammars: GrammarGate | None = None  # compiles `structured` constraints (service.structured)
        self.looper: Looper | None = None
        self.loras: LoraCatalog | None = None  # the LoRA adapters requests may name (service.lora)
        self.not_ready_reason = "the model is loading"
        self.dead = asyncio.Event()
        self.observers: list = []  # objects with on_request_end(valid, completes, code, streamed) / on_error(code)
        self._tokenize_pool: ThreadPoolExecutor | None = None  # started on the first long input
        self.placement = FrontPlacement(config.front_cpu)

    # -- lifecycle -------------------------------------------------------------------------
    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("",) + served_names(self.config):
            await self.health.set(name, status)

    def load_model(self) -> None:
        """Blocking: tokenizer, model card, executor (run it in a thread)."""
        cfg = self.config
        self.tokenizer = Tokenizer.from_dir(cfg.model)
        self.card = ModelCard.from_dir(cfg.model)
        if cfg.model_id:
            self.card = dataclasses.replace(self.card, model_id=cfg.model_id)
        self.validator = Validator(self.tokenizer, self.card, Limits(
            max_context_length=self.card.max_context_length, max_prompt_tokens=cfg.max_prompt_tokens,
            max_new_tokens=cfg.max_new_tokens, default_max_new_tokens=min(cfg.default_max_new_tokens,
                                                                          cfg.max_new_tokens),
            max_n=cfg.max_n, max_stop_strings=cfg.max_stop_strings,
            max_stop_string_length=cfg.max_stop_string_length, max_grammar_bytes=cfg.max_grammar_bytes,
            max_stop_token_ids=cfg.max_stop_token_ids, max_detokenize_ids=cfg.max_detokenize_ids,
            allow_special_tokens_in_chat=cfg.allow_special_tokens_in_chat))
        tokenizer_json = self.tokenizer.to_json()
        compiler = GrammarCompiler(tokenizer_json, self.validator.vocab_size, self.card.eos_token_ids,
                                   cfg.grammar_cache_size)
        processes = CompilePool(tokenizer_json, self.validator.vocab_size, self.card.eos_token_ids,
                                cfg.grammar_compile_workers, cfg.max_grammar_compiles_waiting)
        threads = CompileThreads(cfg.grammar_compile_workers, TOKENIZE_THREAD_STACK,
                                 initializer=self.placement.release_this_thread)
        self.grammars = GrammarGate(compiler, processes, cfg.grammar_compile_timeout, threads)
        self.executor = self._executor_factory(cfg)
        self.capabilities = Capabilities.of(self.executor)  # its optional abilities, read once here

    async def start(self) -> None:
        """Load the model (health NOT_SERVING meanwhile), start the looper, then serve."""
        await self.set_serving(False)
        self.placement.choose()  # a --front-cpu outside the process's CPUs fails here, before the model loads
        await asyncio.to_thread(self.load_model)
        await self.grammars.processes.start()
        self.loras = LoraCatalog(self.executor, self.config.max_loras, self.capabilities, self.config.lora_roots)
        for value in self.config.loras:  # a bad adapter fails start-up, naming it
            await self.loras.load(*parse_lora_flag(value))
        loop = asyncio.get_running_loop()
        self.looper = Looper(self.executor, self.tokenizer, poll_timeout=self.config.poll_timeout,
                             on_death=self._on_death, capabilities=self.capabilities,
                             on_behind=self.placement.looper_behind)
        self.looper.start(loop)
        if self.placement.pin(threading.get_native_id(), self.looper.thread_id) is not None:
            # threads started from now on by the event loop would inherit its one CPU
            loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="tokenloop-worker",
                                                         initializer=self.placement.release_this_thread))
        tune_gc()
        self.not_ready_reason = ""
        await self.set_serving(True)

    def _on_death(self, reason: str) -> None:
        self.not_ready_reason = f"the executor died: {reason}"
        self.admission.close(self.not_ready_reason)
        asyncio.ensure_future(self.set_serving(False))
        self.dead.set()

    async def drain(self, grace: float, now: asyncio.Event | None = None) -> None:
        """Stop admitting, let in-flight requests finish within `grace` (or until `now` is set), then fail the rest.
        Compiles stop at once: their processes are killed and their requests fail UNAVAILABLE."""
        self.admission.close("the server is shutting down")
        self.not_ready_reason = "the server is shutting down"
        if self.grammars is not None and self.grammars.processes is not None:
            self.grammars.processes.close()
        await self.set_serving(False)
        if self.looper is None:
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        while self.looper.num_open and loop.time() < end and not (now is not None and now.is_set()):
            await asyncio.sleep(0.05)
        self.looper.stop()  # fails what is left with UNAVAILABLE
        await asyncio.sleep(0.05)  # let the final hand-off reach the streams

    def close(self) -> None:
        if self.looper is not None:
            self.looper.stop()
        if self.executor is not None:
            self.executor.shutdown()
        if self._tokenize_pool is not None:
            self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if self.grammars is not None and self.grammars.threads is not None:
            self.grammars.threads.shutdown(wait=False)
        self.placement.restore()

    async def tokenizing(self, size: int, fn: Callable, *args):
        """`fn(*args)`, a call that tokenizes (validation, Tokenize, Detokenize) an input of `size` characters
        (or ids): here when `size` is at most `--tokenize-inline-chars`, else on a tokenizer thread. `tokenizers`
        releases the GIL while it works (core.tokenizer), so the event loop keeps writing every other stream and the
        looper keeps polling while a long prompt is tokenized; done here, a prompt of 8k tokens would stop both for
        ~15 ms. Short inputs stay here: the hop to a thread and back (two wake-ups) costs more than they do."""
        if size <= self.config.tokenize_inline_chars:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool(), fn, *args)

    @property
    def num_tokenize_threads(self) -> int:
        """The tokenizer threads running: none until the first long input (`tokenize_pool`)."""
        return TOKENIZE_THREADS if self._tokenize_pool is not None else 0

    def tokenize_pool(self) -> ThreadPoolExecutor:
        """The tokenizer threads (long inputs only: never a compile), started on first use, all at once, with
        TOKENIZE_THREAD_STACK stacks (`threading.stack_size` applies to threads started while it is set)."""
        if self._tokenize_pool is None:
            previous = threading.stack_size(TOKENIZE_THREAD_STACK)
            try:
                pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenloop-tokenize",
                                          initializer=self.placement.release_this_thread)
                started = threading.Barrier(TOKENIZE_THREADS + 1)
                for _ in range(TOKENIZE_THREADS):
                    pool.submit(started.wait)  # each waits until all have started: one new thread per task
                started.wait()
            finally:
                threading.stack_size(previous)
            self._tokenize_pool = pool
        return self._tokenize_pool

    def require_ready(self) -> None:
        if self.not_ready_reason:
            raise Unavailable(self.not_ready_reason)

    # -- reporting -------------------------------------------------------------------------
    def observe_end(self, valid: ValidRequest, completes: list[Complete], code: grpc.StatusCode | None,
                    streamed: dict[int, int] | None = None) -> None:
        """A Generate ended: `code` is OK when every sequence completed, None when it was cut short; `streamed`:
        the tokens each sequence's chunks carried (a sequence cut short has no `Complete`)."""
        for obs in self.observers:
            obs.on_request_end(valid, completes, code, streamed or {})

    def observe_error(self, code: grpc.StatusCode) -> None:
        for obs in self.observers:
            obs.on_error(code)

    def model_info(self) -> pb.ModelInfo:
        card, lim = self.card, self.validator.limits
        info = pb.ModelInfo(
            model_id=card.model_id, architecture=card.architecture, backend=self.config.backend,
            max_context_length=card.max_context_length, vocab_size=self.validator.vocab_size,
            eos_token_ids=card.eos_token_ids, has_chat_template=self.tokenizer.chat_template is not None,
            max_new_tokens_limit=lim.max_new_tokens, max_n=lim.max_n, dtype=self.dtype)
        if card.bos_token_id is not None:
            info.bos_token_id = card.bos_token_id
        if self.loras is not None:
            info.lora_adapters.extend(self.loras.describe(a) for a in self.loras.list())
        return info

    @property
    def dtype(self) -> str:
        dtype = self.capabilities.dtype
        return str(self.card.torch_dtype if dtype is None else dtype).removeprefix("torch.")

    def load(self) -> pb.Load:
        adm = self.admission
        load = pb.Load(max_concurrent_requests=adm.max_concurrent, max_queue=adm.max_queue,
                       num_waiting=adm.num_waiting)
        if self.executor is None or self.looper is None:
            return load
        s = self.executor.stats()
        load.num_running = s.num_running
        load.num_waiting = adm.num_waiting + s.num_waiting
        load.kv_blocks_used = s.kv_blocks_used
        load.kv_blocks_total = s.kv_blocks_total
        load.kv_block_size = s.tokens_per_block
        load.kv_cache_utilization = s.kv_cache_utilization
        load.num_in_flight = max(self.looper.num_open, self.looper.num_in_flight)
        load.step_latency_s = s.step_latency_s
        load.num_preemptions = s.num_preemptions
        load.kv_blocks_cached = s.kv_blocks_cached
        load.prefix_cache_hit_rate = s.prefix_cache_hit_rate
        load.spec_acceptance_rate = s.spec_acceptance_rate
        load.spec_tokens_per_step = s.spec_tokens_per_step
        return load
