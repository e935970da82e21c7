"""Each API's Generate mapping (tokenloop.v1 `Validator.generate`, vLLM and trtllm `to_valid_request`) with several
fields at their extremes at once (tests/field_extremes.py): a ValidRequest whose values fit the types below the
seam, or a ValidationError naming one of the fields set; never another exception. Through a server, every method
of every API one field at a time: tests/integration/test_field_ranges.py."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from tests.field_extremes import INVALID_UTF8_MARK, field_cases, names_field
from tokenloop.core.request import ValidRequest
from tokenloop.core.tokenizer import ModelCard, Tokenizer
from tokenloop.service import trtllm_service, vllm_service
from tokenloop.service.errors import ValidationError
from tokenloop.service.validation import Limits, Validator
from tokenloop.v1 import tokenloop_pb2 as pb

IDS = [5, 6, 7, 8]
INT32, UINT64 = (-2**31, 2**31 - 1), (0, 2**64 - 1)
APIS = {
    "tokenloop.v1": (pb.GenerateRequest(text="Hello", stopping=pb.StoppingCriteria(max_new_tokens=2)),
                     lambda v, r: v.generate(r, "rid")),
    "vllm": (vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=IDS),
                                 sampling_params=vpb.SamplingParams(max_tokens=2)),
             lambda v, r: vllm_service.to_valid_request(v, r, "rid", None, {"top_k": 20, "temperature": 0.7})),
    "trtllm": (tpb.GenerateRequest(tokenized=tpb.TokenizedInput(input_token_ids=IDS), max_tokens=2),
               lambda v, r: trtllm_service.to_valid_request(v, r, "rid", None)),
}
# invalid UTF-8 never parses (the decoding interceptor's seam), and a whole MB is slow to tokenize 300 times
CASES = {name: [c for c in field_cases(base.DESCRIPTOR) if c.value != INVALID_UTF8_MARK
                and not (isinstance(c.value, str) and len(c.value) > 1000 and c.leaf == "text")]
         for name, (base, _) in APIS.items()}


@pytest.fixture(scope="module")
def validator(tokenizer_dir):
    tok, card = Tokenizer.from_dir(tokenizer_dir), ModelCard.from_dir(tokenizer_dir)
    return Validator(tok, card, Limits(max_context_length=256, max_new_tokens=200, default_max_new_tokens=16,
                                       max_n=4, max_prompt_tokens=100))


def check_fits(valid: ValidRequest) -> None:
    """What the looper and the executors take: finite sampling values in their ranges, ids in the vocabulary."""
    s = valid.sampling
    assert all(math.isfinite(x) for x in (s.temperature, s.top_p, s.min_p, s.repetition_penalty,
                                          s.presence_penalty, s.frequency_penalty))
    assert INT32[0] <= s.top_k <= INT32[1] and s.top_k >= 0
    assert UINT64[0] <= s.seed <= UINT64[1]
    assert 1 <= valid.n <= 4 and 1 <= valid.stopping.max_new_tokens <= 200
    assert 0 <= valid.stopping.min_new_tokens <= valid.stopping.max_new_tokens
    assert 0 < len(valid.prompt_token_ids) <= 100
    assert len(valid.request_id) <= 256


@pytest.mark.parametrize("api", sorted(APIS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_fields_at_their_extremes_map_to_a_fitting_request_or_an_error_naming_one(validator, api, data):
    base, to_valid = APIS[api]
    cases = data.draw(st.lists(st.sampled_from(CASES[api]), min_size=1, max_size=4, unique_by=lambda c: c.path))
    request = base
    for case in cases:
        request = case.message(request)
    try:
        valid = to_valid(validator, request)
    except ValidationError as exc:
        assert any(names_field(c, exc.message) for c in cases) or exc.rule in ("context_exceeded", "min_new_tokens",
                                                                                  "empty_input", "no_token_allowed"), (
            [str(c) for c in cases], exc.message)
        return
    check_fits(valid)
