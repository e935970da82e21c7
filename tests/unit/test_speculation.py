"""The draftless proposer (prompt lookup), each sequence's adaptive draft length and the batch back-off rule."""

from __future__ import annotations

import random

import pytest

from tokenloop.engine.calibration import BUCKETS
from tokenloop.engine.matmul import Backend, MatmulPolicy
from tokenloop.engine.quant_routes import candidate_name
from tokenloop.engine.speculation import (
    DEFAULT_ROW_COST,
    ROW_COST_RANGE,
    DraftLength,
    NgramIndex,
    SpecState,
    SpecStats,
    SpeculativeConfig,
    drafting_allowed,
    row_cost_from_times,
)


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: the longest suffix (max_n..min_n) that occurred earlier with a token after it; its most
    recent such occurrence's continuation, copying on past the end (the text as periodic from there)."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - 1, n - 1, -1):  # `start`: where the continuation begins, < len(tokens)
            if tokens[start - n:start] == suffix:
                extended = list(tokens)
                while len(extended) < start + k:
                    extended.append(extended[len(extended) - (len(tokens) - start)])
                return extended[start:start + k]
    return []


def test_a_repeated_span_drafts_what_followed_it():
    index = NgramIndex(2, 4)
    passage = [10, 11, 12, 13, 14, 15, 16]
    tokens = [1, 2] + passage + [3] + passage[:3]  # the output starts copying the passage
    assert index.propose(tokens, 3) == [13, 14, 15]
    # past the end of what is known, the matched span repeats: 13 14 15 16 3 10 11 12 | 13 14
    assert index.propose(tokens, 10) == [13, 14, 15, 16, 3, 10, 11, 12, 13, 14]


def test_the_longest_suffix_wins_and_then_the_most_recent_occurrence():
    index = NgramIndex(1, 3)
    # "7 8" occurs twice: after "5 7 8" (-> 1) and after "6 7 8" (-> 2); the suffix "6 7 8" matches only the second
    tokens = [5, 7, 8, 1, 6, 7, 8, 2, 6, 7, 8]
    assert index.propose(tokens, 1) == [2]
    # with only 2-grams, the most recent "7 8" wins
    assert NgramIndex(1, 2).propose(tokens, 1) == [2]
    assert NgramIndex(1, 2).propose([7, 8, 1, 7, 8, 3, 7, 8], 1) == [3]


def test_no_match_drafts_nothing_and_min_n_is_respected():
    assert NgramIndex(2, 4).propose([1, 2, 3, 4, 5], 4) == []
    assert NgramIndex(2, 4).propose([1, 2, 3, 1], 4) == []  # a 1-gram match is below min_n
    assert NgramIndex(1, 4).propose([1, 2, 3, 1], 4) == [2, 3, 1, 2]
    assert NgramIndex(1, 4).propose([1, 2, 3], 0) == []


