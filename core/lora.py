"""LoRA adapters in the PEFT format, for every executor: the errors, the one reader, and the registry.

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules) and
`adapter_model.safetensors` with `base_model.model.model.layers.N.{self_attn,mlp}.X_proj.lora_{A,B}.weight`.
PEFT adds `lora_B(lora_A(x)) * scaling` to the projection's output, scaling = lora_alpha / r
(lora_alpha / sqrt(r) with rslora). `read_peft` checks the directory, its config and the names and pairs of its
weights, and returns them as they are; each executor shapes them its own way (engine/lora.py fuses them into its
projections, trtllm/lora.py packs them for the C++ executor). No tensor library is imported until an adapter is read.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# PEFT module name -> the decoder layer's sub-layer that holds it; the order is the order adapters list them in
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
WEIGHT_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight")


class LoraError(ValueError):
    """An adapter that cannot be loaded or used; the message names the adapter and the rule."""

    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


class LoraInUseError(LoraError):
    """Unloading an adapter that requests are still using."""


@dataclass(eq=False, slots=True)
class PeftAdapter:
    """One PEFT adapter as read: its config and `parts[(layer, module)] = (lora_A [r, D_in], lora_B [D_out, r])`."""

    name: str
    path: Path
    config: dict
    parts: dict[tuple[int, str], tuple[Any, Any]]

    @property
    def alpha(self) -> float:
        return float(self.config.get("lora_alpha", self.config["r"]))

    def scaling(self, r: int) -> float:
        """What PEFT multiplies lora_B(lora_A(x)) by for a part of rank `r`."""
        return self.alpha / math.sqrt(r) if self.config.get("use_rslora") else self.alpha / r

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted({m for _, m in self.parts}, key=list(MODULES).index))

    def digest(self) -> str:
        """Of its files: an adapter reloaded with other weights under the same name gets another one."""
        return hashlib.blake2b((self.path / CONFIG_FILE).read_bytes() + (self.path / WEIGHTS_FILE).read_bytes(),
                               digest_size=8).hexdigest()


def read_peft(name: str, path: str | Path, adapted_by: str, num_layers: int | None = None) -> PeftAdapter:
    """Read and check the PEFT adapter in `path`; raises LoraError naming the adapter and the rule.

    `adapted_by` names the executor in the messages ("the engine", "TensorRT-LLM"); `num_layers`, when known,
    refuses weights for layers the model lacks."""
    from safetensors import safe_open

    path = Path(path)
    config = read_peft_config(name, path)
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a regex string or "all-linear" is checked through the weights' names instead
        lacking = sorted(set(targets) - set(MODULES))
        if lacking:
            raise LoraError("lora_target_modules", f"LoRA adapter `{name}` targets modules the model lacks or "
                            f"{adapted_by} does not adapt: {', '.join(lacking)} (supported: {', '.join(MODULES)})")
    found: dict[tuple[int, str], dict[str, Any]] = {}
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():
                m = WEIGHT_KEY.fullmatch(key)
                if m is None:
                    raise LoraError("lora_target_modules", f"LoRA adapter `{name}`: weight `{key}` is not a LoRA "
                                    f"weight of a projection {adapted_by} adapts ({', '.join(MODULES)})")
                layer, module = int(m.group(1)), m.group(3)
                if MODULES.get(module) != m.group(2):
                    raise LoraError("lora_target_modules", f"LoRA adapter `{name}` targets `{m.group(2)}.{module}`, "
                                    f"which the model lacks or {adapted_by} does not adapt")
                if num_layers is not None and layer >= num_layers:
                    raise LoraError("lora_target_modules", f"LoRA adapter `{name}` has weights for layer {layer}; "
                                    f"the model has {num_layers} layers")
                found.setdefault((layer, module), {})[m.group(4)] = f.get_tensor(key)
    except LoraError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt file: say so, naming the adapter
        raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: {WEIGHTS_FILE} is unreadable "
                        f"({type(exc).__name__}: {exc})") from None
    if not found:
        raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: {WEIGHTS_FILE} holds no LoRA weights")
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: layer {layer} {module} lacks lora_"
                            f"{'B' if 'A' in ab else 'A'}")
    return PeftAdapter(name, path, config, {k: (ab["A"], ab["B"]) for k, ab in found.items()})


def read_peft_config(name: str, path: Path) -> dict:
    """`adapter_config.json` of the adapter directory `path`, checked: a LoRA config this reader supports."""
    if not path.is_dir():
        raise LoraError("lora_not_a_directory", f"LoRA adapter `{name}`: {path} is not a directory")
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / file).is_file():
            raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: {path} is not a PEFT adapter (no {file})")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: {CONFIG_FILE} is not readable JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: {CONFIG_FILE} is not a LoRA config "
                        f"(peft_type {config.get('peft_type') if isinstance(config, dict) else None!r})")
    unsupported = [(key, config.get(key)) for key in ("use_dora", "modules_to_save", "alpha_pattern", "layer_replication")
                   if config.get(key)]
    if config.get("bias", "none") != "none":
        unsupported.append(("bias", config["bias"]))
    if unsupported:
        what = ", ".join(f"{k}={v!r}" for k, v in unsupported)
        raise LoraError("lora_unsupported", f"LoRA adapter `{name}`: unsupported PEFT options {what}")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: `r` must be a positive integer, got {config.get('r')!r}")
    return config


class NamedAdapter(Protocol):
    name: str


class LoraRegistry:
    """The adapters an executor can run, by name, and how many requests use each, so an adapter in use is never
    removed under them (`remove` refuses instead). Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._adapters: dict[str, NamedAdapter] = {}
        self._in_use: dict[str, int] = {}

    def add(self, weights: NamedAdapter) -> None:
        with self._lock:
            if weights.name in self._adapters:
                raise LoraError("lora_exists", f"LoRA adapter `{weights.name}` is already loaded")
            self._adapters[weights.name] = weights
            self._in_use[weights.name] = 0

    def remove(self, name: str) -> NamedAdapter:
        """Drop an idle adapter; LoraInUseError while requests use it, LoraError when unknown."""
        with self._lock:
            self._known(name)
            if self._in_use[name]:
                raise LoraInUseError("lora_in_use", f"LoRA adapter `{name}` has {self._in_use[name]} requests in "
                                     "flight; unload it once they finish")
            del self._in_use[name]
            return self._adapters.pop(name)

    def acquire(self, name: str) -> NamedAdapter:
        """The adapter for one more request; LoraError when it is not loaded."""
        with self._lock:
            weights = self._known(name)
            self._in_use[name] += 1
            return weights

    def release(self, weights: NamedAdapter) -> None:
        with self._lock:
            if self._adapters.get(weights.name) is weights:
                self._in_use[weights.name] -= 1

    def num_in_use(self, name: str) -> int:
        with self._lock:
            return self._in_use.get(name, 0)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def _known(self, name: str) -> NamedAdapter:
        weights = self._adapters.get(name)
        if weights is None:
            known = ", ".join(f"`{n}`" for n in self._adapters) or "none"
            raise LoraError("lora_unknown", f"LoRA adapter `{name}` is not loaded (loaded: {known})")
        return weights
