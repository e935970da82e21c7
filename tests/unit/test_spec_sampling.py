"""Verifying drafts: greedy acceptance, the point-mass rejection rule and the coupled draw the engine uses keep the
target distribution (chi-square over many seeds), and the coupled draw is the very token speculation off draws."""

from __future__ import annotations

import math

import pytest
import torch

from tokenloop.engine import sampler
from tokenloop.engine.spec_sampling import (
    coupled_step,
    greedy_verify,
    num_accepted,
    rejection_step,
    verify_draft,
)

NUM_SEEDS = 4000


def chi_square_limit(df: int, z: float = 3.719) -> float:
    """The chi-square quantile for `df` degrees of freedom at the normal quantile z (3.719: p = 1e-4),
    Wilson-Hilferty's approximation (within ~1 % for df >= 3)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: dict[int, int], probs: torch.Tensor, total: int) -> tuple[float, int]:
    """Pearson's statistic of observed `counts` against `probs` [V] over the tokens with p > 0, and its degrees of
    freedom. A token drawn with p == 0 makes it infinite."""
    support = [t for t in range(probs.shape[0]) if probs[t] > 0]
    if any(t not in support for t in counts):
        return math.inf, len(support) - 1
    stat = sum((counts.get(t, 0) - total * float(probs[t])) ** 2 / (total * float(probs[t])) for t in support)
    return stat, len(support) - 1


def target_probs() -> torch.Tensor:
    """A processed distribution: penalties, temperature, top-k, top-p and min-p applied to fixed logits, with
    sampler.py's own functions, as a sampled request's row gets them."""
    logits = torch.tensor([2.0, 1.5, 1.4, 0.9, 0.3, -0.5, 0.8, 1.1, -2.0, 0.0, 0.2, 1.7])
    logits = sampler.apply_penalties(logits, [0, 3], [7], repetition=1.2, presence=0.1, frequency=0.2)
    scaled = sampler.apply_temperature(logits, 0.8)
    scaled = sampler.apply_min_p(sampler.apply_top_p(sampler.apply_top_k(scaled, 8), 0.95), 0.05)
    return scaled.softmax(-1)


def test_verify_draft_keeps_agreeing_tokens_and_ends_at_the_first_disagreement():
    target = [5, 6, 9, 1]
    assert verify_draft([5, 6, 7], lambda i: target[i]) == [5, 6, 9]
    assert verify_draft([5, 6, 9], lambda i: target[i]) == [5, 6, 9, 1]  # all accepted: the bonus token too
    assert verify_draft([4], lambda i: target[i]) == [5]
    assert verify_draft([], lambda i: target[i]) == [5]
    assert verify_draft([5, 6, 9], lambda i: target[i] if i < 2 else None) == [5, 6]  # the sequence ended at 2
    assert num_accepted([5, 6, 7], [5, 6, 9]) == 2
    assert num_accepted([5, 6, 9], [5, 6, 9, 1]) == 3
    assert num_accepted([5, 6], [5]) == 1


def test_greedy_verify_is_the_argmax_run():
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, 0.1], [0.0, 0.5, 0.4]])
    argmax = logits.argmax(-1).tolist()  # [1, 0, 1]
    assert greedy_verify([1, 0], argmax) == [1, 0, 1]
    assert greedy_verify([1, 2], argmax) == [1, 0]
    assert greedy_verify([2, 0], argmax) == [1]


@pytest.mark.parametrize("step", [rejection_step, coupled_step], ids=["rejection", "coupled"])
@pytest.mark.parametrize("draft", [0, 4, 8], ids=["likely", "unlikely", "impossible"])
def test_a_verified_position_keeps_the_target_distribution(step, draft):
    probs = target_probs()
    counts: dict[int, int] = {}
    rejected: dict[int, int] = {}
    accepted = 0
    for seed in range(NUM_SEEDS):
        ok, token = step(probs, draft, torch.Generator().manual_seed(seed))
        counts[token] = counts.get(token, 0) + 1
        if ok:
            accepted += 1
            assert token == draft
        else:
            assert token != draft
            rejected[token] = rejected.get(token, 0) + 1
    stat, df = chi_square(counts, probs, NUM_SEEDS)
    assert stat < chi_square_limit(df), (stat, df, counts)
    p = float(probs[draft])
    assert abs(accepted / NUM_SEEDS - p) < 4 * math.sqrt(max(p * (1 - p), 1e-9) / NUM_SEEDS) + 1e-12
    residual = probs.clone()
    residual[draft] = 0.0
    residual /= residual.sum()
    stat, df = chi_square(rejected, residual, NUM_SEEDS - accepted)  # on rejection: p without the draft
    assert stat < chi_square_limit(df), (stat, df, rejected)


def test_the_coupled_draw_is_the_plain_draw():
    """Each verified position draws what a plain step draws from the same generator state, so a seeded request's
    tokens are the same with speculation on or off: here three positions, the first two drafts accepted or not."""
    rows = [target_probs(), target_probs().flip(0), target_probs().roll(3)]
    for seed in range(200):
        plain_gen = torch.Generator().manual_seed(seed)
        plain = [sampler.draw(row.log(), plain_gen) for row in rows]  # speculation off: one draw a step
        spec_gen = torch.Generator().manual_seed(seed)
        draft = [plain[0], (plain[1] + seed % 2) % rows[0].shape[0]]  # the second draft is wrong half the time
        emitted = verify_draft(draft, lambda i, d=draft, g=spec_gen: coupled_step(rows[i], d[i] if i < len(d) else -1,
                                                                                   g)[1])
        assert emitted == plain[:len(emitted)]
        assert len(emitted) == (3 if seed % 2 == 0 else 2)
