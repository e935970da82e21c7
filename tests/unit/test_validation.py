"""Each validation rule's exact error: field named, rule stated."""

from __future__ import annotations

import pytest

from tokenloop.core.tokenizer import RELEASE_GIL_OVER, ModelCard, Tokenizer
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
    ("too many prompt tokens", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 150)), "prompt_too_long",
     "the prompt (`token_ids.ids`) has 150 tokens; the limit is 100 (--max-prompt-tokens)"),
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
     "`sampling.repetition_penalty` must be between 0.01 and 100 (1 disables it); got 0"),
    ("repetition 1e-40", req(sampling=pb.SamplingParams(repetition_penalty=1e-40)), "repetition_penalty",
     "`sampling.repetition_penalty` must be between 0.01 and 100 (1 disables it); got 1e-40"),
    ("repetition 1e30", req(sampling=pb.SamplingParams(repetition_penalty=1e30)), "repetition_penalty",
     "`sampling.repetition_penalty` must be between 0.01 and 100 (1 disables it); got 1e+30"),
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


# -- tokenizing long inputs: the GIL-free entry points, and texts refused before tokenizing -------------
TEXTS = ["Hello world", "  leading and   inner   spaces  ", "<|im_start|>user\nHi<|im_end|>", "東京は日本の首都です。🚀👩‍💻",
         "x" * 500, " " * 300, "-" * 257 + "\n" * 40, "def main():\n    return 42\n" * 30,
         "Emoji 😀 東京 <|im_end|> text " * 120]  # the last one past RELEASE_GIL_OVER: the batch entry points


@pytest.mark.parametrize("kind", ["byte_level", "metaspace"])
def test_tokenizer_entry_points_match_the_plain_ones(kind, tokenizer_dir, metaspace_dir):
    """Short inputs go through `tokenizers`' plain calls, long ones through the batch calls that release the GIL:
    both give what the plain calls give."""
    tok = Tokenizer.from_dir(tokenizer_dir if kind == "byte_level" else metaspace_dir)
    assert max(map(len, TEXTS)) > RELEASE_GIL_OVER
    hf = tok.hf
    for text in TEXTS:
        for special in (False, True):
            ids = hf.encode(text, add_special_tokens=special).ids
            assert tok.encode(text, add_special_tokens=special) == ids
            assert tok.encode_with_tokens(text, add_special_tokens=special) == (ids, [hf.id_to_token(i) for i in ids])
        for skip in (False, True):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
            assert tok.decode(ids * 400, skip) == hf.decode(ids * 400, skip_special_tokens=skip)  # past 2048 ids


def test_max_chars_per_token_bounds_every_text(tokenizer_dir, metaspace_dir, default_model_or_none):
    assert Tokenizer.from_dir(metaspace_dir).max_chars_per_token is None  # an unknown token can stand for anything
    for model_dir in filter(None, (tokenizer_dir, default_model_or_none)):
        tok = Tokenizer.from_dir(model_dir)
        bound = tok.max_chars_per_token
        assert bound == max(len(t) for t in tok.hf.get_vocab(with_added_tokens=True))
        for text in TEXTS + ["".join(chr(c) for c in range(32, 2000)), "<|endoftext|>" * 20]:
            assert len(text) <= len(tok.encode(text)) * bound, text[:40]


class CountingTokenizer:
    """Delegates to a real tokenizer and counts `encode` calls."""

    def __init__(self, tok):
        self._inner, self.calls = tok, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def encode(self, text, add_special_tokens=False):
        self.calls += 1
        return self._inner.encode(text, add_special_tokens)


def test_text_too_long_for_any_tokenization_is_refused_untokenized(tokenizer_dir):
    inner = Tokenizer.from_dir(tokenizer_dir)
    tok = CountingTokenizer(inner)
    v = Validator(tok, ModelCard.from_dir(tokenizer_dir), Limits(max_context_length=256, max_prompt_tokens=100))
    per = inner.max_chars_per_token
    with pytest.raises(ValidationError) as exc:
        v.generate(req(text="a" * (100 * per + 1)), "rid")
    assert (exc.value.rule, exc.value.message) == (
        "prompt_too_long", f"`text` has {100 * per + 1} characters, more than a prompt of at most 100 tokens can "
                           f"hold ({100 * per}: no token of this tokenizer stands for more than {per})")
    assert tok.calls == 0
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="b" * (100 * per))])
    with pytest.raises(ValidationError) as exc:
        v.generate(pb.GenerateRequest(chat=chat), "rid")
    assert exc.value.message.startswith("the rendered `chat` has ") and tok.calls == 0
    # at the bound the text is tokenized, then judged by its token count
    with pytest.raises(ValidationError) as exc:
        v.generate(req(text="a" * (100 * per)), "rid")
    assert exc.value.message.startswith("the prompt (`text`) has ") and tok.calls == 1