def test_a_run_or_a_cycle_drafts_k_tokens_of_itself():
    assert NgramIndex(2, 3).propose([9, 4, 4, 4, 4], 3) == [4, 4, 4]  # "4 4 4" last seen followed by the final 4
    assert NgramIndex(1, 1).propose([4, 4], 3) == [4, 4, 4]
    assert NgramIndex(2, 2).propose([7, 1, 2, 3, 1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]


@pytest.mark.parametrize("seed", range(30))
def test_incremental_index_equals_the_definition(seed):
    rng = random.Random(seed)
    index = NgramIndex(2, 4)
    tokens = [rng.randrange(6) for _ in range(5)]
    for _ in range(60):  # tokens appended one or several at a time, looked up after each
        tokens += [rng.randrange(6) for _ in range(rng.choice((1, 1, 3)))]
        assert index.propose(tokens, 4) == brute_force(tokens, 4, 2, 4), tokens


def test_a_shorter_token_list_rebuilds_the_index():
    index = NgramIndex(2, 2)
    assert index.propose([1, 2, 3, 1, 2], 1) == [3]
    assert index.propose([5, 6, 5], 1) == []  # replaced by a different, shorter list: nothing stale is found
    assert index.propose([5, 6, 5, 6], 1) == [5]


def test_draft_length_grows_with_acceptance_and_stops_when_it_does_not_pay():
    length = DraftLength(max_k=5, row_cost=0.15)
    assert length.next() >= 2  # optimistic prior
    for _ in range(10):
        length.record(5, 5)
    assert length.acceptance > 0.9 and length.next() == 5
    for _ in range(20):  # the strong history fades: ~10 verifications of rejections stop the drafting
        length.record(3, 0)
    assert length.acceptance < 0.15
    assert length.best_length() == 0
    assert length.next() == 0  # starts a back-off


def test_break_even_acceptance_is_the_row_cost():
    """E(1) / cost(1) = (1 + a) / (1 + c) > 1 exactly when a > c: one draft pays when its acceptance beats its cost."""
    for a, want in ((0.10, 0), (0.20, 1)):
        length = DraftLength(max_k=1, row_cost=0.15, accepted=a * 100, rejected=(1 - a) * 100)
        assert length.best_length() == want


def test_the_row_cost_is_measured_from_the_calibration_and_sets_the_draft_length():
    """The calibration's times of the chosen routes at 1 and 4 rows give the cost per extra row; with this CPU's
    x22-avx2 figures (6.3 ms one row, 14.9 ms four) a row costs ~0.46 of a step, so an acceptance of 0.4 that pays
    under the assumed 0.15 does not pay, and a high one drafts fewer tokens."""
    policy = MatmulPolicy(dict.fromkeys(BUCKETS, Backend.TORCH))
    chosen, split = policy.route(1)
    route = candidate_name(chosen.name, split)
    policy.timings = {1: {route: 6.3e-3, "faster-but-not-chosen/2t": 1e-3}, 4: {route: 14.9e-3}}
    assert policy.row_timing() == (6.3e-3, 14.9e-3, 4, route)
    assumed = SpeculativeConfig(mode="ngram")
    measured = assumed.with_measured_row_cost(policy.row_timing())
    assert measured.row_cost == pytest.approx((14.9 / 6.3 - 1) / 3)
    assert "measured at start-up" in measured.describe() and "0.46 of a one-row step" in measured.describe()
    assert "assumed" in assumed.describe()

    def decision(config, acceptance):
        return DraftLength(config.num_speculative_tokens, config.row_cost, accepted=acceptance * 100,
                           rejected=(1 - acceptance) * 100).best_length()
    assert decision(assumed, 0.4) >= 1 and decision(measured, 0.4) == 0
    assert decision(assumed, 0.9) == 4 and decision(measured, 0.9) == 3
    assert decision(measured, 0.99) == 4


def test_a_row_cost_without_timings_or_out_of_range_is_assumed_or_clamped():
    policy = MatmulPolicy(dict.fromkeys(BUCKETS, Backend.TORCH))  # float weights: no route timings
    assert policy.row_timing() is None
    policy.timings = {1: {"torch/1t": 6.3e-3}, 4: {"torch/1t": 14.9e-3}}
    assert policy.row_timing() is not None
    policy.timed_under_load = True  # a provisional calibration: its ratio is the other processes' noise
    assert policy.row_timing() is None
    config = SpeculativeConfig(mode="ngram")
    assert config.with_measured_row_cost(None) is config and config.row_cost == DEFAULT_ROW_COST
    assert row_cost_from_times(1.0, 1.0, 4) == ROW_COST_RANGE[0]  # noise: four rows no slower than one
    assert row_cost_from_times(1.0, 9.0, 4) == ROW_COST_RANGE[1]  # rows dearer than a step each: still < 1
    assert row_cost_from_times(0.0, 1.0, 4) == DEFAULT_ROW_COST


def test_a_back_off_probes_with_one_token_and_doubles_while_probes_fail():
    length = DraftLength(max_k=4, row_cost=0.15, accepted=0.0, rejected=10.0)
    says = [length.next() for _ in range(5)]
    assert says == [0, 0, 0, 0, 1]  # 4 steps of back-off, the last a one-token probe
    length.record(1, 0)
    says = [length.next() for _ in range(9)]
    assert says == [0] * 8 + [1]  # the next back-off is twice as long
    for _ in range(200):
        length.next()
    assert length.next_backoff == DraftLength.MAX_BACKOFF


def test_a_probe_that_is_accepted_brings_drafting_back():
    length = DraftLength(max_k=4, row_cost=0.15, accepted=0.0, rejected=3.0)
    while length.next() != 1:
        pass
    for _ in range(6):
        length.record(1, 1)
    assert length.next() >= 2
    assert length.next_backoff == 4


def test_batch_back_off_rule():
    on = SpeculativeConfig(mode="ngram", max_batch_size=4)
    assert drafting_allowed(1, on) and drafting_allowed(4, on)
    assert not drafting_allowed(5, on)
    assert not drafting_allowed(0, on)
    assert not drafting_allowed(1, SpeculativeConfig())  # off


def test_spec_state_respects_the_limit_and_keeps_totals():
    state = SpecState.for_config(SpeculativeConfig(mode="ngram", num_speculative_tokens=4))
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    assert state.propose(tokens, limit=2) == [3, 4]
    assert state.propose(tokens, limit=0) == []
    state.record(4, 3)
    state.record(2, 2)
    assert (state.num_draft_tokens, state.num_accepted_tokens) == (6, 5)


def test_stats_count_drafts_tokens_and_positions():
    stats = SpecStats()
    stats.observe(4, 2)
    stats.observe(2, 2)
    stats.observe(0, 0)  # no draft: not a verification
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.accepted_per_pos == [2, 2, 0, 0]
    assert stats.acceptance_rate == pytest.approx(4 / 6)
    assert stats.tokens_per_draft == pytest.approx(3.0)
    assert SpecStats().tokens_per_draft == 0.0 and SpecStats().acceptance_rate == 0.0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "eagle"}, "speculative mode must be one of off, ngram, got 'eagle'"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be in 1..16, got 0"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens must be in 1..16, got 17"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "1 <= min <= max <= 16, got min 3, max 2"),
    ({"max_batch_size": 0}, "speculative max_batch_size must be >= 1, got 0"),
    ({"row_cost": 0.0}, r"speculative row_cost must be in \(0, 1\), got 0.0"),
])
def test_config_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**kwargs)


def test_config_describes_itself_for_the_start_up_log():
    assert SpeculativeConfig().describe() == "speculative decoding off"
    text = SpeculativeConfig(mode="ngram", num_speculative_tokens=5).describe()
    assert text.startswith("speculative decoding ngram") and "up to 5 tokens" in text
