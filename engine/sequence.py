"""One generated sequence: its tokens, how many have K/V in the cache, its blocks and its RNG."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from tokenloop.core.request import EmbedParams, FinishReason, ValidRequest

_seq_ids = itertools.count()


def plain_greedy_from(request: ValidRequest) -> int | None:
    """How many output tokens a sequence of `request` has before each next token is the plain argmax of its logits
    (sampler.sample_row changes nothing in the row then): greedy, no penalty, no log probabilities, no structure;
    min_new_tokens holds back stop tokens and EOS until then. None: never."""
    sampling, output = request.sampling, request.output
    if not sampling.greedy or sampling.repetition_penalty != 1.0 or sampling.presence_penalty or \
            sampling.frequency_penalty or output.logprobs or output.top_logprobs or request.structured is not None \
            or request.embed is not None:
        return None
    stopping = request.stopping
    return stopping.min_new_tokens if stopping.stop_token_ids or not stopping.ignore_eos else 0


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(eq=False, slots=True)
class Sequence:
    """Prompt plus output tokens; `num_computed_tokens` of them have K/V in `block_table`'s blocks."""

    executor_id: int  # the engine's id of its request (Step.executor_id)
    seq_index: int
    token_ids: list[int]
    num_prompt_tokens: int
    request: ValidRequest | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered with the prefix cache
    num_cached_prompt_tokens: int | None = None  # prompt tokens served from the prefix cache at first admission
    cache_key: str | None = None  # extra key in its block hashes (what besides tokens the K/V depends on)
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    matcher: object | None = None  # llguidance.LLMatcher of a `structured` request: what may come next
    lora: object | None = None  # lora.LoraWeights of a request that names an adapter; None: the base model
    embed: EmbedParams | None = None  # an embedding request's pooling: it samples nothing (ValidRequest.embed)
    pooled: torch.Tensor | None = None  # [D] float32: the last token's final hidden state, or the sum over the prompt
    # output tokens from which its next token is its logits' argmax and nothing more (the sampler's fast path); None:
    # never (sampled, penalties, log probabilities, a structure, an embedding). See plain_greedy_from.
    argmax_from: int | None = None
    spec: object | None = None  # speculation.SpecState when the engine drafts for this sequence (spec_step.py)
    draft: list[int] = field(default_factory=list)  # this step's drafted tokens, verified after the forward pass

    @classmethod
    def from_request(cls, executor_id: int, seq_index: int, request: ValidRequest) -> Sequence:
        prompt = list(request.prompt_token_ids)
        seq = cls(executor_id, seq_index, prompt, len(prompt), request, embed=request.embed)
        if not request.sampling.greedy:
            # each sequence of a request draws from its own stream: seed, seq_index -> generator
            seq.generator = torch.Generator().manual_seed((request.sampling.seed * 1_000_003 + seq_index) % (1 << 63))
        if request.structured is not None:  # one matcher per sequence, copied from the compiled grammar
            seq.matcher = request.structured.grammar.matcher()
        seq.argmax_from = plain_greedy_from(request)
        return seq

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model before this sequence can sample (1 when decoding)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def reuses_prefix(self) -> bool:
        """Whether cached blocks may stand in for its leading tokens: not for a mean-pooled embedding, which needs
        every prompt token's hidden state (a cached block has only its K/V)."""
        return self.embed is None or self.embed.pooling != "mean"

    def pool(self, hidden: torch.Tensor) -> None:
        """Take the final hidden states [n, D] of an embedding's tokens just computed (all of them for mean pooling,
        the last prompt token's for last)."""
        rows = hidden.float()
        if self.embed.pooling == "mean":
            total = rows.sum(0)
            self.pooled = total if self.pooled is None else self.pooled + total
        else:
            self.pooled = rows[-1]

    def embedding(self) -> list[float]:
        """The pooled vector once the whole prompt is computed: the mean (over every prompt token) or the last
        token's state, L2-normalized when asked."""
        vec = self.pooled / self.num_prompt_tokens if self.embed.pooling == "mean" else self.pooled
        if self.embed.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        return vec.tolist()

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def reset_for_recompute(self) -> None:
        """Preempted: drop all cache state; prompt and output tokens are kept and recomputed later. The matcher
        stays as it is: it has consumed exactly the output tokens, and recompute samples nothing until they are
        all back in the cache."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.num_cached_blocks = 0
        self.draft = []  # a verification cut short: nothing of it was computed
        self.status = SequenceStatus.WAITING
        self.pooled = None  # an embedding pools again from its recomputed states
