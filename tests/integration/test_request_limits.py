"""Request limits through an in-process server, each refused with INVALID_ARGUMENT naming it; the server keeps serving.

Tokenize is bound by Generate's prompt limit (`--max-prompt-tokens`). Detokenize's ids (`--max-detokenize-ids`)
and stop_token_ids (`--max-stop-token-ids`) are bounded on both APIs, and a negative beam_width is refused on the
router API (the validator alone: tests/unit/test_validation_limits.py).

Without the bound a 16 MiB text tied up a tokenizer thread for ~12 s and its answer could exceed the message
limit. A byte-level tokenizer bounds a token's characters, so a text that cannot fit is refused untokenized;
other tokenizers (Metaspace here) are refused once their token count is known. The server keeps serving.
"""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import trtllm_service_pb2_grpc as tpb_grpc

from tests.conftest import run
from tests.integration.service_harness import serving
from tokenloop.core.tokenizer import Tokenizer
from tokenloop.v1 import tokenloop_pb2 as pb

LIMIT = 16


async def tokenize(stub, **kw):
    try:
        return await stub.Tokenize(pb.TokenizeRequest(**kw))
    except grpc.aio.AioRpcError as err:
        return err


def test_a_text_that_cannot_fit_is_refused_untokenized(tokenizer_dir):
    per_token = Tokenizer.from_dir(tokenizer_dir).max_chars_per_token
    too_long = "a" * (LIMIT * per_token + 1)

    async def body():
        async with serving(tokenizer_dir, max_prompt_tokens=LIMIT) as (_server, stub, _ex):
            return await tokenize(stub, text=too_long), await tokenize(stub, text="Hello world")

    refused, ok = run(body())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == (f"`text` has {len(too_long)} characters, more than a prompt of at most {LIMIT} "
                                 f"tokens can hold ({LIMIT * per_token}: no token of this tokenizer stands for more "
                                 f"than {per_token})")
    assert len(ok.token_ids) >= 2


def test_a_chat_that_renders_too_long_is_refused(tokenizer_dir):
    per_token = Tokenizer.from_dir(tokenizer_dir).max_chars_per_token
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="b" * (LIMIT * per_token))])

    async def body():
        async with serving(tokenizer_dir, max_prompt_tokens=LIMIT) as (_server, stub, _ex):
            return await tokenize(stub, chat=chat)

    refused = run(body())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("the rendered `chat` has ")


@pytest.mark.parametrize("size", [LIMIT + 40, 4000])  # tokenized inline, and on a tokenizer thread
def test_more_tokens_than_the_limit_is_refused_once_counted(metaspace_dir, size):
    text = " ".join(["hello"] * size)
    assert Tokenizer.from_dir(metaspace_dir).max_chars_per_token is None  # no character bound here

    async def body():
        async with serving(metaspace_dir, max_prompt_tokens=LIMIT) as (_server, stub, _ex):
            return await tokenize(stub, text=text), await tokenize(stub, text="hello world")

    refused, ok = run(body())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("the prompt (`text`) has ")
    assert refused.details().endswith(f" tokens; the limit is {LIMIT} (--max-prompt-tokens)")
    assert 0 < len(ok.token_ids) <= LIMIT


def test_detokenize_and_stop_token_ids_over_their_limits_are_refused(tokenizer_dir):
    async def body():
        async with serving(tokenizer_dir, max_detokenize_ids=10, max_stop_token_ids=2) as (server, stub, _):
            assert (await stub.Detokenize(pb.DetokenizeRequest(token_ids=[5] * 10))).text
            errors = []
            for call in (stub.Detokenize(pb.DetokenizeRequest(token_ids=[5] * 11)),
                         stub.Generate(pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(
                             stop_token_ids=[1, 2, 3]))).read()):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call
                errors.append((err.value.code(), err.value.details()))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                router = tpb_grpc.TrtllmServiceStub(ch)
                for request, message in (
                        (tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=[5, 6]), max_tokens=2,
                                             stop_token_ids=[1, 2, 3]),
                         "`stop_token_ids` may hold at most 2 ids (--max-stop-token-ids); got 3"),
                        (tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=[5, 6]), max_tokens=2,
                                             sampling_config=tpb.SamplingConfig(beam_width=-7)),
                         "`sampling_config.beam_width` must be >= 1 (0, unset, means 1); got -7")):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        [m async for m in router.Generate(request)]
                    errors.append((err.value.code(), err.value.details()))
                    assert err.value.details() == message
            assert errors[:2] == [
                (grpc.StatusCode.INVALID_ARGUMENT, "`token_ids` may hold at most 10 ids (--max-detokenize-ids); got 11"),
                (grpc.StatusCode.INVALID_ARGUMENT,
                 "`stopping.stop_token_ids` may hold at most 2 ids (--max-stop-token-ids); got 3")]
            assert {code for code, _ in errors} == {grpc.StatusCode.INVALID_ARGUMENT}
    run(body())
