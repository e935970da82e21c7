"""LoRA adapters on TensorRT-LLM, for both adapters: checked here, applied by TensorRT-LLM.

Written against NVIDIA/TensorRT-LLM:
  LLM API: tensorrt_llm/llmapi/llm_args.py (`enable_lora`, `lora_config`), tensorrt_llm/lora_helper.py /
    docs llm-api/reference LoraConfig (`LoraConfig(lora_dir=[...], max_lora_rank=64, max_loras=None,
    max_cpu_loras=None, lora_target_modules=[...])`; with no `lora_dir` the target modules must be given),
    tensorrt_llm/executor/request.py (`LoRARequest(lora_name, lora_int_id, lora_path="")`), and
    `LLM.generate_async(..., lora_request=)`. The adapter directory goes to TensorRT-LLM as it is.
  C++ executor: docs/source/advanced/lora.md ("LoRA tensor format details") and
    cpp/tensorrt_llm/nanobind/executor/request.cpp (`LoraConfig(task_id, weights=None, config=None)`,
    `Request(..., lora_config=)`): the first request of a task id carries `weights`
    [num_module_layers, D*Hi + Ho*D] (each row lora_A [D, Hi] then lora_B [Ho, D] flattened, zero-padded) and
    `config` [num_module_layers, 3] = (module id, layer, D); TensorRT-LLM caches the adapter, so later requests
    send the task id only.
Module names: tensorrt_llm/lora_manager.py `get_default_trtllm_modules_to_hf_modules()` (mlp_h_to_4h is
gate_proj, mlp_gate is up_proj) and the module-id table of docs/source/advanced/lora.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tokenloop.core.lora import MODULES, LoraError, LoraRegistry, read_peft

TRTLLM_MODULES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_dense",
                  "gate_proj": "mlp_h_to_4h", "down_proj": "mlp_4h_to_h", "up_proj": "mlp_gate"}
MODULE_IDS = {"attn_q": 1, "attn_k": 2, "attn_v": 3, "attn_dense": 4, "mlp_h_to_4h": 5, "mlp_4h_to_h": 6,
              "mlp_gate": 7}


@dataclass(eq=False, slots=True)
class TrtllmLora:
    """One adapter as TensorRT-LLM gets it; `weights`/`config` only for the C++ executor."""

    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    task_id: int = 0  # set by the catalog: the router API's lora_config.task_id, TensorRT-LLM's lora_int_id
    weights: object | None = None  # torch.Tensor [num_module_layers, max(D*Hi + Ho*D)]
    config: object | None = None  # torch.Tensor int32 [num_module_layers, 3]
    sent: bool = field(default=False)  # the C++ executor has had its weights


def read_trtllm_adapter(name: str, path: str | Path, max_rank: int, with_tensors: bool) -> TrtllmLora:
    """Check a PEFT adapter (core.lora.read_peft: the engine's rules), and build the C++ executor's tensors if asked."""
    import torch

    peft = read_peft(name, path, "TensorRT-LLM")
    rank = max(a.shape[0] for a, _ in peft.parts.values())
    if rank > max_rank:
        raise LoraError("lora_rank", f"LoRA adapter `{name}` has rank {rank}; this server takes at "
                        f"most {max_rank} (--max-lora-rank)")
    lora = TrtllmLora(name, str(peft.path), rank, peft.alpha, peft.modules)
    if with_tensors:
        rows, config = [], []
        for (layer, module) in sorted(peft.parts, key=lambda k: (k[0], list(MODULES).index(k[1]))):
            a, b = (t.float() for t in peft.parts[(layer, module)])
            r = a.shape[0]
            rows.append(torch.cat([a.flatten(), (b * peft.scaling(r)).flatten()]))
            config.append([MODULE_IDS[TRTLLM_MODULES[module]], layer, r])
        width = max(row.numel() for row in rows)
        lora.weights = torch.stack([torch.nn.functional.pad(row, (0, width - row.numel())) for row in rows])
        lora.config = torch.tensor(config, dtype=torch.int32)
    return lora


class TrtllmLoras:
    """The executor side of service.lora.LoraCatalog, shared by both TensorRT-LLM adapters (a mixin)."""

    _with_tensors = False  # the C++ executor sends weights; the LLM API sends the directory
    lora_disabled_reason = "TensorRT-LLM was started without LoRA: start the server with at least one --lora"

    def _init_loras(self, enabled: bool, max_rank: int) -> None:
        self.loras = LoraRegistry()
        self.lora_enabled = enabled  # LoRA is set up in TensorRT-LLM only when the server starts with --lora
        self._max_lora_rank = max_rank

    def read_lora(self, name: str, path: str) -> TrtllmLora:
        if not self.lora_enabled:
            raise LoraError("lora_disabled", f"LoRA adapter `{name}`: TensorRT-LLM was started without LoRA; "
                            "start the server with at least one --lora")
        return read_trtllm_adapter(name, path, self._max_lora_rank, self._with_tensors)

    def add_lora(self, lora: TrtllmLora) -> None:
        self.loras.add(lora)

    def unload_lora(self, name: str) -> TrtllmLora:
        return self.loras.remove(name)

    def _acquire_lora(self, name: str) -> TrtllmLora | None:
        return self.loras.acquire(name) if name else None

    def _release_lora(self, lora: TrtllmLora | None) -> None:
        if lora is not None:
            self.loras.release(lora)
