"""Sampling functions: each filter, penalties, min_new_tokens masking, seeded draws, log probabilities."""

from __future__ import annotations

import math

import torch

from tokenloop.core.request import OutputParams, SamplingParams, StoppingParams, ValidRequest
from tokenloop.engine import sampler
from tokenloop.engine.sequence import Sequence

NEG_INF = float("-inf")


def seq_for(prompt=(1, 2), output=(), seed=0, n_index=0, **kw) -> Sequence:
    sampling = {k: kw.pop(k) for k in list(kw) if k in SamplingParams.__slots__}
    stopping = {k: kw.pop(k) for k in list(kw) if k in StoppingParams.__slots__}
    request = ValidRequest("r", tuple(prompt), SamplingParams(seed=seed, **sampling), StoppingParams(**stopping),
                           OutputParams(**kw))
    s = Sequence.from_request(1, n_index, request)
    s.token_ids.extend(output)
    return s


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    assert sampler.apply_top_k(logits, 2).tolist() == [NEG_INF, 4.0, 3.0, NEG_INF]
    assert sampler.apply_top_k(logits, 0).tolist() == logits.tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = sampler.apply_top_p(logits, 0.7).isfinite().tolist()
    assert kept == [True, True, False, False]
    assert sampler.apply_top_p(logits, 0.1).isfinite().tolist() == [True, False, False, False]


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    assert sampler.apply_min_p(logits, 0.2).isfinite().tolist() == [True, True, False, False]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([2.0, -2.0, 2.0, 1.0])
    out = sampler.apply_penalties(logits, prompt_ids=[0], output_ids=[1], repetition=2.0, presence=0.0,
                                  frequency=0.0)
    assert out.tolist() == [1.0, -4.0, 2.0, 1.0]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(4)
    out = sampler.apply_penalties(logits, prompt_ids=[3], output_ids=[1, 1, 2], repetition=1.0, presence=0.5,
                                  frequency=0.25)
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0]


def test_greedy_picks_argmax_and_reports_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    (sample,) = sampler.sample_batch(logits, [seq_for(temperature=0.0, logprobs=True, top_logprobs=2)], (0,))
    assert sample.token_id == 1
    expected = torch.log_softmax(logits[0], -1)
    assert math.isclose(sample.logprob, expected[1].item(), rel_tol=1e-6)
    assert [t for t, _ in sample.top_logprobs] == [1, 3]
    assert math.isclose(sample.top_logprobs[1][1], expected[3].item(), rel_tol=1e-6)


def test_min_new_tokens_masks_eos_and_stop_tokens():
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]])  # eos 1 and stop token 2 are the favourites
    s = seq_for(temperature=0.0, min_new_tokens=1, stop_token_ids=(2,))
    assert sampler.sample_batch(logits, [s], (1,))[0].token_id == 3
    s_done = seq_for(output=[3], temperature=0.0, min_new_tokens=1, stop_token_ids=(2,))
    assert sampler.sample_batch(logits, [s_done], (1,))[0].token_id == 1
    s_ignore = seq_for(temperature=0.0, min_new_tokens=1, ignore_eos=True)
    assert sampler.sample_batch(logits, [s_ignore], (1,))[0].token_id == 1  # EOS is just a token then


def _draws(seed: int, seq_index: int = 0, num: int = 20, **sampling) -> list[int]:
    s = seq_for(seed=seed, n_index=seq_index, **{"temperature": 1.0, **sampling})
    logits = torch.linspace(0, 2, 50)[None, :]
    return [sampler.sample_batch(logits, [s], (0,))[0].token_id for _ in range(num)]


def test_same_seed_same_draws_other_seed_or_sequence_differs():
    assert _draws(5) == _draws(5)
    assert _draws(5) != _draws(6)
    assert _draws(5, seq_index=0) != _draws(5, seq_index=1)


def test_draws_respect_filters():
    assert set(_draws(1, top_k=3)) <= {47, 48, 49}
    assert set(_draws(1, temperature=0.01)) == {49}


