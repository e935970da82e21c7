"""Next-token choice: small pure functions over logits, and `sample_batch` that applies them per sequence.

Order: the structure's mask (guided.py, `structured` requests only) -> penalties -> min_new_tokens mask ->
(log probabilities reported here) -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> a draw from the
sequence's own torch.Generator. Each
sampled sequence draws exactly one number per step from its own generator, so a seed gives the same
tokens whatever else shares the batch.

A row whose values cannot be sampled (no token allowed, or logits that overflow or are NaN) fails alone: it gets
a `RowFailure` that says why, and every other row of the batch is sampled exactly as it would have been.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from . import guided
from .sequence import Sequence

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Sample:
    """One sequence's new token and, when asked, its log probability and the top alternatives."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class RowFailure:
    """A sequence that could not be sampled this step; `invalid` when its own values explain it (the request
    then fails with INVALID_ARGUMENT, else INTERNAL). Its request fails; no other row is affected."""

    message: str
    invalid: bool = True


def apply_penalties(logits: torch.Tensor, prompt_ids: list[int], output_ids: list[int], repetition: float,
                    presence: float, frequency: float) -> torch.Tensor:
    """logits [V]. Repetition (HF/CTRL) over prompt and output tokens; presence/frequency (OpenAI) over output."""
    logits = logits.clone()
    if repetition != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        if seen.numel():
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / repetition, picked * repetition)
    if (presence or frequency) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=logits.shape[-1])
        counts = counts[:logits.shape[-1]].to(logits.dtype)
        logits -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature


def apply_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` largest logits (0 or >= V: keep all). logits [V]."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches `top_p` (always >= 1)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = sorted_logits.softmax(-1)
    drop_sorted = probs.cumsum(-1) - probs > top_p  # mass before this token already reaches top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` times the most likely token's."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def draw(logits: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from softmax(logits), using `generator`'s stream."""
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())


def top_alternatives(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The `k` most likely (token id, log probability) pairs, best first, leaving out impossible ones (a structure
    or min_new_tokens can leave fewer than `k` possible tokens). logprobs [V]."""
    values, ids = torch.topk(logprobs, k)
    return [(t, v) for t, v in zip(ids.tolist(), values.tolist()) if v != float("-inf")]


def _banned_ids(seq: Sequence, eos_token_ids: tuple[int, ...]) -> list[int]:
    """Tokens that may not end the sequence yet (min_new_tokens); with a structure, EOS under ignore_eos too. A
    structure that is complete allows only EOS: nothing is banned then (the sequence ends at once)."""
    stopping = seq.request.stopping
    constrained = seq.matcher is not None
    if constrained and seq.matcher.is_stopped():
        return []
    banned = list(eos_token_ids) if constrained and stopping.ignore_eos else []
    if seq.num_output_tokens >= stopping.min_new_tokens:
        return banned
    banned.extend(stopping.stop_token_ids)
    if not stopping.ignore_eos:
        banned.extend(eos_token_ids)
    return banned


