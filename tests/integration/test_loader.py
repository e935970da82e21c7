"""Loading checkpoints: sharded safetensors, tied and untied heads, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.tiny_model import make_tiny_model
from tokenloop.engine.loader import ModelConfig, load_weights, read_tensors


def shard(model_dir, num_shards: int = 2) -> None:
    """Rewrite model.safetensors as `num_shards` files with a model.safetensors.index.json."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::num_shards]}
        save_file(part, str(model_dir / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    whole = make_tiny_model(tmp_path / "whole", "qwen2", tied=False)
    parts = make_tiny_model(tmp_path / "parts", "qwen2", tied=False)
    shard(parts, 3)
    assert not (parts / "model.safetensors").exists()
    config = ModelConfig.from_dir(whole)
    a, b = load_weights(whole, config, torch.float32), load_weights(parts, config, torch.float32)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "layers.0.qkv_bias" in a  # qwen2 biases fused with the projections


def test_tied_head_is_the_embedding_and_untied_is_not(tmp_path):
    tied = make_tiny_model(tmp_path / "tied", "llama", tied=True)
    untied = make_tiny_model(tmp_path / "untied", "llama", tied=False)
    w_tied = load_weights(tied, ModelConfig.from_dir(tied), torch.float32)
    w_untied = load_weights(untied, ModelConfig.from_dir(untied), torch.float32)
    assert w_tied["lm_head"] is w_tied["embed"]
    assert not torch.equal(w_untied["lm_head"], w_untied["embed"])
    assert w_tied["layers.1.gate_up"].shape == (2 * 128, 64)  # gate and up fused: [2I, D]


def test_missing_weight_and_missing_files_are_named(tmp_path):
    model_dir = make_tiny_model(tmp_path / "m", "llama")
    tensors = read_tensors(model_dir)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="missing weight 'model.layers.1.mlp.down_proj.weight'"):
        load_weights(model_dir, ModelConfig.from_dir(model_dir), torch.float32)
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no \*.safetensors"):
        load_weights(tmp_path / "empty", ModelConfig.from_dir(model_dir), torch.float32)


def test_tiny_model_tokenizer_round_trips_emoji_and_cjk(tmp_path):
    from tokenloop.core.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(make_tiny_model(tmp_path / "m", "llama"))
    text = "Hello 😀 你好 — ok"
    assert tok.decode(tok.encode(text)) == text
    assert tok.token_to_id("<|im_end|>") == 2 and tok.token_to_id("<|im_start|>") == 1
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
