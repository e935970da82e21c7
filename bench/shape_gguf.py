"""A random-weight GGUF file in a model's shape, written tensor by tensor with llama.cpp's `gguf` package: what the
size checks serve where the real weights are not at hand (speed and memory depend on shapes, not values).

    .venv/bin/python -m tokenloop.bench.shape_gguf --shape llama-3.1-8b --out /tmp/llama-3.1-8b-shape.Q4_0.gguf

The layers' matrices and the embedding are Q4_0 (`--weights auto` serves it as int4, its 4-bit levels as they are),
the output matrix Q8_0 (int4's int8 lm_head, as it is), the norms F32: Llama-3.1-8B's shape is ~4.6 GB, never a
float32 checkpoint (32 GB). Each block's 4-bit levels are random and its float16 scale ~0.004 (weights of standard
deviation ~0.02); one random layer is drawn and written for every layer (values do not change the cost). The
tokenizer is the default model's (byte-level BPE from a checkpoint directory's tokenizer.json, SmolLM2's chat
template), its vocabulary padded with control tokens `<|pad_N|>` to the shape's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter

from tokenloop.bench.harness import DEFAULT_MODEL

# Llama-3.1-8B's layers (its config.json): the 8B shape of issue 43
SHAPES = {"llama-3.1-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                               context=131072, rope_theta=500000.0)}
BLOCK = {T.Q4_0: (32, 18), T.Q8_0: (32, 34)}  # (columns, bytes) per block



def add_key(w, key: str, value) -> None:
    """One metadata key on a gguf.GGUFWriter, typed by its Python value (bool, uint32, float32, string, array)."""
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)

def random_blocks(rows: int, cols: int, kind: T, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 32 * block bytes] uint8 of `kind` (Q4_0 / Q8_0): float16 scales ~0.004 (Q8_0: / 16), random
    levels."""
    size, nbytes = BLOCK[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // size, nbytes), dtype=np.uint8)
    scale = 0.004 if kind == T.Q4_0 else 0.00025
    d = (scale * (0.5 + rng.random((rows, cols // size), dtype=np.float32))).astype(np.float16)
    blocks[:, :, 0:2] = d.view(np.uint8).reshape(rows, cols // size, 2)
    return blocks.reshape(rows, -1)


def tokenizer_keys(model_dir: Path, vocab: int) -> dict:
    """The default model's tokenizer as `tokenizer.ggml.*` keys, padded to `vocab` tokens."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tokens = [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    if len(tokens) > vocab:
        raise ValueError(f"the shape's vocabulary ({vocab}) is smaller than the tokenizer's ({len(tokens)})")
    specials = {a["id"] for a in tok["added_tokens"] if a["special"]}
    types = [3 if i in specials else 1 for i in range(len(tokens))] + [3] * (vocab - len(tokens))
    tokens += [f"<|pad_{i}|>" for i in range(len(tokens), vocab)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or (model_dir / "chat_template.jinja").read_text()
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": ids.get("<|im_start|>", 1),
            "tokenizer.ggml.eos_token_id": ids.get("<|im_end|>", 2), "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": template}


def write_shape_gguf(path: str | Path, shape: dict, tokenizer_dir: str | Path = DEFAULT_MODEL, seed: int = 0) -> Path:
    """A Llama-architecture GGUF file of `shape` (SHAPES' keys) at `path`, written one tensor at a time."""
    path, s, rng = Path(path), shape, np.random.default_rng(seed)
    hidden, inter, heads, kv_heads = s["hidden"], s["intermediate"], s["heads"], s["kv_heads"]
    head_dim = hidden // heads
    w = GGUFWriter(str(path), "llama")
    for key, value in {"llama.context_length": s["context"], "llama.embedding_length": hidden,
                       "llama.block_count": s["layers"], "llama.feed_forward_length": inter,
                       "llama.attention.head_count": heads, "llama.attention.head_count_kv": kv_heads,
                       "llama.rope.dimension_count": head_dim, "llama.rope.freq_base": float(s["rope_theta"]),
                       "llama.attention.layer_norm_rms_epsilon": 1e-5,
                       **tokenizer_keys(Path(tokenizer_dir), s["vocab"])}.items():
        add_key(w, key, value)
    layer = {"attn_q.weight": (hidden, hidden), "attn_k.weight": (kv_heads * head_dim, hidden),
             "attn_v.weight": (kv_heads * head_dim, hidden), "attn_output.weight": (hidden, hidden),
             "ffn_gate.weight": (inter, hidden), "ffn_up.weight": (inter, hidden), "ffn_down.weight": (hidden, inter)}
    plan = [("token_embd.weight", (s["vocab"], hidden), T.Q4_0), ("output_norm.weight", (hidden,), T.F32),
            ("output.weight", (s["vocab"], hidden), T.Q8_0)]
    for i in range(s["layers"]):
        plan += [(f"blk.{i}.attn_norm.weight", (hidden,), T.F32), (f"blk.{i}.ffn_norm.weight", (hidden,), T.F32)]
        plan += [(f"blk.{i}.{name}", dims, T.Q4_0) for name, dims in layer.items()]
    for name, dims, kind in plan:
        nbytes = 4 * dims[0] if kind == T.F32 else dims[0] * dims[1] // BLOCK[kind][0] * BLOCK[kind][1]
        w.add_tensor_info(name, [dims[0], nbytes // dims[0]] if kind != T.F32 else list(dims),
                          np.uint8 if kind != T.F32 else np.float32, nbytes, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    drawn: dict[str, np.ndarray] = {}  # one random layer, written for every layer
    for name, dims, kind in plan:
        if kind == T.F32:
            data = np.ones(dims, dtype=np.float32)
        elif name.startswith("blk."):
            key = name.split(".", 2)[2]
            data = drawn.setdefault(key, random_blocks(*dims, kind, rng))
        else:
            data = random_blocks(*dims, kind, rng)
        w.write_tensor_data(data)
        del data
    w.close()
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--out", required=True, help="the GGUF file to write")
    p.add_argument("--tokenizer", default=str(DEFAULT_MODEL), help="a checkpoint directory with tokenizer.json")
    args = p.parse_args(argv)
    print(write_shape_gguf(args.out, SHAPES[args.shape], args.tokenizer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
