"""Verifying a draft: which drafted tokens the target model would itself have produced. Small pure functions.

Draftless speculation drafts each token with certainty (the draft distribution q is a point mass), so the standard
rejection rule (accept d with probability min(1, p(d) / q(d)); on rejection draw from max(0, p - q), renormalised)
becomes: accept d with probability p(d); on rejection draw from p with d removed, renormalised. `rejection_step` is
that rule as written.

The engine uses `coupled_step`: draw x from p with the sequence's own generator, exactly as a plain decode step
draws, and accept d when x == d. Its law is the same (P(accept) = p(d); given a rejection, x is distributed as p
without d, renormalised: `tests/unit/test_spec_sampling.py` checks both with a chi-square test over many seeds),
and it gives more: each position's token is the very token speculation off would draw there (torch's draw consumes
the same generator state whatever the probabilities), so a seeded request gives the same text with speculation on
or off, alone or in any batch. The drafts, which depend on the batch through the back-off rule, only decide how
many positions one step verifies. Greedy is the case where p is one-hot at the argmax (`greedy_verify`).

p is the distribution after everything the request applies (the structure's mask, penalties, min_new_tokens,
temperature, top-k, top-p, min-p): the engine samples each verified position with the function that samples a
plain step, on the sequence's state advanced by the drafts accepted before it (`verify_draft`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def verify_draft(draft: Sequence[int], sample_at: Callable[[int], int | None]) -> list[int]:
    """The tokens one verification emits. `sample_at(i)` is the target's token at draft position i, given
    draft[:i] accepted (None: the sequence cannot go on: it ended or failed at i). The target's token is kept at every
    position; the run goes on while it equals the draft, and ends with the first one that differs (a rejection) or
    with the token after the whole draft (the bonus): at least one token, at most len(draft) + 1."""
    out: list[int] = []
    for i in range(len(draft) + 1):
        token = sample_at(i)
        if token is None:
            break
        out.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return out


def num_accepted(draft: Sequence[int], emitted: Sequence[int]) -> int:
    """How many drafted tokens a verification accepted, from what it emitted (`verify_draft`)."""
    n = 0
    while n < len(draft) and n < len(emitted) and emitted[n] == draft[n]:
        n += 1
    return n


def greedy_verify(draft: Sequence[int], target_ids: Sequence[int]) -> list[int]:
    """Greedy verification from the target's argmax at each of the len(draft) + 1 positions: the drafts that equal
    it, then the argmax where they stop (or the bonus)."""
    return verify_draft(draft, lambda i: int(target_ids[i]))


def rejection_step(probs: torch.Tensor, draft_token: int, generator: torch.Generator | None) -> tuple[bool, int]:
    """The rejection rule for a point-mass draft, as written: accept `draft_token` with probability p(token) (one
    uniform draw); on rejection draw from p with it removed, renormalised. probs [V], summing to 1.
    Returns (accepted, the position's token)."""
    u = float(torch.rand((), generator=generator))
    p = float(probs[draft_token])
    if u < p:
        return True, draft_token
    residual = probs.clone()
    residual[draft_token] = 0.0
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator).item())


def coupled_step(probs: torch.Tensor, draft_token: int, generator: torch.Generator | None) -> tuple[bool, int]:
    """The rule the engine uses: the position's token is a plain draw from p (`sampler.draw`'s), accepted when it
    equals `draft_token`. probs [V]. Returns (accepted, the position's token)."""
    token = int(torch.multinomial(probs, 1, generator=generator).item())
    return token == draft_token, token
