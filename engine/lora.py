"""LoRA adapters on the embedded engine: a PEFT adapter as core/lora.py reads it, fused into the engine's layers.

PEFT adds `lora_B(lora_A(x)) * scaling` to the projection's output (core/lora.py). The engine fuses q/k/v and
gate/up (loader.py), so an adapter is fused the same way once, at load: per layer and fused projection,
A [R, D_in] stacks the targeted parts' lora_A and B [D_out, R] places their lora_B (scaling folded in)
block-diagonally; the update is (x @ A^T) @ B^T, and both are kept transposed (A^T, B^T) for it.

`core.lora.LoraRegistry` holds the adapters the engine can run and counts the requests using each.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tokenloop.core.kv_events import lora_cache_key
from tokenloop.core.lora import LoraError, read_peft

from .loader import ModelConfig

# PEFT module name -> (sub-layer, the engine's fused projection, index of the part inside it)
TARGETS = {"q_proj": ("self_attn", "qkv", 0), "k_proj": ("self_attn", "qkv", 1), "v_proj": ("self_attn", "qkv", 2),
           "o_proj": ("self_attn", "o", 0), "gate_proj": ("mlp", "gate_up", 0), "up_proj": ("mlp", "gate_up", 1),
           "down_proj": ("mlp", "down", 0)}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
_uids = itertools.count(1)


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
        return lora_cache_key(self.name, self.digest)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for ab in layer.values() for t in ab)


def read_adapter(name: str, path: str | Path, config: ModelConfig, dtype: torch.dtype,
                 max_rank: int) -> LoraWeights:
    """Read and check the PEFT adapter in `path` against the base model; raises LoraError."""
    peft = read_peft(name, path, "the engine", config.num_layers)
    rank_pattern = peft.config.get("rank_pattern") or {}
    shapes = part_shapes(config)
    scaled: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    max_seen = 0
    for (layer, module), (a, b) in peft.parts.items():
        d_in, d_out = shapes[module]
        r = a.shape[0]
        if a.shape != (r, d_in) or b.shape != (d_out, r):
            raise LoraError("lora_target_modules", f"LoRA adapter `{name}`: layer {layer} {module} has lora_A "
                            f"{list(a.shape)} and lora_B {list(b.shape)}; the model's {module} needs [r, {d_in}] "
                            f"and [{d_out}, r] (an adapter for another base model?)")
        if r > max_rank:
            raise LoraError("lora_rank", f"LoRA adapter `{name}` has rank {r}; this server takes at most "
                            f"{max_rank} (--max-lora-rank)")
        if not rank_pattern and r != peft.config["r"]:
            raise LoraError("lora_not_peft", f"LoRA adapter `{name}`: layer {layer} {module} has rank {r}, "
                            f"adapter_config.json says r={peft.config['r']}")
        max_seen = max(max_seen, r)
        scaled[(layer, module)] = (a.to(torch.float64), b.to(torch.float64) * peft.scaling(r))
    layers = [_fuse(config, layer, scaled, dtype) for layer in range(config.num_layers)]
    return LoraWeights(name, str(peft.path), max(max_seen, peft.config["r"]), peft.alpha, peft.modules, layers,
                       peft.digest())


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
