"""Validated requests: what `service/validation.py` produces and everything below it consumes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.IntEnum):
    """Why a sequence ended; values match `tokenloop.v1.FinishReason`."""

    LENGTH = 1
    EOS = 2
    STOP_SEQUENCE = 3
    STOP_TOKEN = 4
    CANCELLED = 5
    STRUCTURE_COMPLETE = 6  # the `structured` constraint could take no more tokens


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0: disabled
    top_p: float = 1.0  # 1.0: disabled
    min_p: float = 0.0  # 0.0: disabled
    repetition_penalty: float = 1.0  # 1.0: disabled
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0  # always set: the service picks one when the client did not

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class StoppingParams:
    """When a sequence ends. Stop strings are the looper's job; token rules are the executor's."""

    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False


@dataclass(frozen=True, slots=True)
class OutputParams:
    """What responses carry besides text."""

    logprobs: bool = False
    top_logprobs: int = 0  # 0..20; > 0 implies logprobs
    skip_special_tokens: bool = True
    echo: bool = False


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """A constraint on the output (`GenerateRequest.structured`): `kind` is the oneof's field name."""

    kind: str  # json_schema | json_object | regex | grammar | structural_tag
    spec: str = ""  # the schema, regex, grammar or structural tag text; "" for json_object
    # core.structured.Grammar, set once the service compiled it (the embedded engine matches with it)
    grammar: object | None = field(default=None, compare=False, repr=False)


POOLINGS = ("last", "mean")  # EmbedParams.pooling: the last prompt token's hidden state, or the mean over the prompt


@dataclass(frozen=True, slots=True)
class EmbedParams:
    """An embedding request (`ValidRequest.embed`): the executor runs the prompt as a prefill, samples nothing, and
    ends the request with one final Step carrying the pooled final hidden state (after the model's final norm).
    `pooling` is one of POOLINGS; `normalize` scales the vector to unit L2 norm."""

    pooling: str = "last"
    normalize: bool = True


@dataclass(frozen=True, slots=True)
class ValidRequest:
    """A request that passed validation: defaults filled, limits checked, prompt tokenized."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    output: OutputParams = field(default_factory=OutputParams)
    n: int = 1
    stream: bool = False
    prompt_text: str = ""  # for echo; empty when the prompt came as token ids
    deadline: float | None = None  # time.monotonic() after which the request is cancelled
    structured: StructuredOutput | None = None  # None: free text
    lora: str = ""  # a loaded LoRA adapter's name; "": the base model
    embed: EmbedParams | None = None  # set: an embedding request (n 1, no sampling); None: generation
