"""Serving a GGUF file (engine/gguf.py, core/gguf_file.py, core/gguf_tokenizer.py) on tiny files written here
(tests/tiny_gguf.py) from tiny checkpoints: the shape, the weights in every mode, the engine's greedy tokens, the
tokenizer against transformers' own GGUF tokenizer, and `--weights auto`. tests/unit/test_gguf_file.py has the
refusals; tests/e2e/test_gguf_serve.py serves the default model's own GGUF."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import quants

from tests.engine_helpers import greedy_request, run_all, tokens
from tests.tiny_gguf import T, write_gguf
from tests.tiny_model import make_tiny_model
from tokenloop.core.gguf_file import GGUFError, open_gguf
from tokenloop.core.tokenizer import ModelCard, Tokenizer
from tokenloop.engine import kernels
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.engine.loader import ModelConfig, load_weights
from tokenloop.engine.matmul import ROUTE_ENV
from tokenloop.engine.quant import QWeight, embedding_rows, quantize4

PROMPTS = [[1, 40, 41, 42, 43], [5, 6, 7, 8, 9, 10, 11, 12], [100, 3, 77]]
TEXTS = ["Hello, world!", " leading space", "The capital of France is Paris.", "Emoji 😀 and 你好",
         "<|im_start|>user\nhi<|im_end|>", "x\n\n  y", "1234567"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    """(checkpoint dir, its F32 GGUF) of one architecture."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    model = make_tiny_model(root / "model", request.param, tied=request.param != "qwen2")
    return model, write_gguf(model, root / "model.gguf")


def test_shape_and_fp32_weights_equal_the_checkpoint(tiny):
    model, gguf = tiny
    config = ModelConfig.from_dir(gguf)
    assert dataclasses.replace(config, rms_norm_eps=1e-5) == ModelConfig.from_dir(model)  # float32 in the file
    ours, ref = load_weights(gguf, config, torch.float32), load_weights(model, config, torch.float32)
    assert ours.keys() == ref.keys()
    for name in ref:  # Llama's q / k rows come back from llama.cpp's permutation
        assert torch.equal(ours[name], ref[name]), name


def greedy_tokens(path, num_new: int, prompts=PROMPTS, **config) -> list[list[int]]:
    """Each prompt's greedy continuation by an engine on `path`, all in one batch."""
    engine = Engine.from_dir(path, EngineConfig(**{"kv_cache_tokens": 1024, "max_batch_size": 4,
                                                   "max_num_tokens": 64, **config}))
    try:
        ids, steps = run_all(engine, [greedy_request(p, num_new) for p in prompts])
        return [tokens(steps[(i, 0)]) for i in ids]
    finally:
        engine.shutdown()


def test_engine_greedy_tokens_equal_the_checkpoint(tiny):
    model, gguf = tiny
    assert greedy_tokens(model, 12) == greedy_tokens(gguf, 12)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gguf-q") / "model", "llama", tied=False)


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1])
def test_q4_blocks_go_into_int4_unchanged(llama, tmp_path, kind):
    """int4 computes with the file's own 4-bit values: the weights it holds dequantize to exactly what
    gguf.quants (llama.cpp's reference) makes of the file's blocks, with no re-quantization."""
    gguf = write_gguf(llama, tmp_path / "q.gguf", kind, T.Q8_0)
    config = ModelConfig.from_dir(gguf)
    fp32, int4 = load_weights(gguf, config, torch.float32), load_weights(gguf, config, torch.float32, "int4")
    for name in ("layers.0.qkv", "layers.1.o", "layers.0.gate_up", "layers.1.down"):
        assert torch.equal(int4[name].dequantize(), fp32[name]), name
    assert torch.equal(int4["lm_head"].dequantize(), fp32["lm_head"])  # Q8_0 -> the int8 lm_head, unchanged


def test_q8_blocks_go_into_int8_unchanged(llama, tmp_path):
    gguf = write_gguf(llama, tmp_path / "q8.gguf", T.Q8_0, T.Q8_0)
    config = ModelConfig.from_dir(gguf)
    fp32, int8 = load_weights(gguf, config, torch.float32), load_weights(gguf, config, torch.float32, "int8")
    for name in ("layers.0.qkv", "layers.0.o", "layers.1.gate_up", "layers.0.down", "lm_head"):
        assert torch.equal(int8[name].dequantize(), fp32[name]), name


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_tied_q8_0_embedding_is_the_int8_lm_head(tmp_path, mode):
    """A tied Q8_0 token_embd (Gemma 3's files) under int8 / int4 is served from the int8 lm_head's rows: no float32
    copy of the table is loaded, and every row equals what fp32 reads from the file, bit for bit. An F16 table (not
    the lm_head's own values) stays float32."""
    model = make_tiny_model(tmp_path / "model", "llama", tied=True)
    gguf = write_gguf(model, tmp_path / "q8.gguf", T.Q4_1, T.Q8_0)
    config = ModelConfig.from_dir(gguf)
    fp32, quantized = load_weights(gguf, config, torch.float32), load_weights(gguf, config, torch.float32, mode)
    assert isinstance(quantized["embed"], QWeight) and quantized["embed"].q is quantized["lm_head"].q
    ids = torch.cat([torch.arange(config.vocab_size), torch.tensor([5, 5, 383, 0])])
    assert torch.equal(embedding_rows(quantized["embed"], ids), fp32["embed"][ids])
    f16 = write_gguf(model, tmp_path / "f16.gguf", T.Q4_1, T.F16)
    assert isinstance(load_weights(f16, ModelConfig.from_dir(f16), torch.float32, mode)["embed"], torch.Tensor)


