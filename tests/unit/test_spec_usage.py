"""Speculative decoding made visible: a sequence's drafted and accepted tokens from its steps to its usage, and the
executor's totals in GetLoad and /metrics under vLLM's spec_decode names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tokenloop.core.executor import ExecutorStats, Step, merge_steps
from tokenloop.core.request import FinishReason, StoppingParams, ValidRequest
from tokenloop.looper.outputs import RequestState
from tokenloop.looper.stream import Complete, RequestStream, Timing
from tokenloop.service.convert import complete_message
from tokenloop.service.metrics import LoadCollector
from tokenloop.v1 import tokenloop_pb2 as pb


def test_merged_steps_keep_the_latest_totals():
    steps = [Step(3, 0, [5], num_draft_tokens=4, num_accepted_draft_tokens=3), Step(3, 0, [6]),
             Step(3, 0, [7, 8], num_draft_tokens=6, num_accepted_draft_tokens=4)]
    (merged,) = merge_steps(steps)
    assert merged.token_ids == [5, 6, 7, 8]
    assert (merged.num_draft_tokens, merged.num_accepted_draft_tokens) == (6, 4)
    (merged,) = merge_steps([Step(3, 0, [5], num_draft_tokens=2, num_accepted_draft_tokens=1), Step(3, 0, [6])])
    assert (merged.num_draft_tokens, merged.num_accepted_draft_tokens) == (2, 1)  # a later step without: unchanged


def _state(tokenizer, **stopping) -> RequestState:
    request = ValidRequest("r", tuple(tokenizer.encode("Hello")), stream=True,
                           stopping=StoppingParams(max_new_tokens=16, **stopping))
    return RequestState(RequestStream(request, on_cancel=lambda _: None), tokenizer, arrival=0.0)


def test_usage_counts_reach_the_complete_on_the_fast_and_the_general_path(tokenizer):
    ids = tokenizer.encode(" world and more")
    for stopping in ({}, {"stop": ("zzz",)}):  # no stop strings: the decode path; with: token by token
        state = _state(tokenizer, **stopping)
        state.apply(Step(1, 0, ids[:1], num_draft_tokens=3, num_accepted_draft_tokens=2), now=0.1)
        state.apply(Step(1, 0, ids[1:2]), now=0.2)
        events = state.apply(Step(1, 0, ids[2:], is_final=True, finish_reason=FinishReason.LENGTH,
                                  num_draft_tokens=5, num_accepted_draft_tokens=2), now=0.3)
        done = events[-1]
        assert isinstance(done, Complete)
        assert (done.draft_tokens, done.accepted_draft_tokens) == (5, 2), stopping


def test_usage_message_carries_the_counts():
    done = Complete(index=0, text="x", token_ids=[1, 2, 3], finish_reason=FinishReason.LENGTH, prompt_tokens=2,
                    seed=0, timing=Timing(),
                    draft_tokens=7, accepted_draft_tokens=5)
    usage = complete_message("r", done, ValidRequest("r", (1, 2))).complete.usage
    assert (usage.completion_tokens, usage.draft_tokens, usage.accepted_draft_tokens) == (3, 7, 5)


def test_stats_rates():
    stats = ExecutorStats(spec_num_drafts=4, spec_num_draft_tokens=10, spec_num_accepted_tokens=6)
    assert stats.spec_acceptance_rate == 0.6
    assert stats.spec_tokens_per_step == 2.5  # 6 accepted over 4 verifications, plus each one's own token
    assert ExecutorStats().spec_acceptance_rate == 0.0 and ExecutorStats().spec_tokens_per_step == 0.0


class _Executor:
    def stats(self):
        return ExecutorStats(spec_num_drafts=4, spec_num_draft_tokens=10, spec_num_accepted_tokens=6,
                             spec_accepted_per_pos=(4, 2))


class _App:
    executor = _Executor()

    def load(self):
        return pb.Load()


def test_metrics_use_vllm_spec_decode_names():
    registry = CollectorRegistry()
    registry.register(LoadCollector(_App()))

    def sample(name, labels=None):
        return registry.get_sample_value(name, labels or {})

    assert sample("tokenloop:spec_decode_num_drafts_total") == 4
    assert sample("tokenloop:spec_decode_num_draft_tokens_total") == 10
    assert sample("tokenloop:spec_decode_num_accepted_tokens_total") == 6
    assert sample("tokenloop:spec_decode_num_accepted_tokens_per_pos_total", {"position": "0"}) == 4
    assert sample("tokenloop:spec_decode_num_accepted_tokens_per_pos_total", {"position": "1"}) == 2
