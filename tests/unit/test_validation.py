"""Each validation rule's exact error: field named, rule stated."""

from __future__ import annotations

import pytest

from tokenloop.looper.tokenizer import ModelCard, Tokenizer
from tokenloop.service.errors import ValidationError
from tokenloop.service.validation import Limits, Validator
from tokenloop.v1 import tokenloop_pb2 as pb


@pytest.fixture(scope="module")
def validator(tokenizer_dir):
    tok, card = Tokenizer.from_dir(tokenizer_dir), ModelCard.from_dir(tokenizer_dir)
    return Validator(tok, card, Limits(max_context_length=256, max_new_tokens=200, default_max_new_tokens=64, max_n=4,
                                       max_prompt_tokens=100))


def req(**kw) -> pb.GenerateRequest:
    kw.setdefault("text", "Hello world")
    return pb.GenerateRequest(**kw)


def error_of(validator, request) -> tuple[str, str]:
    with pytest.raises(ValidationError) as exc:
        validator.generate(request, "rid")
    return exc.value.rule, exc.value.message


CASES = [
    ("empty input", pb.GenerateRequest(), "empty_input", "`input` must be set: one of `text`, `token_ids`, `chat`"),
    ("empty text", req(text=""), "empty_text", "`text` must not be empty"),
    ("empty ids", pb.GenerateRequest(token_ids=pb.TokenIds()), "empty_token_ids", "`token_ids.ids` must not be empty"),
    ("id out of vocab", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999])), "token_id_out_of_range",
     "`token_ids.ids` must be < the vocabulary size 400; got 99999"),
    ("empty chat", pb.GenerateRequest(chat=pb.Chat()), "empty_chat", "`chat.messages` must not be empty"),
    ("unknown role", pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="x")])),
     "unknown_chat_role", "`chat.messages[0].role` must be one of system, user, assistant, tool; got 'robot'"),
    ("too many prompt tokens", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 150)), "prompt_too_long", "the prompt has 150 tokens; the limit is 100"),
    ("max_new_tokens 0", req(stopping=pb.StoppingCriteria(max_new_tokens=0)), "max_new_tokens",
     "`stopping.max_new_tokens` must be between 1 and 200; got 0"),
    ("max_new_tokens too big", req(stopping=pb.StoppingCriteria(max_new_tokens=201)), "max_new_tokens",
     "`stopping.max_new_tokens` must be between 1 and 200; got 201"),
    ("over context", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 90), stopping=pb.StoppingCriteria(max_new_tokens=200)), "context_exceeded",
     "the prompt (90 tokens) plus `stopping.max_new_tokens` (200) exceeds the model's context of 256 tokens"),
    ("min > max", req(stopping=pb.StoppingCriteria(max_new_tokens=5, min_new_tokens=6)), "min_new_tokens",
     "`stopping.min_new_tokens` (6) must be <= max_new_tokens (5)"),
    ("temperature < 0", req(sampling=pb.SamplingParams(temperature=-0.1)), "temperature",
     "`sampling.temperature` must be >= 0"),
    ("temperature nan", req(sampling=pb.SamplingParams(temperature=float("nan"))), "sampling.temperature_not_finite",
     "`sampling.temperature` must be a finite number"),
    ("top_p 0", req(sampling=pb.SamplingParams(top_p=0.0)), "top_p", "`sampling.top_p` must be > 0 and <= 1"),
    ("top_p > 1", req(sampling=pb.SamplingParams(top_p=1.5)), "top_p", "`sampling.top_p` must be > 0 and <= 1"),
    ("top_k < 0", req(sampling=pb.SamplingParams(top_k=-1)), "top_k", "`sampling.top_k` must be >= 0 (0 disables it)"),
    ("min_p > 1", req(sampling=pb.SamplingParams(min_p=1.5)), "min_p", "`sampling.min_p` must be between 0 and 1"),
    ("repetition 0", req(sampling=pb.SamplingParams(repetition_penalty=0)), "repetition_penalty",
     "`sampling.repetition_penalty` must be > 0 (1 disables it)"),
    ("presence", req(sampling=pb.SamplingParams(presence_penalty=3)), "presence_penalty",
     "`sampling.presence_penalty` must be between -2 and 2"),
    ("frequency", req(sampling=pb.SamplingParams(frequency_penalty=-3)), "frequency_penalty",
     "`sampling.frequency_penalty` must be between -2 and 2"),
    ("n too big", req(n=5), "n", "`n` must be between 1 and 4; got 5"),
    ("top_logprobs", req(output=pb.OutputOptions(top_logprobs=21)), "top_logprobs",
     "`output.top_logprobs` must be between 0 and 20; got 21"),
    ("too many stops", req(stopping=pb.StoppingCriteria(stop=["a"] * 17)), "too_many_stop_strings",
     "`stopping.stop` may hold at most 16 strings; got 17"),
    ("empty stop", req(stopping=pb.StoppingCriteria(stop=["ok", ""])), "stop_string_length",
     "`stopping.stop[1]` must be 1 to 256 characters long"),
    ("stop token out of vocab", req(stopping=pb.StoppingCriteria(stop_token_ids=[400])), "stop_token_id_out_of_range",
     "`stopping.stop_token_ids` must be < the vocabulary size 400; got 400"),
]


@pytest.mark.parametrize("name,request_,rule,message", CASES, ids=[c[0] for c in CASES])
def test_rule(validator, name, request_, rule, message):
    assert error_of(validator, request_) == (rule, message)


def test_request_id_rule(validator):
    with pytest.raises(ValidationError) as exc:
        validator.generate(req(), "x" * 300)
    assert exc.value.rule == "request_id"


def test_defaults_filled(validator):
    v = validator.generate(req(), "rid")
    assert v.n == 1 and v.stopping.max_new_tokens == 64
    assert v.sampling.temperature == 1.0 and v.sampling.top_p == 1.0 and v.output.skip_special_tokens
    assert 0 <= v.sampling.seed < 2**63
    assert v.prompt_token_ids == tuple(validator.tokenizer.encode("Hello world"))


def test_explicit_values_kept(validator):
    v = validator.generate(req(sampling=pb.SamplingParams(temperature=0, seed=7, top_k=3),
                               stopping=pb.StoppingCriteria(max_new_tokens=9, stop=["x"], ignore_eos=True),
                               output=pb.OutputOptions(top_logprobs=2, skip_special_tokens=False), n=2), "rid")
    assert v.sampling.greedy and v.sampling.seed == 7 and v.sampling.top_k == 3
    assert v.stopping.max_new_tokens == 9 and v.stopping.stop == ("x",) and v.stopping.ignore_eos
    assert v.output.logprobs and v.output.top_logprobs == 2 and not v.output.skip_special_tokens and v.n == 2


def test_chat_is_rendered_with_template(validator):
    v = validator.generate(pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="Hi")])), "r")
    assert v.prompt_text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_default_max_new_tokens_capped_by_context(validator):
    v = validator.generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 99)), "rid")
    assert v.stopping.max_new_tokens == min(validator.limits.default_max_new_tokens, 256 - 99)