def test_other_types_are_dequantized_then_quantized_to_the_mode(llama, tmp_path):
    """A Q5_0 file under int4: each matrix dequantized by gguf.quants, then quantized as a checkpoint's would be."""
    gguf = write_gguf(llama, tmp_path / "q5.gguf", T.Q5_0, T.F16)
    g = open_gguf(gguf)
    t = g.tensors["blk.0.ffn_down.weight"]
    with open(gguf, "rb") as f:
        f.seek(t.offset)
        raw = np.frombuffer(f.read(t.num_bytes), np.uint8).reshape(t.shape[0], -1)
    expected = quantize4(torch.from_numpy(quants.dequantize(raw, T.Q5_0)))
    int4 = load_weights(gguf, ModelConfig.from_dir(gguf), torch.float32, "int4")
    assert torch.equal(int4["layers.0.down"].q, expected.q) and torch.equal(int4["layers.0.down"].sm, expected.sm)


@pytest.mark.parametrize(("kind", "mode"), [(T.F32, "fp32"), (T.F16, "fp32"), (T.Q8_0, "int8"), (T.Q4_1, "int4"),
                                            (T.Q5_1, "int8")])
def test_weights_auto_is_the_files_precision(llama, tmp_path, kind, mode):
    assert open_gguf(write_gguf(llama, tmp_path / "a.gguf", kind, T.Q8_0)).weights_mode() == mode


def test_tokenizer_equals_transformers_gguf_tokenizer(tiny):
    from transformers import AutoTokenizer

    model, gguf = tiny
    ours = Tokenizer.from_dir(gguf)
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    for text in TEXTS:
        for special in (False, True):
            assert ours.encode(text, special) == ref(text, add_special_tokens=special)["input_ids"], (text, special)
    assert ours.special_ids == Tokenizer.from_dir(model).special_ids
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == Tokenizer.from_dir(model).apply_chat_template(chat)


def test_card_from_metadata(tiny, tmp_path):
    model, _ = tiny
    gguf = write_gguf(model, tmp_path / "s.gguf", metadata={"general.sampling.temp": 0.6,
                                                           "general.sampling.top_p": 0.95,
                                                           "general.sampling.top_k": 20})
    card = ModelCard.from_dir(gguf)
    assert (card.model_id, card.eos_token_ids, card.bos_token_id, card.max_context_length) == ("s", (2,), 1, 1024)
    assert card.generation == {"temperature": pytest.approx(0.6), "top_p": pytest.approx(0.95), "top_k": 20}
    assert card.default_top_k == 20


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_int4_on_q4_1_blocks_equals_fp32_on_the_same_file(tmp_path, monkeypatch, arch):
    """The file's own Q4_1 / Q8_0 values in int4 (a float32-activation C path) give fp32's greedy tokens on the same
    file, alone and in a batch (chunked prefill beside decodes); Qwen3's q/k norms run outside the fused step."""
    model = make_tiny_model(tmp_path / "model", arch, num_layers=3)
    gguf = write_gguf(model, tmp_path / "q4.gguf", T.Q4_1, T.Q8_0)
    kernel = kernels.load_int4()
    monkeypatch.setenv(ROUTE_ENV, f"int4-{kernel.isa}" if kernel is not None else "torch-fp32")
    config = dict(kv_cache_tokens=2048, max_batch_size=8, max_num_tokens=32)
    prompts = [[(7 * i + j) % 380 + 3 for j in range(5 + 9 * i)] for i in range(8)]
    fp32 = greedy_tokens(gguf, 12, prompts, weights="fp32", **config)
    config["kv_dtype"] = "fp32"  # fp32's cache: only the products' rounding differs (int4's default is float16 KV)
    assert greedy_tokens(gguf, 12, prompts, weights="int4", **config) == fp32
    assert greedy_tokens(gguf, 12, prompts[5:6], weights="int4", **config) == fp32[5:6]  # alone


