"""smg's vLLM protocol at the door (service/vllm_service.py): a vLLM GenerateRequest -> ValidRequest, the fields this
executor cannot honour refused by name, the defaults of what a request leaves unset, and looper events -> vLLM
responses."""

from __future__ import annotations

import json

import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from tokenloop.core.request import FinishReason
from tokenloop.core.tokenizer import ModelCard, Tokenizer
from tokenloop.looper.stream import Chunk, Complete, Timing, TokenLogprob
from tokenloop.service.errors import ValidationError
from tokenloop.service.validation import Limits, Validator
from tokenloop.service.vllm_service import VllmWriter, generation_defaults, to_valid_request


def sent(writer: VllmWriter, batch) -> list[vpb.GenerateResponse]:
    """What the client reads for one batch: the writer's bytes, parsed."""
    return [vpb.GenerateResponse.FromString(m) for m in writer.encode(batch)]

DEFAULTS = {"temperature": 0.2, "top_p": 0.9}


@pytest.fixture(scope="module")
def validator(tokenizer_dir):
    tok, card = Tokenizer.from_dir(tokenizer_dir), ModelCard.from_dir(tokenizer_dir)
    return Validator(tok, card, Limits(max_context_length=256, max_new_tokens=200, default_max_new_tokens=64, max_n=4,
                                       max_prompt_tokens=100))


def gen(ids=(5, 6, 7), **sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=list(ids)),
                               sampling_params=vpb.SamplingParams(**sampling))


def valid(validator, request, defaults=DEFAULTS):
    return to_valid_request(validator, request, "rid", None, defaults)


def error_of(validator, request) -> tuple[str, str]:
    with pytest.raises(ValidationError) as exc:
        valid(validator, request)
    return exc.value.rule, exc.value.message


REFUSED = [
    ("mm_inputs", vpb.GenerateRequest(mm_inputs=vpb.MultimodalInputs()), "`mm_inputs` cannot be honoured: multimodal"),
    ("extra_mm_inputs", vpb.GenerateRequest(extra_mm_inputs=[vpb.MultimodalInputs()]),
     "`extra_mm_inputs` cannot be honoured: multimodal"),
    ("media_refs", vpb.GenerateRequest(media_refs=vpb.MediaRefs()), "`media_refs` cannot be honoured"),
    ("kv_transfer_params", vpb.GenerateRequest(kv_transfer_params=vpb.KvTransferParams(remote_host="h")),
     "`kv_transfer_params` cannot be honoured: KV transfer"),
    ("kv_transfer_params_json", vpb.GenerateRequest(kv_transfer_params_json="{}"),
     "`kv_transfer_params_json` cannot be honoured: KV transfer"),
    ("data_parallel_rank", vpb.GenerateRequest(data_parallel_rank=1), "`data_parallel_rank` cannot be honoured"),
    ("logit_bias", gen(logit_bias={5: 1.0}), "`sampling_params.logit_bias` cannot be honoured: logit biases"),
    ("prompt_logprobs", gen(prompt_logprobs=1), "`sampling_params.prompt_logprobs` cannot be honoured"),
]


@pytest.mark.parametrize("name,request_,message", REFUSED, ids=[c[0] for c in REFUSED])
def test_fields_the_executor_cannot_honour_are_refused_by_name(validator, name, request_, message):
    rule, text = error_of(validator, request_)
    assert rule == "unsupported_field" and text.startswith(message), text


