"""GetTokenizer's zip for a model served from a GGUF file (service/trtllm_service.tokenizer_bundle): the tokenizer the
file's metadata holds as tokenizer.json, tokenizer_config.json and chat_template.jinja, which a router that takes the
worker's tokenizer (smg given no tokenizer directory) loads: the same ids as Tokenize, the file's BOS rule and chat
template."""

from __future__ import annotations

import io
import json
import zipfile

from tokenizers import Tokenizer as HFTokenizer

from tests.tiny_gguf import write_gguf
from tests.tiny_model import make_tiny_model
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.service.trtllm_service import tokenizer_bundle

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_gguf_files_tokenizer_is_bundled_with_its_bos_rule_and_chat_template(tmp_path):
    model = make_tiny_model(tmp_path / "m", "llama")
    gguf = write_gguf(model, tmp_path / "m.gguf",
                      metadata={"tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": TEMPLATE})
    ours = Tokenizer.from_dir(gguf)
    files = zipfile.ZipFile(io.BytesIO(tokenizer_bundle(gguf)))
    assert sorted(files.namelist()) == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads(files.read("tokenizer_config.json"))
    assert config == {"bos_token": ours.bos_token, "eos_token": ours.eos_token, "add_bos_token": True,
                      "chat_template": TEMPLATE}
    assert files.read("chat_template.jinja").decode() == TEMPLATE
    hf = HFTokenizer.from_str(files.read("tokenizer.json").decode())
    for text in ("hello world", "  two  spaces\nand a line", "<|im_start|>user"):
        assert hf.encode(text).ids == ours.encode(text, add_special_tokens=True)  # BOS first, as Tokenize gives
        assert hf.encode(text).ids[0] == hf.token_to_id(ours.bos_token)
    assert bytes(tokenizer_bundle(gguf)) == bytes(tokenizer_bundle(gguf))  # the same file, the same bytes


def test_a_gguf_without_a_chat_template_bundles_no_template_file(tmp_path):
    model = make_tiny_model(tmp_path / "m", "llama")
    gguf = write_gguf(model, tmp_path / "m.gguf", metadata={"tokenizer.chat_template": None})  # None: no such key
    files = zipfile.ZipFile(io.BytesIO(tokenizer_bundle(gguf)))
    assert sorted(files.namelist()) == ["tokenizer.json", "tokenizer_config.json"]
    assert json.loads(files.read("tokenizer_config.json"))["add_bos_token"] is False
