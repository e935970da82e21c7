"""Every scalar field of every request message of every API through its extremes, against an in-process server.

tokenloop.v1.TextGeneration, vllm.grpc.engine.VllmEngine and trtllm.TrtllmService: each method's request (walked by
tests/field_extremes.py: 0, -1, the type's min and max, 2^31, 2^32-1, NaN, +-inf, empty, 1 MB, control characters,
invalid UTF-8, 200,000 repeated elements) sent one field at a time on top of a request that succeeds. Every answer
is OK, INVALID_ARGUMENT naming the field (or the message that holds it), or a status the method documents for
that input; never INTERNAL or UNKNOWN. The validators alone, with several fields wild at once:
tests/unit/test_field_ranges.py; one case per API against `tokenloop serve`: tests/e2e/test_field_ranges.py.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import message_factory
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from tests.conftest import run
from tests.field_extremes import field_cases, names_field
from tests.integration.service_harness import serving
from tests.tiny_model import make_tiny_model
from tokenloop.engine.config import EngineConfig
from tokenloop.engine.engine import Engine
from tokenloop.v1 import tokenloop_pb2 as pb

C = grpc.StatusCode
IDS = [5, 6, 7, 8]
TL, VL, TR = "/tokenloop.v1.TextGeneration/", "/vllm.grpc.engine.VllmEngine/", "/trtllm.TrtllmService/"
# A request of each method that succeeds (methods not listed: the empty request)
BASES = {
    TL + "Generate": pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_new_tokens=2)),
    TL + "Tokenize": pb.TokenizeRequest(text="Hello"),
    TL + "Detokenize": pb.DetokenizeRequest(token_ids=IDS),
    TL + "Embed": pb.EmbedRequest(text="Hello"),
    TL + "Abort": pb.AbortRequest(request_id="x"),
    TL + "LoadLoraAdapter": pb.LoadLoraAdapterRequest(name="a", path="a"),
    TL + "UnloadLoraAdapter": pb.UnloadLoraAdapterRequest(name="a"),
    VL + "Generate": vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=IDS),
                                         sampling_params=vpb.SamplingParams(max_tokens=2)),
    VL + "Embed": vpb.EmbedRequest(tokenized=vpb.TokenizedInput(input_ids=IDS)),
    VL + "Abort": vpb.AbortRequest(request_ids=["x"]),
    VL + "FlushCache": common_pb2.FlushCacheRequest(),
    TR + "Generate": tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=IDS), max_tokens=2),
    TR + "Abort": tpb.AbortRequest(request_id="x"),
}
# What else a method may answer for some values, and why
ALSO = {
    TL + "Generate": {C.NOT_FOUND}, TR + "Generate": {C.NOT_FOUND},  # `lora`, `lora_config.task_id`: no such adapter
    TL + "LoadLoraAdapter": {C.NOT_FOUND},  # no adapter at `path` under --lora-root
    TL + "UnloadLoraAdapter": {C.NOT_FOUND},  # no such adapter
    VL + "StartProfile": {C.UNIMPLEMENTED}, VL + "StopProfile": {C.UNIMPLEMENTED},  # no profiler
    TR + "Embed": {C.UNIMPLEMENTED},  # trtllm: a generative model
    VL + "SubscribeKvEvents": {C.OUT_OF_RANGE}, TR + "SubscribeKvEvents": {C.OUT_OF_RANGE},  # not in the history
}


def methods():
    """(path, request type, streaming) of every method of the three services."""
    out = []
    for module, service in ((pb, "TextGeneration"), (vpb, "VllmEngine"), (tpb, "TrtllmService")):
        desc = module.DESCRIPTOR.services_by_name[service]
        for m in desc.methods:
            out.append((f"/{desc.full_name}/{m.name}", m.input_type, m.server_streaming))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("field-ranges"), "llama")


async def answer(call, data: bytes, streaming: bool) -> tuple[grpc.StatusCode, str]:
    """The status of one call; a stream is read to its end, or to its first message (subscriptions never end)."""
    try:
        if streaming:
            [_ async for _ in call(data, timeout=30)]
        else:
            await call(data, timeout=30)
        return C.OK, ""
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""


async def first_or_end(call, data: bytes) -> tuple[grpc.StatusCode, str]:
    """A subscription's first message (then cancelled), or how it ended."""
    stream = call(data, timeout=30)
    try:
        await stream.read()
        return C.OK, ""
    except grpc.aio.AioRpcError as err:
        return err.code(), err.details() or ""
    finally:
        stream.cancel()


def test_every_field_of_every_api_at_its_extremes_is_ok_or_invalid_argument_naming_it(checkpoint):
    async def body():
        engine = Engine.from_dir(checkpoint, EngineConfig(kv_cache_tokens=4096, max_batch_size=8, max_lora_rank=8))
        wrong, num = [], 0
        options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        async with serving(checkpoint, engine, default_max_new_tokens=2, max_prompt_tokens=100,
                           max_message_bytes=64 << 20, lora_roots=(str(checkpoint),)) as (server, _, _):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
                for path, request_type, streaming in methods():
                    base = BASES.get(path)
                    if base is None:
                        base = message_factory.GetMessageClass(request_type)()
                    make = channel.unary_stream if streaming else channel.unary_unary
                    call = make(path, request_serializer=None, response_deserializer=None)
                    allowed = {C.OK, C.INVALID_ARGUMENT} | ALSO.get(path, set())
                    for case in [None, *field_cases(request_type)]:
                        num += 1
                        data = base.SerializeToString() if case is None else case.serialize(base)
                        if path.endswith("/SubscribeKvEvents"):
                            code, details = await first_or_end(call, data)
                        else:
                            code, details = await answer(call, data, streaming)
                        if case is None:  # the base request itself
                            if code not in allowed:
                                wrong.append(f"{path} (base): {code.name} {details[:200]}")
                            continue
                        if code not in allowed or (code == C.INVALID_ARGUMENT and not names_field(case, details)):
                            wrong.append(f"{path} {case}: {code.name} {details[:200]}")
        return wrong, num

    wrong, num = run(body())
    assert num > 800
    assert not wrong, "\n".join(wrong)