RULES = [
    ("no input", vpb.GenerateRequest(), "empty_input", "`input` must be set: one of `tokenized`, `text`"),
    ("empty ids", gen(()), "empty_token_ids", "`tokenized.input_ids` must not be empty"),
    ("id out of vocab", gen((1, 99999)), "token_id_out_of_range", "`tokenized.input_ids` must be < the vocabulary"),
    ("n", gen(n=5), "n", "`sampling_params.n` must be between 1 and 4; got 5"),
    ("logprobs -1", gen(logprobs=-1), "top_logprobs", "`sampling_params.logprobs` must be between 0 and 20; got -1 "
                                                      "(-1, every token of the vocabulary, is not supported)"),
    ("logprobs 21", gen(logprobs=21), "top_logprobs", "`sampling_params.logprobs` must be between 0 and 20; got 21"),
    ("max_tokens 0", gen(max_tokens=0), "max_new_tokens", "`sampling_params.max_tokens` must be between 1 and 200"),
    ("max_tokens big", gen(max_tokens=201), "max_new_tokens", "`sampling_params.max_tokens` must be between 1 and"),
    ("min > max", gen(max_tokens=3, min_tokens=4), "min_new_tokens", "`sampling_params.min_tokens` (4) must be <= "
                                                                     "max_tokens (3)"),
    ("temperature", gen(temperature=-1), "temperature", "`sampling_params.temperature` must be >= 0"),
    ("top_p", gen(top_p=1.5), "top_p", "`sampling_params.top_p` must be > 0 and <= 1"),
    ("min_p", gen(min_p=2), "min_p", "`sampling_params.min_p` must be between 0 and 1"),
    ("penalty", gen(presence_penalty=3), "presence_penalty", "`sampling_params.presence_penalty` must be between"),
    ("stop", gen(stop=[""]), "stop_string_length", "`sampling_params.stop[0]` must be 1 to"),
    ("stop ids", gen(stop_token_ids=[99999]), "stop_token_id_out_of_range", "`sampling_params.stop_token_ids` must"),
    ("truncate 0", gen(truncate_prompt_tokens=0), "truncate_prompt_tokens",
     "`sampling_params.truncate_prompt_tokens` must be >= 1, or -1 for the prompt limit; got 0"),
    ("empty regex", gen(regex=""), "empty_structure", "`sampling_params.regex` must not be empty"),
    ("json_object false", gen(json_object=False), "json_object_false", "`sampling_params.json_object` must be true"),
    ("empty choice", gen(choice=vpb.ChoiceConstraint()), "empty_structure",
     "`sampling_params.choice.choices` must not be empty"),
    ("prompt too long", gen(range(3, 104)), "prompt_too_long", "the prompt (`tokenized.input_ids`) has 101 tokens; the limit is 100 (--max-prompt-tokens)"),
]


@pytest.mark.parametrize("name,request_,rule,message", RULES, ids=[c[0] for c in RULES])
def test_each_rule_names_the_vllm_field(validator, name, request_, rule, message):
    got_rule, text = error_of(validator, request_)
    assert (got_rule, text[:len(message)]) == (rule, message), text


def test_unset_fields_take_the_models_defaults_and_default_max_new_tokens(validator):
    v = valid(validator, gen())
    assert (v.sampling.temperature, v.sampling.top_p, v.sampling.top_k) == (pytest.approx(0.2), pytest.approx(0.9), 0)
    assert v.stopping.max_new_tokens == 64 and v.n == 1 and not v.stream and not v.output.logprobs
    # what the request sets wins; 0 for top_p / repetition_penalty is unset (proto3), as in vLLM's servicer
    v = valid(validator, gen(temperature=0.0, top_p=0.5, top_k=7, repetition_penalty=1.3, max_tokens=9))
    assert (v.sampling.temperature, v.sampling.top_p, v.sampling.top_k) == (0.0, 0.5, 7)
    assert v.sampling.repetition_penalty == pytest.approx(1.3) and v.stopping.max_new_tokens == 9
    v = valid(validator, gen(), defaults={"top_k": 20, "repetition_penalty": 1.1, "min_p": 0.05})
    assert (v.sampling.top_k, v.sampling.repetition_penalty, v.sampling.min_p) == (20, pytest.approx(1.1),
                                                                                   pytest.approx(0.05))
    v = valid(validator, gen(), defaults={})  # no model defaults: vLLM's own (temperature 1, top_p 1)
    assert (v.sampling.temperature, v.sampling.top_p) == (1.0, 1.0)


def test_seed_n_stops_logprobs_and_truncation_are_carried(validator):
    v = valid(validator, gen(seed=42, n=3, stop=["x"], stop_token_ids=[9], ignore_eos=True, min_tokens=2,
                             include_stop_str_in_output=True, logprobs=3))
    assert v.sampling.seed == 42 and v.n == 3 and v.stopping.stop == ("x",) and v.stopping.stop_token_ids == (9,)
    assert v.stopping.ignore_eos and v.stopping.min_new_tokens == 2 and v.stopping.include_stop_str_in_output
    assert v.output.logprobs and v.output.top_logprobs == 3
    assert valid(validator, gen(seed=-1)).sampling.seed == 0xFFFFFFFF
    assert valid(validator, gen(logprobs=0)).output.logprobs  # the chosen token's logprob only
    # without a seed each request draws its own
    assert valid(validator, gen()).sampling.seed != valid(validator, gen()).sampling.seed
    assert valid(validator, gen(range(3, 13), truncate_prompt_tokens=4)).prompt_token_ids == (9, 10, 11, 12)
    assert len(valid(validator, gen(range(3, 120), truncate_prompt_tokens=-1)).prompt_token_ids) == 100


