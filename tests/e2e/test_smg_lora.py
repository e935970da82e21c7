"""LoRA behind the real Shepherd Model Gateway, on the session's shared `tokenloop serve` (default model).

What exists in smg 1.13.0: its OpenAI front never fills `lora_config` (every TensorRT-LLM request builder in
lightseekorg/smg grpc_client/src/trtllm_service.rs sets `lora_config: None`; the vLLM protocol it detects on a worker
that serves both has no LoRA field at all), so a chat completion through it runs the base model even while adapters
are loaded; `trtllm.TrtllmService.Generate` with `lora_config.task_id`
(what a router that fills it sends) runs the adapter. The test shows both on one worker, and what smg answers
when the OpenAI `model` names the adapter.
"""

from __future__ import annotations

import json

import grpc
import pytest
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tests.e2e.gateway import Router, post, smg_binary
from tests.e2e.live_server import DEFAULT_MODEL, live_address, shared_lora_root
from tests.lora_helpers import write_adapter
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e
QUESTION = "What is the capital of France?"
TASK_ID = 4242


@pytest.fixture(scope="module")
def router(tmp_path_factory):
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip("the default model is not prepared: run `make model`")
    smg_binary()
    gateway = Router(live_address(), tmp_path_factory.mktemp("smg-lora") / "smg.log")
    try:
        gateway.wait_ready()
        yield gateway
    finally:
        gateway.stop()


def chat(router: Router, model: str) -> tuple[int, dict]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
                       "max_tokens": 16}).encode()
    resp = post(router, body)
    raw = resp.read()
    return resp.status, (json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode(errors="replace")})


def test_task_id_reaches_the_adapter_and_smg_http_reaches_the_base(router):
    write_adapter(DEFAULT_MODEL, shared_lora_root() / "smg-poet", r=8, alpha=16,
                  targets=("q_proj", "v_proj", "o_proj", "down_proj"), seed=3, scale=0.08)
    with grpc.insecure_channel(live_address()) as channel:
        stub, trt = pb_grpc.TextGenerationStub(channel), tpb_grpc.TrtllmServiceStub(channel)
        stub.LoadLoraAdapter(pb.LoadLoraAdapterRequest(name="smg-poet", path="smg-poet", id=TASK_ID))  # --lora-root
        try:
            ids = list(stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(
                messages=[pb.ChatMessage(role="user", content=QUESTION)]))).token_ids)

            def generate(**kw) -> list[int]:
                msgs = list(trt.Generate(tpb.GenerateRequest(
                    tokenized=tpb.TokenizedInput(input_token_ids=ids), max_tokens=16,
                    sampling_config=tpb.SamplingConfig(temperature=0.0), **kw)))
                return list(msgs[-1].complete.output_token_ids)

            base, with_adapter = generate(), generate(lora_config=tpb.LoraConfig(task_id=TASK_ID))
            assert with_adapter != base  # the task id reached the adapter
            status, answer = chat(router, DEFAULT_MODEL.name)
            assert status == 200, answer
            text = stub.Detokenize(pb.DetokenizeRequest(token_ids=base)).text
            assert answer["choices"][0]["message"]["content"].strip() == text.strip()  # smg's request: the base
            status, answer = chat(router, "smg-poet")  # the adapter's name as the OpenAI model
            if status == 200:  # smg routed it anyway, without lora_config: still the base model
                assert answer["choices"][0]["message"]["content"].strip() == text.strip()
            else:
                assert 400 <= status < 500, answer
        finally:
            stub.UnloadLoraAdapter(pb.UnloadLoraAdapterRequest(name="smg-poet"))
