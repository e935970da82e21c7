"""EngineConfig and ModelConfig check their input and say what is wrong."""

from __future__ import annotations

import pytest
import torch

from tokenloop.engine.config import DEFAULT_KV_CACHE_TOKENS, EngineConfig, default_kv_tokens
from tokenloop.engine.loader import ModelConfig, rope_inv_freq
from tokenloop.engine.model import layer_windows

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256}


@pytest.mark.parametrize("kwargs, message", [
    ({"max_batch_size": 0}, "max_batch_size must be >= 1"),
    ({"max_batch_size": 64, "max_num_tokens": 32}, "max_num_tokens (32) must be >= max_batch_size (64)"),
    ({"block_size": 0}, "block_size must be in 1..1024"),
    ({"kv_cache_tokens": 1024, "kv_cache_memory_fraction": 0.5}, "not both"),
    ({"kv_cache_tokens": 8}, "kv_cache_tokens must be >= block_size"),
    ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction must be in (0, 1]"),
    ({"dtype": "float16"}, "dtype must be one of float32, bfloat16, float64"),
    ({"num_threads": 0}, "num_threads must be >= 1"),
    ({"matmul_backend": "cuda"}, "matmul_backend must be one of auto, torch, numpy"),
    ({"attention_backend": "flash"}, "attention_backend must be one of auto, native, torch"),
    ({"attention_backend": "native", "dtype": "bfloat16"}, "attention_backend 'native' needs dtype float32"),
    ({"weights": "int2"}, "weights must be one of fp32, int8, int4, got 'int2'"),
    ({"weights": "int8", "dtype": "bfloat16"}, "weights 'int8' keeps float32 activations and needs dtype float32"),
    ({"weights": "int4", "dtype": "bfloat16"}, "weights 'int4' keeps float32 activations and needs dtype float32"),
    ({"speculative": "lookahead"}, "speculative mode must be one of off, ngram, got 'lookahead'"),
    ({"speculative": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in 1..16, got 0"),
    ({"speculative_max_batch_size": 0}, "speculative max_batch_size must be >= 1, got 0"),
    ({"kv_dtype": "bf16"}, "kv_dtype must be one of auto, fp32, fp16, got 'bf16'"),
    ({"kv_dtype": "fp16", "dtype": "bfloat16"}, "kv_dtype 'fp16' needs dtype float32"),
])
def test_engine_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError) as err:
        EngineConfig(**kwargs)
    assert message in str(err.value)


def test_speculative_settings_become_the_speculative_config():
    spec = EngineConfig(speculative="ngram", num_speculative_tokens=6, speculative_max_batch_size=2).speculative_config
    assert (spec.mode, spec.num_speculative_tokens, spec.max_batch_size, spec.enabled) == ("ngram", 6, 2, True)
    assert EngineConfig().speculative_config.mode == "ngram"  # on by default (docs/engine.md's rule)
    assert not EngineConfig(speculative="off").speculative_config.enabled


def test_kv_blocks_from_tokens_fraction_or_default():
    assert EngineConfig(kv_cache_tokens=1000, block_size=16).num_kv_blocks(100) == 62
    assert EngineConfig(block_size=16).num_kv_blocks(100) == DEFAULT_KV_CACHE_TOKENS // 16
    assert EngineConfig(kv_cache_memory_fraction=0.01).num_kv_blocks(1 << 20) >= 1
    assert EngineConfig(dtype="bfloat16").torch_dtype is torch.bfloat16


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_dict({**LLAMA, "architectures": ["GPT2LMHeadModel"]})


def test_unsupported_rope_scaling_is_named():
    with pytest.raises(ValueError, match="unsupported rope scaling 'yarn'"):
        ModelConfig.from_dict({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("extra, message", [
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}},
     "unsupported rope scaling 'longrope'"),  # Phi-3's 128k variants
    ({"partial_rotary_factor": 0.75}, r"unsupported partial_rotary_factor 0.75; the engine rotates whole heads"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "unsupported partial_rotary_factor 0.5"),
])
def test_phi3_rope_variants_the_engine_lacks_are_named(extra, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**LLAMA, "architectures": ["Phi3ForCausalLM"], **extra})


