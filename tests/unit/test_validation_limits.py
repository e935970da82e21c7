"""Validation rules that bound the work a request makes: stop_token_ids counted before the prompt is tokenized,
Detokenize's ids counted before they are looked at, and beam_width on the router API. Through a server:
tests/integration/test_request_limits.py."""

from __future__ import annotations

import pytest
from smg_grpc_proto.generated import trtllm_service_pb2 as tpb

from tokenloop.core.tokenizer import ModelCard, Tokenizer
from tokenloop.service.errors import ValidationError
from tokenloop.service.trtllm_service import check_supported
from tokenloop.service.validation import Limits, Validator
from tokenloop.v1 import tokenloop_pb2 as pb


@pytest.fixture(scope="module")
def validator(tokenizer_dir):
    tok, card = Tokenizer.from_dir(tokenizer_dir), ModelCard.from_dir(tokenizer_dir)
    return Validator(tok, card, Limits(max_context_length=256, max_stop_token_ids=4, max_prompt_tokens=100))


def rule_of(fn, *args) -> tuple[str, str]:
    with pytest.raises(ValidationError) as exc:
        fn(*args)
    return exc.value.rule, exc.value.message


def test_stop_token_ids_over_the_limit_are_refused_before_the_prompt_is_tokenized(validator):
    validator.generate(pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(stop_token_ids=[1] * 4)), "r")
    # an empty text is refused when the prompt is looked at: the count comes first
    request = pb.GenerateRequest(text="", stopping=pb.StoppingCriteria(stop_token_ids=[1] * 5))
    assert rule_of(validator.generate, request, "r") == (
        "too_many_stop_token_ids", "`stopping.stop_token_ids` may hold at most 4 ids (--max-stop-token-ids); got 5")
    assert rule_of(validator.stop_lists, [], [1] * 5, "") == (
        "too_many_stop_token_ids", "`stop_token_ids` may hold at most 4 ids (--max-stop-token-ids); got 5")


def test_detokenize_ids_default_to_the_context_length_and_are_counted_before_looked_at(validator):
    assert validator.limits.max_detokenize_ids == 256  # 0: the model's context length
    validator.detokenize_ids([5] * 256)
    assert rule_of(validator.detokenize_ids, [10**6] * 257) == (
        "too_many_detokenize_ids", "`token_ids` may hold at most 256 ids (--max-detokenize-ids); got 257")
    assert rule_of(validator.detokenize_ids, [5, 10**6]) == (
        "token_id_out_of_range", "`token_ids` must be < the vocabulary size 400; got 1000000")
    assert Limits(max_context_length=256, max_detokenize_ids=10).max_detokenize_ids == 10


def test_beam_width_below_zero_is_refused_on_the_router_api():
    for width in (0, 1):  # 0: unset
        check_supported(tpb.GenerateRequest(sampling_config=tpb.SamplingConfig(beam_width=width)))
    request = tpb.GenerateRequest(sampling_config=tpb.SamplingConfig(beam_width=-7))
    assert rule_of(check_supported, request) == (
        "beam_width", "`sampling_config.beam_width` must be >= 1 (0, unset, means 1); got -7")
