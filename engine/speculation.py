"""Draftless speculative decoding: what to draft, how much, and when not to. Plain Python, no tensors.

A sequence that decodes may propose a few tokens that its own text suggests come next (**prompt lookup**: the last
n tokens of prompt + output occurred before, so draft what followed them; vLLM's `ngram` method, llama.cpp's
`ngram-simple`). The engine step then computes the sequence's last token and its K drafted tokens as one chunk of
K+1 rows, and keeps the drafts the target model itself would have produced (spec_sampling.py): one read of the
weights yields up to K+1 tokens, at no change to the output.

Three rules keep it from ever costing more than it gives:

- `NgramIndex`: n from `prompt_lookup_max` down to `prompt_lookup_min` (the longest match wins; among equal
  lengths, the most recent occurrence, whose continuation is the freshest text; a continuation that reaches the
  end of the text repeats itself, so a cycle drafts all k tokens), kept up to date as tokens are appended, so a
  lookup is a few dictionary reads, not a scan of the sequence.
- `DraftLength`: per sequence, the draft length that maximises expected tokens per unit of step cost, from the
  sequence's recent acceptance; 0 (no draft) when drafting does not pay, with an occasional one-token probe so that
  a sequence whose text turns repetitive gets speculation back.
- `SpeculativeConfig.max_batch_size`: a step with more decoding sequences than this drafts nothing: it is
  compute-bound, so extra rows cost what they would save (vLLM's `disable_by_batch_size`, TensorRT-LLM's
  `max_concurrency`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

SPECULATIVE_MODES = ("off", "ngram")
DEFAULT_ROW_COST = 0.15  # a verification row's cost, as a share of a one-row step, where nothing was timed
ROW_COST_RANGE = (0.02, 0.95)  # a measured row cost is clamped to this (timing noise must not make rows free)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """The embedded engine's speculation settings (`--speculative`, `--num-speculative-tokens`); checks itself."""

    mode: str = "off"  # off | ngram (prompt lookup)
    num_speculative_tokens: int = 4  # K: the most tokens one sequence drafts in one step
    prompt_lookup_max: int = 4  # the longest n-gram matched against the sequence's earlier text
    prompt_lookup_min: int = 2  # the shortest (1 matches any repeated token: many wrong drafts)
    max_batch_size: int = 4  # more decoding sequences than this in a step: no drafts (the step is compute-bound)
    # the cost of one more verified row in a step of one decoding sequence, as a fraction of that step (weights
    # read once either way; the rows' arithmetic, attention and lm_head are what grows); sets when drafting pays.
    # The engine measures it at start-up (with_measured_row_cost); DEFAULT_ROW_COST where nothing was timed
    row_cost: float = DEFAULT_ROW_COST
    row_cost_source: str = "assumed"  # how row_cost was set, for the start-up log

    def __post_init__(self):
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative mode must be one of {', '.join(SPECULATIVE_MODES)}, got {self.mode!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError("prompt lookup n-gram sizes must satisfy 1 <= min <= max <= 16, got "
                             f"min {self.prompt_lookup_min}, max {self.prompt_lookup_max}")
        if self.max_batch_size < 1:
            raise ValueError(f"speculative max_batch_size must be >= 1, got {self.max_batch_size}")
        if not 0.0 < self.row_cost < 1.0:
            raise ValueError(f"speculative row_cost must be in (0, 1), got {self.row_cost}")

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def describe(self) -> str:
        """The start-up log's words for it."""
        if not self.enabled:
            return "speculative decoding off"
        return (f"speculative decoding ngram (prompt lookup, n {self.prompt_lookup_max}..{self.prompt_lookup_min}, "
                f"up to {self.num_speculative_tokens} tokens, adaptive per sequence, off above "
                f"{self.max_batch_size} decoding sequences; a verified row costs {self.row_cost:.2f} of a one-row "
                f"step, {self.row_cost_source}; drafting pays from acceptance {break_even_acceptance(self.row_cost):.2f})")

    def with_measured_row_cost(self, measured: tuple[float, float, int, str] | None) -> SpeculativeConfig:
        """This config with row_cost from a product timed at one row and at several: (seconds for 1 row, seconds
        for n rows, n, what was timed), as matmul.MatmulPolicy.row_timing gives it; unchanged for None."""
        if measured is None:
            return self
        one, several, num_rows, what = measured
        return replace(self, row_cost=row_cost_from_times(one, several, num_rows),
                       row_cost_source=f"measured at start-up ({what}: {one * 1e3:.2f} ms for 1 row, "
                                       f"{several * 1e3:.2f} ms for {num_rows})")


def row_cost_from_times(one_row_s: float, rows_s: float, num_rows: int) -> float:
    """The cost of each row past the first as a share of a one-row step, from a product timed at 1 and at `num_rows`
    rows: (t_n / t_1 - 1) / (n - 1), clamped to ROW_COST_RANGE. The products are most of a step and what grows
    with its rows (attention and the lm_head grow too; norms, sampling and the step's overhead do not)."""
    if one_row_s <= 0 or rows_s <= 0 or num_rows < 2:
        return DEFAULT_ROW_COST
    low, high = ROW_COST_RANGE
    return min(high, max(low, (rows_s / one_row_s - 1.0) / (num_rows - 1)))


def break_even_acceptance(row_cost: float) -> float:
    """The acceptance rate from which a one-token draft pays: (1 + a) / (1 + row_cost) > 1, so a > row_cost."""
    return row_cost


def drafting_allowed(num_decoding: int, config: SpeculativeConfig) -> bool:
    """Whether any sequence drafts in a step where `num_decoding` sequences decode (the batch back-off rule)."""
    return config.enabled and 0 < num_decoding <= config.max_batch_size


class NgramIndex:
    """For each n in min_n..max_n, where each n-gram of a token list last occurred: n-gram -> the position right
    after it (its continuation). Indexed incrementally: `update` reads only the tokens appended since its last call."""

    __slots__ = ("max_n", "min_n", "num_indexed", "tables")

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.num_indexed = 0  # tokens[:num_indexed] are indexed (every n-gram with a continuation inside them)

    def update(self, tokens: list[int]) -> None:
        """Index every n-gram that at least one token follows. The n-gram ending at the last token is not indexed
        yet: it is what a lookup asks for."""
        if len(tokens) < self.num_indexed:  # the list was replaced by a shorter one: start again
            self.tables = {n: {} for n in self.tables}
            self.num_indexed = 0
        for start in range(max(self.num_indexed, 1), len(tokens)):  # `start`: where a continuation begins
            for n, table in self.tables.items():
                if start >= n:
                    table[tuple(tokens[start - n:start])] = start
        self.num_indexed = len(tokens)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """`k` tokens that followed the most recent earlier occurrence of the longest suffix of `tokens` (max_n
        down to min_n tokens) that occurred before; [] when none did. A continuation that runs into the end of
        `tokens` goes on copying itself (the text repeats with period len(tokens) - start: a run of one token, or a
        cycle of a few, drafts k tokens, not the few left before the end)."""
        if k <= 0:
            return []
        self.update(tokens)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self.tables[n].get(tuple(tokens[-n:]))
            if start is not None:
                draft = tokens[start:start + k]
                period = len(tokens) - start
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
        return []


@dataclass(slots=True)
class DraftLength:
    """One sequence's draft length, from its recent acceptance.

    Acceptance is modelled as geometric: each drafted position is accepted with probability `a` given the ones before
    it were. `a` is estimated from decayed counts (accepted positions over accepted positions plus rejections, the
    maximum-likelihood estimate for that model). A draft of k tokens then yields E(k) = 1 + a + ... + a^k tokens for
    a step that costs 1 + row_cost * k; `next` picks the k in 0..max_k with the most tokens per cost. When that is 0
    the sequence drafts nothing for `backoff` steps, then probes with one token (the back-off doubles, up to
    MAX_BACKOFF, while probes keep failing).
    """

    max_k: int
    row_cost: float
    accepted: float = 1.5  # prior: a = 0.75 before any evidence (optimistic: a first draft is cheap to try)
    rejected: float = 0.5
    decay: float = 0.8  # per verification: the last ~5 verifications weigh most
    backoff: int = 0  # steps left without drafting
    next_backoff: int = 4
    MAX_BACKOFF = 64

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def best_length(self) -> int:
        """The k in 0..max_k that maximises E(k) / (1 + row_cost * k) at the current acceptance estimate."""
        a = self.acceptance
        best_k, best, expected, power = 0, 1.0, 1.0, 1.0
        for k in range(1, self.max_k + 1):
            power *= a
            expected += power
            value = expected / (1.0 + self.row_cost * k)
            if value > best:
                best_k, best = k, value
        return best_k

    def next(self) -> int:
        """How many tokens to draft this step (0: none). Counts a step of back-off when it says 0."""
        if self.backoff > 0:
            self.backoff -= 1
            return 1 if self.backoff == 0 else 0  # the last step of a back-off probes with one token
        k = self.best_length()
        if k == 0:
            self.backoff = self.next_backoff
            self.next_backoff = min(self.next_backoff * 2, self.MAX_BACKOFF)
        return k

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """A verification of `num_drafted` tokens accepted the first `num_accepted`."""
        if num_drafted <= 0:
            return
        self.accepted = self.accepted * self.decay + num_accepted
        self.rejected = self.rejected * self.decay + (1 if num_accepted < num_drafted else 0)
        if num_accepted == num_drafted:
            self.next_backoff = 4  # drafting pays again: a later back-off starts short


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation: its n-gram index, its draft length, and its totals (usage)."""

    index: NgramIndex
    length: DraftLength
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @classmethod
    def for_config(cls, config: SpeculativeConfig) -> SpecState:
        return cls(NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max),
                   DraftLength(config.num_speculative_tokens, config.row_cost))

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """The draft for this step (at most `limit` tokens: what the step's budget and the request's
        max_new_tokens leave); [] when the sequence does not draft now or its text suggests nothing."""
        k = min(self.length.next(), limit)
        return self.index.propose(tokens, k) if k > 0 else []

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.length.record(num_drafted, num_accepted)
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted


@dataclass(slots=True)
class SpecStats:
    """The engine's totals since start (vLLM's spec_decode counters): verifications with a draft, drafted and
    accepted tokens, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted tokens, 0 to 1."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_draft(self) -> float:
        """Tokens one verification of a draft yields on average: its accepted drafts plus the target's own token
        (vLLM's mean acceptance length); 0 before any draft."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