def test_reads_both_rope_spellings_and_defaults():
    old = ModelConfig.from_dict({**LLAMA, "rope_theta": 5e5})
    new = ModelConfig.from_dict({**LLAMA, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert old.rope_theta == new.rope_theta == 5e5 and new.rope_scaling is None
    assert old.head_dim == 16 and not old.qkv_bias and not old.tie_word_embeddings
    qwen = ModelConfig.from_dict({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32,
                                  "use_sliding_window": False})
    assert qwen.qkv_bias and qwen.max_context_length == 256 and layer_windows(qwen) == [0, 0]


@pytest.mark.parametrize("arch, extra, windows", [
    ("MistralForCausalLM", {"sliding_window": 128}, [128, 128]),
    ("MistralForCausalLM", {}, [4096, 4096]),  # MistralConfig's default where config.json has none
    ("MistralForCausalLM", {"sliding_window": None}, [0, 0]),
    ("Qwen2ForCausalLM", {"sliding_window": 32, "use_sliding_window": True, "max_window_layers": 1}, [0, 32]),
    ("Qwen3ForCausalLM", {"sliding_window": 32, "use_sliding_window": True, "max_window_layers": 2}, [0, 0]),
    ("Qwen2ForCausalLM", {"sliding_window": 32, "use_sliding_window": True,
                          "layer_types": ["sliding_attention", "full_attention"]}, [32, 0]),
    ("LlamaForCausalLM", {"sliding_window": 32}, [0, 0]),  # Llama has none, whatever config.json says
    ("Phi3ForCausalLM", {"sliding_window": 32}, [32, 32]),
    ("Phi3ForCausalLM", {}, [0, 0]),  # Phi3Config's default: none
])
def test_sliding_windows_by_layer_as_transformers_reads_them(arch, extra, windows):
    config = ModelConfig.from_dict({**LLAMA, "architectures": [arch], **extra})
    assert layer_windows(config) == windows and config.max_context_length == 256


def test_llama3_rope_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    ours = rope_inv_freq(ModelConfig.from_dict({**LLAMA, "rope_scaling": scaling, "rope_theta": 5e5}))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf_config = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k != "architectures"},
                                         rope_scaling=scaling, rope_theta=5e5)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    assert torch.equal(ours, theirs)
    assert not torch.equal(ours, rope_inv_freq(ModelConfig.from_dict({**LLAMA, "rope_theta": 5e5})))


def test_default_kv_cache_is_sized_from_the_model_and_free_memory():
    """32,768 tokens where a quarter of the free memory holds them; fewer for a large model on a small machine; never
    under one block (docs/models.md#the-kv-cache)."""
    gib = 1 << 30
    assert default_kv_tokens(46 * 1024, 16, available=20 * gib) == DEFAULT_KV_CACHE_TOKENS  # 135M: 1.4 GiB
    assert default_kv_tokens(384 * 1024, 16, available=20 * gib) == 5 * gib // (384 * 1024)  # 1.7B: 13,653 tokens
    assert default_kv_tokens(1 << 30, 16, available=gib) == 16


def test_the_kv_cache_is_16_bit_for_the_quantized_modes_unless_asked_otherwise():
    assert EngineConfig(weights="int8").kv_torch_dtype is torch.float16
    assert EngineConfig(weights="int4").kv_torch_dtype is torch.float16
    assert EngineConfig(weights="int4", kv_dtype="fp32").kv_torch_dtype is torch.float32
    assert EngineConfig().kv_torch_dtype is torch.float32  # fp32 weights: the float32 reference
    assert EngineConfig(kv_dtype="fp16").kv_torch_dtype is torch.float16
    assert EngineConfig(dtype="float64").kv_torch_dtype is torch.float64  # the activations' own
