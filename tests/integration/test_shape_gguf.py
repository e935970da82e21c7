"""The 8B-shape procedure of docs/models.md on a small shape: bench/shape_gguf.py writes a random-weight Q4_0 file
tensor by tensor (the default model's tokenizer padded to the shape's vocabulary; here a tiny checkpoint's), `--weights
auto` serves it as int4 on the file's own 4-bit levels with the 16-bit KV cache, and `tokenloop-bench model_load
--serve` starts `tokenloop serve` on it, generates through gRPC and reads the server's memory and sizes."""

from __future__ import annotations

import numpy as np
import torch
from gguf import quants

from tests.engine_helpers import greedy_request, run_all, tokens
from tests.tiny_model import make_tiny_model
from tokenloop.bench import model_load
from tokenloop.bench.shape_gguf import write_shape_gguf
from tokenloop.core.gguf_file import open_gguf
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.quant import Q4Weight
from tokenloop.service.cli import weights_for

SHAPE = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=512, context=512, rope_theta=5e5)


def test_a_shape_file_serves_as_int4_on_its_own_levels_and_through_the_server(tmp_path):
    tokenizer_dir = make_tiny_model(tmp_path / "tok")  # 384 tokens: padded to 512
    path = write_shape_gguf(tmp_path / "shape.gguf", SHAPE, tokenizer_dir)
    g = open_gguf(path)
    assert g.tensors["blk.1.ffn_down.weight"].shape == (128, 256) and g.tensors["token_embd.weight"].shape[0] == 512
    assert weights_for(str(path)) == "int4"
    tok = Tokenizer.from_dir(path)
    assert tok.encode("hello world") == Tokenizer.from_dir(tokenizer_dir).encode("hello world")

    engine = Engine.from_dir(path, EngineConfig(weights="int4", kv_cache_tokens=1024, max_batch_size=4))
    try:
        model = engine.model
        assert model.k_cache.dtype == torch.float16 and model.embed.shape == (512, 128)
        down = model.layers[1].down
        assert isinstance(down, Q4Weight)  # the file's levels as they are: the same values llama.cpp computes with
        raw = np.fromfile(path, dtype=np.uint8, count=g.tensors["blk.1.ffn_down.weight"].num_bytes,
                          offset=g.tensors["blk.1.ffn_down.weight"].offset).reshape(128, -1)
        assert torch.equal(down.dequantize(), torch.from_numpy(quants.dequantize(raw, g.tensors[
            "blk.1.ffn_down.weight"].kind)).float())
        prompts = [[5, 9, 14, 3], [7, 7, 300, 2, 11, 40]]
        ids, steps = run_all(engine, [greedy_request(p, 6) for p in prompts])
        together = [tokens(steps[(i, 0)]) for i in ids]
        ids, steps = run_all(engine, [greedy_request(prompts[1], 6)])
        assert [tokens(steps[(i, 0)]) for i in ids] == together[1:]  # alone as in the batch
    finally:
        engine.shutdown()

    row = model_load.serve(str(path), "auto", timeout=300, new_tokens=4)
    assert row["tokens"] == 4 and row["kv_dtype"] == "float16"
    assert row["weights_bytes"] > 0 and row["kv_bytes"] > 0 and row["peak_rss"] >= row["rss"] > 0
