"""One field at an extreme per API against a real `tokenloop serve` (the shared server, default model): vLLM
`top_k` 2^32-5 (its uint32 past our int32) generates; tokenloop.v1 `Embed` of 200,000 ids is refused naming
`token_ids.ids` and the flag; trtllm `sampling_config.temperature` NaN is refused naming it. Every field of every
method: tests/integration/test_field_ranges.py (in-process) and tests/unit/test_field_ranges.py (the mappings)."""

from __future__ import annotations

import math

import grpc
import pytest
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from tests.e2e.live_server import live_address
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary


@pytest.fixture(scope="module")
def channel():
    ch = grpc.insecure_channel(live_address(), options=[("grpc.max_send_message_length", 16 << 20)])
    yield ch
    ch.close()


def test_vllm_top_k_past_int32_generates(channel):
    request = vpb.GenerateRequest(request_id="e2e-top-k", tokenized=vpb.TokenizedInput(input_ids=IDS),
                                  sampling_params=vpb.SamplingParams(top_k=2**32 - 5, max_tokens=4, temperature=0.0))
    msgs = list(vpb_grpc.VllmEngineStub(channel).Generate(request, timeout=120))
    assert msgs[-1].HasField("complete") and len(msgs[-1].complete.output_ids) == 4


def test_tokenloop_embed_of_200000_ids_names_the_field(channel):
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.TextGenerationStub(channel).Embed(pb.EmbedRequest(token_ids=pb.TokenIds(ids=[5] * 200_000)),
                                                  timeout=120)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == ("the prompt (`token_ids.ids`) has 200000 tokens; the limit is 8191 "
                                   "(--max-prompt-tokens)")


def test_trtllm_nan_temperature_names_the_field(channel):
    request = tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=IDS), max_tokens=4,
                                  sampling_config=tpb.SamplingConfig(temperature=math.nan))
    with pytest.raises(grpc.RpcError) as err:
        list(tpb_grpc.TrtllmServiceStub(channel).Generate(request, timeout=120))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "`sampling_config.temperature`" in err.value.details()
