"""Test LoRA adapters made with `peft` (PyPI) on a base checkpoint, and transformers + peft greedy references."""

from __future__ import annotations

from pathlib import Path

import torch

# name -> (r, lora_alpha, target modules, use_rslora): different ranks, targets and scalings
ADAPTERS = {
    "attn": (8, 16, ["q_proj", "v_proj"], False),
    "all": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "mlp": (16, 8, ["o_proj", "gate_proj", "up_proj", "down_proj"], True),
}


def make_adapter(base_dir: Path, out_dir: Path, name: str, seed: int, scale: float = 0.1) -> Path:
    """Save a PEFT adapter `name` of ADAPTERS for `base_dir` with non-zero random B (so the output changes)."""
    import peft
    import transformers

    r, alpha, targets, rslora = ADAPTERS[name]
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "lora_B" in pname:  # PEFT starts B at zero: an adapter that changes nothing
                param.copy_(torch.randn_like(param) * scale)
    path = out_dir / name
    model.save_pretrained(path)
    return path


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    """transformers + peft greedy continuations (fp32, EOS ignored); `adapter_dir` None: the base model."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new,
                                 min_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=2)
            outs.append(out[0, len(p):].tolist())
    return outs


def write_adapter(base_dir: Path, path: Path, r: int = 4, alpha: float = 8, targets=("q_proj", "v_proj", "down_proj"),
                  seed: int = 0, scale: float = 0.5, **config) -> Path:
    """Write a PEFT-format adapter for `base_dir` without peft (the layout peft 0.18 saves; tests/e2e checks the
    engine against peft itself). Random A and B, so the output changes. `config` overrides adapter_config.json."""
    import json

    from safetensors.torch import save_file

    from tokenloop.engine.loader import ModelConfig
    from tokenloop.engine.lora import TARGETS, part_shapes

    model = ModelConfig.from_dir(base_dir)
    shapes = part_shapes(model)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        for module in targets:
            d_in, d_out = shapes[module]
            key = f"base_model.model.model.layers.{layer}.{TARGETS[module][0]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, d_in, generator=gen) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, r, generator=gen) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
        **config}))
    return path
