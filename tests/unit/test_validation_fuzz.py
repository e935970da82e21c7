"""Fuzzing request validation: arbitrary field values give INVALID_ARGUMENT or a request within the limits."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import run
from tokenloop.core.request import ValidRequest
from tokenloop.core.tokenizer import ModelCard, Tokenizer
from tokenloop.service.errors import ValidationError
from tokenloop.service.validation import Limits, Validator
from tokenloop.v1 import tokenloop_pb2 as pb

U32 = st.integers(0, 2**32 - 1)
SMALL = st.one_of(st.integers(0, 40), U32)
F32 = st.floats(width=32)  # includes nan, +-inf, subnormals
TEXT = st.text(max_size=60)
LIMITS = Limits(max_context_length=256, max_prompt_tokens=100, max_new_tokens=64, default_max_new_tokens=16,
                max_n=4, max_stop_strings=3, max_stop_string_length=8)


def _maybe(strategy):
    return st.one_of(st.none(), strategy)


FIELDS = ("n", "input", "temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "top_k", "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids",
          "top_logprobs", "request_id")
SANE = {"temperature": st.floats(0, 2, width=32), "top_p": st.floats(0.0625, 1, width=32),
        "min_p": st.floats(0, 1, width=32), "repetition_penalty": st.floats(0.5, 2, width=32),
        "presence_penalty": st.floats(-2, 2, width=32), "frequency_penalty": st.floats(-2, 2, width=32)}


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """GenerateRequests: a few fields (chosen per request) take arbitrary values, the rest plausible ones."""
    wild = draw(st.sets(st.sampled_from(FIELDS), max_size=3))

    def pick(name, sane, arbitrary):
        return draw(st.one_of(sane, arbitrary) if name in wild else sane)

    req = pb.GenerateRequest(request_id=pick("request_id", st.text("abc-_019", max_size=20), TEXT),
                             stream=draw(st.booleans()), n=pick("n", st.integers(0, 4), SMALL))
    which = pick("input", st.sampled_from(("text", "token_ids", "chat")), st.none())
    if which == "text":
        req.text = draw(TEXT)
    elif which == "token_ids":
        req.token_ids.ids.extend(draw(st.lists(st.one_of(st.integers(0, 399), U32) if "input" in wild
                                               else st.integers(0, 399), max_size=120)))
    elif which == "chat":
        role = st.sampled_from(("system", "user", "assistant", "tool"))
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in draw(st.lists(st.tuples(
            st.one_of(role, TEXT) if "input" in wild else role, TEXT), max_size=4)))
    s = req.sampling
    for name, sane in SANE.items():
        if (value := pick(name, _maybe(sane), F32)) is not None:
            setattr(s, name, value)
    s.top_k = pick("top_k", st.integers(0, 50), st.integers(-2**31, 2**31 - 1))
    if (seed := draw(_maybe(st.integers(0, 2**64 - 1)))) is not None:
        s.seed = seed
    t = req.stopping
    if (max_new := pick("max_new_tokens", _maybe(st.integers(1, 64)), SMALL)) is not None:
        t.max_new_tokens = max_new
    t.min_new_tokens = pick("min_new_tokens", st.integers(0, 4), SMALL)
    t.stop.extend(pick("stop", st.lists(st.text(min_size=1, max_size=8), max_size=3),
                       st.lists(st.text(max_size=12), max_size=5)))
    t.stop_token_ids.extend(pick("stop_token_ids", st.lists(st.integers(0, 399), max_size=3),
                                 st.lists(U32, max_size=4)))
    t.ignore_eos, t.include_stop_str_in_output = draw(st.booleans()), draw(st.booleans())
    o = req.output
    o.logprobs, o.echo = draw(st.booleans()), draw(st.booleans())
    o.top_logprobs = pick("top_logprobs", st.integers(0, 20), SMALL)
    if (skip := draw(_maybe(st.booleans()))) is not None:
        o.skip_special_tokens = skip
    return req


def check_within_limits(valid: ValidRequest, limits: Limits) -> None:
    assert 1 <= valid.n <= limits.max_n
    assert 1 <= len(valid.prompt_token_ids) <= limits.max_prompt_tokens
    assert 1 <= valid.stopping.max_new_tokens <= limits.max_new_tokens
    assert len(valid.prompt_token_ids) + valid.stopping.max_new_tokens <= limits.max_context_length
    assert len(valid.stopping.stop) <= limits.max_stop_strings
    assert all(0 < len(s) <= limits.max_stop_string_length for s in valid.stopping.stop)
    assert valid.sampling.temperature >= 0 and 0 < valid.sampling.top_p <= 1


_validator: Validator | None = None


def validator(tokenizer_dir) -> Validator:
    global _validator
    if _validator is None:
        _validator = Validator(Tokenizer.from_dir(tokenizer_dir), ModelCard.from_dir(tokenizer_dir), LIMITS)
    return _validator


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(request=generate_requests(), request_id=TEXT)
def test_validator_gives_a_valid_request_or_a_validation_error(tokenizer_dir, request, request_id):
    v = validator(tokenizer_dir)
    try:
        valid = v.generate(request, request_id)
    except ValidationError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT and exc.rule and exc.message
        assert "Traceback" not in exc.message and "/" not in exc.rule
        return
    check_within_limits(valid, LIMITS)


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                               HealthCheck.too_slow])
@given(requests=st.lists(generate_requests(), min_size=40, max_size=40))
def test_a_real_server_answers_ok_or_invalid_argument(tokenizer_dir, requests):
    from tests.integration.service_harness import serving

    async def body():
        codes = []
        async with serving(tokenizer_dir, max_new_tokens=64, default_max_new_tokens=16, max_n=4,
                           max_prompt_tokens=100, max_stop_strings=3, max_stop_string_length=8) as (_, stub, _):
            for i, request in enumerate(requests):
                request.request_id = f"fuzz-{i}" if request.request_id == "" else request.request_id
                try:
                    msgs = [m async for m in stub.Generate(request, timeout=30)]
                    assert msgs and msgs[-1].HasField("complete")
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as err:
                    codes.append(err.code())
                    assert "Traceback" not in err.details() and "File \"" not in err.details()
            assert (await stub.GetLoad(pb.GetLoadRequest())).num_running == 0
        return codes

    codes = run(body())
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, codes
