"""The LoRA adapter catalog: names, ids and directories of the adapters this worker serves, and which are resident.

`LoadLoraAdapter` reads only under the `--lora-root` directories (none: it is off); `--lora` takes any directory
(the operator's). Every adapter loaded (`--lora NAME=DIR` or `LoadLoraAdapter`) stays known until
`UnloadLoraAdapter`; at most `--max-loras` are resident in the executor at once. A request for a known adapter that
is not resident reads it again (off the event loop), pushing out the least recently used resident adapter that no
request is using; when every resident adapter is in use, the request gets RESOURCE_EXHAUSTED. Reading an adapter (safetensors, a few MB)
always happens on a worker thread, so the event loop keeps serving every other stream.

Unloading an adapter that requests are using is refused with FAILED_PRECONDITION (they keep running); unload it
once they finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from dataclasses import dataclass

from tokenloop.core.capabilities import Capabilities
from tokenloop.core.lora import LoraError, LoraInUseError
from tokenloop.core.request import ValidRequest
from tokenloop.v1 import tokenloop_pb2 as pb

from .config import LORA_NAME as NAME
from .errors import AlreadyExists, InUse, NotFound, Overloaded, RuntimeLoadingOff, Unimplemented, ValidationError

MAX_TASK_ID = (1 << 63) - 1
MAX_PATH_CHARS = 4096  # PATH_MAX: a longer `path` names nothing
MAX_SHOWN_CHARS = 64  # of a refused name, in its message
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(slots=True)
class Adapter:
    """One known adapter; `weights` is None while it is not resident."""

    name: str
    id: int
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    weights: object | None
    last_used: float = 0.0


class LoraCatalog:
    """Adapters by name and by id, on one executor that can run them (`read_lora`, `add_lora`, `unload_lora`)."""

    def __init__(self, executor, max_loras: int, capabilities: Capabilities, roots: tuple[str, ...] = ()):
        self.executor = executor
        self.max_loras = max_loras
        self.roots = tuple(os.path.realpath(r) for r in roots)  # --lora-root: where LoadLoraAdapter may read
        self.supported = capabilities.lora
        self._unsupported_reason = capabilities.lora_disabled_reason
        self._adapters: dict[str, Adapter] = {}
        self._lock = asyncio.Lock()  # one load, unload or swap at a time

    # -- RPCs ------------------------------------------------------------------------------------------------
    async def load_at_run_time(self, name: str, path: str, adapter_id: int | None = None) -> Adapter:
        """LoadLoraAdapter: `path` resolved under a --lora-root (`resolve`), then `load`."""
        self._require_support()
        check_name(name)
        return await self.load(name, self.resolve(name, path), adapter_id)

    def resolve(self, name: str, path: str) -> str:
        """The adapter directory `path` names under a --lora-root (relative: under each root in turn; absolute:
        inside one), symlinks followed but never out of the root, no `..`, holding a PEFT adapter's two files.
        Every way of failing (missing, outside the roots, not an adapter) gets the same NOT_FOUND, so that a caller
        learns nothing of the server's disk beyond the roots; FAILED_PRECONDITION when no root is configured."""
        if not self.roots:
            raise RuntimeLoadingOff("LoadLoraAdapter is off: this server loads adapters at run time only from "
                                    "--lora-root directories, and none is configured (--lora adapters are served)")
        if not path:
            raise ValidationError("lora_path", f"LoRA adapter `{name}`: `path` must name an adapter directory")
        refusal = NotFound(f"LoRA adapter `{name}`: `path` names no PEFT adapter under this server's --lora-root "
                           "directories (not found, or not allowed)")
        if len(path) > MAX_PATH_CHARS or not path.isprintable() or ".." in path.replace("\\", "/").split("/"):
            raise refusal
        for root in self.roots:
            try:
                real = os.path.realpath(os.path.join(root, path))  # an absolute `path` replaces the root
                files = [os.path.realpath(os.path.join(real, f)) for f in PEFT_FILES]  # links out count as out
                inside = all(os.path.commonpath([p, root]) == root for p in (real, *files))
                if inside and all(map(os.path.isfile, files)):
                    return real
            except (OSError, ValueError):  # a name too long for the file system, ...
                continue
        raise refusal

    async def load(self, name: str, path: str, adapter_id: int | None = None) -> Adapter:
        """Read `path` (a PEFT adapter the operator named: --lora, or `resolve`d) and serve it as `name`; raises a
        ServiceError naming the adapter."""
        self._require_support()
        check_name(name)
        if not path:
            raise ValidationError("lora_path", f"LoRA adapter `{name}`: `path` must name an adapter directory")
        if adapter_id is not None and not 1 <= adapter_id <= MAX_TASK_ID:
            raise ValidationError("lora_id", f"LoRA adapter `{name}`: `id` must be in 1..{MAX_TASK_ID}")
        async with self._lock:
            if name in self._adapters:
                raise AlreadyExists(f"LoRA adapter `{name}` is already loaded (unload it first)")
            taken = {a.id: a.name for a in self._adapters.values()}
            if adapter_id in taken:
                raise AlreadyExists(f"LoRA adapter `{name}`: id {adapter_id} is taken by `{taken[adapter_id]}`")
            weights = await self._read(name, path)
            await self._make_room(name)
            weights.task_id = adapter_id or max(taken, default=0) + 1
            self.executor.add_lora(weights)
            adapter = Adapter(name, weights.task_id, path, weights.rank, weights.alpha, weights.target_modules,
                              weights, time.monotonic())
            self._adapters[name] = adapter
            return adapter

    async def unload(self, name: str) -> Adapter:
        self._require_support()
        async with self._lock:
            adapter = self._get(name)
            if adapter.weights is not None:
                try:
                    self.executor.unload_lora(name)
                except LoraInUseError as exc:
                    raise InUse(str(exc)) from None
            del self._adapters[name]
            return adapter

    def list(self) -> list[Adapter]:
        return sorted(self._adapters.values(), key=lambda a: a.name)

    def describe(self, adapter: Adapter) -> pb.LoraAdapter:
        running = self.executor.loras.num_in_use(adapter.name) if adapter.weights is not None else 0
        return pb.LoraAdapter(name=adapter.name, id=adapter.id, path=adapter.path, rank=adapter.rank,
                              alpha=adapter.alpha, target_modules=adapter.target_modules, num_running=running)

    # -- requests --------------------------------------------------------------------------------------------
    def name_of_task(self, task_id: int) -> str:
        """The adapter a router's `lora_config.task_id` names."""
        for adapter in self._adapters.values():
            if adapter.id == task_id:
                return adapter.name
        known = ", ".join(f"{a.id} (`{a.name}`)" for a in self.list()) or "none"
        raise NotFound(f"`lora_config.task_id` {task_id} names no loaded LoRA adapter (loaded: {known})")

    async def admit(self, valid: ValidRequest) -> ValidRequest:
        """A request naming an adapter: make sure it is resident (reading it again if it was pushed out)."""
        if not valid.lora:
            return valid
        self._require_support()
        adapter = self._get(valid.lora)
        adapter.last_used = time.monotonic()
        if adapter.weights is None:
            async with self._lock:
                adapter = self._get(valid.lora)  # unloaded meanwhile?
                if adapter.weights is None:
                    weights = await self._read(adapter.name, adapter.path)
                    await self._make_room(adapter.name)
                    weights.task_id = adapter.id
                    self.executor.add_lora(weights)
                    adapter.weights = weights
        return valid

    # -- inside ----------------------------------------------------------------------------------------------
    async def _read(self, name: str, path: str):
        try:
            return await asyncio.to_thread(self.executor.read_lora, name, path)
        except LoraError as exc:
            raise ValidationError(exc.rule, str(exc)) from None

    async def _make_room(self, name: str) -> None:
        """Push out least recently used idle adapters until one more fits under --max-loras."""
        resident = [a for a in self._adapters.values() if a.weights is not None]
        while len(resident) >= self.max_loras:
            idle = [a for a in resident if self.executor.loras.num_in_use(a.name) == 0]
            if not idle:
                raise Overloaded(f"LoRA adapter `{name}` cannot be made resident: all {self.max_loras} resident "
                                 "adapters are in use (--max-loras); retry later")
            victim = min(idle, key=lambda a: a.last_used)
            try:
                self.executor.unload_lora(victim.name)
            except LoraInUseError:  # a request took it meanwhile: try the next one
                victim.last_used = time.monotonic()
                continue
            victim.weights = None
            resident.remove(victim)

    def _get(self, name: str) -> Adapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            known = ", ".join(f"`{n}`" for n in sorted(self._adapters)) or "none"
            raise NotFound(f"LoRA adapter `{name}` is not loaded (loaded: {known})")
        return adapter

    def _require_support(self) -> None:
        if not self.supported:
            raise Unimplemented(self._unsupported_reason)


def check_name(name: str, field: str = "name") -> None:
    """An adapter's name: ValidationError naming `field` unless 1-128 letters, digits, '.', '_' or '-'."""
    if not NAME.fullmatch(name):
        shown = f"{name[:MAX_SHOWN_CHARS]!r}{'...' if len(name) > MAX_SHOWN_CHARS else ''}"
        raise ValidationError("lora_name", f"`{field}` must be 1-128 letters, digits, '.', '_' or '-' starting with "
                              f"a letter or digit; got {shown}")


def with_lora(valid: ValidRequest, name: str) -> ValidRequest:
    return dataclasses.replace(valid, lora=name)