def test_sentencepiece_tokenizer_equals_transformers(tmp_path):
    """A Llama-2-style sentencepiece vocabulary (tokenizer.ggml.model `llama`: scores, byte tokens, no merges, BOS
    added by default): our ids equal transformers' GGUF tokenizer's, BOS included."""
    from transformers import AutoTokenizer

    from tests.tiny_tokenizer import build_metaspace

    sp = build_metaspace()
    vocab = sorted(sp.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    kinds = [3 if t.startswith("<|") else 6 if t.startswith("<0x") else 1 for t in tokens]
    gguf = write_gguf(make_tiny_model(tmp_path / "model"), tmp_path / "sp.gguf", metadata={
        "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": None,
        "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))], "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.add_bos_token": None, "tokenizer.ggml.pre": None})
    ours = Tokenizer.from_dir(gguf)
    ref = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    assert ours.add_bos
    for text in TEXTS + ["hello world", "  two  spaces", "Ünïcödé ✓"]:
        for special in (False, True):
            assert ours.encode(text, special) == ref(text, add_special_tokens=special)["input_ids"], (text, special)
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)


def test_llama3_rope_freqs_give_the_checkpoints_rotary_frequencies_and_tokens(tmp_path):
    """A Llama 3.x file carries its rope scaling as rope_freqs.weight (a factor per frequency, as llama.cpp's
    converter writes it); the frequencies it gives equal the checkpoint's llama3 scaling, and so do the tokens."""
    from tokenloop.engine.loader import rope_inv_freq

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # the tiny head's wavelengths fall in all three bands
    model = make_tiny_model(tmp_path / "model", rope_scaling=scaling)
    gguf = write_gguf(model, tmp_path / "l3.gguf")
    ours, ref = ModelConfig.from_dir(gguf), ModelConfig.from_dir(model)
    assert ours.rope_freq_factors is not None and len(set(ours.rope_freq_factors)) > 2
    torch.testing.assert_close(rope_inv_freq(ours), rope_inv_freq(ref), rtol=1e-6, atol=0)
    assert greedy_tokens(model, 24) == greedy_tokens(gguf, 24)


def test_gemma3_file_gives_the_checkpoints_weights_and_serves(tmp_path):
    """A Gemma 3 file (llama.cpp's names, its norms stored as 1 + w) loads the checkpoint's weights bit for bit and
    its shape as llama.cpp runs it (every 6th layer global, attention scaled by the head size), and serves."""
    model = make_tiny_model(tmp_path / "model", "gemma3", tied=False, num_layers=6)
    gguf = write_gguf(model, tmp_path / "g3.gguf")
    ours, ref = ModelConfig.from_dir(gguf), ModelConfig.from_dir(model)
    assert ours.local_layers == (True,) * 5 + (False,) and ours.attn_scale == ref.head_dim ** -0.5
    assert dataclasses.replace(ours, rms_norm_eps=1e-5, local_layers=ref.local_layers,
                               attn_scale=ref.attn_scale) == ref
    mine, theirs = load_weights(gguf, ours, torch.float32), load_weights(model, ref, torch.float32)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
    assert all(len(t) == 8 for t in greedy_tokens(gguf, 8))


def test_phi3_file_gives_the_checkpoints_weights_and_serves(tmp_path):
    """A Phi-3 file (llama.cpp's names: q/k/v fused in attn_qkv, gate/up in ffn_up, no row permutation; its sliding
    window as a key) loads the checkpoint's weights bit for bit and its shape, and serves its greedy tokens past the
    window; a longrope file (rope_factors_long.weight) is refused by name."""
    model = make_tiny_model(tmp_path / "model", "phi3", tied=False, num_layers=2, sliding_window=6)
    gguf = write_gguf(model, tmp_path / "phi3.gguf")
    ours, ref = ModelConfig.from_dir(gguf), ModelConfig.from_dir(model)
    assert ours.local_layers == (True, True) and ours.sliding_window == 6
    assert dataclasses.replace(ours, rms_norm_eps=1e-5) == ref
    mine, theirs = load_weights(gguf, ours, torch.float32), load_weights(model, ref, torch.float32)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert torch.equal(mine[name], theirs[name]), name
    assert greedy_tokens(model, 16, dtype="float32") == greedy_tokens(gguf, 16, dtype="float32")
    factors = np.ones(ref.head_dim // 2, dtype=np.float32)
    longrope = write_gguf(model, tmp_path / "longrope.gguf",
                          extra={"rope_factors_long.weight": factors, "rope_factors_short.weight": factors})
    with pytest.raises(GGUFError, match="tensor 'rope_factors_long.weight' \\(Phi-3's longrope scaling\\) is not one we"):
        ModelConfig.from_dir(longrope)