def test_a_sequences_draws_do_not_depend_on_its_batch_neighbours():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    alone = seq_for(seed=9)
    alone_tokens = [sampler.sample_batch(logits[1:2], [alone], (0,))[0].token_id for _ in range(10)]
    mid, others = seq_for(seed=9), [seq_for(seed=1), seq_for(seed=2, temperature=0.0)]
    batch_tokens = [sampler.sample_batch(logits[[0, 1, 2]], [others[0], mid, others[1]], (0,))[1].token_id
                    for _ in range(10)]
    assert alone_tokens == batch_tokens


def test_the_largest_api_seed_is_accepted():
    assert len(_draws((1 << 64) - 1, num=3)) == 3


# -- a row that cannot be sampled fails alone ---------------------------------------------------------------------

def test_a_temperature_that_overflows_fails_its_row_and_names_the_value():
    """Validation makes a temperature below 1e-5 greedy; a request that reaches the sampler with one fails alone."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    (failure,) = sampler.sample_batch(logits, [seq_for(seed=1, temperature=1e-45)], (0,))
    assert isinstance(failure, sampler.RowFailure) and failure.invalid
    assert failure.message == ("sampling is impossible at output token 0: `temperature` 1e-45 with these logits "
                               "overflows float32 (penalties: repetition 1); use a larger temperature, or 0 for greedy")


def test_bad_rows_leave_their_neighbours_tokens_unchanged():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 5

    def run(with_bad: bool) -> list[list[int]]:
        good = [seq_for(temperature=0.0), seq_for(seed=3, top_k=10), seq_for(seed=4, top_p=0.9)]
        bad = seq_for(seed=1, temperature=1e-45, repetition_penalty=1e-40)
        seqs = [good[0], bad, good[1], good[2]] if with_bad else good
        rows = logits if with_bad else logits[[0, 2, 3]]
        out = [[] for _ in good]
        for _ in range(10):
            samples = sampler.sample_batch(rows.clone(), seqs, (0,))
            if with_bad:
                assert isinstance(samples.pop(1), sampler.RowFailure)
            for j, s in enumerate(samples):
                out[j].append(s.token_id)
        return out

    assert run(with_bad=True) == run(with_bad=False)


def test_a_repetition_penalty_that_overflows_fails_its_row():
    s = seq_for(prompt=(1, 2, 3), temperature=0.0, repetition_penalty=1e-40)
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0.5]])
    (failure,) = sampler.sample_batch(logits, [s], (0,))
    assert isinstance(failure, sampler.RowFailure) and failure.invalid
    assert failure.message == ("sampling is impossible at output token 0: the penalties (repetition 1e-40, presence 0, "
                               "frequency 0) make the logits non-finite")


def test_no_token_allowed_fails_the_row_greedy_or_sampled():
    """stop_token_ids plus EOS cover the vocabulary while min_new_tokens holds them back: before, a greedy row
    silently took token 0 and a sampled row made torch.multinomial raise for the whole batch."""
    for temperature in (0.0, 0.7):
        s = seq_for(temperature=temperature, min_new_tokens=2, stop_token_ids=(1, 2, 3))
        good = seq_for(temperature=0.0)
        logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]])
        failure, sample = sampler.sample_batch(logits, [s, good], (0,))
        assert isinstance(failure, sampler.RowFailure) and failure.invalid
        assert failure.message == ("no token is allowed at output token 0: `stop_token_ids` and EOS held back by "
                                   "`min_new_tokens` (2) forbid every token")
        assert sample.token_id == 1


def test_non_finite_model_logits_fail_the_row_as_internal():
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 3.0, 1.0], [float("inf"), 0.0, 0.0]])
    a, b, c = sampler.sample_batch(logits, [seq_for(temperature=0.0), seq_for(temperature=0.0), seq_for(seed=1)], (0,))
    for failure in (a, c):
        assert isinstance(failure, sampler.RowFailure) and not failure.invalid
        assert failure.message == "the model produced non-finite logits for this request"
    assert b.token_id == 1


def test_an_exception_in_one_row_fails_that_row_only(monkeypatch):
    real_draw = sampler.draw

    def draw(logits, generator):
        if generator.initial_seed() == 7 * 1_000_003:  # the row seeded 7 (seq_index 0)
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real_draw(logits, generator)

    monkeypatch.setattr(sampler, "draw", draw)
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    failure, sample = sampler.sample_batch(logits, [seq_for(seed=7), seq_for(temperature=0.0)], (0,))
    assert isinstance(failure, sampler.RowFailure) and not failure.invalid
    assert failure.message.startswith("sampling failed: RuntimeError: probability tensor")
    assert sample.token_id == 1


def test_greedy_takes_the_first_of_equal_maxima_as_torch_argmax_does():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -1.0, -2.0]])
    samples = sampler.sample_batch(logits, [seq_for(temperature=0.0) for _ in range(3)], (99,))
    assert [s.token_id for s in samples] == [1, 0, 0] == logits.argmax(-1).tolist()


# -- the plain-greedy fast path ------------------------------------------------------------------------------------

def test_plain_greedy_from_names_the_rows_that_are_their_argmax():
    """Sequence.argmax_from (sequence.plain_greedy_from): from which output length a row is sampled by its argmax
    alone; None whenever sample_row would change or report anything."""
    assert seq_for(temperature=0.0).argmax_from == 0  # EOS is never held back without min_new_tokens
    assert seq_for(temperature=0.0, min_new_tokens=3).argmax_from == 3  # EOS held back until 3 tokens
    assert seq_for(temperature=0.0, min_new_tokens=3, ignore_eos=True).argmax_from == 0  # nothing held back
    assert seq_for(temperature=0.0, min_new_tokens=3, ignore_eos=True, stop_token_ids=(7,)).argmax_from == 3
    for kw in (dict(temperature=0.7), dict(repetition_penalty=1.1), dict(presence_penalty=0.5),
               dict(frequency_penalty=0.5), dict(logprobs=True), dict(top_logprobs=2)):
        assert seq_for(**{"temperature": 0.0, **kw}).argmax_from is None, kw
    assert Sequence(1, 0, [1, 2], 2).argmax_from is None  # built by hand: the general path


def test_the_fast_path_gives_what_the_general_path_gives(monkeypatch):
    """Plain greedy rows (ties, NaN, +inf, all -inf, min_new_tokens before and after) sampled with the fast path
    and with it switched off (argmax_from None: sample_row for every row) give the same samples and failures."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [0.0, nan, 5.0, 1.0], [1.0, inf, 0.0, 0.0], [-inf, -inf, -inf, -inf],
                           [0.0, 9.0, 8.0, 1.0], [0.0, 9.0, 8.0, 1.0], [3.0, -1.0, 3.0, 2.0], [0.5, 0.25, 1.0, 1.0]])

    def seqs() -> list[Sequence]:
        return [seq_for(temperature=0.0) for _ in range(4)] + [
            seq_for(temperature=0.0, min_new_tokens=1, stop_token_ids=(2,)),  # holds back EOS 1 and stop token 2
            seq_for(output=[3], temperature=0.0, min_new_tokens=1, stop_token_ids=(2,)),  # no longer
            seq_for(temperature=0.0, logprobs=True), seq_for(seed=5)]

    fast_seqs, slow_seqs = seqs(), seqs()
    assert [s.argmax_from for s in fast_seqs] == [0, 0, 0, 0, 1, 1, None, None]
    for s in slow_seqs:
        s.argmax_from = None
    rows = []
    real = sampler.sample_row
    monkeypatch.setattr(sampler, "sample_row", lambda raw, seq, *a: rows.append(seq) or real(raw, seq, *a))
    fast = sampler.sample_batch(logits.clone(), fast_seqs, (1,))
    assert [fast_seqs.index(s) for s in rows] == [1, 2, 3, 4, 6, 7]  # rows 0 and 5 took the fast path
    slow = sampler.sample_batch(logits.clone(), slow_seqs, (1,))
    assert fast == slow
    assert [getattr(s, "token_id", None) for s in fast] == [1, None, None, None, 3, 1, 0, fast[7].token_id]
    assert [s.invalid for s in fast[1:4]] == [False, False, False]  # non-finite logits: INTERNAL
