"""Every start-up failure of a real `tokenloop serve` process: exit code 2 and one line naming what to fix.

Each case runs the installed `tokenloop serve` on a tiny checkpoint made here (no default model needed); the
checks run before the port opens or the model loads, so each process ends in about a second. The TLS, API-key
and port cases use `--backend trtllm`, whose model check needs no torch import (the checks are the same for both
backends; without TensorRT-LLM installed, that backend would fail only later, at loading).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

from tests.e2e.live_server import ROOT, tokenloop_command
from tests.tiny_model import make_tiny_model
from tests.tls_helpers import issue, make_ca, pem
from tokenloop.trtllm import MISSING_TRTLLM

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("startup") / "tiny")


def copy_model(tiny, tmp_path, drop=(), **replace):
    """A copy of the tiny checkpoint without the files in `drop` and with `replace` {name: bytes}."""
    target = tmp_path / "model"
    shutil.copytree(tiny, target)
    for name in drop:
        (target / name).unlink()
    for name, data in replace.items():
        (target / name.replace("__", ".")).write_bytes(data)
    return target


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*tokenloop_command(), "serve", "--port", "0", *args], capture_output=True, text=True,
                          timeout=120)


def assert_refused(run: subprocess.CompletedProcess, message: str) -> None:
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert lines[-1] == f"tokenloop: {message}", run.stderr


@pytest.mark.parametrize("backend", ["engine", "trtllm"])
def test_missing_model_dir_names_the_path_and_flag(backend, tmp_path):
    missing = tmp_path / "does" / "not" / "exist"
    assert_refused(serve("--backend", backend, "--model", str(missing)), f"--model {missing}: no such file or directory")


def test_model_path_that_is_a_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert_refused(serve("--model", str(tmp_path / "weights.bin")),
                   f"--model {tmp_path / 'weights.bin'}: neither a checkpoint directory (config.json, tokenizer.json, weights) "
                   "nor a GGUF file (*.gguf)")


def test_truncated_gguf_file(tiny, tmp_path):
    """A GGUF file cut short: one line naming the file and tensor, before the port opens (docs/models.md)."""
    from tests.tiny_gguf import write_gguf

    whole = write_gguf(tiny, tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:-64])
    run = serve("--model", str(cut))
    assert_refused(run, f"--model {cut}: tensor 'output_norm.weight' ends at byte {len(whole)} but the file has "
                        f"{len(whole) - 64} bytes; the file is truncated")
    assert "Traceback" not in run.stderr


def test_dir_without_config(tiny, tmp_path):
    model = copy_model(tiny, tmp_path, drop=("config.json",))
    assert_refused(serve("--model", str(model)),
                   f"--model {model}: no config.json; expected a Hugging Face checkpoint directory")


def test_dir_without_tokenizer(tiny, tmp_path):
    model = copy_model(tiny, tmp_path, drop=("tokenizer.json",))
    assert_refused(serve("--model", str(model), "--backend", "trtllm"),
                   f"--model {model}: no tokenizer.json; tokenloop tokenizes with the checkpoint's tokenizer.json "
                   "(a Hugging Face fast tokenizer)")


def test_unreadable_weights(tiny, tmp_path):
    model = copy_model(tiny, tmp_path, model__safetensors=b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    run = serve("--model", str(model))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith(
        f"tokenloop: --model {model}: cannot read the weights in model.safetensors (")


def test_unsupported_architecture(tiny, tmp_path):
    config = json.loads((tiny / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    model = copy_model(tiny, tmp_path, config__json=json.dumps(config).encode())
    assert_refused(serve("--model", str(model)),
                   f"--model {model}: unsupported architecture 'GPT2LMHeadModel'; the engine supports "
                   "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, Phi3ForCausalLM (--backend engine)")


def test_port_in_use(tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([*tokenloop_command(), "serve", "--backend", "trtllm", "--model", str(tiny), "--port",
                              str(port)], capture_output=True, text=True, timeout=120)
    assert_refused(run, f"--port {port}: 127.0.0.1:{port} is already in use by another process; choose another "
                        "--port")


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = make_ca("test-ca")
    key, cert = issue(ca, "localhost")
    other_key, _ = issue(ca, "other")
    for name, data in {"server.pem": pem(cert), "server.key": pem(key), "other.key": pem(other_key),
                       "ca.pem": pem(ca[1]), "garbage.pem": b"not a certificate\n"}.items():
        (d / name).write_bytes(data)
    return d


@pytest.mark.parametrize("case", ["missing_cert", "not_pem", "key_mismatch", "bad_client_ca"])
def test_bad_tls_files(case, tiny, tls_files):
    d = tls_files
    args, message = {
        "missing_cert": (["--tls-cert", str(d / "nope.pem"), "--tls-key", str(d / "server.key")],
                         f"--tls-cert {d / 'nope.pem'}: No such file or directory"),
        "not_pem": (["--tls-cert", str(d / "garbage.pem"), "--tls-key", str(d / "server.key")],
                    f"--tls-cert {d / 'garbage.pem'}: holds no PEM certificate (-----BEGIN CERTIFICATE-----)"),
        "key_mismatch": (["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "other.key")],
                         f"--tls-key {d / 'other.key'}: does not match the certificate in --tls-cert "
                         f"{d / 'server.pem'}"),
        "bad_client_ca": (["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"),
                           "--tls-client-ca", str(d / "garbage.pem")], None),
    }[case]
    run = serve("--backend", "trtllm", "--model", str(tiny), *args)
    if message is None:
        assert run.returncode == 2
        assert run.stderr.strip().splitlines()[-1].startswith(
            f"tokenloop: --tls-client-ca {d / 'garbage.pem'}: holds no PEM CA certificate (")
    else:
        assert_refused(run, message)


def test_empty_api_key_file(tiny, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# no key here\n\n")
    assert_refused(serve("--backend", "trtllm", "--model", str(tiny), "--api-key-file", str(keys)),
                   f"--api-key-file {keys}: holds no API key (one per line; # starts a comment)")


def test_empty_admin_key_file_and_missing_lora_root(tiny, tmp_path):
    keys = tmp_path / "admin-keys"
    keys.write_text("# operators: none yet\n")
    assert_refused(serve("--backend", "trtllm", "--model", str(tiny), "--admin-key-file", str(keys)),
                   f"--admin-key-file {keys}: holds no admin key (one per line; # starts a comment)")
    assert_refused(serve("--backend", "trtllm", "--model", str(tiny), "--lora-root", str(tmp_path / "nope")),
                   f"--lora-root {tmp_path / 'nope'}: no such directory")
    assert_refused(serve("--model", str(tiny), "--max-connections", "-1"), "--max-connections must be >= 0 (0: no cap)")


def test_trtllm_backend_without_tensorrt_llm(tiny):
    from tokenloop.trtllm import MISSING_TRTLLM
    assert_refused(serve("--backend", "trtllm", "--model", str(tiny)), MISSING_TRTLLM)


def test_lora_flags_are_checked_before_anything_loads(tiny, tmp_path):
    missing = tmp_path / "nope"
    assert_refused(serve("--model", str(tiny), "--backend", "trtllm", "--lora", f"a={missing}"),
                   f"--lora a={missing}: no such directory")
    assert_refused(serve("--model", str(tiny), "--backend", "trtllm", "--lora", f"a={tmp_path}"),
                   f"--lora a={tmp_path}: not a PEFT adapter (no adapter_config.json)")
    assert_refused(serve("--model", str(tiny), "--lora", "a"), "--lora 'a': expected NAME=DIR")


def test_serve_without_tensorrt_llm_exits_with_the_sentence(tokenizer_dir):
    """`tokenloop serve --backend trtllm` as a process: start-up stops with the one sentence."""
    code = ("import sys; sys.modules['tensorrt_llm'] = None  # not installed, even where it is\n"
            "from tokenloop.service.cli import main\n"
            f"sys.exit(main(['serve', '--backend', 'trtllm', '--model', {str(tokenizer_dir)!r}, '--port', '0']))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode != 0
    assert MISSING_TRTLLM in out.stderr + out.stdout
