"""LoRA adapters in the PEFT format, read with safetensors (the engine does not import peft).

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules) and
`adapter_model.safetensors` with `base_model.model.model.layers.N.{self_attn,mlp}.X_proj.lora_{A,B}.weight`.
PEFT adds `lora_B(lora_A(x)) * scaling` to the projection's output, scaling = lora_alpha / r
(lora_alpha / sqrt(r) with rslora). The engine fuses q/k/v and gate/up (loader.py), so an adapter is fused
the same way once, at load: per layer and fused projection, A [R, D_in] stacks the targeted parts' lora_A
and B [D_out, R] places their lora_B (scaling folded in) block-diagonally; the update is (x @ A^T) @ B^T, and
both are kept transposed (A^T, B^T) for it.

`LoraRegistry` holds the adapters the engine can run and counts the requests using each, so an adapter in
use is never removed under them (`remove` refuses instead).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .loader import ModelConfig

# PEFT module name -> (sub-layer, the engine's fused projection, index of the part inside it)
TARGETS = {"q_proj": ("self_attn", "qkv", 0), "k_proj": ("self_attn", "qkv", 1), "v_proj": ("self_attn", "qkv", 2),
           "o_proj": ("self_attn", "o", 0), "gate_proj": ("mlp", "gate_up", 0), "up_proj": ("mlp", "gate_up", 1),
           "down_proj": ("mlp", "down", 0)}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight")
_uids = itertools.count(1)


class LoraError(ValueError):
    """An adapter that cannot be loaded or used; the message names the adapter and the rule."""

    def __init__(self, rule: str, message: str):
        super().__init__(message)
        self.rule = rule


class LoraInUseError(LoraError):
    """Unloading an adapter that requests are still using."""


def part_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(D_in, D_out) of each PEFT target module of `config`'s layers."""
    c = config
    q, kv, d, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, i),
            "up_proj": (d, i), "down_proj": (i, d)}


@dataclass(eq=False, slots=True)
class LoraWeights:
    """One loaded adapter: `layers[i][proj] = (A^T [D_in, R], B^T [R, D_out])` for each fused projection it adapts
    (stored transposed, so the forward pass multiplies contiguous matrices with no transpose)."""

    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    task_id: int = 0  # set by the catalog (service/lora.py): the router API's lora_config.task_id
    digest: str = ""  # of its files: an adapter reloaded with other weights under the same name gets other blocks
    uid: int = field(default_factory=lambda: next(_uids))  # unique per load: orders rows by adapter

    @property
    def cache_key(self) -> str:
        """The extra key of its sequences' prefix-cache block hashes (and KV events): name and content, the same
        on every worker that loads the same files."""
        return f"lora:{self.name}:{self.digest}"

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for ab in layer.values() for t in ab)


def _read_config(name: str, path: Path) -> dict:
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


def _check_targets(name: str, config: dict) -> None:
    targets = config.get("target_modules")
    if isinstance(targets, list):  # a regex string or "all-linear" is checked through the weights' names instead
        lacking = sorted(set(targets) - set(TARGETS))
        if lacking:
            raise LoraError("lora_target_modules", f"LoRA adapter `{name}` targets modules the model lacks or the "
                            f"engine does not adapt: {', '.join(lacking)} (supported: {', '.join(TARGETS)})")