def test_text_input_and_structured_constraints(validator):
    v = to_valid_request(validator, vpb.GenerateRequest(text="Hello world"), "rid", None)
    assert v.prompt_token_ids == validator.prompt(vpb.GenerateRequest(text="Hello world"))[0]
    for kind, spec in (("json_schema", '{"type": "object"}'), ("regex", "[a-z]+"), ("grammar", 'start: "a"'),
                       ("structural_tag", '{"type": "structural_tag"}')):
        s = valid(validator, gen(**{kind: spec})).structured
        assert (s.kind, s.spec) == (kind, spec)
    assert valid(validator, gen(json_object=True)).structured.kind == "json_object"
    s = valid(validator, gen(choice=vpb.ChoiceConstraint(choices=["yes", 'say "no"']))).structured
    assert (s.kind, s.spec) == ("grammar", 'start: "yes" | "say \\"no\\""')


def test_generation_defaults_reads_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.05,
         "max_new_tokens": 300, "eos_token_id": 2}))
    assert generation_defaults(ModelCard.from_dir(tmp_path)) == {"temperature": 0.2, "top_p": 0.9, "top_k": 50,
                                             "repetition_penalty": 1.05, "max_tokens": 300}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.2, "max_new_tokens": 30}))
    assert generation_defaults(ModelCard.from_dir(tmp_path)) == {"max_tokens": 30}  # greedy by config (no do_sample): no sampling ones
    assert generation_defaults(ModelCard.from_dir(tmp_path / "missing")) == {}


def _events(valid_request):
    lp = [TokenLogprob(token_id=t, logprob=-0.5, top=((t, -0.5), (1, -2.0))) for t in (11, 12, 13)]
    done = Complete(index=0, text="", token_ids=[11, 12, 13], finish_reason=FinishReason.STOP_TOKEN,
                    prompt_tokens=3, seed=1, timing=Timing(), matched_stop_token=13, logprobs=lp,
                    cached_prompt_tokens=2)
    return [[Chunk(0, "", [11], lp[:1]), Chunk(0, "", [12], lp[1:2])], [Chunk(0, "", [13], lp[2:]), done]]


def test_streaming_sends_deltas_and_a_complete_with_the_last_delta(validator):
    v = valid(validator, vpb.GenerateRequest(stream=True, tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]),
                                             sampling_params=vpb.SamplingParams(logprobs=2)))
    writer = VllmWriter(v)
    first, second = (sent(writer, batch) for batch in _events(v))
    (chunk,) = [m.chunk for m in first]
    assert list(chunk.token_ids) == [11, 12] and chunk.completion_tokens == 2 and chunk.prompt_tokens == 3
    assert list(chunk.output_logprobs.token_ids) == [11, 12] and list(chunk.output_logprobs.token_logprobs) == [-0.5] * 2
    assert list(chunk.output_logprobs.top_logprobs[0].token_ids) == [11, 1]
    last, done = second
    assert list(last.chunk.token_ids) == [13] and last.chunk.completion_tokens == 1
    c = done.complete
    assert list(c.output_ids) == [13] and c.finish_reason == "stop" and c.matched_token_id == 13
    assert c.prompt_tokens == 3 and c.cached_tokens == 2 and list(c.output_logprobs.token_ids) == [13]


def test_not_streaming_sends_one_complete_with_every_token(validator):
    v = valid(validator, gen(logprobs=0))
    writer = VllmWriter(v)
    first, second = (sent(writer, batch) for batch in _events(v))
    assert first == [] and len(second) == 1
    c = second[0].complete
    assert list(c.output_ids) == [11, 12, 13] and c.completion_tokens == 3 and c.index == 0
    assert list(c.output_logprobs.token_ids) == [11, 12, 13] and not c.output_logprobs.top_logprobs  # logprobs 0
