"""engine/admission.py: each backstop refusal names the field and the rule, exactly."""

import dataclasses

import pytest

from tests.engine_helpers import greedy_request
from tokenloop.core.request import EmbedParams, StructuredOutput
from tokenloop.engine.admission import AdmissionError, check_request

CONTEXT, VOCAB, KV = 64, 100, 48


def refusal(request) -> AdmissionError:
    with pytest.raises(AdmissionError) as err:
        check_request(request, CONTEXT, VOCAB, KV)
    return err.value


@pytest.mark.parametrize("request_, rule, message", [
    (greedy_request([], 4), "empty_prompt", "`prompt_token_ids` must not be empty"),
    (greedy_request(list(range(64)), 4), "prompt_too_long",
     "`prompt_token_ids` has 64 tokens; this model takes at most 63 so that one can be generated"),
    (greedy_request([5, 100, 7], 4), "token_id_out_of_range", "`prompt_token_ids` must be in 0..99; got 100"),
    (greedy_request([5, -1], 4), "token_id_out_of_range", "`prompt_token_ids` must be in 0..99; got -1"),
    (dataclasses.replace(greedy_request([5], 4), n=0), "n_too_small", "`n` must be >= 1; got 0"),
    (dataclasses.replace(greedy_request([5], 4), n=2, embed=EmbedParams()), "embed_n",
     "`n` must be 1 for an embedding request; got 2"),
    (dataclasses.replace(greedy_request([5], 4), embed=EmbedParams(), structured=StructuredOutput("regex", "a")),
     "embed_structured", "`structured` must be unset for an embedding request"),
    (dataclasses.replace(greedy_request([5], 4), structured=StructuredOutput("regex", "a+")),
     "structured_not_compiled", "`structured.regex` must be compiled before the engine (service validation "
     "compiles it)"),
    (greedy_request(list(range(40)), 9), "kv_cache_too_small",
     "`prompt_token_ids` plus `max_new_tokens` (49 tokens) must fit the KV cache (48 tokens)"),
])
def test_each_refusal_names_the_field_and_the_rule(request_, rule, message):
    err = refusal(request_)
    assert err.rule == rule and str(err) == f"{message} (engine admission: {rule})"
    assert isinstance(err, ValueError)  # the looper maps ValueError from enqueue to INVALID_ARGUMENT


def test_a_request_within_every_rule_is_admitted():
    check_request(greedy_request(list(range(40)), 8), CONTEXT, VOCAB, KV)  # 48 tokens: exactly the KV cache
    check_request(dataclasses.replace(greedy_request([5], 4), embed=EmbedParams()), CONTEXT, VOCAB, KV)
