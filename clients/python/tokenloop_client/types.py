"""Typed results: plain frozen dataclasses built from the protobuf responses.

The ones that mirror a message of protos/tokenloop/v1/tokenloop.proto (Delta, Usage, ModelInfo, Load, ...) are
generated from it, field for field with its defaults and comments, into `_gen/messages.py` (clients/python/generate.py,
run by `make proto`; `make proto-check` fails when they are stale): the client keeps its own types (it imports nothing
of the server) and the proto is their one source. This module holds what is the client's own: a Completion's JSON and
the result of a whole call. The package (`tokenloop_client`) exports both."""

from __future__ import annotations

import json
from dataclasses import dataclass

from ._gen import messages
from ._gen.messages import FinishReason, Timing, Usage
from .errors import IncompleteOutputError


class Completion(messages.Completion):
    """The end of one sequence: its whole text and why it stopped (the message Complete)."""

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
        return Usage(prompt_tokens=first.prompt_tokens, completion_tokens=sum(c.usage.completion_tokens for c in done),
                     cached_prompt_tokens=first.cached_prompt_tokens, draft_tokens=sum(c.usage.draft_tokens for c in done),
                     accepted_draft_tokens=sum(c.usage.accepted_draft_tokens for c in done))

    @property
    def timing(self) -> Timing:
        """Timing of the first sequence."""
        return self.completions[0].timing
