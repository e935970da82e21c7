"""The optional abilities of an executor: one protocol each, read once where the executor is built.

`Executor` (core/executor.py) is what every executor does. Some do more; each extra ability is a protocol here,
and `Capabilities.of(executor)` checks them all once (the service's App when it builds the executor; a Looper
built without a record, as tests build one). Nothing else asks an executor what it can do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .kv_events import KvEventHub
from .request import EmbedParams

NO_LORA = "LoRA adapters are not supported by this executor"
NO_EMBED = ("embeddings are not supported by this executor (the TensorRT-LLM backend only generates); "
            "serve the model with --backend engine")
NO_FLUSH_CACHE = "this executor cannot flush its prefix cache"


@runtime_checkable
class Wakes(Protocol):
    """`wake()`, thread-safe, makes a blocked (or the next) `await_responses` return early. The looper calls it from
    the event loop after queueing a new request or a cancel, so that it is taken at once instead of after the
    executor's wait (up to the looper's `poll_timeout`). Without it, commands wait for the current
    `await_responses` to return."""

    def wake(self) -> None: ...


@runtime_checkable
class Pauses(Protocol):
    """`pause(id)` and `resume(id)`, both idempotent, unknown or finished ids ignored. `pause` stops generating for a
    request and frees what it holds in the executor (KV blocks) while keeping its output so far; steps already made
    may still arrive. `resume` lets it generate again from where it stopped: the same tokens as if never paused
    (greedy; seeded sampling keeps its RNG). The service pauses a request whose reader stopped reading
    (--slow-reader-grace) and gives its admission slot to another; the looper sends both through its channel like
    `cancel`. An executor without them (the TensorRT-LLM adapters) keeps generating for a stalled reader, which keeps
    its slot until --stall-timeout."""

    def pause(self, executor_id: int) -> None: ...

    def resume(self, executor_id: int) -> None: ...


@runtime_checkable
class ReportsDeath(Protocol):
    """`set_death_callback(callback)`: the executor calls `callback(reason)` once, from any thread, when it dies (at
    once if it is already dead). The looper then fails every stream and reports the death even while no request is
    in flight (it waits on its command channel then, not on the executor)."""

    def set_death_callback(self, callback: Callable[[str], None]) -> None: ...


@runtime_checkable
class RunsLoras(Protocol):
    """LoRA adapters (service/lora.py's catalog drives these): `read_lora` reads and checks one (core.lora.LoraError),
    `add_lora` makes it usable by requests, `unload_lora` removes an idle one; `loras` (core.lora.LoraRegistry)
    counts the requests using each. `lora_enabled` False (TensorRT-LLM started without --lora) refuses them with
    `lora_disabled_reason`."""

    loras: Any
    lora_enabled: bool
    lora_disabled_reason: str

    def read_lora(self, name: str, path: str) -> Any: ...

    def add_lora(self, adapter: Any) -> None: ...

    def unload_lora(self, name: str) -> Any: ...


@runtime_checkable
class PublishesKvEvents(Protocol):
    """`kv_events`: the hub of the executor's KV-cache events (stored / removed blocks) for SubscribeKvEvents; None
    when this executor was started without them."""

    kv_events: KvEventHub | None


@runtime_checkable
class NamesDtype(Protocol):
    """`dtype`: the weights' data type as loaded (shown by GetModelInfo; the model card's otherwise)."""

    dtype: Any


@runtime_checkable
class Embeds(Protocol):
    """The executor runs embedding requests (`ValidRequest.embed` set): the prompt as a prefill without sampling, then
    one final Step whose `embedding` is the pooled final hidden state. `embed_defaults` (core.request.EmbedParams) is
    the pooling and normalization a request that leaves them unset gets (the model's sentence-transformers config,
    else the server's flags, else last token, normalized, as vLLM does for a decoder-only model)."""

    embed_defaults: EmbedParams


@runtime_checkable
class FlushesCache(Protocol):
    """`flush_cache()`: drop every prefix-cache block no request uses (evictable, reference count 0), emitting their KV
    "removed" events; returns how many were dropped. Blocks in use stay cached. Thread-safe: it goes through the
    executor's own command path and blocks the caller until done (call it off the event loop); raises
    core.executor.EngineDeadError when the executor is dead."""

    def flush_cache(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What one executor can do beyond `Executor`, read once by `of`."""

    wake: Callable[[], None] | None = None
    pause: bool = False
    death_callback: Callable[[Callable[[str], None]], None] | None = None
    lora: bool = False
    lora_disabled_reason: str = NO_LORA
    kv_events: KvEventHub | None = None
    dtype: Any = None
    embed: bool = False  # Embeds: ValidRequest.embed requests are served (else refuse them UNIMPLEMENTED, NO_EMBED)
    embed_defaults: EmbedParams | None = None  # Embeds.embed_defaults
    flush_cache: Callable[[], int] | None = None  # FlushesCache.flush_cache (blocking); None: NO_FLUSH_CACHE

    @classmethod
    def of(cls, executor: object) -> Capabilities:
        runs_loras = isinstance(executor, RunsLoras)
        return cls(
            wake=executor.wake if isinstance(executor, Wakes) else None,
            pause=isinstance(executor, Pauses),
            death_callback=executor.set_death_callback if isinstance(executor, ReportsDeath) else None,
            lora=runs_loras and bool(executor.lora_enabled),
            lora_disabled_reason=(runs_loras and executor.lora_disabled_reason) or NO_LORA,
            kv_events=executor.kv_events if isinstance(executor, PublishesKvEvents) else None,
            dtype=executor.dtype if isinstance(executor, NamesDtype) else None,
            embed=isinstance(executor, Embeds),
            embed_defaults=executor.embed_defaults if isinstance(executor, Embeds) else None,
            flush_cache=executor.flush_cache if isinstance(executor, FlushesCache) else None,
        )
