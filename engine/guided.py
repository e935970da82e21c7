"""Grammar-constrained rows of a step: fill each one's token bitmask (llguidance), mask its logits, advance it.

Only sequences with a matcher (`Sequence.matcher`, a request with `structured`) are touched; a batch with none costs
one pass over the list. The masks of all constrained rows are filled by llguidance's thread pool (the GIL
released), unpacked in one numpy call and written into the logits in place (numpy), before any sampling step
(penalties, temperature, top-k/p): every token the structure forbids gets -inf.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from llguidance import LLExecutor

from .sequence import Sequence

_executor: LLExecutor | None = None


def _pool() -> LLExecutor:
    global _executor
    if _executor is None:
        _executor = LLExecutor(max(1, os.cpu_count() or 1))  # the model's threads are idle meanwhile
    return _executor


def constrained_rows(seqs: list[Sequence]) -> list[int]:
    return [i for i, seq in enumerate(seqs) if seq.matcher is not None]


def forbidden_tokens(matchers: list, num_words: int, vocab_size: int) -> np.ndarray:
    """bool [R, vocab_size]: True where matcher R forbids the token next (and past its own vocabulary)."""
    bitmask = np.zeros((len(matchers), num_words), dtype=np.int32)  # [R, W], bit set: allowed
    if len(matchers) == 1:
        matchers[0].unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
    else:
        _pool().unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data,
                                        num_words * 4, len(matchers))
    bits = np.unpackbits(np.invert(bitmask).view(np.uint8), axis=1, bitorder="little")  # [R, W * 32], 1: forbidden
    if bits.shape[1] < vocab_size:
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])), constant_values=1)
    return bits[:, :vocab_size].view(np.bool_)


def mask_logits(logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, str]:
    """In place: forbid, in each constrained row of logits [S, V], what its sequence's structure forbids. numpy
    writes the -inf (`copyto` with a mask is several times faster than torch's `masked_fill_` on one thread).
    Returns {row: error} for rows whose matcher could not give a mask (those rows fail alone; the batch is
    computed row by row then, so that one bad matcher does not fail the others)."""
    rows = constrained_rows(seqs)
    if not rows:
        return {}
    grammar = seqs[rows[0]].request.structured.grammar
    try:
        forbidden = forbidden_tokens([seqs[i].matcher for i in rows], grammar.num_mask_words, logits.shape[-1])
    except Exception:  # noqa: BLE001 - find the row(s) at fault
        return _mask_rows_alone(logits, seqs, rows)
    _write_mask(logits, rows, forbidden)
    return {}


def _mask_rows_alone(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> dict[int, str]:
    failures, ok, masks = {}, [], []
    for i in rows:
        grammar = seqs[i].request.structured.grammar
        try:
            masks.append(forbidden_tokens([seqs[i].matcher], grammar.num_mask_words, logits.shape[-1]))
            ok.append(i)
        except Exception as exc:  # noqa: BLE001 - this row's matcher failed: its request fails alone
            failures[i] = f"the structured-output matcher failed: {type(exc).__name__}: {exc}"
    if ok:
        _write_mask(logits, ok, np.concatenate(masks))
    return failures


def _write_mask(logits: torch.Tensor, rows: list[int], forbidden: np.ndarray) -> None:
    if logits.dtype not in (torch.float32, torch.float64):  # no numpy view of this dtype
        with torch.inference_mode():  # the model's logits are an inference tensor
            logits[rows] = logits[rows].masked_fill(torch.from_numpy(forbidden), float("-inf"))
        return
    values = logits.numpy()  # shares memory
    if len(rows) == values.shape[0]:  # every row constrained: one pass
        np.copyto(values, -np.inf, where=forbidden)
        return
    for j, i in enumerate(rows):
        np.copyto(values[i], -np.inf, where=forbidden[j])


def advance(seq: Sequence, token_id: int) -> str | None:
    """Feed the chosen token to `seq`'s matcher; the library's error text when it refused it."""
    matcher = seq.matcher
    if matcher.consume_token(token_id) and not matcher.is_error():
        return None
    return matcher.get_error() or f"the structure does not allow token {token_id}"


def structure_complete(seq: Sequence) -> bool:
    """The structure can take no more tokens (only the end of the sequence may follow)."""
    return seq.matcher is not None and seq.matcher.is_stopped()
