"""Fuzzing request validation: arbitrary field values give INVALID_ARGUMENT or a request within the limits."""

from __future__ import annotations

import grpc
from hypothesis import HealthCheck, given, settings

from tests.request_strategies import TEXT, generate_requests
from tokenloop.core.request import ValidRequest
from tokenloop.core.tokenizer import ModelCard, Tokenizer
from tokenloop.service.errors import ValidationError
from tokenloop.service.validation import Limits, Validator

LIMITS = Limits(max_context_length=256, max_prompt_tokens=100, max_new_tokens=64, default_max_new_tokens=16,
                max_n=4, max_stop_strings=3, max_stop_string_length=8)


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
