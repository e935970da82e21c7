"""Typed results: plain frozen dataclasses built from the protobuf responses.

Each mirrors one message of protos/tokenloop/v1/tokenloop.proto, field for field (a oneof is one field named
after it), with the proto's defaults: tests/unit/test_client_types.py compares them, so the client
keeps its own types (it imports nothing of the server) and the proto stays their one source."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields

from ._gen import tokenloop_pb2 as pb
from .errors import IncompleteOutputError


class FinishReason(str, enum.Enum):
    """Why a sequence ended (the proto's FinishReason names)."""

    UNSPECIFIED = "FINISH_REASON_UNSPECIFIED"
    LENGTH = "LENGTH"
    EOS = "EOS"
    STOP_SEQUENCE = "STOP_SEQUENCE"
    STOP_TOKEN = "STOP_TOKEN"
    CANCELLED = "CANCELLED"
    STRUCTURE_COMPLETE = "STRUCTURE_COMPLETE"  # the structured-output constraint was complete

    @classmethod
    def from_pb(cls, value: int) -> FinishReason:
        """Map a proto enum number to a FinishReason."""
        return cls(pb.FinishReason.Name(value))


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation: role is `system`, `user` or `assistant`."""

    role: str
    content: str


@dataclass(frozen=True)
class TopLogprob:
    """One alternative token and its log probability."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The log probability of one generated token, with alternatives."""

    token_id: int
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()

    @classmethod
    def from_pb(cls, msg: pb.TokenLogprob) -> TokenLogprob:
        """Build from a protobuf TokenLogprob."""
        tops = tuple(TopLogprob(t.token_id, t.logprob) for t in msg.top_logprobs)
        return cls(msg.token_id, msg.logprob, tops)


@dataclass(frozen=True)
class Usage:
    """Token counts of one sequence."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # of the prompt tokens, those the server's prefix cache held
    draft_tokens: int = 0  # speculative decoding: tokens drafted for this sequence and checked by the model
    accepted_draft_tokens: int = 0  # of draft_tokens, those kept (each a completion token)


@dataclass(frozen=True)
class Timing:
    """Server-side timing of one sequence, in seconds since the request arrived."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0


@dataclass(frozen=True)
class Delta:
    """New text (and token ids) of one sequence, as streamed."""

    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()

    @classmethod
    def from_pb(cls, msg: pb.Chunk) -> Delta:
        """Build from a protobuf Chunk."""
        return cls(msg.index, msg.text, tuple(msg.token_ids), tuple(map(TokenLogprob.from_pb, msg.logprobs)))


@dataclass(frozen=True)
class Completion:
    """The end of one sequence: its whole text and why it stopped."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    seed: int = 0
    matched_stop: str | int | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_text: str = ""
    prompt_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_pb(cls, msg: pb.Complete) -> Completion:
        """Build from a protobuf Complete."""
        which = msg.WhichOneof("matched_stop")
        return cls(
            index=msg.index,
            text=msg.text,
            token_ids=tuple(msg.token_ids),
            finish_reason=FinishReason.from_pb(msg.finish_reason),
            usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_prompt_tokens,
                        msg.usage.draft_tokens, msg.usage.accepted_draft_tokens),
            timing=Timing(msg.timing.queue_s, msg.timing.ttft_s, msg.timing.total_s),
            seed=msg.seed,
            matched_stop=getattr(msg, which) if which else None,
            logprobs=tuple(map(TokenLogprob.from_pb, msg.logprobs)),
            prompt_text=msg.prompt_text,
            prompt_token_ids=tuple(msg.prompt_token_ids),
        )

    @property
    def truncated(self) -> bool:
        """True when the sequence ended at LENGTH: a structured output is then incomplete (not valid JSON)."""
        return self.finish_reason is FinishReason.LENGTH

    def json(self):
        """The text parsed as JSON; IncompleteOutputError when the sequence ended at LENGTH (cut off mid-value),
        json.JSONDecodeError when the text is not JSON for another reason (an unconstrained request)."""
        if self.truncated:
            raise IncompleteOutputError(self)
        return json.loads(self.text)


@dataclass(frozen=True)
class GenerateResult:
    """The final result of a Generate call: one Completion per sequence, by index."""

    request_id: str
    completions: tuple[Completion, ...]

    @property
    def text(self) -> str:
        """Text of the first sequence."""
        return self.completions[0].text

    @property
    def finish_reason(self) -> FinishReason:
        """Finish reason of the first sequence."""
        return self.completions[0].finish_reason

    def json(self):
        """The first sequence's text parsed as JSON (Completion.json: IncompleteOutputError when it ended at LENGTH)."""
        return self.completions[0].json()

    @property
    def usage(self) -> Usage:
        """Token counts: the prompt once, completion tokens summed over sequences."""
        first, done = self.completions[0].usage, self.completions
        return Usage(first.prompt_tokens, sum(c.usage.completion_tokens for c in done), first.cached_prompt_tokens,
                     sum(c.usage.draft_tokens for c in done), sum(c.usage.accepted_draft_tokens for c in done))

    @property
    def timing(self) -> Timing:
        """Timing of the first sequence."""
        return self.completions[0].timing


@dataclass(frozen=True)
class TokenizeResult:
    """Token ids of a text, the pieces they stand for, and the rendered chat prompt."""

    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    text: str = ""


@dataclass(frozen=True)
class EmbedResult:
    """One prompt's embedding: the vector (the model's hidden size long), the prompt's token count, and how it was
    pooled ("last" or "mean") and whether it was scaled to unit L2 norm."""

    request_id: str
    embedding: tuple[float, ...]
    prompt_tokens: int
    pooling: str
    normalized: bool

    @classmethod
    def from_pb(cls, msg: pb.EmbedResponse) -> EmbedResult:
        """Build from a protobuf EmbedResponse."""
        return cls(msg.request_id, tuple(msg.embedding), msg.prompt_tokens, pb.Pooling.Name(msg.pooling).lower(),
                   msg.normalized)


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model and the server's limits."""

    model_id: str
    architecture: str
    backend: str
    max_context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    has_chat_template: bool
    max_new_tokens_limit: int
    max_n: int
    dtype: str
    lora_adapters: tuple[LoraAdapter, ...] = ()

    @classmethod
    def from_pb(cls, msg: pb.ModelInfo) -> ModelInfo:
        """Build from a protobuf ModelInfo."""
        bos = msg.bos_token_id if msg.HasField("bos_token_id") else None
        return cls(
            msg.model_id, msg.architecture, msg.backend, msg.max_context_length, msg.vocab_size,
            tuple(msg.eos_token_ids), bos, msg.has_chat_template, msg.max_new_tokens_limit, msg.max_n,
            msg.dtype, tuple(LoraAdapter.from_pb(a) for a in msg.lora_adapters),
        )


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter the server serves; requests select it with `lora=name`."""

    name: str
    id: int  # the router API's lora_config.task_id
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    num_running: int

    @classmethod
    def from_pb(cls, msg: pb.LoraAdapter) -> LoraAdapter:
        return cls(msg.name, msg.id, msg.path, msg.rank, msg.alpha, tuple(msg.target_modules), msg.num_running)


@dataclass(frozen=True)
class Load:
    """A snapshot of what the server is doing."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_block_size: int = 0
    kv_cache_utilization: float = 0.0
    num_in_flight: int = 0
    max_concurrent_requests: int = 0
    max_queue: int = 0
    step_latency_s: float = 0.0
    num_preemptions: int = 0
    kv_blocks_cached: int = 0  # blocks holding a reusable prefix (in use or evictable)
    prefix_cache_hit_rate: float = 0.0  # prompt tokens served from the prefix cache / prompt tokens looked up
    spec_acceptance_rate: float = 0.0  # speculative decoding: accepted drafted tokens / drafted tokens
    spec_tokens_per_step: float = 0.0  # speculative decoding: tokens one verification of a draft yields on average

    @classmethod
    def from_pb(cls, msg: pb.Load) -> Load:
        """Build from a protobuf Load."""
        return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})
