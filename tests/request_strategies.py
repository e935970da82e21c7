"""Hypothesis strategies for tokenloop.v1 GenerateRequests: a few fields arbitrary, the rest plausible.

Shared by the validator's fuzz test (tests/unit/test_validation_fuzz.py) and the same requests through a real
server (tests/integration/test_validation_fuzz.py).
"""

from __future__ import annotations

from hypothesis import strategies as st

from tokenloop.v1 import tokenloop_pb2 as pb

U32 = st.integers(0, 2**32 - 1)
SMALL = st.one_of(st.integers(0, 40), U32)
F32 = st.floats(width=32)  # includes nan, +-inf, subnormals
TEXT = st.text(max_size=60)


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