def read_adapter(name: str, path: str | Path, config: ModelConfig, dtype: torch.dtype,
                 max_rank: int) -> LoraWeights:
    """Read and check the PEFT adapter in `path` against the base model; raises LoraError."""
    path = Path(path)
    peft = _read_config(name, path)
    _check_targets(name, peft)
    rank_pattern = peft.get("rank_pattern") or {}
    alpha = float(peft.get("lora_alpha", peft["r"]))
    shapes = part_shapes(config)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():
                m = _KEY.fullmatch(key)
                if m is None:
                    raise LoraError("lora_target_modules", f"LoRA adapter `{name}`: weight `{key}` is not a LoRA "
                                    f"weight of a projection the engine adapts ({', '.join(TARGETS)})")
                layer, module = int(m.group(1)), m.group(3)
                if module not in TARGETS or TARGETS[module][0] != m.group(2):
                    raise LoraError("lora_target_modules", f"LoRA adapter `{name}` targets `{m.group(2)}.{module}`, "
                                    f"which the model lacks or the engine does not adapt")
                if layer >= config.num_layers:
                    raise LoraError("lora_target_modules", f"LoRA adapter `{name}` has weights for layer {layer}; "
                                    f"the model has {config.num_layers} layers")
                parts.setdefault((layer, module), {})[m.group(4)] = f.get_tensor(key)
    except LoraError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt file: say so, naming the adapter
        raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: {WEIGHTS_FILE} is unreadable "
                        f"({type(exc).__name__}: {exc})") from None
    if not parts:
        raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: {WEIGHTS_FILE} holds no LoRA weights")
    scaled: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    max_seen = 0
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: layer {layer} {module} lacks lora_"
                            f"{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        d_in, d_out = shapes[module]
        r = a.shape[0]
        if a.shape != (r, d_in) or b.shape != (d_out, r):
            raise LoraError("lora_target_modules", f"LoRA adapter `{name}`: layer {layer} {module} has lora_A "
                            f"{list(a.shape)} and lora_B {list(b.shape)}; the model's {module} needs [r, {d_in}] "
                            f"and [{d_out}, r] (an adapter for another base model?)")
        if r > max_rank:
            raise LoraError("lora_rank", f"LoRA adapter `{name}` has rank {r}; this server takes at most "
                            f"{max_rank} (--max-lora-rank)")
        if not rank_pattern and r != peft["r"]:
            raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: layer {layer} {module} has rank {r}, "
                            f"adapter_config.json says r={peft['r']}")
        scaling = alpha / math.sqrt(r) if peft.get("use_rslora") else alpha / r
        max_seen = max(max_seen, r)
        scaled[(layer, module)] = (a.to(torch.float64), b.to(torch.float64) * scaling)
    layers = [_fuse(config, layer, scaled, dtype) for layer in range(config.num_layers)]
    modules = tuple(sorted({m for _, m in parts}, key=list(TARGETS).index))
    digest = hashlib.blake2b((path / CONFIG_FILE).read_bytes() + (path / WEIGHTS_FILE).read_bytes(),
                             digest_size=8).hexdigest()
    return LoraWeights(name, str(path), max(max_seen, peft["r"]), alpha, modules, layers, digest)


def _fuse(config: ModelConfig, layer: int, scaled: dict, dtype: torch.dtype) -> dict:
    """One layer's (A, B) per fused projection: A stacked, B block-diagonal, for the parts the adapter targets."""
    shapes = part_shapes(config)
    out = {}
    for proj in PROJECTIONS:
        modules = [m for m, (_, p, _) in TARGETS.items() if p == proj]
        present = [(m, scaled[(layer, m)]) for m in modules if (layer, m) in scaled]
        if not present:
            continue
        d_in = shapes[modules[0]][0]
        rank = sum(a.shape[0] for _, (a, _) in present)
        a_all = torch.zeros(rank, d_in, dtype=torch.float64)
        b_all = torch.zeros(sum(shapes[m][1] for m in modules), rank, dtype=torch.float64)
        row = col = 0
        for m in modules:
            d_out = shapes[m][1]
            if (layer, m) in scaled:
                a, b = scaled[(layer, m)]
                a_all[col:col + a.shape[0]] = a
                b_all[row:row + d_out, col:col + a.shape[0]] = b
                col += a.shape[0]
            row += d_out
        out[proj] = (a_all.t().to(dtype).contiguous(), b_all.t().to(dtype).contiguous())  # A^T, B^T: see model.add_lora
    return out


class LoraRegistry:
    """The adapters the engine can run, by name, and how many requests use each. Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._adapters: dict[str, LoraWeights] = {}
        self._in_use: dict[str, int] = {}

    def add(self, weights: LoraWeights) -> None:
        with self._lock:
            if weights.name in self._adapters:
                raise LoraError("lora_exists", f"LoRA adapter `{weights.name}` is already loaded")
            self._adapters[weights.name] = weights
            self._in_use[weights.name] = 0

    def remove(self, name: str) -> LoraWeights:
        """Drop an idle adapter; LoraInUseError while requests use it, LoraError when unknown."""
        with self._lock:
            self._known(name)
            if self._in_use[name]:
                raise LoraInUseError("lora_in_use", f"LoRA adapter `{name}` has {self._in_use[name]} requests in "
                                     "flight; unload it once they finish")
            del self._in_use[name]
            return self._adapters.pop(name)

    def acquire(self, name: str) -> LoraWeights:
        """The adapter for one more request; LoraError when it is not loaded."""
        with self._lock:
            weights = self._known(name)
            self._in_use[name] += 1
            return weights

    def release(self, weights: LoraWeights) -> None:
        with self._lock:
            if self._adapters.get(weights.name) is weights:
                self._in_use[weights.name] -= 1

    def num_in_use(self, name: str) -> int:
        with self._lock:
            return self._in_use.get(name, 0)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._adapters)

    def _known(self, name: str) -> LoraWeights:
        weights = self._adapters.get(name)
        if weights is None:
            known = ", ".join(f"`{n}`" for n in self._adapters) or "none"
            raise LoraError("lora_unknown", f"LoRA adapter `{name}` is not loaded (loaded: {known})")
        return weights