def _process(row: torch.Tensor, seq: Sequence, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    sampling = seq.request.sampling
    if sampling.repetition_penalty != 1.0 or sampling.presence_penalty or sampling.frequency_penalty:
        row = apply_penalties(row, seq.token_ids[:seq.num_prompt_tokens], seq.output_token_ids,
                              sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty)
    banned = [i for i in _banned_ids(seq, eos_token_ids) if i < row.shape[-1]]
    if banned:
        row = row.clone()
        row[banned] = float("-inf")
    return row


def _unsamplable(raw: torch.Tensor, row: torch.Tensor, seq: Sequence, after_temperature: bool) -> RowFailure:
    """Why `row` (`raw` after the request's rules) has no finite maximum: no token allowed, or non-finite values."""
    sampling, stopping = seq.request.sampling, seq.request.stopping
    if bool(raw.isnan().any()) or bool(raw.isposinf().any()):
        return RowFailure("the model produced non-finite logits for this request", invalid=False)
    if not bool(torch.isfinite(raw).any()):  # raw carries the structure's mask
        if seq.matcher is not None:
            error = seq.matcher.get_error() if seq.matcher.is_error() else ""
            return RowFailure("the `structured` constraint allows no token at output token "
                              f"{seq.num_output_tokens}" + (f": {error}" if error else ""))
        return RowFailure("the model produced non-finite logits for this request", invalid=False)
    at = f"at output token {seq.num_output_tokens}"
    if not bool(torch.isfinite(row).any()) and not bool(row.isnan().any()):  # every token -inf
        rules = []
        if seq.matcher is not None:
            rules.append("the `structured` constraint")
        if seq.num_output_tokens < stopping.min_new_tokens and (stopping.stop_token_ids or not stopping.ignore_eos):
            rules.append(f"`stop_token_ids`{'' if stopping.ignore_eos else ' and EOS'} held back by "
                         f"`min_new_tokens` ({stopping.min_new_tokens})")
        if sampling.repetition_penalty != 1.0 or sampling.presence_penalty or sampling.frequency_penalty:
            rules.append(f"the penalties (repetition {sampling.repetition_penalty:g}, presence "
                         f"{sampling.presence_penalty:g}, frequency {sampling.frequency_penalty:g})")
        return RowFailure(f"no token is allowed {at}: {' with '.join(rules) or 'the request rules'} forbid every token")
    if after_temperature:
        return RowFailure(f"sampling is impossible {at}: `temperature` {sampling.temperature:g} with these logits "
                          f"overflows float32 (penalties: repetition {sampling.repetition_penalty:g}); use a larger "
                          "temperature, or 0 for greedy")
    return RowFailure(f"sampling is impossible {at}: the penalties (repetition {sampling.repetition_penalty:g}, "
                      f"presence {sampling.presence_penalty:g}, frequency {sampling.frequency_penalty:g}) make the "
                      "logits non-finite")


FLOAT32_MAX = torch.finfo(torch.float32).max


def sample_row(raw: torch.Tensor, seq: Sequence, eos_token_ids: tuple[int, ...], raw_max: float | None = None,
               greedy_id: int | None = None) -> Sample | RowFailure:
    """The next token of one sequence from its logits `raw` [V], or why it has none. `raw_max` and `greedy_id`
    are raw's maximum and argmax when the caller has them (one batched `max` serves every row's check)."""
    row = _process(raw, seq, eos_token_ids)  # the same tensor when nothing applies
    sampling, output = seq.request.sampling, seq.request.output
    row_max = raw_max if row is raw and raw_max is not None else float(row.max())
    if not math.isfinite(row_max):  # NaN, +inf, or every token -inf
        return _unsamplable(raw, row, seq, after_temperature=False)
    if sampling.greedy:
        token = greedy_id if row is raw and greedy_id is not None else int(row.argmax())
    else:
        # top-k / top-p / min-p keep the best token, so the scaled row is usable iff its maximum is finite
        if not abs(row_max / sampling.temperature) < FLOAT32_MAX:
            return _unsamplable(raw, row, seq, after_temperature=True)
        scaled = apply_temperature(row, sampling.temperature)
        scaled = apply_min_p(apply_top_p(apply_top_k(scaled, sampling.top_k), sampling.top_p), sampling.min_p)
        token = draw(scaled, seq.generator)
    sample = Sample(token)
    if output.logprobs or output.top_logprobs:
        logprobs = row.log_softmax(-1)
        sample.logprob = float(logprobs[token])
        if output.top_logprobs:
            sample.top_logprobs = top_alternatives(logprobs, output.top_logprobs)
    return sample


def sample_batch(logits: torch.Tensor, seqs: list[Sequence],
                 eos_token_ids: tuple[int, ...]) -> list[Sample | RowFailure]:
    """Choose the next token of each sequence. logits [S, V] float32, row i belongs to seqs[i]; the rows of
    `structured` sequences are masked in place. A row that cannot be sampled gets a RowFailure, alone."""
    failures = guided.mask_logits(logits, seqs)  # row -> error where a structure's matcher failed
    # one batched argmax serves every unmodified row, in numpy: torch's max(-1) with indices takes ~45 us a row of
    # 49152 here, numpy ~6 (both give the first of equal maxima and propagate NaN). The value at the argmax is the
    # row's maximum (the first NaN where there is one), with no second pass over the logits
    values = (logits.detach() if logits.requires_grad else logits).numpy()
    out: list[Sample | RowFailure] = []
    for i, (seq, token) in enumerate(zip(seqs, values.argmax(-1).tolist())):
        if i in failures:
            out.append(RowFailure(failures[i], invalid=False))
            continue
        best = values.item(i, token)
        first = seq.argmax_from
        if first is not None and len(seq.token_ids) - seq.num_prompt_tokens >= first and -math.inf < best < math.inf:
            out.append(Sample(token))  # a plain greedy row: what sample_row gives it, with no row tensor
            continue
        try:
            out.append(sample_row(logits[i], seq, eos_token_ids, best, token))
        except Exception as exc:  # noqa: BLE001 - one row's failure must not fail its neighbours
            log.exception("sampling failed for request %d", seq.executor_id)
            out.append(RowFailure(f"sampling failed: {type(exc).__name__}: {exc}", invalid=False))
    return out
