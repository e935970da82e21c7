"""Structured output through the gRPC server, both APIs, on the embedded engine with a tiny random model.

Shows the constraint end to end (validation, compile off the event loop, the cache, the engine), every refusal
rule with its exact message, and that a bad constraint breaks nothing else.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import grpc
import pytest
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tests.conftest import run
from tests.integration.service_harness import serving
from tests.structured_helpers import check_arithmetic, check_json, check_regex
from tests.tiny_model import make_tiny_model
from tokenloop.bench.structured_cases import ARITHMETIC_GRAMMAR, REGEXES, SCHEMAS
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.v1 import tokenloop_pb2 as pb

SCHEMA = SCHEMAS["tool_call"]
GUIDE = tpb.GuidedDecodingParams.GuideType


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama-structured-service"), "llama")


@asynccontextmanager
async def engine_server(checkpoint, **config):
    """(server, tokenloop.v1 stub, trtllm stub) with the embedded engine on the tiny checkpoint."""
    engine = Engine.from_dir(checkpoint, EngineConfig(kv_cache_tokens=16384, max_batch_size=64))
    async with serving(checkpoint, engine, **config) as (server, stub, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, stub, tpb_grpc.TrtllmServiceStub(channel)


def generate(**kw) -> pb.GenerateRequest:
    kw.setdefault("sampling", pb.SamplingParams(temperature=1.0, seed=7))
    kw.setdefault("stopping", pb.StoppingCriteria(max_new_tokens=320))
    return pb.GenerateRequest(text="Answer in JSON:", **kw)


async def complete(stub, request) -> pb.Complete:
    msgs = [m async for m in stub.Generate(request)]
    return msgs[-1].complete


def test_v1_json_schema_streamed_and_not(checkpoint):
    async def body():
        async with engine_server(checkpoint) as (server, stub, _):
            done = await complete(stub, generate(json_schema=json.dumps(SCHEMA)))
            check_json(done.text, SCHEMA)
            assert done.finish_reason == pb.STRUCTURE_COMPLETE
            msgs = [m async for m in stub.Generate(generate(json_schema=json.dumps(SCHEMA), stream=True,
                                                            sampling=pb.SamplingParams(temperature=1.0, seed=8)))]
            text = "".join(m.chunk.text for m in msgs if m.HasField("chunk"))
            assert text == msgs[-1].complete.text and len(msgs) > 2
            check_json(text, SCHEMA)
            assert server.app.grammars.compiler.num_compiled == 1  # the second request hit the cache
    run(body())


def test_v1_json_object_regex_grammar_and_n(checkpoint):
    async def body():
        async with engine_server(checkpoint) as (_, stub, _):
            obj = await complete(stub, generate(json_object=True, stopping=pb.StoppingCriteria(max_new_tokens=64)))
            assert obj.finish_reason == pb.LENGTH or isinstance(json.loads(obj.text), dict)
            check_regex((await complete(stub, generate(regex=REGEXES["ipv4"]))).text, REGEXES["ipv4"])
            check_arithmetic((await complete(stub, generate(grammar=ARITHMETIC_GRAMMAR))).text)
            msgs = [m async for m in stub.Generate(generate(json_schema=json.dumps(SCHEMA), n=4))]
            assert sorted(m.complete.index for m in msgs) == [0, 1, 2, 3]
            for m in msgs:
                check_json(m.complete.text, SCHEMA)
    run(body())


def test_stop_string_inside_the_structure_ends_it(checkpoint):
    async def body():
        async with engine_server(checkpoint) as (_, stub, _):
            done = await complete(stub, generate(json_schema=json.dumps(SCHEMA),
                                                 stopping=pb.StoppingCriteria(max_new_tokens=320, stop=['"arguments"'])))
            assert done.finish_reason == pb.STOP_SEQUENCE and done.matched_stop_str == '"arguments"'
            assert done.text.startswith('{"name": "get_') and '"arguments"' not in done.text
    run(body())


def test_abort_of_a_structured_request(checkpoint):
    async def body():
        async with engine_server(checkpoint) as (server, stub, _):
            call = stub.Generate(generate(request_id="s-1", json_schema=json.dumps(SCHEMAS["recursive_ref"]),
                                          stream=True, n=2))
            await call.read()
            assert (await stub.Abort(pb.AbortRequest(request_id="s-1"))).found
            reasons = set()
            while (msg := await call.read()) is not grpc.aio.EOF:
                if msg.HasField("complete"):
                    reasons.add(msg.complete.finish_reason)
            assert pb.CANCELLED in reasons and reasons <= {pb.CANCELLED, pb.STRUCTURE_COMPLETE}
            assert server.app.executor.num_requests == 0  # the engine dropped the sequences and their matchers
    run(body())


@pytest.mark.parametrize("fields, message", [
    ({"json_schema": '{"type": "objec"}'}, "`json_schema` is not a valid JSON schema: Invalid type: objec"),
    ({"json_schema": "[1, 2]"}, "`json_schema` is not a valid JSON schema: a JSON schema is a JSON object; got list"),
    ({"json_schema": "{bad"}, "`json_schema` is not a valid JSON schema: not JSON: Expecting property name enclosed in "
                              "double quotes: line 1 column 2 (char 1)"),
    ({"regex": "a(b"}, '`regex` is not a valid regular expression: at 1(8): invalid regex "a(b" (in regex): regex '
                       "parse error: | a(b | ^ | error: unclosed group | 1 | start: /a(b/ | ^"),
    ({"grammar": "root ::= foo"}, "`grammar` is not a valid grammar: Exception: Rule 'foo' not found"),
    ({"grammar": "root ::= r0\n" + "".join(f'r{i} ::= "x"\n' for i in range(300))},
     "`grammar` is not a valid grammar: it has 301 GBNF rules; at most 256 are converted (send larger grammars in "
     "Lark, llguidance's own syntax)"),
    ({"structural_tag": '{"type": "structural_tag", "format": {"type": "qwen_xml"}}'},
     "`structural_tag` is not a valid structural tag: format type 'qwen_xml' is not supported"),
    ({"json_object": False}, "`json_object` must be true when set (leave it unset for free text)"),
    ({"regex": ""}, "`regex` must not be empty"),
    ({"json_schema": json.dumps({"enum": ["x" * 8000]})},
     "`json_schema` is 8014 bytes; the limit is 8000 (--max-grammar-bytes)"),
])
def test_bad_constraints_are_invalid_argument_and_nothing_else_breaks(checkpoint, fields, message):
    async def body():
        async with engine_server(checkpoint, max_grammar_bytes=8000) as (_, stub, trt):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await complete(stub, generate(**fields))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == message
            check_regex((await complete(stub, generate(regex=REGEXES["phone"]))).text, REGEXES["phone"])
    run(body())


def test_a_compile_past_its_timeout_is_refused_and_its_process_killed(checkpoint):
    big = {"type": "object", "additionalProperties": False, "required": [f"k{i}" for i in range(3000)],
           "properties": {f"k{i}": {"type": "integer", "minimum": 0, "maximum": 9} for i in range(3000)}}
    schema = json.dumps(big)  # ~0.4 s to compile here: well past the 0.02 s allowed

    async def body():
        async with engine_server(checkpoint, grammar_compile_timeout=0.02) as (server, stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await complete(stub, generate(json_schema=schema))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == ("`json_schema` did not compile within 0.02 s (--grammar-compile-timeout): "
                                           "make it simpler")
            processes = server.app.grammars.processes
            assert processes.num_killed == 1  # the compile stopped with its request: nothing finishes it
            assert server.app.grammars.compiler.cached("json_schema", schema) is None
            server.app.grammars.timeout = 30.0
            retry = await complete(stub, generate(json_schema=schema, stopping=pb.StoppingCriteria(max_new_tokens=8)))
            assert retry.finish_reason == pb.LENGTH and retry.text.startswith('{"k0": ')  # a new process compiled it
    run(body())


# 600 `patternProperties` keys: ~90 s to compile with the tiny model's tokenizer on a quiet 2-vCPU EPYC (300: 3.2 s,
# under the 5 s timeout, so too fast to show a timeout on a quiet machine). Each is killed at its timeout anyway.
SLOW_SCHEMAS = [json.dumps({"type": "object", "patternProperties": {f"^{p}{i}_[a-z]+$": {"type": "integer"}
                                                                    for i in range(600)}}) for p in "kq"]


def test_slow_compiles_stop_at_their_timeout_while_tokenize_and_cached_schemas_answer(tmp_path_factory):
    checkpoint = make_tiny_model(tmp_path_factory.mktemp("llama-long-prompts"), "llama", max_positions=4096)

    async def body():
        async with engine_server(checkpoint, grammar_compile_timeout=5.0, grammar_compile_workers=2,
                                 max_grammar_compiles_waiting=1) as (server, stub, _):
            processes = server.app.grammars.processes
            cached = generate(json_schema=json.dumps(SCHEMA), stopping=pb.StoppingCriteria(max_new_tokens=8))
            await complete(stub, cached)  # compiled once: a cache hit from now on
            slow = [asyncio.ensure_future(complete(stub, generate(json_schema=s))) for s in SLOW_SCHEMAS]
            while processes.num_pending < 2:
                await asyncio.sleep(0.01)
            # both compile processes are busy: tokenization and cached constraints do not wait for them
            tokens = await stub.Tokenize(pb.TokenizeRequest(text="a long prompt " * 215))  # 3,010 characters
            assert len(tokens.token_ids) > 400 and processes.num_pending == 2
            done = await complete(stub, cached)
            assert done.finish_reason == pb.LENGTH and processes.num_pending == 2
            waiting = asyncio.ensure_future(complete(stub, generate(regex="[a-z]{3}")))  # waits for a process
            while processes.num_pending < 3:
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as full:  # past 2 running + 1 waiting
                await complete(stub, generate(regex="[0-9]{3}"))
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert full.value.details().startswith("too many constraints are compiling (2 compiles run and 1 wait; "
                                                   "--max-grammar-compiles-waiting)")
            for job in slow:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await job
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "did not compile within 5 s" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as waited:  # its 5 s passed before a process was free
                await waiting
            assert waited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert waited.value.details() == ("no compile process was free within 5 s (--grammar-compile-workers 2, "
                                              "all busy): retry later")
            assert processes.num_killed == 2
            done = await complete(stub, generate(regex="[a-z]{3}"))  # compiled by a process started in their place
            assert len(done.text) == 3
    run(body())


def test_a_grammar_past_the_matchers_row_limit_is_refused_at_admission(checkpoint):
    alternatives = " | ".join(f'"w{i}"' for i in range(20000))

    async def body():
        async with engine_server(checkpoint) as (_, stub, _):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await complete(stub, generate(grammar=f"start: {alternatives}\n"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == ("`grammar` is not a valid grammar: Parser Error: Current row has 20001 "
                                           "items; max is 2000; consider making your grammar left-recursive if it's "
                                           "right-recursive")
            check_regex((await complete(stub, generate(regex=REGEXES["phone"]))).text, REGEXES["phone"])
    run(body())


def guided(ids, guide_type, guide="", **kw) -> tpb.GenerateRequest:
    return tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=ids), max_tokens=320, streaming=True,
                               sampling_config=tpb.SamplingConfig(temperature=1.0, seed=3),
                               guided_decoding=tpb.GuidedDecodingParams(guide_type=guide_type, guide=guide), **kw)


def test_router_guided_decoding_every_guide_type(checkpoint):
    async def body():
        async with engine_server(checkpoint) as (server, _, trt):
            ids = server.app.tokenizer.encode("Answer in JSON:")
            tokenizer = server.app.tokenizer
            texts = {}
            for guide_type, guide in [(GUIDE.GUIDE_TYPE_JSON_SCHEMA, json.dumps(SCHEMA)), (GUIDE.GUIDE_TYPE_JSON, ""),
                                      (GUIDE.GUIDE_TYPE_REGEX, REGEXES["phone"]),
                                      (GUIDE.GUIDE_TYPE_EBNF_GRAMMAR, ARITHMETIC_GRAMMAR)]:
                msgs = [m async for m in trt.Generate(guided(ids, guide_type, guide))]
                done = msgs[-1].complete
                assert done.finish_reason in ("stop", "length")
                streamed = [t for m in msgs[:-1] for t in m.chunk.token_ids]
                assert streamed == list(done.output_token_ids)
                texts[guide_type] = (tokenizer.decode(done.output_token_ids), done.finish_reason)
            check_json(texts[GUIDE.GUIDE_TYPE_JSON_SCHEMA][0], SCHEMA)
            assert texts[GUIDE.GUIDE_TYPE_JSON_SCHEMA][1] == "stop"
            check_regex(texts[GUIDE.GUIDE_TYPE_REGEX][0], REGEXES["phone"])
            check_arithmetic(texts[GUIDE.GUIDE_TYPE_EBNF_GRAMMAR][0])
            text, reason = texts[GUIDE.GUIDE_TYPE_JSON]
            assert reason == "length" or isinstance(json.loads(text), dict)
    run(body())


@pytest.mark.parametrize("guide_type, guide, message", [
    (GUIDE.GUIDE_TYPE_JSON_SCHEMA, '{"type": "objec"}',
     "`guided_decoding.guide` is not a valid JSON schema: Invalid type: objec"),
    (GUIDE.GUIDE_TYPE_REGEX, "", "`guided_decoding.guide` must not be empty for GUIDE_TYPE_REGEX"),
    (GUIDE.GUIDE_TYPE_UNSPECIFIED, "x", "`guided_decoding.guide_type` must be one of GUIDE_TYPE_JSON, "
     "GUIDE_TYPE_JSON_SCHEMA, GUIDE_TYPE_REGEX, GUIDE_TYPE_EBNF_GRAMMAR, GUIDE_TYPE_STRUCTURAL_TAG; got 0"),
])
def test_router_bad_guides_name_their_field(checkpoint, guide_type, guide, message):
    async def body():
        async with engine_server(checkpoint) as (server, _, trt):
            ids = server.app.tokenizer.encode("Answer in JSON:")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                [m async for m in trt.Generate(guided(ids, guide_type, guide))]
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details() == message
    run(body())


def test_a_grammar_nested_thousands_of_rules_deep_does_not_crash_the_server(checkpoint):
    """llguidance recurses per nested rule: on a default 8 MB thread stack this grammar killed the process."""
    deep = "start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1} | "y"' for i in range(5000)) + '\nr5000: "z"\n'  # Lark

    async def body():
        async with engine_server(checkpoint) as (_, stub, _):
            done = await complete(stub, generate(grammar=deep, stopping=pb.StoppingCriteria(max_new_tokens=40)))
            assert set(done.text) <= {"x", "y", "z"} and done.text
            check_regex((await complete(stub, generate(regex=REGEXES["phone"]))).text, REGEXES["phone"])
    run(body())
