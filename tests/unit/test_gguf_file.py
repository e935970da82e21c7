"""GGUF files we refuse at start-up (core/gguf_file.py through service/startup.py's check_model_dir): one line naming
the file, the key or tensor, and what we accept. tests/integration/test_gguf.py serves the files we take;
tests/e2e/test_startup_errors.py shows a real `tokenloop serve` exiting with the line and no traceback."""

from __future__ import annotations

import struct

import pytest

from tests.tiny_gguf import T, write_gguf
from tests.tiny_model import make_tiny_model
from tokenloop.core.gguf_file import GGUFError, check_servable, is_gguf, open_gguf
from tokenloop.service.cli import build_parser, config_from_args
from tokenloop.service.startup import StartupError, check_model_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("gguf-unit") / "model")


@pytest.fixture(scope="module")
def good(model, tmp_path_factory):
    return write_gguf(model, tmp_path_factory.mktemp("gguf-good") / "good.gguf", T.Q4_1, T.Q8_0)


def refused(path) -> str:
    with pytest.raises(StartupError) as info:
        check_model_dir(path, "engine")
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_a_good_file_passes_and_is_recognised(good, tmp_path):
    check_model_dir(good, "engine")
    assert is_gguf(good)
    renamed = tmp_path / "model.bin"  # recognised by its magic too
    renamed.write_bytes(good.read_bytes())
    assert is_gguf(renamed) and not is_gguf(tmp_path)


def test_truncated_file(good, tmp_path):
    cut = tmp_path / "cut.gguf"
    data = good.read_bytes()
    cut.write_bytes(data[:len(data) - 100])
    tensor = list(open_gguf(good).tensors)[-1]
    assert refused(cut) == (f"--model {cut}: tensor {tensor!r} ends at byte {len(data)} but the file has "
                            f"{len(data) - 100} bytes; the file is truncated")
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:5000])  # inside the vocabulary
    assert refused(header).startswith(f"--model {header}: the GGUF header cannot be read (")
    assert refused(header).endswith("; the file is truncated or damaged")


def test_unknown_version(good, tmp_path):
    future = tmp_path / "v9.gguf"
    data = bytearray(good.read_bytes())
    data[4:8] = struct.pack("<I", 9)
    future.write_bytes(bytes(data))
    assert refused(future) == f"--model {future}: GGUF version 9 is unknown; we read versions 2, 3"


def test_not_gguf(tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf")
    assert refused(fake) == f"--model {fake}: not a GGUF file (it does not start with the GGUF magic)"


def test_architecture_refused_by_name_with_the_list(model, tmp_path):
    path = write_gguf(model, tmp_path / "phi.gguf", arch="phi2")
    assert refused(path) == (f"--model {path}: architecture 'phi2' (general.architecture) is not one we serve; "
                             "we serve llama, mistral, qwen2, qwen3, gemma3, phi3")


def test_tensor_type_refused_by_name(model, tmp_path):
    path = write_gguf(model, tmp_path / "tq.gguf", types={"blk.1.ffn_up.weight": T.I8})
    message = refused(path)
    assert message.startswith(f"--model {path}: tensor 'blk.1.ffn_up.weight' has type I8, which we do not read; "
                              "we read F32, F16, BF16, Q8_0, Q6_K, Q5_0, Q5_1, Q5_K, Q4_0, Q4_1")


def test_missing_key_and_tokenizer(model, tmp_path):
    path = write_gguf(model, tmp_path / "nokey.gguf", metadata={"llama.block_count": None})
    assert refused(path) == f"--model {path}: metadata key 'llama.block_count' is missing"
    path = write_gguf(model, tmp_path / "tok.gguf", metadata={"tokenizer.ggml.model": "rwkv"})
    assert refused(path) == (f"--model {path}: tokenizer.ggml.model 'rwkv' is not a tokenizer we build; we build "
                             "gpt2, llama (byte-level BPE, sentencepiece BPE)")
    with pytest.raises(GGUFError):
        check_servable(path)


def test_trtllm_backend_refuses_a_gguf(good):
    with pytest.raises(StartupError, match="a GGUF file is served by the embedded engine"):
        check_model_dir(good, "trtllm")


def test_weights_default_to_the_files_precision(good, model):
    parse = lambda *args: config_from_args(build_parser().parse_args(["serve", *args])).executor_options  # noqa: E731
    assert parse("--model", str(good))["weights"] == "int4"
    assert parse("--model", str(good), "--weights", "auto")["weights"] == "int4"
    assert parse("--model", str(good), "--weights", "fp32")["weights"] == "fp32"
    assert "weights" not in parse("--model", str(model))  # a checkpoint directory: fp32
    assert "weights" not in parse("--model", str(model), "--weights", "auto")
