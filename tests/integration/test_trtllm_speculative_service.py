"""TensorRT-LLM's speculation counts through the in-process server, on the fake tensorrt_llm's LLM API (n-gram, 4
drafted tokens per iteration, accepted 2, 0, 3, 1 in turn: 20 tokens in 8 verifications, 32 drafted, 12 accepted):
tokenloop.v1's usage, GetLoad's rates, /metrics' spec_decode counters, and both router protocols' GenerateComplete
spec_draft_tokens / spec_accepted_tokens."""

from __future__ import annotations

import pytest

from tests.fakes.fixtures import fake_trtllm
from tokenloop.trtllm import create_trtllm_executor

NUM_NEW, ITERATIONS = 20, 8


@pytest.fixture
def fake():
    with fake_trtllm() as module:
        yield module


def test_through_the_server_usage_load_metrics_and_both_router_protocols(fake, tokenizer_dir):
    """On the LLM API with n-gram drafting: tokenloop.v1's usage, GetLoad's rates, /metrics' spec_decode counters,
    and the router protocols' GenerateComplete.spec_draft_tokens / spec_accepted_tokens (what smg reads)."""
    import grpc
    from prometheus_client import CollectorRegistry
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

    from tests.conftest import run
    from tests.integration.service_harness import gen, read_all, serving, trtllm, wait_for
    from tokenloop.service.metrics import LoadCollector
    from tokenloop.v1 import tokenloop_pb2 as pb

    executor = create_trtllm_executor(str(tokenizer_dir), trtllm_api="llm", speculative="ngram",
                                      num_speculative_tokens=4)

    async def body():
        async with serving(tokenizer_dir, executor) as (server, stub, _):
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[20]), sampling=pb.SamplingParams(temperature=0),
                                         stopping=pb.StoppingCriteria(max_new_tokens=NUM_NEW, ignore_eos=True))
            usage = (await read_all(stub.Generate(request)))[-1].complete.usage
            assert (usage.completion_tokens, usage.draft_tokens, usage.accepted_draft_tokens) == (NUM_NEW, 32, 12)
            assert await wait_for(lambda: executor.stats().spec_num_drafts == ITERATIONS)
            load = await stub.GetLoad(pb.GetLoadRequest())
            assert load.spec_acceptance_rate == pytest.approx(12 / 32)
            assert load.spec_tokens_per_step == pytest.approx(1 + 12 / 8)
            registry = CollectorRegistry()
            registry.register(LoadCollector(server.app))
            assert registry.get_sample_value("tokenloop:spec_decode_num_draft_tokens_total") == 32
            assert registry.get_sample_value("tokenloop:spec_decode_num_accepted_tokens_total") == 12
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                vllm = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[20]), stream=False,
                                           sampling_params=vpb.SamplingParams(temperature=0, max_tokens=NUM_NEW,
                                                                              ignore_eos=True))
                (done,) = [m.complete for m in await read_all(vpb_grpc.VllmEngineStub(channel).Generate(vllm))
                           if m.HasField("complete")]
                assert (done.spec_draft_tokens, done.spec_accepted_tokens) == (32, 12)
        async with trtllm(tokenizer_dir, create_trtllm_executor(str(tokenizer_dir), trtllm_api="llm",
                                                                speculative="ngram", num_speculative_tokens=4)) \
                as (_, tstub, _ex):
            msgs = await read_all(tstub.Generate(gen([20], max_tokens=NUM_NEW, request_id="r")))
            (done,) = [m.complete for m in msgs if m.HasField("complete")]
            assert (done.spec_draft_tokens, done.spec_accepted_tokens) == (32, 12)
    run(body())
