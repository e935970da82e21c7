"""The Python client refuses bad arguments itself: ParameterError naming the parameter and the rule, nothing sent.

Before, `max_new_tokens="lots"` was a bare TypeError from protobuf, `max_new_tokens=10**12` a protobuf ValueError
and a chat message without `content` a KeyError. The clients are pointed at a closed port: the checks happen
before any connection, so none is needed.
"""

from __future__ import annotations

import asyncio

import pytest

from tokenloop_client import AsyncClient, ChatMessage, Client, ParameterError


@pytest.fixture(scope="module")
def client():
    with Client("127.0.0.1:9") as c:
        yield c


def refused(call) -> ParameterError:
    with pytest.raises(ParameterError) as info:
        call()
    return info.value


@pytest.mark.parametrize(("kwargs", "parameter", "message"), [
    ({"max_new_tokens": "lots"}, "max_new_tokens", "`max_new_tokens` must be an integer; got 'lots' (str)"),
    ({"max_new_tokens": 10**12}, "max_new_tokens",
     "`max_new_tokens` must be between 0 and 4294967295; got 1000000000000"),
    ({"max_new_tokens": -1}, "max_new_tokens", "`max_new_tokens` must be between 0 and 4294967295; got -1"),
    ({"max_new_tokens": 2.5}, "max_new_tokens", "`max_new_tokens` must be an integer; got 2.5 (float)"),
    ({"n": True}, "n", "`n` must be an integer; got True (bool)"),
    ({"top_k": 2**31}, "top_k", "`top_k` must be between -2147483648 and 2147483647; got 2147483648"),
    ({"seed": -5}, "seed", "`seed` must be between 0 and 18446744073709551615; got -5"),
    ({"temperature": "hot"}, "temperature", "`temperature` must be a number; got 'hot' (str)"),
    ({"ignore_eos": "yes"}, "ignore_eos", "`ignore_eos` must be True or False; got 'yes' (str)"),
    ({"stop": ["ok", 3]}, "stop[1]", "`stop[1]` must be a string; got 3 (int)"),
    ({"stop": {"a": 1}}, "stop", "`stop` must be one value or a list of them; got {'a': 1} (dict)"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids[1]", "`stop_token_ids[1]` must be between 0 and 4294967295; got -2"),
])
def test_option_types_and_ranges(client, kwargs, parameter, message):
    err = refused(lambda: client.generate("Hi", **kwargs))
    assert (err.parameter, str(err)) == (parameter, message)
    assert isinstance(err, TypeError) and isinstance(err, ValueError)  # code catching either keeps working


def test_unknown_option_lists_the_known_ones(client):
    err = refused(lambda: client.generate("Hi", max_tokens=5))
    assert err.parameter == "max_tokens"
    assert str(err).startswith("unknown option `max_tokens`; the generation options are echo, frequency_penalty, ")


@pytest.mark.parametrize(("messages", "parameter", "message"), [
    ([{"role": "user"}], "messages[0]", "`messages[0]` needs a 'role' and a 'content'; it has no 'content'"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], "messages[1]",
     "`messages[1]` needs a 'role' and a 'content'; it has no 'role'"),
    ([("user", 5)], "messages[0].content", "`messages[0].content` must be a string; got 5 (int)"),
    (["hello"], "messages[0]",
     "`messages[0]` must be a ChatMessage, a {'role', 'content'} dict or a (role, content) pair; got 'hello' (str)"),
    ("hello", "messages", "`messages` must be a list of chat messages; got str"),
])
def test_chat_messages(client, messages, parameter, message):
    err = refused(lambda: client.chat(messages))
    assert (err.parameter, str(err)) == (parameter, message)


def test_inputs(client):
    assert str(refused(lambda: client.generate(42))) == "`prompt` must be a string; got 42 (int)"
    assert str(refused(lambda: client.generate(token_ids="12"))) == \
        "`token_ids` must be a list of token ids; got '12' (str)"
    assert str(refused(lambda: client.generate(token_ids=[1, 2**32]))) == \
        "`token_ids[1]` must be a token id (an integer from 0 to 4294967295); got 4294967296 (int)"
    assert str(refused(lambda: client.tokenize(b"bytes"))) == "`text` must be a string; got b'bytes' (bytes)"
    assert str(refused(lambda: client.detokenize([1, "2"]))) == \
        "`token_ids[1]` must be a token id (an integer from 0 to 4294967295); got '2' (str)"
    assert str(refused(lambda: client.generate("Hi", request_id=7))) == "`request_id` must be a string; got 7 (int)"


def test_valid_arguments_still_build(client):
    from tokenloop_client._request import build_generate
    req = build_generate(None, messages=[ChatMessage("user", "Hi"), ("assistant", "Hello"), {"role": "user",
                         "content": "More"}], stream=True, params={"max_new_tokens": 4, "stop": "x",
                         "temperature": 0, "seed": 2**64 - 1, "stop_token_ids": 7, "n": None})
    assert [m.content for m in req.chat.messages] == ["Hi", "Hello", "More"]
    assert (req.stopping.max_new_tokens, list(req.stopping.stop), list(req.stopping.stop_token_ids)) == (4, ["x"], [7])
    assert req.sampling.seed == 2**64 - 1 and req.sampling.HasField("temperature")


def test_the_asyncio_client_checks_the_same_way():
    async def body():
        async with AsyncClient("127.0.0.1:9") as client:
            with pytest.raises(ParameterError, match=r"^`max_new_tokens` must be an integer; got 'lots' \(str\)$"):
                await client.generate("Hi", max_new_tokens="lots")
            with pytest.raises(ParameterError, match="it has no 'content'"):
                client.stream(messages=[{"role": "user"}])

    asyncio.run(body())
