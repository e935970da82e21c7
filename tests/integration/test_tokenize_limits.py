"""Tokenize is bound by Generate's prompt limit (`--max-prompt-tokens`), refused with INVALID_ARGUMENT naming it.

Without the bound a 16 MiB text tied up a tokenizer thread for ~12 s and its answer could exceed the message
limit. A byte-level tokenizer bounds a token's characters, so a text that cannot fit is refused untokenized;
other tokenizers (Metaspace here) are refused once their token count is known. The server keeps serving.
"""

from __future__ import annotations

import grpc
import pytest

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
    assert refused.details().startswith("the prompt has ")
    assert refused.details().endswith(f" tokens; the limit is {LIMIT}")
    assert 0 < len(ok.token_ids) <= LIMIT
