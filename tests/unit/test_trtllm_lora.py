"""LoRA on both TensorRT-LLM adapters, against the fakes (which follow the cited TensorRT-LLM sources):
the exact construction arguments, the per-request LoRARequest, and the C++ executor's LoraConfig with the
weights on first use and the task id alone afterwards (trtllm/lora.py)."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from safetensors.torch import load_file

from tests.fakes import scenarios
from tests.fakes.fixtures import make_engine_dir
from tests.lora_helpers import write_adapter
from tokenloop.core.lora import LoraError, LoraInUseError
from tokenloop.trtllm import TrtllmConfig, create_trtllm_executor
from tokenloop.trtllm.lora import read_trtllm_adapter

BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 8, "intermediate_size": 12,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture
def adapter_dir(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps(BASE))
    return write_adapter(base, tmp_path / "a", r=2, alpha=4, targets=("q_proj", "up_proj", "down_proj"))


def lora_request(name: str):
    return dataclasses.replace(scenarios.request(max_new=3), lora=name)


def finish(executor, num_final: int = 1, timeout: float = 10.0):
    deadline, seen = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        seen += sum(s.is_final for s in executor.await_responses(0.01))
        if seen >= num_final:
            return
    raise AssertionError(f"{seen} of {num_final} final steps")


def test_llm_api_lora_config_at_construction_and_lora_request_per_request(fake, tokenizer_dir, adapter_dir):
    config = TrtllmConfig(api="llm", lora_dirs=(str(adapter_dir),), max_loras=4, max_lora_rank=8)
    executor = create_trtllm_executor(str(tokenizer_dir), config)
    try:
        llm = fake.LLM.instances[-1]
        assert llm.args["enable_lora"] is True
        lc = llm.args["lora_config"]
        assert (lc.lora_dir, lc.max_lora_rank, lc.max_loras, lc.max_cpu_loras) == ([str(adapter_dir)], 8, 4, 4)
        lora = executor.read_lora("a", str(adapter_dir))
        assert (lora.rank, lora.alpha, lora.target_modules, lora.weights) == (2, 4.0, ("q_proj", "up_proj",
                                                                                      "down_proj"), None)
        lora.task_id = 3
        executor.add_lora(lora)
        executor.enqueue(lora_request("a"))
        from tensorrt_llm.executor.request import LoRARequest
        assert llm.lora_requests[-1] == LoRARequest("a", 3, str(adapter_dir))
        with pytest.raises(LoraInUseError):
            executor.unload_lora("a")
        finish(executor)
        time.sleep(0.05)  # the result's task releases it on the adapter's loop thread
        assert executor.loras.num_in_use("a") == 0
        executor.enqueue(scenarios.request(max_new=2))
        assert llm.lora_requests[-1] is None  # the base model
        with pytest.raises(LoraError, match="LoRA adapter `b` is not loaded"):
            executor.enqueue(lora_request("b"))
    finally:
        executor.shutdown()


def test_llm_api_without_lora_flags_sets_nothing_and_refuses_adapters(fake, tokenizer_dir, adapter_dir):
    executor = create_trtllm_executor(str(tokenizer_dir), TrtllmConfig(api="llm"))
    try:
        assert "enable_lora" not in fake.LLM.instances[-1].args and "lora_config" not in fake.LLM.instances[-1].args
        assert executor.lora_enabled is False
        with pytest.raises(LoraError, match="started without LoRA"):
            executor.read_lora("a", str(adapter_dir))
    finally:
        executor.shutdown()


def test_cpp_executor_weights_on_first_use_then_the_task_id_only(fake, tmp_path, tokenizer_dir, adapter_dir):
    engine_dir = make_engine_dir(tmp_path / "engine", tokenizer_dir)
    executor = create_trtllm_executor(str(engine_dir), TrtllmConfig(lora_dirs=(str(adapter_dir),), max_lora_rank=8))
    lora = executor.read_lora("a", str(adapter_dir))
    lora.task_id = 5
    executor.add_lora(lora)
    # docs/source/advanced/lora.md: config rows (module id, layer, rank); weights rows A [D, Hi] then B [Ho, D]
    assert lora.config.tolist() == [[1, 0, 2], [7, 0, 2], [6, 0, 2], [1, 1, 2], [7, 1, 2], [6, 1, 2]]
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.down_proj"
    a, b = tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"]
    row = torch.cat([a.flatten(), (b * 2.0).flatten()])  # scaling alpha / r = 4 / 2
    assert lora.weights.shape == (6, 2 * 12 + 8 * 2) and torch.allclose(lora.weights[5, :row.numel()], row)
    engine = fake.bindings.executor.Executor.instances[-1]
    first = executor.enqueue(lora_request("a"))
    second = executor.enqueue(lora_request("a"))
    sent = engine.requests[first].lora_config
    assert (sent.task_id, sent.weights is lora.weights, sent.config is lora.config) == (5, True, True)
    again = engine.requests[second].lora_config
    assert (again.task_id, again.weights, again.config) == (5, None, None)
    assert engine.requests[executor.enqueue(scenarios.request(max_new=2))].lora_config is None
    assert executor.loras.num_in_use("a") == 2
    finish(executor, 3)
    assert executor.loras.num_in_use("a") == 0
    assert executor.unload_lora("a") is lora
    executor.add_lora(lora)
    engine.lora_cache.clear()  # TensorRT-LLM evicted it: the next request sends the weights again
    resent = engine.requests[executor.enqueue(lora_request("a"))].lora_config
    assert (resent.task_id, resent.weights is lora.weights) == (5, True)


def test_rank_over_the_limit_is_refused_naming_the_adapter(tmp_path, adapter_dir):
    with pytest.raises(LoraError, match=r"LoRA adapter `a` has rank 2; this server takes at most 1 \(--max-lora-rank\)"):
        read_trtllm_adapter("a", adapter_dir, max_rank=1, with_tensors=False)
