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
