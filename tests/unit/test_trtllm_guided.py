"""Structured output through both TensorRT-LLM adapters, on the fake tensorrt_llm: the exact guided-decoding
arguments each one passes (the fakes follow request.cpp / executorConfig.cpp @ 008b2b8d and sampling_params.py @
000a01de). What the GPU then does with them is TensorRT-LLM's; a real run is `make gpu-smoke` (docs/trtllm.md)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tests.fakes import scenarios
from tests.fakes.fixtures import make_engine_dir
from tokenloop.bench.structured_cases import ARITHMETIC_GRAMMAR, SCHEMAS
from tokenloop.core.request import StructuredOutput
from tokenloop.core.structured import JSON_LAYOUT, lark_of, schema_text
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.trtllm import create_trtllm_executor

SCHEMA = json.dumps(SCHEMAS["flat_object"])
SENT = schema_text("json_schema", SCHEMA)  # with the first-try defaults, as the embedded engine compiles it
ANY_OBJECT = schema_text("json_object", "")
TAG = json.dumps({"structures": [{"begin": "<f>", "schema": {"type": "integer"}, "end": "</f>"}], "triggers": ["<f"]})
CASES = [("json_schema", SCHEMA), ("json_object", ""), ("regex", "[a-z]+"), ("grammar", ARITHMETIC_GRAMMAR),
         ("structural_tag", TAG)]


def structured(kind: str, spec: str):
    return replace(scenarios.request(), structured=StructuredOutput(kind, spec))


def with_layout(schema: str) -> dict:
    return {**json.loads(schema), "x-guidance": JSON_LAYOUT}


# -- the C++ executor --------------------------------------------------------------------------
def executor_of(fake):
    return fake.bindings.executor.Executor.instances[-1]


def test_executor_config_carries_a_guided_decoding_config_built_from_the_tokenizer(fake, tmp_path, tokenizer_dir):
    adapter = create_trtllm_executor(str(make_engine_dir(tmp_path / "engine", tokenizer_dir)))
    config = executor_of(fake).config.guided_decoding_config
    tle = fake.bindings.executor
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    assert config.backend == tle.GuidedDecodingConfig.GuidedDecodingBackend.XGRAMMAR
    assert config.encoded_vocab == tokenizer.encoded_vocab() and len(config.encoded_vocab) == tokenizer.vocab_size
    assert json.loads(config.tokenizer_str) == json.loads((tokenizer_dir / "tokenizer.json").read_text())
    assert config.stop_token_ids == [tokenizer.token_to_id("<|im_end|>")]
    adapter.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_executor_requests_carry_guided_decoding_params(fake, tmp_path, tokenizer_dir, backend):
    adapter = create_trtllm_executor(str(make_engine_dir(tmp_path / "engine", tokenizer_dir)),
                                     guided_decoding_backend=backend)
    engine, types = executor_of(fake), fake.bindings.executor.GuidedDecodingParams.GuideType
    sent = {}
    for kind, spec in CASES:
        request_id = adapter.enqueue(structured(kind, spec))
        params = engine.requests[request_id].guided_decoding_params
        sent[kind] = (params.guide_type, params.guide)
    if backend == "xgrammar":
        assert sent == {"json_schema": (types.JSON_SCHEMA, SENT), "json_object": (types.JSON_SCHEMA, ANY_OBJECT),
                        "regex": (types.REGEX, "[a-z]+"), "grammar": (types.EBNF_GRAMMAR, ARITHMETIC_GRAMMAR),
                        "structural_tag": (types.STRUCTURAL_TAG, TAG)}
    else:  # TensorRT-LLM's llguidance reads EBNF as Lark and has no structural tags: both go as Lark
        assert engine.config.guided_decoding_config.backend.name == "LLGUIDANCE"
        assert {k: (t, json.loads(g)) for k, (t, g) in sent.items() if k.startswith("json")} == {
            "json_schema": (types.JSON_SCHEMA, with_layout(SENT)),
            "json_object": (types.JSON_SCHEMA, with_layout(ANY_OBJECT))}
        assert sent["grammar"] == (types.EBNF_GRAMMAR, lark_of("grammar", ARITHMETIC_GRAMMAR))
        assert sent["structural_tag"] == (types.EBNF_GRAMMAR, lark_of("structural_tag", TAG))
    assert engine.requests[adapter.enqueue(scenarios.request())].guided_decoding_params is None
    adapter.shutdown()


def test_executor_with_guided_decoding_off_refuses_structured_requests(fake, tmp_path, tokenizer_dir):
    adapter = create_trtllm_executor(str(make_engine_dir(tmp_path / "engine", tokenizer_dir)),
                                     guided_decoding_backend="none")
    assert executor_of(fake).config.guided_decoding_config is None
    with pytest.raises(ValueError, match="structured output is off on this executor"):
        adapter.enqueue(structured("regex", "[a-z]+"))
    adapter.shutdown()


# -- the LLM API -------------------------------------------------------------------------------
def llm_of(fake):
    return fake.LLM.instances[-1]


@pytest.mark.parametrize("backend, expected", [("auto", "llguidance"), ("xgrammar", "xgrammar"),
                                               ("llguidance", "llguidance"), ("none", None)])
def test_llm_gets_the_guided_decoding_backend(fake, tokenizer_dir, backend, expected):
    adapter = create_trtllm_executor(str(tokenizer_dir), guided_decoding_backend=backend)
    assert llm_of(fake).args.get("guided_decoding_backend") == expected
    if expected is None:
        with pytest.raises(ValueError, match="structured output is off on this server"):
            adapter.enqueue(structured("regex", "[a-z]+"))
    adapter.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_sampling_params_carry_guided_decoding(fake, tokenizer_dir, backend):
    adapter = create_trtllm_executor(str(tokenizer_dir), guided_decoding_backend=backend)
    GuidedDecodingParams = fake.sampling_params.GuidedDecodingParams
    sent = {}
    for kind, spec in CASES:
        adapter.enqueue(structured(kind, spec))
        sent[kind] = llm_of(fake).submits[-1][1].guided_decoding
    if backend == "xgrammar":
        assert sent == {"json_schema": GuidedDecodingParams(json=SENT),
                        "json_object": GuidedDecodingParams(json=ANY_OBJECT),
                        "regex": GuidedDecodingParams(regex="[a-z]+"),
                        "grammar": GuidedDecodingParams(grammar=ARITHMETIC_GRAMMAR),
                        "structural_tag": GuidedDecodingParams(structural_tag=TAG)}
    else:
        assert json.loads(sent["json_schema"].json) == with_layout(SENT)
        assert sent["grammar"] == GuidedDecodingParams(grammar=lark_of("grammar", ARITHMETIC_GRAMMAR))
        assert sent["structural_tag"] == GuidedDecodingParams(grammar=lark_of("structural_tag", TAG))
    adapter.enqueue(scenarios.request())
    assert llm_of(fake).submits[-1][1].guided_decoding is None
    adapter.shutdown()
