"""tokenloop.v1 end to end: a real `tokenloop serve` process on the real default model, the generated stubs."""

from __future__ import annotations

import time

import grpc
import pytest

from tests.e2e.live_server import live_address
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

QUESTION = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])


@pytest.fixture(scope="module")
def stub():
    channel = grpc.insecure_channel(live_address())
    yield pb_grpc.TextGenerationStub(channel)
    channel.close()


def test_greedy_chat_answers_paris(stub):
    (msg,) = list(stub.Generate(pb.GenerateRequest(chat=QUESTION, sampling=pb.SamplingParams(temperature=0),
                                                   stopping=pb.StoppingCriteria(max_new_tokens=32)), timeout=120))
    assert msg.complete.text == "The capital of France is Paris."
    assert msg.complete.finish_reason == pb.EOS


def test_streamed_chunks_add_up_to_the_complete_text(stub):
    msgs = list(stub.Generate(pb.GenerateRequest(text="Once upon a time", stream=True,
                                                 sampling=pb.SamplingParams(temperature=0),
                                                 stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True)),
                              timeout=120))
    chunks = [m.chunk for m in msgs if m.HasField("chunk")]
    done = msgs[-1].complete
    assert len(chunks) >= 2 and "".join(c.text for c in chunks) == done.text
    assert [t for c in chunks for t in c.token_ids] == list(done.token_ids)
    assert done.usage.completion_tokens == 24 and done.finish_reason == pb.LENGTH


def test_default_sampling_with_server_seed_is_reproducible(stub):
    """No temperature, no seed: the model samples with a server-picked 63-bit seed, echoed back."""
    req = pb.GenerateRequest(text="My favourite colour is", stopping=pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True))
    (first,) = list(stub.Generate(req, timeout=120))
    assert first.complete.usage.completion_tokens == 12 and first.complete.seed > 0
    req.sampling.seed = first.complete.seed
    (again,) = list(stub.Generate(req, timeout=120))
    assert again.complete.token_ids == first.complete.token_ids


def test_stop_string_n_and_logprobs(stub):
    msgs = list(stub.Generate(pb.GenerateRequest(
        chat=QUESTION, n=2, sampling=pb.SamplingParams(temperature=0.8, seed=7),
        stopping=pb.StoppingCriteria(max_new_tokens=32, stop=[" Paris"]),
        output=pb.OutputOptions(logprobs=True, top_logprobs=3)), timeout=120))
    assert sorted(m.complete.index for m in msgs) == [0, 1]
    for m in msgs:
        c = m.complete
        assert " Paris" not in c.text
        assert len(c.logprobs) == len(c.token_ids) and all(len(lp.top_logprobs) == 3 for lp in c.logprobs)
        if c.finish_reason == pb.STOP_SEQUENCE:
            assert c.matched_stop_str == " Paris"


def test_bad_input_is_invalid_argument_and_server_keeps_serving(stub):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(max_new_tokens=10**6))))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in err.value.details()
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_id == "SmolLM2-135M-Instruct" and info.backend == "engine" and info.has_chat_template


def test_disconnect_mid_stream_frees_the_request(stub):
    call = stub.Generate(pb.GenerateRequest(text="Count to a thousand:", stream=True,
                                            stopping=pb.StoppingCriteria(max_new_tokens=2000, ignore_eos=True)))
    next(call)
    call.cancel()
    for _ in range(200):
        load = stub.GetLoad(pb.GetLoadRequest())
        if load.num_in_flight == 0 and load.num_running == 0:
            break
        time.sleep(0.05)
    assert load.num_in_flight == 0 and load.num_running == 0 and load.num_waiting == 0