def test_prompt_length_is_checked_before_every_id(validator):
    rule, message = error_of(validator, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 150 + [99999])))
    assert (rule, message) == ("prompt_too_long",
                               "the prompt (`token_ids.ids`) has 151 tokens; the limit is 100 (--max-prompt-tokens)")


def _releases_gil(call) -> bool:
    """Whether `call()` lets another thread run Python while it works. With forced GIL switches made impossible
    (a huge switch interval), this thread can only take the GIL back while `call` is in progress if `call`
    released it; otherwise it next runs when the other thread has finished."""
    import sys
    import threading
    started, state = threading.Event(), {"in_call": False}

    def other():
        started.set()
        state["in_call"] = True
        call()
        state["in_call"] = False
    before = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        thread = threading.Thread(target=other)
        thread.start()
        started.wait()
        seen = state["in_call"]
        thread.join()
    finally:
        sys.setswitchinterval(before)
    return seen


def test_long_inputs_are_tokenized_with_the_gil_released_and_short_ones_with_it_held(tokenizer):
    long_text = "Emoji 😀 東京 text and more text " * 4000
    ids = tokenizer.encode(long_text)
    assert _releases_gil(lambda: tokenizer.encode(long_text))
    assert _releases_gil(lambda: tokenizer.encode_with_tokens(long_text))
    assert _releases_gil(lambda: tokenizer.decode(ids))
    assert not _releases_gil(lambda: [tokenizer.encode("Hello world") for _ in range(200)])
    assert not _releases_gil(lambda: [tokenizer.decode(ids[:50]) for _ in range(200)])


def test_chat_with_more_messages_than_prompt_tokens_is_refused_before_rendering(validator):
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")] * 101)  # the limit is 100 prompt tokens
    rule, message = error_of(validator, pb.GenerateRequest(chat=chat))
    assert (rule, message) == ("too_many_chat_messages",
                               "`chat.messages` may hold at most 100 messages (the prompt limit in tokens); got 101")
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")] * 100)
    assert error_of(validator, pb.GenerateRequest(chat=chat))[0] == "prompt_too_long"  # rendered, then counted


def test_a_temperature_below_1e_5_is_greedy(validator):
    for tiny in (1e-45, 1e-30, 9e-6):
        assert validator.generate(req(sampling=pb.SamplingParams(temperature=tiny)), "rid").sampling.greedy
    kept = validator.generate(req(sampling=pb.SamplingParams(temperature=2e-5)), "rid").sampling
    assert not kept.greedy and kept.temperature == pytest.approx(2e-5)


def test_stop_token_ids_covering_the_vocabulary_with_min_new_tokens_are_refused(validator):
    # a limit on the number of stop token ids, where there is one, must let a list as long as the vocabulary through
    wide = {"max_stop_token_ids": 1024} if "max_stop_token_ids" in Limits.__dataclass_fields__ else {}
    validator = Validator(validator.tokenizer, validator.card, Limits(max_context_length=256, max_new_tokens=200,
                                                                      default_max_new_tokens=64, **wide))
    vocab, eos = validator.card.vocab_size, set(validator.card.eos_token_ids)
    others = [t for t in range(vocab) if t not in eos]
    refused = req(stopping=pb.StoppingCriteria(stop_token_ids=others, min_new_tokens=1))
    assert error_of(validator, refused) == (
        "no_token_allowed", f"`stopping.stop_token_ids` with EOS cover the whole vocabulary ({vocab} tokens): with "
        "`stopping.min_new_tokens` 1 no token could be generated")
    # one token left, no min_new_tokens, or EOS not held back (ignore_eos): a token can be generated
    for stopping in (pb.StoppingCriteria(stop_token_ids=others[1:], min_new_tokens=1),
                     pb.StoppingCriteria(stop_token_ids=others),
                     pb.StoppingCriteria(stop_token_ids=others, min_new_tokens=1, ignore_eos=True)):
        assert validator.generate(req(stopping=stopping), "rid").stopping.stop_token_ids == tuple(stopping.stop_token_ids)
